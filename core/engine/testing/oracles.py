"""Reference oracles of the conformance kit: the plainest torch that states what a
component must compute, written for clarity, not speed. Math runs in float32."""

from __future__ import annotations

import torch


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float, window: int | None
) -> torch.Tensor:
    """Causal softmax attention of one sequence over its unpaged keys and values.

    q: [n, H, D], the queries at positions ``context_len .. context_len + n - 1``;
    k, v: [L, Hkv, D] for positions ``0 .. L - 1`` (L >= context_len + n; later
    positions are ignored). ``H`` must be a multiple of ``Hkv``: query head ``h``
    reads KV head ``h // (H // Hkv)`` (GQA; ``Hkv == 1`` is MQA). The query at
    position ``p`` attends to keys ``0 .. p``, and with ``window`` only to the last
    ``window`` of them, ``p - window < j <= p`` (its own key included).

    Returns [n, H, D] in float32, whatever the input dtype.
    """
    n, num_heads = q.shape[:2]
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    seq_len = context_len + n
    assert k.shape[0] >= seq_len and v.shape[0] >= seq_len, (k.shape, v.shape, context_len, n)
    group = num_heads // num_kv_heads
    # [L, Hkv, D] -> [L, H, D]: each KV head serves `group` consecutive query heads
    keys = k[:seq_len].float().repeat_interleave(group, dim=1)
    values = v[:seq_len].float().repeat_interleave(group, dim=1)
    # scores: [H, n, L]
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    query_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]  # [n, 1]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    allowed = key_pos <= query_pos  # [n, L]
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    # [H, n, L] @ [L, H, D] -> [n, H, D]
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values)


