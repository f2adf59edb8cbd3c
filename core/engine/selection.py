"""Choosing the platform, the compute dtype and each attention group's backend."""

from __future__ import annotations

import logging
from typing import Any

from engine.errors import SelectionError
from engine.interfaces.attention import AttentionBackend, AttentionSpec
from engine.interfaces.platform import Platform

logger = logging.getLogger("engine")

__all__ = ["SelectionError", "resolve_dtype", "select_attention_backend", "select_platform"]


def select_platform(platforms: Any, device: str | None) -> Platform:
    """``device`` by name; else the single available non-CPU platform; else CPU. The choice is
    logged at INFO with its reason and every platform passed over with its own (an available
    accelerator is never passed over for the CPU unless ``device`` asks for the CPU)."""
    if device is not None:
        cls = platforms.get(device)
        availability = cls.is_available()
        if not availability:
            raise SelectionError(f"Platform {device!r} is not available: {availability.reason}")
        logger.info("platform %s chosen (--device %s): %s", cls.name, device, availability.reason)
        return cls()
    candidates = []
    cpu = None
    probed: list[tuple[str, Any, Any]] = []  # (name, class, availability) in registration order
    for name in platforms.names():
        cls = platforms.get(name)
        availability = cls.is_available()
        probed.append((name, cls, availability))
        if not availability:
            continue
        if cls.device_type == "cpu":
            cpu = cpu or cls
        else:
            candidates.append(cls)
    if len(candidates) > 1:
        names = ", ".join(cls.name for cls in candidates)
        raise SelectionError(f"More than one platform is available ({names}); choose one with --device.")
    chosen = candidates[0] if candidates else cpu
    if chosen is None:
        installed = ", ".join(platforms.names()) or "none"
        raise SelectionError(
            f"No platform is available (registered: {installed}). Install a platform plugin such as engine-cpu."
        )
    passed = []
    for name, cls, availability in probed:
        if cls is chosen:
            reason = availability.reason
        elif availability:
            why = "an accelerator is preferred" if chosen.device_type != "cpu" else f"{chosen.name} is registered first"
            passed.append(f"{name} (available; {why}, --device {name} to use it)")
        else:
            passed.append(f"{name} ({availability.reason})")
    logger.info(
        "platform %s chosen: %s%s", chosen.name, reason, f"; passed over: {', '.join(passed)}" if passed else ""
    )
    return chosen()


def resolve_dtype(requested: str, checkpoint_dtype: str | None, platform: Platform) -> str:
    """The compute dtype name: explicit if supported, else the checkpoint's, else the platform default."""
    if requested != "auto":
        if not platform.supports_dtype(requested):
            raise SelectionError(
                f"dtype {requested} is not supported on platform {platform.name!r}; "
                f"supported: {', '.join(platform.supported_dtypes)}."
            )
        return requested
    if checkpoint_dtype in platform.auto_dtype_overrides:
        return platform.auto_dtype_overrides[checkpoint_dtype]
    if checkpoint_dtype and platform.supports_dtype(checkpoint_dtype):
        return checkpoint_dtype
    return platform.default_dtype


def select_attention_backend(
    backends: Any,
    platform: Platform,
    spec: AttentionSpec,
    *,
    dtype: str,
    block_size: int,
    requested: str | None = None,
    batch_invariant: bool = False,
    kv_cache_dtype: str = "auto",
) -> type[AttentionBackend]:
    """The requested backend if it validates, else the platform's first usable preference
    (with ``batch_invariant``, only backends that declare a batch-invariant mode)."""

    def reasons_against(cls: type[AttentionBackend]) -> list[str]:
        reasons = cls.validate(
            spec, platform=platform.name, dtype=dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype
        )
        if batch_invariant and not cls.capabilities.batch_invariant:
            reasons.append("no batch-invariant mode (--batch-invariant)")
        return reasons

    if requested is not None:
        cls = backends.get(requested)
        reasons = reasons_against(cls)
        if reasons:
            raise SelectionError(f"Attention backend {requested!r} cannot serve this model: {'; '.join(reasons)}.")
        return cls
    preferences = platform.attention_backend_preferences(spec.kind)
    rejected = []
    for name in preferences:
        if name not in backends:
            rejected.append(f"{name}: not registered (is its plugin loaded?)")
            continue
        cls = backends.get(name)
        reasons = reasons_against(cls)
        if not reasons:
            return cls
        rejected.append(f"{name}: {'; '.join(reasons)}")
    detail = "; ".join(rejected) if rejected else "the platform lists no backend for it"
    raise SelectionError(
        f"No attention backend for attention kind {spec.kind!r} on platform {platform.name!r} "
        f"(dtype {dtype}, head size {spec.head_size}, block size {block_size}"
        f"{'' if kv_cache_dtype == 'auto' else f', KV-cache dtype {kv_cache_dtype}'}): {detail}."
    )
