"""Engine configuration: one pydantic model, validated once, shown in ``--help``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DTYPES = ("auto", "float32", "bfloat16", "float16")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="Checkpoint directory (config.json + safetensors), a .gguf file (or a directory holding one), "
        "built-in model name or Hub id (owner/name)."
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model directory.")
    plugins: list[str] | None = Field(
        None,
        description="Comma-separated plugins to load (entry-point names or module paths); '' loads none; "
        "unset: $ENGINE_PLUGINS, else every installed plugin.",
    )
    device: str | None = Field(
        None,
        description="Platform name; default: the only available accelerator (two or more need a choice), else cpu.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype; auto: the checkpoint's where the platform supports it, else the "
        "platform's default.",
    )
    attention_backend: str | None = Field(
        None,
        description="Attention backend name or module.path:Class; default: the platform's first backend "
        "that can serve the model.",
    )
    batch_invariant: bool = Field(
        False,
        description="Kernels whose reductions do not depend on the batch: every request's tokens are bitwise "
        "the same alone or in any batch, in any dtype, at some cost in speed. Layers without such a kernel "
        "(MoE experts, attention backends that do not declare one) are refused.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output in tokens; default: the checkpoint's max_position_embeddings."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(16384, ge=1, description="Token budget of one step.")
    kv_cache_memory: float | None = Field(
        None,
        gt=0,
        description="KV-cache size in GiB; unset: kv_cache_memory_fraction of the free memory if that "
        "is set, else the platform's default (half of the free device memory; cpu: half of the free host memory, "
        "at most 4 GiB).",
    )
    kv_cache_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of the free device memory (host memory on cpu) for the KV cache, "
        "used when kv_cache_memory is unset.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of the device's total memory the engine may take, on platforms whose allocator "
        "counts its bytes (cuda, rocm): the KV cache gets that share less what is in use before it (weights, "
        "the runtime, other processes) and the activation peak of a profiled forward at max_num_batched_tokens. "
        "Not used where kv_cache_memory or kv_cache_memory_fraction is set, nor on cpu.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="KV-cache entries: auto (the compute dtype) or fp8 (float8_e4m3fn, per-tensor scales of "
        "1.0: half the bytes of bf16, so twice the tokens in the same memory); fp8 needs an attention backend "
        "that declares it (triton_paged on cuda, rocm, xpu).",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of prompt prefixes seen before.")
    state_snapshot_interval: int = Field(
        256,
        ge=1,
        description="Models with recurrent layers (linear attention, SSMs), with prefix caching: their state is "
        "kept at every multiple of this many tokens (a multiple of block_size) and at the last full block of "
        "each prompt, for later requests with the same prefix to start from; prompts are computed in chunks "
        "that end there.",
    )
    num_state_snapshots: int | None = Field(
        None,
        ge=0,
        description="Recurrent-state snapshots the KV-cache memory keeps for prefix caching (0: no prefix "
        "caching for models with recurrent layers); default: as many as a quarter of the KV-cache memory "
        "holds, at most one per snapshot point of max_num_seqs full-length requests.",
    )
    kv_tier: str | None = Field(
        None,
        description="Secondary KV tier for evicted prefix blocks: cpu (built in), a plugin's tier (e.g. disk) "
        "or module.path:Class.",
    )
    kv_tier_config: dict[str, Any] = Field(
        default_factory=dict,
        description='The tier\'s settings, a JSON object (e.g. {"capacity_gb": 8} for cpu, '
        '{"path": "/var/cache/engine-kv", "capacity_gb": 20} for disk).',
    )
    quantization: str | None = Field(
        None,
        description="Quantize an unquantized checkpoint while loading: a registered method (e.g. "
        "bitsandbytes, from engine-bitsandbytes) or module.path:Class. A quantized checkpoint needs none: its "
        "config.json names its method.",
    )
    quantization_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings for quantization, a JSON object in the shape of a "
        'checkpoint\'s quantization_config (e.g. {"load_in_8bit": true}).',
    )
    speculative_method: str | None = Field(
        None,
        description="Speculative decoding: a proposer drafts tokens, the model verifies them in one pass "
        "(outputs are unchanged): ngram (prompt lookup), draft (a small model, see speculative_config), mtp (the "
        "checkpoint's own multi-token-prediction block: DeepSeek, Qwen3.5, Qwen3-Next), a plugin's proposer or "
        "module.path:Class.",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=64, description="Most draft tokens per request and step (fewer when acceptance or load says so)."
    )
    speculative_config: dict[str, Any] = Field(
        default_factory=dict,
        description='The proposer\'s settings, a JSON object (e.g. {"model": "./draft"} '
        'for draft, {"prompt_lookup_min": 2, "prompt_lookup_max": 5} for ngram).',
    )
    seed: int = Field(0, description="Seed of the random state that requests without a seed of their own sample from.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks to split the model over (tensor parallelism): spawned on this machine, or "
        "started by torchrun across machines (WORLD_SIZE must equal it).",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly: capture no device graphs of decode steps (CUDA graphs on cuda).",
    )
    cuda_graph_max_bs: int | None = Field(
        None,
        ge=1,
        description="Largest decode batch captured as a device graph (sizes 1, 2, 4, 8, then steps of 8); "
        "default: max_num_seqs, at most 512. Larger decode batches run eagerly.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Run the forward on a thread of its own and schedule each step while the one before "
        "runs (its sampled tokens filled in when known), so that scheduling, output processing and the caller's "
        "work overlap the forward; outputs are the same either way. Default: the platform's (on for cuda, where "
        "the GPU runs a step while the host plans the next; off on cpu, whose cores the forward itself uses).",
    )

    structured_output_backend: str | None = Field(
        None,
        description="Structured-output backend: a registered name (xgrammar from engine-xgrammar, llguidance "
        "from engine-llguidance) or module.path:Class; default: xgrammar where installed, else the only one "
        "installed.",
    )
    structured_output_config: dict[str, Any] = Field(
        default_factory=dict, description="The structured-output backend's own settings, a JSON object."
    )
    structured_output_disable_any_whitespace: bool = Field(
        False,
        description="Write constrained JSON without whitespace between its tokens for every request (as if each "
        "asked for disable_any_whitespace); small or untrained models otherwise tend to emit runs of it.",
    )
    structured_output_compile_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a constraint may take to compile; a longer one is refused (a 400), and the "
        "request never waits on it.",
    )
    structured_output_max_constraint_chars: int = Field(
        262144,
        ge=1,
        description="Longest constraint (schema, regex, grammar, choices) in characters; a longer one is refused.",
    )

    tool_call_parser: str = Field(
        "auto",
        description="How tool calls are read out of the output: a registered tool-call parser (engine plugins "
        "lists them), module.path:Class, 'auto' (the model family's own, if it has one) or 'none'.",
    )
    reasoning_parser: str = Field(
        "auto",
        description="How a thinking model's reasoning is split from its answer (reasoning_content): a registered "
        "reasoning parser, module.path:Class, 'auto' (the model family's own, if it has one) or 'none'.",
    )

    @field_validator(
        "kv_tier_config", "quantization_config", "speculative_config", "structured_output_config", mode="before"
    )
    @classmethod
    def _parse_json_object(cls, value: object, info: ValidationInfo) -> object:
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"{info.field_name} is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(f"{info.field_name} must be a JSON object, got {type(value).__name__}")
        return value

    @field_validator("plugins", mode="before")
    @classmethod
    def _split_plugins(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value


class ServerConfig(BaseModel):
    """``engine serve``'s HTTP settings (the engine's are an ``EngineConfig``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 exposes the server to the network.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: str | None = Field(
        None,
        description="Key every endpoint but /health requires (Authorization: Bearer KEY or x-api-key: KEY); "
        "default: $ENGINE_API_KEY, else none.",
    )
    served_model_name: str | None = Field(
        None,
        description="Model name clients send; default: the model argument, or a local directory's own name.",
    )
    metrics_public: bool = Field(False, description="Serve /metrics without the API key.")
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body accepted, in bytes.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header values a server without an API key answers besides localhost's (a browser page "
        "can make requests to localhost under any name it resolves there); '*' answers any.",
    )
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in characters (text prompts, and rendered chat prompts), refused before it "
        "is tokenized; default: 32 per token of the model's context.",
    )
    max_sequences_per_request: int = Field(
        1024, ge=1, description="Most sequences (prompts × n) one request may ask for."
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Run a chat template a request sends in chat_template_kwargs (a template is code; it is "
        "refused otherwise).",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a client has to send a request's headers (from connecting, or after a response).",
    )
    body_timeout: float = Field(
        60.0, gt=0, description="Seconds a client has to send a request's body after its headers."
    )
    write_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a response may wait on a client that does not read it (the connection's send "
        "buffer full); the connection is then closed and its request aborted.",
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds a shutdown (SIGTERM, Ctrl-C) lets running requests finish, after it stops accepting "
        "new ones; those still running then end with an error (a 503, or an error event in a stream).",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="Let the model decide whether to call a tool (tool_choice 'auto', the default when tools "
        "are given): its output is read for calls with the tool-call parser.",
    )

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("api_key must not be empty or blank")
        return value
