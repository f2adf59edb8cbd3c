"""DeepSeek-V4's checkpoint tensor names: the reference checkpoints' names (which
transformers' save_pretrained also writes) mapped to transformers' module names, which the
engine's modules use."""

from __future__ import annotations

import re

# The reference checkpoints' tensor names -> transformers' (as transformers converts them on load;
# its save_pretrained writes them back this way, under "model." for the decoder's).
_RENAMES = [
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.norm\.", ".kv_norm."),  # the attention's and the compressors' norms
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
]


def transformers_name(name: str) -> str:
    """A checkpoint tensor's name as transformers' modules name it. Reference checkpoints name
    them ``layers.N.attn.wq_a.weight``, ``embed.weight``, ``head.weight`` ...; transformers
    saves the same names, the decoder's under ``model.``; its own names pass unchanged."""
    if name.startswith(("mtp.", "lm_head.")):
        return name
    body = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        body = re.sub(pattern, replacement, body)
    return body if body.startswith("lm_head.") else "model." + body
