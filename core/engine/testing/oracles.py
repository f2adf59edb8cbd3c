"""Reference oracles of the conformance kit: the plainest torch that states what a
component must compute, written for clarity, not speed. Math runs in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.interfaces.group_quant import GroupQuantWeight


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention of one sequence over its unpaged keys and values.

    q: [n, H, D], the queries at positions ``context_len .. context_len + n - 1``;
    k, v: [L, Hkv, D] for positions ``0 .. L - 1`` (L >= context_len + n; later
    positions are ignored). ``H`` must be a multiple of ``Hkv``: query head ``h``
    reads KV head ``h // (H // Hkv)`` (GQA; ``Hkv == 1`` is MQA). The query at
    position ``p`` attends to keys ``0 .. p``, and with ``window`` only to the last
    ``window`` of them, ``p - window < j <= p`` (its own key included). With ``sinks``
    [H], head ``h``'s softmax also runs over the logit ``sinks[h]``, a position that
    takes its share of the weight and adds no value.

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
    if sinks is None:
        weights = scores.softmax(dim=-1)
    else:
        # the sink as one more column of scores, dropped after the softmax: [H, n, L + 1]
        sink_column = sinks.float().to(q.device)[:, None, None].expand(-1, n, 1)
        weights = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    # [H, n, L] @ [L, H, D] -> [n, H, D]
    return torch.einsum("hnl,lhd->nhd", weights, values)


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


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **unused,
):
    """flash-attn's ``flash_attn_varlen_func`` (and AITER's, which has its interface) as
    documented, one sequence at a time: ``q`` [total_q, H, D] and ``k`` / ``v`` [total_k, Hkv,
    D] packed by ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32), query head ``h`` reading KV head
    ``h // (H / Hkv)``, a causal mask aligned to the bottom right (query row ``i`` of a
    sequence with ``Lq`` queries and ``Lk`` keys sees keys up to ``Lk - Lq + i``), and
    ``window_size = (left, right)`` keys either side of that (-1: unbounded). Asserts the
    argument types and sizes the library requires."""
    assert dropout_p == 0.0 and not unused
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert k.shape[0] == v.shape[0] == int(cu_seqlens_k[-1]) and q.shape[0] == int(cu_seqlens_q[-1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        qi = q[qs:qe].float().transpose(0, 1)  # [H, Lq, D]
        ki = k[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = scale * qi @ ki.transpose(1, 2)  # [H, Lq, Lk]
        row = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)  # the key index the row aligns to
        key = torch.arange(ke - ks)[None, :]
        allowed = torch.ones_like(scores[0], dtype=torch.bool)
        if causal or window_size[1] >= 0:
            allowed &= key <= row + (0 if causal else window_size[1])
        if window_size[0] >= 0:
            allowed &= key >= row - window_size[0]
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[qs:qe] = (weights @ vi).transpose(0, 1).to(q.dtype)
    return out


class FlashInferPrefillWrapper:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout) as documented, in
    plain torch: ``plan`` takes the CSR page table (``qo_indptr`` [B + 1], ``paged_kv_indptr``
    [B + 1], ``paged_kv_indices``, ``paged_kv_last_page_len`` [B], all int32) and the heads,
    and ``run(q, (k_pages, v_pages))`` attends each sequence's queries to the keys of its pages
    in order (every page full but the last, which holds ``last_page_len``), causal aligned to
    the bottom right, keys at most ``window_left`` before the query's position (-1:
    unbounded). Asserts what the library requires of its arguments."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.planned: dict | None = None
        self.plans = 0

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal=False,
        sm_scale=None,
        window_left=-1,
        q_data_type=torch.float16,
        kv_data_type=None,
        **unused,
    ) -> None:
        assert not unused, unused
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32
        batch = qo_indptr.shape[0] - 1
        assert paged_kv_indptr.shape[0] == batch + 1 and paged_kv_last_page_len.shape[0] == batch
        assert int(paged_kv_indptr[-1]) == paged_kv_indices.shape[0]
        assert bool(((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size)).all())
        assert num_qo_heads % num_kv_heads == 0
        self.plans += 1
        self.planned = dict(
            qo_indptr=qo_indptr.tolist(),
            kv_indptr=paged_kv_indptr.tolist(),
            kv_indices=paged_kv_indices.tolist(),
            last=paged_kv_last_page_len.tolist(),
            heads=(num_qo_heads, num_kv_heads, head_dim_qk),
            page_size=page_size,
            causal=causal,
            scale=head_dim_qk**-0.5 if sm_scale is None else sm_scale,
            window_left=window_left,
            dtype=q_data_type,
        )

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        plan = self.planned
        assert plan is not None, "run before plan"
        k_pages, v_pages = paged_kv_cache
        num_qo_heads, num_kv_heads, head_dim = plan["heads"]
        assert q.shape[1:] == (num_qo_heads, head_dim) and q.dtype == plan["dtype"]
        assert k_pages.shape[1:] == (plan["page_size"], num_kv_heads, head_dim) == v_pages.shape[1:]
        group = num_qo_heads // num_kv_heads
        out = torch.zeros_like(q)
        for i in range(len(plan["qo_indptr"]) - 1):
            qs, qe = plan["qo_indptr"][i], plan["qo_indptr"][i + 1]
            pages = plan["kv_indices"][plan["kv_indptr"][i] : plan["kv_indptr"][i + 1]]
            keys = torch.cat([k_pages[p] for p in pages])[: (len(pages) - 1) * plan["page_size"] + plan["last"][i]]
            values = torch.cat([v_pages[p] for p in pages])[: keys.shape[0]]
            qi = q[qs:qe].float().transpose(0, 1)
            ki = keys.float().repeat_interleave(group, 1).transpose(0, 1)
            vi = values.float().repeat_interleave(group, 1).transpose(0, 1)
            scores = plan["scale"] * qi @ ki.transpose(1, 2)
            row = torch.arange(qe - qs)[:, None] + keys.shape[0] - (qe - qs)
            key = torch.arange(keys.shape[0])[None, :]
            allowed = torch.ones_like(scores[0], dtype=torch.bool)
            if plan["causal"]:
                allowed &= key <= row
            if plan["window_left"] >= 0:
                allowed &= key >= row - plan["window_left"]
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
            out[qs:qe] = (weights @ vi).transpose(0, 1).to(q.dtype)
        return out


def random_group_quant(
    n: int,
    k: int,
    bits: int,
    group_size: int,
    gen: torch.Generator,
    *,
    ordered: bool = False,
    two_level: bool = False,
    symmetric: bool = False,
) -> GroupQuantWeight:
    """A random group-quantized weight [n, k] for kernel tests: uniform ``bits``-bit values;
    float32 scales and zero points per group, or (``two_level``) signed int8 scale codes (as
    ``Q6_K``'s) and offset codes per group times float32s per super-block of up to 16 groups;
    ``symmetric``: every offset the scale times ``2**(bits-1)`` (held as the weight's ``zero``);
    ``ordered``: a random input order."""
    from engine.interfaces.group_quant import GroupQuantWeight

    values = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    groups = k // group_size
    order = torch.randperm(k, generator=gen) if ordered else None
    if two_level:
        supers = groups // next(s for s in (16, 8, 4, 2, 1) if groups % s == 0)
        codes = torch.randint(-128, 128, (n, groups), generator=gen)
        zeros = codes if symmetric else torch.randint(0, 128, (n, groups), generator=gen)
        unit = torch.rand(n, supers, generator=gen) * 4e-4 + 1e-5
        zero_unit = unit * (1 << (bits - 1)) if symmetric else unit * (1 << bits) / 128
        return GroupQuantWeight.from_values(
            values, codes, zeros, bits, input_order=order, super_scales=unit, super_offsets=zero_unit
        )
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.001
    if symmetric:
        zeros = torch.full((n, groups), float(1 << (bits - 1)))
    else:
        zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
    return GroupQuantWeight.from_values(values, scales, scales * zeros, bits, input_order=order)


def group_quant_exact(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 value of ``x @ W^T + bias`` from a group-quantized weight's integers
    (W[n, k] = s q - m, input k of the weight multiplying x's input ``input_order[k]``), and the
    size of its terms, ``|x| @ (|s q| + |m|)^T + |bias|`` (what float32 rounding is relative to)."""
    x64 = w.order_inputs(x.cpu()).double()
    q = w.values().cpu().double()
    s = w.group_scales().cpu().double().repeat_interleave(w.group_size, dim=1)
    m = w.group_offsets().cpu().double().repeat_interleave(w.group_size, dim=1)
    exact = x64 @ (s * q - m).t()
    size = x64.abs() @ ((s * q).abs() + m.abs()).t()
    if bias is not None:
        exact += bias.cpu().double()
        size += bias.cpu().double().abs()
    return exact, size


def group_quant_sum_allowance(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    """How far two float32 evaluations of ``x @ W^T`` that add the K products in different orders
    (or fuse them differently) may differ: each is within ``K * 2^-24 * (|x| @ |s q|^T)`` of the
    exact sum, so twice that, float64."""
    xs = w.order_inputs(x.cpu()).double().abs()
    scaled = w.group_scales().cpu().double().repeat_interleave(w.group_size, dim=1) * w.values().cpu().double()
    return 2 * xs.shape[1] * 2.0**-24 * (xs @ scaled.abs().t())


def group_quant_int8_allowance(x: torch.Tensor, w: GroupQuantWeight, block: int) -> torch.Tensor:
    """How far rounding x to int8 in blocks of ``block`` inputs (after ``input_order``; scale
    max|x| / 127 a block) may move ``x @ W^T``: ``(dx / 2) @ |s q|^T``, float64, with half a
    percent for the scale's own rounding (``LayerOps.group_quant_linear``'s contract)."""
    xs = w.order_inputs(x.cpu()).double()
    dx = xs.abs().view(xs.shape[0], -1, block).amax(-1) / 127
    moved = (dx * 0.505).repeat_interleave(block, dim=1)
    scaled = w.group_scales().cpu().double().repeat_interleave(w.group_size, dim=1) * w.values().cpu().double()
    return moved @ scaled.abs().t()
