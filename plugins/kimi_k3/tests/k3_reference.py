"""A tiny random Kimi-K3 checkpoint, and a plainly written reference of the network: token by
token KDA recurrence, dense MLA with the keys and values expanded, a loop over experts. It reads
the checkpoint's tensors by name and shares no code with the engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "attn_res_block_size": 2,
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "kda_layers": [1, 2, 4, 5],
        "full_attn_layers": [3],
    },
}


def make_k3_checkpoint(path: Path, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """Write config.json and model.safetensors of a random tiny K3 at ``path``; returns the tensors."""
    text = {**TEXT_CONFIG, **overrides}
    gen = torch.Generator().manual_seed(seed)
    d, v = text["hidden_size"], text["vocab_size"]
    linear = text["linear_attn_config"]
    heads, dk, kernel = linear["num_heads"], linear["head_dim"], linear["short_conv_kernel_size"]
    mla_heads, nope, rope, vd = (
        text["num_attention_heads"],
        text["qk_nope_head_dim"],
        text["qk_rope_head_dim"],
        text["v_head_dim"],
    )
    experts, inter, latent = text["num_experts"], text["moe_intermediate_size"], text["routed_expert_hidden_size"]

    def rand(*shape, std=None):
        std = std if std is not None else 1 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)

    t = {
        "model.embed_tokens.weight": rand(v, d, std=1.0),
        "model.norm.weight": norm(d),
        "lm_head.weight": rand(v, d),
        "model.output_attn_res_norm.weight": norm(d),
        "model.output_attn_res_proj.weight": rand(1, d, std=0.5),
    }
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + name + ".weight"] = norm(d)
        t[p + "self_attention_res_proj.weight"] = rand(1, d, std=0.5)
        t[p + "mlp_res_proj.weight"] = rand(1, d, std=0.5)
        a = p + "self_attn."
        if i + 1 in linear["kda_layers"]:
            for x in "qkv":
                t[a + f"{x}_proj.weight"] = rand(heads * dk, d)
                t[a + f"{x}_conv1d.weight"] = rand(heads * dk, 1, kernel, std=0.5)
            t[a + "f_a_proj.weight"] = rand(dk, d)
            t[a + "f_b_proj.weight"] = rand(heads * dk, dk)
            t[a + "dt_bias"] = rand(heads * dk, std=0.5)
            t[a + "A_log"] = torch.empty(128).uniform_(1.0, 16.0, generator=gen).log()  # more entries than heads
            t[a + "b_proj.weight"] = rand(heads, d)
            t[a + "g_proj.weight"] = rand(heads * dk, d)
            t[a + "o_norm.weight"] = norm(dk)
            t[a + "o_proj.weight"] = rand(d, heads * dk)
        else:
            q_lora, kv_lora = text["q_lora_rank"], text["kv_lora_rank"]
            t[a + "q_a_proj.weight"] = rand(q_lora, d)
            t[a + "q_a_layernorm.weight"] = norm(q_lora)
            t[a + "q_b_proj.weight"] = rand(mla_heads * (nope + rope), q_lora)
            t[a + "kv_a_proj_with_mqa.weight"] = rand(kv_lora + rope, d)
            t[a + "kv_a_layernorm.weight"] = norm(kv_lora)
            t[a + "kv_b_proj.weight"] = rand(mla_heads * (nope + vd), kv_lora)
            t[a + "o_proj.weight"] = rand(d, mla_heads * vd)
            t[a + "g_proj.weight"] = rand(mla_heads * vd, d)
        m = p + "block_sparse_moe."
        if i < text["first_k_dense_replace"]:
            t[m + "gate_proj.weight"] = rand(text["intermediate_size"], d)
            t[m + "up_proj.weight"] = rand(text["intermediate_size"], d)
            t[m + "down_proj.weight"] = rand(d, text["intermediate_size"])
        else:
            t[m + "gate.weight"] = rand(experts, d)
            t[m + "gate.e_score_correction_bias"] = rand(experts, std=0.1)
            t[m + "routed_expert_down_proj.weight"] = rand(latent, d)
            t[m + "routed_expert_norm.weight"] = norm(latent)
            t[m + "routed_expert_up_proj.weight"] = rand(d, latent)
            for e in range(experts):
                t[m + f"experts.{e}.w1.weight"] = rand(inter, latent)
                t[m + f"experts.{e}.w3.weight"] = rand(inter, latent)
                t[m + f"experts.{e}.w2.weight"] = rand(latent, inter)
            shared = inter * text["num_shared_experts"]
            t[m + "shared_experts.gate_proj.weight"] = rand(shared, d)
            t[m + "shared_experts.up_proj.weight"] = rand(shared, d)
            t[m + "shared_experts.down_proj.weight"] = rand(d, shared)
    tensors = {"language_model." + name: tensor.contiguous() for name, tensor in t.items()}
    tensors["vision_tower.patch_embed.weight"] = rand(4, 4)  # not the language model's: skipped
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def reference_logits(tensors: dict[str, torch.Tensor], text: dict, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of K3 over the whole sequence, computed in float64 (so the
    tests measure the engine's float32 error alone, not the reference's own, which depends on
    the CPU's summation order) and returned as float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _reference_logits(tensors, text, tokens).float()
    finally:
        torch.set_default_dtype(default)


def float32_rounding_error(tensors: dict[str, torch.Tensor], text: dict, tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] how far the reference computed in float32 lands from its float64 result at
    each position (max over the vocabulary): what float32 rounding alone does to this model there.
    Where the model is ill-conditioned it is far above its usual 1e-6."""
    float32 = _reference_logits(tensors, text, tokens).float()
    return (float32 - reference_logits(tensors, text, tokens)).abs().amax(dim=-1)


