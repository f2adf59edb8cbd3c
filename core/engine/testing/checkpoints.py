"""Tiny random-weight checkpoints of HF architectures, saved as safetensors.

Everything is made locally with transformers (nothing is downloaded); the
returned HF model is the numerical reference for the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
    ),
    "MistralForCausalLM": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
        sliding_window=None,
    ),
    "Qwen2ForCausalLM": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "Qwen3ForCausalLM": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=512,
    ),
}

TINY_CONFIGS["DeepseekV3ForCausalLM"] = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    vocab_size=320,
    max_position_embeddings=512,
)

# V3.2: an indexer selecting more positions than the kit's sequences hold, so that it selects every
# causal position and transformers' result does not hinge on ties among indexer scores
TINY_CONFIGS["DeepseekV32ForCausalLM"] = dict(
    TINY_CONFIGS["DeepseekV3ForCausalLM"],
    index_n_heads=4,
    index_head_dim=16,
    index_topk=64,
)

# V4: every attention type (sliding only, compressed sparse with ratio 4, heavily compressed with
# ratio 16 here), a window of 8, hash routing in the first layer, YaRN on the compressed layers'
# rope; index_topk covers every entry of the kit's sequences
TINY_CONFIGS["DeepseekV4ForCausalLM"] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=48,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=64,
    sliding_window=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=320,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# Qwen3.5: gated DeltaNet layers (two key heads serving four value heads) around a gated
# attention layer with partial RoPE
TINY_CONFIGS["Qwen3_5ForCausalLM"] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    vocab_size=320,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Qwen3.5-MoE: the same layers, every MLP eight routed experts (two a token) and a shared one
TINY_CONFIGS["Qwen3_5MoeForCausalLM"] = dict(
    {k: v for k, v in TINY_CONFIGS["Qwen3_5ForCausalLM"].items() if k != "intermediate_size"},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

# Qwen3-Next: the MoE layers, a dense first MLP, top-k weights renormalised
TINY_CONFIGS["Qwen3NextForCausalLM"] = dict(
    TINY_CONFIGS["Qwen3_5MoeForCausalLM"],
    intermediate_size=96,
    mlp_only_layers=[0],
    norm_topk_prob=True,
)

# the published (multimodal) Qwen3.5 checkpoints: the tiny text model and a one-block vision tower
_TINY_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
TINY_CONFIGS["Qwen3_5ForConditionalGeneration"] = dict(
    text_config=TINY_CONFIGS["Qwen3_5ForCausalLM"], vision_config=_TINY_QWEN_VISION, tie_word_embeddings=False
)
TINY_CONFIGS["Qwen3_5MoeForConditionalGeneration"] = dict(
    text_config=TINY_CONFIGS["Qwen3_5MoeForCausalLM"], vision_config=_TINY_QWEN_VISION, tie_word_embeddings=False
)

# Kimi Linear: three KDA layers around one MLA layer (no positional encoding), a dense first layer
TINY_CONFIGS["KimiLinearForCausalLM"] = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_shared_experts=1,
    vocab_size=320,
    max_position_embeddings=512,
    linear_num_heads=4,
    linear_head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Nemotron-H: Mamba-2 layers (eight heads in two groups) around an attention layer without positional
# encoding, a relu² MLP and routed relu² experts (two groups of four, one group chosen)
TINY_CONFIGS["NemotronHForCausalLM"] = dict(
    hidden_size=64,
    vocab_size=320,
    layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    layer_norm_epsilon=1e-6,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_CONFIG_CLASSES = {
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "DeepseekV32ForCausalLM": "DeepseekV32Config",
    "DeepseekV4ForCausalLM": "DeepseekV4Config",
    "KimiLinearForCausalLM": "KimiLinearConfig",
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "NemotronHForCausalLM": "NemotronHConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5Config",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeConfig",
}


def make_tiny_checkpoint(
    architecture: str,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    with_tokenizer: bool = False,
    **overrides: Any,
) -> Any:
    """Save a random ``architecture`` model to ``path``; return the HF model (eval mode).

    Every parameter is random, norm weights and biases included (see
    :func:`randomize_constant_parameters`), so a model that fails to load one
    cannot match the reference by accident.

    ``overrides`` change fields of the tiny config; ``max_shard_size`` (e.g.
    "100KB") writes a sharded checkpoint with ``model.safetensors.index.json``.
    """
    import torch
    import transformers

    if architecture not in TINY_CONFIGS:
        raise KeyError(f"No tiny config for {architecture!r}. Known: {', '.join(TINY_CONFIGS)}.")
    config_cls = getattr(transformers, _CONFIG_CLASSES[architecture])
    config = config_cls(**{**TINY_CONFIGS[architecture], **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(getattr(torch, dtype)).eval()
    randomize_constant_parameters(model, seed + 1)
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return model


def randomize_constant_parameters(hf_model: Any, seed: int) -> None:
    """HF initialises norm weights to 1 and biases to 0: give every constant parameter (and
    every constant buffer the checkpoint saves) random values around its constant (noise of
    std 0.1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    saved = set(hf_model.state_dict())
    buffers = [b for name, b in hf_model.named_buffers() if name in saved]  # e.g. a router's score bias
    with torch.no_grad():
        for param in [*hf_model.parameters(), *buffers]:
            flat = param.detach().flatten()
            if param.is_floating_point() and bool((flat == flat[0]).all()):
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_(0.1 * noise.to(param.dtype))
        # hash routing tables (DeepSeek-V4's tid2eid [vocab, k], all zeros at init): distinct random experts
        num_experts = getattr(hf_model.config, "n_routed_experts", None)
        for name, table in hf_model.named_buffers():
            if name.endswith("tid2eid") and name in saved and num_experts:
                rows = [
                    torch.randperm(num_experts, generator=generator)[: table.shape[1]] for _ in range(table.shape[0])
                ]
                table.copy_(torch.stack(rows))


_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "An inference engine schedules requests, pages the KV cache and samples tokens.",
    "Hello world! Numbers like 12345 and symbols like #, @ and % appear too.",
    "Plugins register platforms, models, attention backends and KV tiers.",
]


def make_tiny_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
