"""Engine configuration: one pydantic model, validated once, shown in ``--help``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DTYPES = ("auto", "float32", "bfloat16", "float16")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Checkpoint directory (config.json + safetensors) or a built-in model name.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to the model directory.")
    plugins: list[str] | None = Field(None, description="Plugins to load; None autoloads all installed.")
    device: str | None = Field(None, description="Platform name; default: the only available accelerator, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto uses the checkpoint's when the platform supports it."
    )
    attention_backend: str | None = Field(None, description="Attention backend name or module.path:Class.")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output; default from config.json.")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(16384, ge=1, description="Token budget of one step.")
    kv_cache_memory: float | None = Field(
        None, gt=0, description="KV-cache size in GiB; default: kv_cache_memory_fraction of free memory, "
        "else the platform's default (cpu: half of free memory, at most 4 GiB)."
    )
    kv_cache_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="Share of free device memory for the KV cache."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of prompt prefixes seen before.")
    kv_tier: str | None = Field(
        None, description="Secondary KV tier for evicted prefix blocks: a registered name (cpu, disk, ...) or "
        "module.path:Class; default: none."
    )
    kv_tier_config: dict[str, Any] = Field(
        default_factory=dict, description="The tier's settings, a JSON object (e.g. {\"capacity_gb\": 8})."
    )
    quantization: str | None = Field(
        None, description="Quantize an unquantized checkpoint while loading: a registered method (bitsandbytes, "
        "...) or module.path:Class. A quantized checkpoint names its own method in config.json."
    )
    quantization_config: dict[str, Any] = Field(
        default_factory=dict, description="Settings for --quantization, a JSON object in the shape of a "
        "checkpoint's quantization_config (e.g. {\"load_in_8bit\": true})."
    )
    speculative_method: str | None = Field(
        None, description="Speculative decoding proposer: ngram, draft, a plugin's, or module.path:Class; "
        "default: none."
    )
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="Most draft tokens per request and step.")
    speculative_config: dict[str, Any] = Field(
        default_factory=dict, description="The proposer's settings, a JSON object (e.g. {\"model\": \"./draft\"} "
        "for draft, {\"prompt_lookup_max\": 5} for ngram)."
    )
    seed: int = Field(0, description="Seed for unseeded sampling.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks to split the model over (tensor parallelism): spawned on this machine, or "
        "started by torchrun across machines (WORLD_SIZE must equal it)."
    )

    @field_validator("kv_tier_config", "quantization_config", "speculative_config", mode="before")
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
        None, description="Key every endpoint but /health requires (Authorization: Bearer KEY or x-api-key: KEY); "
        "default: $ENGINE_API_KEY, else none."
    )
    served_model_name: str | None = Field(None, description="Model name clients send; default: the model argument.")
    metrics_public: bool = Field(False, description="Serve /metrics without the API key.")
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body accepted.")

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("api_key must not be empty or blank")
        return value