def _reference_logits(tensors: dict[str, torch.Tensor], text: dict, tokens: list[int]) -> torch.Tensor:
    text = {**TEXT_CONFIG, **text}
    eps, linear = text["rms_norm_eps"], text["linear_attn_config"]

    def w(name):
        return tensors["language_model." + name].to(torch.get_default_dtype())

    def rms(x, weight, e=eps):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + e) * weight

    def situ(gate, up):
        b, bl = text["activation_situ_beta"], text["activation_situ_linear_beta"]
        return b * torch.tanh(gate / b) * torch.sigmoid(gate) * bl * torch.tanh(up / bl)

    def mix(name, prefix, blocks):  # one token's values [n + 1, D]
        values = torch.stack([*blocks, prefix], dim=1)  # [L, n + 1, D]
        scores = rms(values, w(name + "_norm.weight")) @ w(name + "_proj.weight")[0]
        return torch.einsum("ln,lnd->ld", scores.softmax(dim=-1), values)

    def kda(p, x):
        heads, dk, kernel = linear["num_heads"], linear["head_dim"], linear["short_conv_kernel_size"]
        length = x.shape[0]
        raw = torch.cat([x @ w(p + f"{c}_proj.weight").T for c in "qkv"], dim=-1)  # [L, 3 · H · dk]
        conv = torch.cat([w(p + f"{c}_conv1d.weight")[:, 0] for c in "qkv"])  # [C, kernel]
        padded = torch.cat([torch.zeros(kernel - 1, raw.shape[1]), raw])
        a_log = w(p + "A_log").flatten()[:heads]
        out = torch.zeros(length, heads, dk)
        state = torch.zeros(heads, dk, dk)
        for t in range(length):
            mixed = torch.nn.functional.silu((padded[t : t + kernel].T * conv).sum(1))
            q, k, v = (part.view(heads, dk) for part in mixed.split(heads * dk))
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            gate = (x[t] @ w(p + "f_a_proj.weight").T @ w(p + "f_b_proj.weight").T + w(p + "dt_bias")).view(heads, dk)
            g = linear["gate_lower_bound"] * torch.sigmoid(a_log.exp()[:, None] * gate)
            beta = torch.sigmoid(x[t] @ w(p + "b_proj.weight").T)
            for h in range(heads):
                decayed = torch.diag(g[h].exp()) @ state[h]
                state[h] = decayed - beta[h] * torch.outer(k[h], k[h] @ decayed) + beta[h] * torch.outer(k[h], v[h])
                out[t, h] = state[h].T @ q[h]
        gate = (x @ w(p + "g_proj.weight").T).view(length, heads, dk)
        normed = rms(out, w(p + "o_norm.weight")) * torch.sigmoid(gate)
        return normed.reshape(length, -1) @ w(p + "o_proj.weight").T

    def mla(p, x):
        length, heads = x.shape[0], text["num_attention_heads"]
        nope, rope, kv_lora = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["kv_lora_rank"]
        q = rms(x @ w(p + "q_a_proj.weight").T, w(p + "q_a_layernorm.weight"), 1e-6) @ w(p + "q_b_proj.weight").T
        q = q.view(length, heads, nope + rope)
        compressed = x @ w(p + "kv_a_proj_with_mqa.weight").T
        latent, k_rope = compressed[:, :kv_lora], compressed[:, kv_lora:]
        kv = (rms(latent, w(p + "kv_a_layernorm.weight"), 1e-6) @ w(p + "kv_b_proj.weight").T).view(length, heads, -1)
        keys = torch.cat([kv[..., :nope], k_rope[:, None, :].expand(length, heads, rope)], dim=-1)
        scores = torch.einsum("ihd,jhd->hij", q, keys) / math.sqrt(nope + rope)
        scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., nope:]).reshape(length, -1)
        return (out * torch.sigmoid(x @ w(p + "g_proj.weight").T)) @ w(p + "o_proj.weight").T

    def mlp(p, x, dense):
        if dense:
            return situ(x @ w(p + "gate_proj.weight").T, x @ w(p + "up_proj.weight").T) @ w(p + "down_proj.weight").T
        scores = torch.sigmoid(x @ w(p + "gate.weight").T)  # [L, E]
        out = torch.zeros(x.shape[0], text["routed_expert_hidden_size"])
        latent = x @ w(p + "routed_expert_down_proj.weight").T
        for t in range(x.shape[0]):
            chosen = (scores[t] + w(p + "gate.e_score_correction_bias")).topk(text["num_experts_per_token"]).indices
            weights = scores[t, chosen] / scores[t, chosen].sum() * text["routed_scaling_factor"]
            for e, weight in zip(chosen.tolist(), weights):
                e_p = p + f"experts.{e}."
                hidden = situ(latent[t] @ w(e_p + "w1.weight").T, latent[t] @ w(e_p + "w3.weight").T)
                out[t] += weight * (hidden @ w(e_p + "w2.weight").T)
        routed = rms(out, w(p + "routed_expert_norm.weight")) @ w(p + "routed_expert_up_proj.weight").T
        s = p + "shared_experts."
        shared = situ(x @ w(s + "gate_proj.weight").T, x @ w(s + "up_proj.weight").T) @ w(s + "down_proj.weight").T
        return routed + shared

    def layer(i, x):  # (attention, MLP) of layer i as functions
        p = f"model.layers.{i}."
        is_kda = i + 1 in linear["kda_layers"]
        attention = (
            (lambda h: kda(p + "self_attn.", rms(h, w(p + "input_layernorm.weight"))))
            if is_kda
            else (lambda h: mla(p + "self_attn.", rms(h, w(p + "input_layernorm.weight"))))
        )
        return attention, lambda h: mlp(
            p + "block_sparse_moe.", rms(h, w(p + "post_attention_layernorm.weight")), i < text["first_k_dense_replace"]
        )

    with torch.no_grad():
        if text["attn_res_block_size"] is None:  # plain pre-norm residuals
            h = w("model.embed_tokens.weight")[torch.tensor(tokens)]
            for i in range(text["num_hidden_layers"]):
                attention, feed_forward = layer(i, h)
                h = h + attention(h)
                h = h + feed_forward(h)
            return rms(h, w("model.norm.weight")) @ w("lm_head.weight").T
        prefix, blocks = w("model.embed_tokens.weight")[torch.tensor(tokens)], []
        for i in range(text["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = mix(p + "self_attention_res", prefix, blocks) if blocks else prefix
            if i % text["attn_res_block_size"] == 0:
                blocks.append(prefix)
                prefix = None
            normed = rms(x, w(p + "input_layernorm.weight"))
            is_kda = i + 1 in linear["kda_layers"]
            attended = kda(p + "self_attn.", normed) if is_kda else mla(p + "self_attn.", normed)
            prefix = attended if prefix is None else prefix + attended
            mlp_in = rms(mix(p + "mlp_res", prefix, blocks), w(p + "post_attention_layernorm.weight"))
            prefix = prefix + mlp(p + "block_sparse_moe.", mlp_in, i < text["first_k_dense_replace"])
        final = rms(mix("model.output_attn_res", prefix, blocks), w("model.norm.weight"))
        return final @ w("lm_head.weight").T