def naive_mla_attention(
    q: torch.Tensor,
    entries: torch.Tensor,
    context_len: int,
    scale: float,
    latent_size: int,
    indices: torch.Tensor | None = None,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal multi-head latent attention (absorbed form) of one sequence over its unpaged
    cache entries; with ``indices``, sparse MLA over the selected positions only.

    q: [n, H, D], the absorbed queries at positions ``context_len .. context_len + n - 1``;
    entries: [L, 1, D], the cache entries ``[c; k_rope]`` of positions ``0 .. L - 1``
    (L >= context_len + n; later positions are ignored). Every head scores every entry
    over all ``D`` dims, ``scale · q·entry``; the query at position ``p`` attends to
    entries ``0 .. p``, and the values are the entries' first ``latent_size`` dims.
    ``indices``: [n, m] positions each query attends to (the others are masked; ``-1``
    is padding; a query selecting nothing gets zeros).

    Returns [n, H, latent_size] in float32, whatever the input dtype; with ``with_lse``
    also each row's log-sum-exp of its scores [n, H] (``-inf`` for a row selecting nothing).
    """
    n = q.shape[0]
    seq_len = context_len + n
    assert entries.shape[0] >= seq_len and entries.shape[1] == 1, (entries.shape, context_len, n)
    latents = entries[:seq_len, 0].float()  # [L, D]
    # scores: [H, n, L]
    scores = torch.einsum("nhd,ld->hnl", q.float(), latents) * scale
    query_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]  # [n, 1]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    allowed = key_pos <= query_pos  # [n, L]
    if indices is not None:
        chosen = torch.zeros(n, seq_len + 1, dtype=torch.bool, device=q.device)
        chosen[torch.arange(n, device=q.device)[:, None], indices.long() % (seq_len + 1)] = True  # -1 -> the spare
        allowed &= chosen[:, :seq_len]
    scores = scores.masked_fill(~allowed, float("-inf"))
    # [H, n, L] @ [L, latent_size] -> [n, H, latent_size]
    out = torch.einsum("hnl,lr->nhr", scores.softmax(dim=-1).nan_to_num(0.0), latents[:, :latent_size])
    return (out, scores.logsumexp(dim=-1).transpose(0, 1)) if with_lse else out


def naive_index_scores(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """The lightning indexer's scores for one sequence's queries over its unpaged keys.

    q: [n, H, D], the queries at positions ``context_len .. context_len + n - 1``; keys:
    [L, 1, D] for positions ``0 .. L - 1`` (later positions than the queries' are
    ignored); weights: [n, H]. The score of position ``j`` for the query at ``p`` is
    ``Σ_h weights[h] · relu(scale · q[h]·key_j)`` for ``j <= p`` and ``-inf`` after it.

    Returns [n, context_len + n] in float32, whatever the input dtype.
    """
    n = q.shape[0]
    seq_len = context_len + n
    assert keys.shape[0] >= seq_len and keys.shape[1] == 1, (keys.shape, context_len, n)
    per_head = torch.einsum("nhd,ld->nhl", q.float(), keys[:seq_len, 0].float()) * scale  # [n, H, L]
    scores = torch.einsum("nhl,nh->nl", per_head.relu(), weights.float())
    query_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]  # [n, 1]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    return scores.masked_fill(key_pos > query_pos, float("-inf"))


def naive_kda(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_heads: int,
    head_size: int,
    value_size: int,
    scale: float,
) -> torch.Tensor:
    """Kimi delta attention of one whole sequence from a zero state, token by token.

    mixed_qkv: [L, C] the inputs of the short convolution (queries, keys, values);
    conv_weight: [C, kernel]; g: [L, H, head_size] log decays; beta: [L, H]. The input at
    position t convolves with the ``kernel - 1`` before it (zeros before the sequence),
    SiLU; q and k are L2-normalised per head (``x / sqrt(Σx² + 1e-6)``), q times ``scale``;
    ``S_t = (I - β_t k_t k_tᵀ) diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ`` and ``o_t = S_tᵀ q_t``.

    Returns [L, H, value_size] in float32.
    """
    length, channels = mixed_qkv.shape
    kernel = conv_weight.shape[1]
    padded = torch.cat([torch.zeros(kernel - 1, channels), mixed_qkv.float()])
    state = torch.zeros(num_heads, head_size, value_size)
    out = torch.zeros(length, num_heads, value_size)
    for t in range(length):
        mixed = torch.nn.functional.silu((padded[t : t + kernel].T * conv_weight.float()).sum(dim=1))  # [C]
        q, k, v = mixed.split([num_heads * head_size, num_heads * head_size, num_heads * value_size])
        q, k, v = q.view(num_heads, head_size), k.view(num_heads, head_size), v.view(num_heads, value_size)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        for h in range(num_heads):
            decayed = torch.diag(g[t, h].float().exp()) @ state[h]  # [dk, dv]
            b = float(beta[t, h])
            state[h] = decayed - b * torch.outer(k[h], k[h] @ decayed) + b * torch.outer(k[h], v[h])
            out[t, h] = state[h].T @ q[h]
    return out


def chi_squared_p_value(observed: list[int], probabilities: list[float]) -> float:
    """Pearson's goodness-of-fit test of ``observed`` counts against ``probabilities``
    (summing to 1): the probability that χ² with len - 1 degrees of freedom reaches the
    statistic."""
    total = sum(observed)
    statistic = sum((o - total * p) ** 2 / (total * p) for o, p in zip(observed, probabilities))
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)).item()


def equal_mass_bins(tokens: list[int], probabilities: torch.Tensor, bins: int) -> tuple[list[int], list[float]]:
    """Counts of ``tokens`` and the probability mass in each of ``bins`` groups of token ids
    holding about equal mass (ids taken by descending probability), so that every group
    expects enough samples for a chi-squared test."""
    order = probabilities.argsort(descending=True).tolist()
    group = {}
    mass = [0.0] * bins
    before = 0.0
    for token in order:
        index = min(int(before * bins), bins - 1)
        group[token] = index
        mass[index] += probabilities[token].item()
        before += probabilities[token].item()
    counts = [0] * bins
    for token in tokens:
        counts[group[token]] += 1
    return counts, mass
