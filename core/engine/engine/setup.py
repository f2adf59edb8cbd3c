"""Every component of an engine resolved and checked from its ``EngineConfig`` before any
weight is read: the checkpoint's config, platform, dtype, model class, quantizer (or the
dequantizer of a checkpoint without kernels here), attention backend, proposer and KV
tier. A mistake in any of them fails here, in well under a second."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import SelectionError
from engine.interfaces.model import Model
from engine.interfaces.platform import Platform
from engine.interfaces.quantizer import Quantizer
from engine.model_config import HFConfig
from engine.model_loader.checkpoint import checkpoint_dtype, read_config, resolve_model_path
from engine.model_loader.dequant import CheckpointDequantizer, dequantizable
from engine.plugins.registry import ComponentError
from engine.runtime.kv_cache_manager import cache_salt
from engine.selection import resolve_dtype, select_platform

logger = logging.getLogger("engine")

# quantization methods whose plugin is ours to name in an error, by quant_method (or
# "<quant_method>/<format>" where one format of a method has a plugin of its own)
QUANTIZER_DISTRIBUTIONS = {
    "awq": "engine-awq",
    "bitsandbytes": "engine-bitsandbytes",
    "gptq": "engine-gptq",
    "mxfp8": "engine-xpu",
    "fp8": "engine-cuda",
    "gguf": "engine-gguf",
    "compressed-tensors/float-quantized": "engine-cuda",
    "compressed-tensors/pack-quantized": "engine-compressed-tensors",
}


@dataclass(frozen=True)
class EngineSetup:
    """What an engine (and each of its ranks) is built from."""

    config: EngineConfig
    components: Any  # engine.plugins.components.Components
    model_path: Path
    raw_config: dict
    hf_config: HFConfig
    architecture: str
    model_cls: type[Model]
    platform: Platform
    dtype_name: str
    max_model_len: int
    vocab_size: int
    quantizer: Quantizer | None
    # a checkpoint dequantized at load (all of it, or with keep_quantized what the quantizer's layers do not take)
    dequantizer: CheckpointDequantizer | None
    proposer_cls: type | None
    kv_tier_cls: type | None
    structured_output_cls: type | None = None  # None: no backend installed (constraints are refused)
    tool_parser_cls: type | None = None  # None: tool calls are not read (tool choice is refused)
    reasoning_parser_cls: type | None = None  # None: the output is all content

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def salt(self) -> bytes:
        """The root of the prefix-cache hash chains (and of a KV tier's digest)."""
        return cache_salt(str(self.model_path.resolve()), self.architecture, self.dtype_name, self.config.block_size)


def transformers_text_defaults(raw_config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config as transformers reads ``raw_config`` (its defaults filled in for
    the fields a published config leaves out: Gemma 3's multimodal configs omit the vocabulary
    size, say), or ``{}`` where transformers does not know the ``model_type``."""
    model_type = raw_config.get("model_type")
    if not model_type:
        return {}
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in raw_config.items() if k != "model_type"}
        return AutoConfig.for_model(model_type, **fields).get_text_config().to_dict()
    except Exception:  # an unknown model type, or a config transformers cannot read
        logger.debug("transformers cannot read a %r config for its defaults", model_type, exc_info=True)
        return {}


def resolve_setup(config: EngineConfig, components: Any) -> EngineSetup:
    """Resolve and check every component named by ``config``; reads config.json, no weight."""
    model_path = resolve_model_path(config.model)
    raw_config = read_config(model_path)
    architectures = raw_config.get("architectures") or []
    if not architectures:
        raise SelectionError(f"{model_path / 'config.json'} lists no 'architectures'.")
    architecture = architectures[0]
    model_cls = components.models.get(architecture)
    platform = select_platform(components.platforms, config.device)
    dtype_name = resolve_dtype(config.dtype, checkpoint_dtype(raw_config), platform)
    # Kimi's configs name it model_max_length; multimodal ones keep the language model's under text_config
    text_config = raw_config.get("text_config") or {}
    max_positions = (
        raw_config.get("max_position_embeddings")
        or raw_config.get("model_max_length")
        or text_config.get("max_position_embeddings")
        or text_config.get("model_max_length")
    )
    vocab_size = raw_config.get("vocab_size") or text_config.get("vocab_size")
    if not (max_positions and vocab_size):  # fields a config leaves to transformers' defaults
        defaults = transformers_text_defaults(raw_config)
        max_positions = max_positions or defaults.get("max_position_embeddings")
        vocab_size = vocab_size or defaults.get("vocab_size")
    max_positions = int(max_positions or 2048)
    max_model_len = config.max_model_len or max_positions
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_positions}.")
    if config.attention_backend is not None:
        components.attention_backends.get(config.attention_backend)  # an unknown name lists the known ones
    quantizer, dequantizer = resolve_quantizer(config, components, raw_config, model_path, platform, dtype_name)
    return EngineSetup(
        config=config,
        components=components,
        model_path=model_path,
        raw_config=raw_config,
        hf_config=HFConfig(raw_config),
        architecture=architecture,
        model_cls=model_cls,
        platform=platform,
        dtype_name=dtype_name,
        max_model_len=max_model_len,
        vocab_size=int(vocab_size or 0),
        quantizer=quantizer,
        dequantizer=dequantizer,
        proposer_cls=resolve_proposer(config, components),
        kv_tier_cls=resolve_kv_tier(config, components),
        structured_output_cls=resolve_structured_output_backend(config, components),
        tool_parser_cls=resolve_parser(config.tool_call_parser, components.tool_parsers, model_cls.tool_parser),
        reasoning_parser_cls=resolve_parser(
            config.reasoning_parser, components.reasoning_parsers, model_cls.reasoning_parser
        ),
    )


def resolve_quantizer(
    config: EngineConfig,
    components: Any,
    raw_config: dict,
    model_path: Path,
    platform: Platform,
    dtype_name: str,
) -> tuple[Quantizer | None, CheckpointDequantizer | None]:
    """The checkpoint's own quantization method, else ``--quantization``'s, else none; for a
    format the engine can dequantize, the dequantizer too: alone where no quantizer for it
    runs here (the weights become dense), keeping the weights the quantizer's layers take
    quantized where one does."""
    checkpoint_config = raw_config.get("quantization_config")
    if checkpoint_config is not None:
        method = checkpoint_config.get("quant_method") if isinstance(checkpoint_config, dict) else None
        if not isinstance(method, str):
            raise SelectionError(
                f"{model_path / 'config.json'} has a quantization_config without a quant_method string."
            )
        if config.quantization is not None and config.quantization.split("/")[0] != method:
            raise SelectionError(
                f"The checkpoint is already quantized with {method!r}; --quantization {config.quantization} "
                f"applies to unquantized checkpoints only."
            )
        if config.quantization_config:
            raise SelectionError(
                "--quantization-config applies to on-the-fly quantization; this checkpoint's "
                "quantization_config in config.json is used as it is."
            )
        if dequantizable(checkpoint_config):
            unusable = kernel_quantizer_unusable(components, checkpoint_config, model_path, platform, dtype_name)
            if unusable is not None:  # no kernels for this format here: the weights become dense
                logger.info(
                    "the checkpoint is quantized with %r and %s: its weights are dequantized to %s at load",
                    method,
                    unusable,
                    dtype_name,
                )
                return None, CheckpointDequantizer(checkpoint_config, getattr(torch, dtype_name))
            quantizer_cls = components.quantizers.get(
                checkpoint_quantizer_name(components, checkpoint_config, model_path)
            )
            logger.info(
                "the checkpoint is quantized with %r: the linear layers %s takes keep their quantized "
                "weights, every other quantized tensor is dequantized to %s at load",
                method,
                quantizer_cls.name,
                dtype_name,
            )
            quantizer = quantizer_cls.from_config(dict(checkpoint_config), prequantized=True)
            return quantizer, CheckpointDequantizer(checkpoint_config, getattr(torch, dtype_name), keep_quantized=True)
        name = checkpoint_quantizer_name(components, checkpoint_config, model_path)
        try:
            quantizer_cls = components.quantizers.get(name)
        except ComponentError:
            withdrawn = components.quantizers.withdrawn(name)
            if withdrawn is not None:  # two plugins registered it: say so
                raise SelectionError(withdrawn) from None
            fmt = checkpoint_format(checkpoint_config, model_path)
            names = [f"{method}/{fmt}", method] if fmt is not None else [method]
            install = next((QUANTIZER_DISTRIBUTIONS[key] for key in names if key in QUANTIZER_DISTRIBUTIONS), None)
            hint = (
                f"install {install} (pip install {install})"
                if install
                else (f"install a plugin that registers the quantization method {names[0]!r}")
            )
            raise SelectionError(
                f"The checkpoint at {model_path} is quantized with {method!r}"
                f"{f' in format {fmt!r}' if fmt is not None else ''} (its quantization_config), and no quantizer "
                f"is registered as {' or '.join(map(repr, names))} "
                f"(registered: {', '.join(components.quantizers.names()) or 'none'}): {hint}, "
                f"and select it if you pass --plugins."
            ) from None
        settings, prequantized = checkpoint_config, True
    elif config.quantization is not None:
        quantizer_cls = components.quantizers.get(config.quantization)
        settings, prequantized = config.quantization_config, False
    else:
        if config.quantization_config:
            raise SelectionError("--quantization-config was given without --quantization: name the method.")
        return None, None
    name = quantizer_cls.name
    platform.check_quantization(name)
    if quantizer_cls.supported_platforms is not None and platform.name not in quantizer_cls.supported_platforms:
        raise SelectionError(
            f"Quantization {name!r} does not run on platform {platform.name!r}; it supports "
            f"{', '.join(sorted(quantizer_cls.supported_platforms))}."
        )
    if dtype_name not in quantizer_cls.activation_dtypes:
        raise SelectionError(
            f"Quantization {name!r} computes in {', '.join(sorted(quantizer_cls.activation_dtypes))}, "
            f"not {dtype_name}; pass --dtype with one of those."
        )
    return quantizer_cls.from_config(dict(settings), prequantized=prequantized), None


def checkpoint_format(checkpoint_config: dict, model_path: Path) -> str | None:
    """The format a checkpoint's ``quantization_config`` names for its weights: the one every
    entry of its ``config_groups`` names (compressed-tensors), else its top-level ``format``,
    else None. Groups that name different formats are a SelectionError."""
    groups = checkpoint_config.get("config_groups")
    groups = groups.items() if isinstance(groups, dict) else ()
    formats = {name: group["format"] for name, group in groups if isinstance(group, dict) and group.get("format")}
    if len(set(formats.values())) > 1:
        named = ", ".join(f"{name}: {fmt}" for name, fmt in formats.items())
        raise SelectionError(
            f"{model_path / 'config.json'}'s quantization_config mixes formats across its config_groups "
            f"({named}); one quantizer serves one format, so every group must name the same one. "
            f"Requantize the model with a single format."
        )
    if formats:
        return next(iter(formats.values()))
    fmt = checkpoint_config.get("format")
    return fmt if isinstance(fmt, str) and fmt else None


def checkpoint_quantizer_name(components: Any, checkpoint_config: dict, model_path: Path) -> str:
    """The registered name of the quantizer for a prequantized checkpoint:
    ``"<quant_method>/<format>"`` where the config names a format and a quantizer is registered
    under that name (or was withdrawn from it: its lookup then says why), else ``"<quant_method>"``."""
    method = checkpoint_config["quant_method"]
    fmt = checkpoint_format(checkpoint_config, model_path)
    if fmt is not None:
        name = f"{method}/{fmt}"
        if name in components.quantizers or components.quantizers.withdrawn(name) is not None:
            return name
    return method


def kernel_quantizer_unusable(
    components: Any, checkpoint_config: dict, model_path: Path, platform: Platform, dtype_name: str
) -> str | None:
    """Why the quantizer registered for a format the engine can also dequantize cannot serve
    this checkpoint here (so that it is dequantized instead), or None when it can."""
    try:
        method = checkpoint_quantizer_name(components, checkpoint_config, model_path)
    except SelectionError:  # formats mixed across groups, each of which the engine dequantizes
        return "its config_groups mix formats, which no one quantizer serves"
    if method not in components.quantizers.names():
        return "no quantizer of that name is registered"
    quantizer_cls = components.quantizers.get(method)
    declined = quantizer_cls.declines(checkpoint_config)
    if declined is not None:
        return f"quantizer {method!r} does not take it ({declined})"
    supported = quantizer_cls.supported_platforms
    if supported is not None and platform.name not in supported:
        return f"quantizer {method!r} runs on {', '.join(sorted(supported))}, not {platform.name}"
    if dtype_name not in quantizer_cls.activation_dtypes:
        return f"quantizer {method!r} does not compute in {dtype_name}"
    try:
        platform.check_quantization(method)
    except ValueError as error:
        return str(error)
    return None


def resolve_proposer(config: EngineConfig, components: Any) -> type | None:
    """The speculative proposer's class, or None without speculation."""
    if config.speculative_method is None:
        if config.speculative_config:
            raise SelectionError("--speculative-config was given without --speculative-method: name the proposer.")
        return None
    return components.spec_proposers.get(config.speculative_method)


def resolve_kv_tier(config: EngineConfig, components: Any) -> type | None:
    """The KV tier's class, or None without a tier (its settings are checked when it is made,
    also before any weight is read: it needs the model's cache layout)."""
    if config.kv_tier is None:
        if config.kv_tier_config:
            raise ValueError("kv_tier_config was given without kv_tier: name the tier (--kv-tier).")
        return None
    if not config.enable_prefix_caching:
        raise ValueError("A KV tier holds prefix-cache blocks: it needs prefix caching on.")
    return components.kv_tiers.get(config.kv_tier)


DEFAULT_STRUCTURED_OUTPUT_BACKEND = "xgrammar"


def resolve_structured_output_backend(config: EngineConfig, components: Any) -> type | None:
    """The structured-output backend's class: the one named, else xgrammar where installed,
    else the first installed by name, else None."""
    registry = components.structured_output_backends
    name = config.structured_output_backend
    if name is None:
        if config.structured_output_config:
            raise ValueError(
                "structured_output_config was given without structured_output_backend: name the backend "
                "(--structured-output-backend)."
            )
        if DEFAULT_STRUCTURED_OUTPUT_BACKEND in registry:
            name = DEFAULT_STRUCTURED_OUTPUT_BACKEND
        elif len(registry):
            name = registry.names()[0]
        else:
            return None
    return registry.get(name)


def resolve_parser(name: str, registry: Any, family_default: str | None) -> type | None:
    """A parser class: the one ``name`` names, the model family's own for ``auto`` (None when it
    has none, or names one no loaded plugin registers), None for ``none``."""
    if name == "none":
        return None
    if name == "auto":
        if family_default is None:
            return None
        if family_default not in registry:
            logger.warning(
                "the model family's %s %r is not registered by any loaded plugin; none is used",
                registry.kind,
                family_default,
            )
            return None
        return registry.get(family_default)
    return registry.get(name)


def check_tensor_parallel(setup: EngineSetup, launch: Any = None) -> None:
    """What more than one rank cannot run, refused on every rank before any joins; with a
    ``launch`` (``engine.distributed.executor.Launch``) its group size must be the configured one."""
    config = setup.config
    if launch is not None and launch.world_size != config.tensor_parallel_size:
        raise ValueError(
            f"This process was started as rank {launch.rank} of {launch.world_size}, but "
            f"--tensor-parallel-size is {config.tensor_parallel_size}: make them equal."
        )
    if not getattr(setup.model_cls, "supports_tensor_parallel", False):
        raise SelectionError(
            f"{setup.architecture} does not support tensor parallelism (its plugin does not "
            f"shard it); run it with --tensor-parallel-size 1."
        )
    if config.speculative_method is not None:
        raise SelectionError("Speculative decoding is not supported with --tensor-parallel-size > 1 yet.")
