"""Building a model and its paged KV cache the way the engine does (also used by
proposers that load a model of their own: ``draft``, ``mtp``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.interfaces.attention import TOKEN_STATE, AttentionSpec
from engine.interfaces.model import Model, ModelInit
from engine.interfaces.ops import REFERENCE_OPS
from engine.interfaces.platform import Platform
from engine.interfaces.quantizer import Quantizer
from engine.layers.linear import (
    MergedLinear,
    RowByRowLinearMethod,
    UnquantizedLinearMethod,
    apply_linear_method,
    make_batch_invariant,
    quantize_model,
)
from engine.layers.moe import Experts, quantize_experts
from engine.model_config import HFConfig
from engine.model_loader.checkpoint import safetensors_files
from engine.model_loader.dequant import CheckpointDequantizer
from engine.model_loader.weights import load_weights
from engine.runtime.kv_cache import KVCache, KVCacheGroup, group_layers, num_blocks_for
from engine.runtime.token_state import TokenStateCache
from engine.selection import select_attention_backend

logger = logging.getLogger("engine")


def construct_model(
    model_cls: type[Model],
    hf_config: HFConfig,
    dtype_name: str,
    device: torch.device,
    *,
    quantizer: Quantizer | None = None,
    tp: TensorParallel = SINGLE,
) -> Model:
    """The model (rank ``tp.rank``'s part of it), its linear layers given the quantizer's
    methods, no weight read yet."""
    model = model_cls(ModelInit(config=hf_config, dtype=getattr(torch, dtype_name), device=device, tp=tp))
    model.eval()
    if quantizer is not None:
        quantized, declined = quantize_model(model, quantizer)
        experts = quantize_experts(model, quantizer)
        logger.info(
            "quantization %s: %d linear layers quantized, %d left as they are (%s)%s",
            quantizer.name,
            len(quantized),
            len(declined),
            ", ".join(declined) or "none",
            f"; the routed experts of {len(experts)} layers quantized" if experts else "",
        )
    return model


def load_model(
    model: Model,
    model_path: Path,
    platform: Platform,
    dtype_name: str,
    *,
    progress: bool = True,
    dequantizer: CheckpointDequantizer | None = None,
    batch_invariant: bool = False,
) -> Model:
    """Stream the checkpoint into ``model`` (dense from a quantized one with a
    ``dequantizer``), then switch its unquantized layers to the platform's linear method (its
    batch-invariant one, or every layer's method one row at a time, with ``batch_invariant``)."""
    ops = platform.layer_ops(dtype_name) or REFERENCE_OPS
    for module in model.modules():  # quantized methods compute with the platform's kernels
        if isinstance(module, MergedLinear):
            module.ops = ops
    # before the platform's methods replace the unquantized ones: the layers a quantizer took
    quantized = [
        m for m in model.modules() if isinstance(m, MergedLinear) and type(m.method) is not UnquantizedLinearMethod
    ]
    load_weights(model, safetensors_files(model_path), progress=progress, dequantizer=dequantizer)
    if batch_invariant:
        method = platform.batch_invariant_linear_method(dtype_name)
        if method is None:
            method = RowByRowLinearMethod(platform.linear_method(dtype_name) or UnquantizedLinearMethod())
        make_batch_invariant(model, method)
    else:
        linear_method = platform.linear_method(dtype_name)
        if linear_method is not None:
            apply_linear_method(model, linear_method)
    model.weight_memory = weight_memory(model, quantized)
    logger.info("%s", model.weight_memory.describe())
    return model


def refuse_batch_variant_layers(model: Model) -> None:
    """``--batch-invariant`` covers linear layers, attention and the layer ops; routed experts
    group tokens by expert, so a token's sums follow how many others chose its experts."""
    experts = [name for name, module in model.named_modules() if isinstance(module, Experts)]
    if experts:
        raise ValueError(
            f"--batch-invariant: {type(model).__name__} has routed experts ({experts[0]}, ...), which have "
            "no batch-invariant path yet; run it without --batch-invariant."
        )


def build_model(
    model_cls: type[Model],
    hf_config: HFConfig,
    model_path,
    platform,
    dtype_name: str,
    device: torch.device,
    *,
    quantizer: Quantizer | None = None,
    progress: bool = True,
    dequantizer: CheckpointDequantizer | None = None,
) -> Model:
    """Construct a model, give its linear layers the quantizer's methods, load its
    checkpoint (dense from a quantized one with a ``dequantizer``), then switch its
    unquantized layers to the platform's linear method."""
    model = construct_model(model_cls, hf_config, dtype_name, device, quantizer=quantizer)
    return load_model(model, model_path, platform, dtype_name, progress=progress, dequantizer=dequantizer)


def select_backends(
    specs: list[AttentionSpec],
    components,
    platform,
    dtype_name: str,
    block_size: int,
    attention_backend: str | None = None,
    batch_invariant: bool = False,
    kv_cache_dtype: str = "auto",
) -> list[tuple[AttentionSpec, list[int], type]]:
    """Each group of layers with equal specs and the backend class that serves it: a requested
    backend for the groups of the kinds it declares (a model may mix kinds: sparse MLA and its
    indexer), the platform's preference for the rest. One it serves none of is refused."""
    requested_kinds = set()
    if attention_backend is not None:
        requested_kinds = set(components.attention_backends.get(attention_backend).capabilities.kinds)
        if not requested_kinds & {spec.kind for spec in specs}:
            requested_kinds = {spec.kind for spec in specs if spec.kind != TOKEN_STATE}  # validation says why not
    selected = []
    for spec, layers in group_layers(specs):
        if spec.kind == TOKEN_STATE:  # stored values, not attention: the core serves them everywhere
            backend_cls = TokenStateCache
        else:
            backend_cls = select_attention_backend(
                components.attention_backends,
                platform,
                spec,
                dtype=dtype_name,
                block_size=block_size,
                requested=attention_backend if spec.kind in requested_kinds else None,
                batch_invariant=batch_invariant,
                kv_cache_dtype=kv_cache_dtype,
            )
        selected.append((spec, layers, backend_cls))
    return selected


def build_kv_cache(
    model: Model,
    components,
    platform,
    dtype_name: str,
    device: torch.device,
    block_size: int,
    memory_bytes: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    attention_backend: str | None = None,
    agree: Callable[[int], int] | None = None,
    backends: list[tuple[AttentionSpec, list[int], type]] | None = None,
    batch_invariant: bool = False,
    spare_blocks: int = 0,
    kv_cache_dtype: str = "auto",
    state_snapshots: int | None = 0,
    snapshot_interval: int = 0,
) -> KVCache:
    """The paged KV cache of ``model``: one group per distinct layer spec with the attention
    backend selected for it (``backends``, from :func:`select_backends`, when already chosen),
    as many blocks as ``memory_bytes`` holds (no more than ``max_num_seqs`` sequences of
    ``max_model_len`` can use), ``spare_blocks`` of them past the rest and given to no request
    (on top of the memory where it holds no more than one request of ``max_model_len``).

    Recurrent layers get a state slot per sequence first, then ``state_snapshots`` rows for
    prefix caching (None: as many as a quarter of the memory left holds, at most one per
    ``snapshot_interval`` tokens of ``max_num_seqs`` sequences of ``max_model_len``)."""
    dtype = getattr(torch, dtype_name)
    specs = model.kv_cache_specs()
    if backends is None:
        backends = select_backends(
            specs, components, platform, dtype_name, block_size, attention_backend, batch_invariant, kv_cache_dtype
        )
    groups = []
    for spec, layers, backend_cls in backends:
        backend = backend_cls(spec, block_size, dtype, device)
        if batch_invariant and spec.kind != TOKEN_STATE:  # stored values: nothing is reduced
            backend.batch_invariant = True
        if spec.kind != TOKEN_STATE:
            backend.kv_cache_dtype = kv_cache_dtype
        groups.append(KVCacheGroup(spec, backend, layers))
        logger.info("attention kind %s: backend %s for %d layers", spec.kind, backend_cls.name, len(layers))
    # bytes of a cache element: the paged groups' cache dtype (fp8 caches take one byte)
    paged = [
        group.backend.cache_dtype(dtype)
        for group in groups
        if not group.spec.is_recurrent and group.spec.kind != TOKEN_STATE
    ]
    element_size = torch.empty(0, dtype=paged[0] if paged else dtype).element_size()
    # recurrent layers hold one state per running request, taken from the memory first
    num_state_slots = max_num_seqs if any(spec.is_recurrent for spec in specs) else 0
    row_bytes = sum(  # one request's state in every recurrent layer
        spec.state_numel()
        * torch.empty(0, dtype=group.backend.cache_dtype(dtype)).element_size()
        * len(group.layer_indices)
        for group in groups
        for spec in [group.spec]
        if spec.is_recurrent
    )
    state_bytes = num_state_slots * row_bytes
    if state_bytes >= memory_bytes:
        raise ValueError(
            f"KV-cache memory of {memory_bytes / 2**30:.3f} GiB does not hold the recurrent states of "
            f"{max_num_seqs} requests ({state_bytes / 2**30:.3f} GiB); raise --kv-cache-memory or lower --max-num-seqs."
        )
    memory_bytes -= state_bytes
    num_state_snapshots = 0
    if num_state_slots and state_snapshots != 0:
        if state_snapshots is None:
            useful = max_num_seqs * (max_model_len // snapshot_interval + 1)
            num_state_snapshots = min(memory_bytes // 4 // row_bytes, useful)
        else:
            num_state_snapshots = state_snapshots
        snapshot_bytes = num_state_snapshots * row_bytes
        if snapshot_bytes >= memory_bytes:
            raise ValueError(
                f"KV-cache memory of {memory_bytes / 2**30:.3f} GiB left after the running requests' recurrent "
                f"states does not hold {num_state_snapshots} state snapshots ({snapshot_bytes / 2**30:.3f} GiB); "
                f"lower --num-state-snapshots or raise --kv-cache-memory."
            )
        memory_bytes -= snapshot_bytes
        logger.info(
            "prefix caching of recurrent state: %d snapshots of %.2f MiB (every %d tokens and at prompt ends)",
            num_state_snapshots,
            row_bytes / 2**20,
            snapshot_interval,
        )
    blocks_per_seq = -(-max_model_len // block_size)
    # the spare blocks come out of the same memory, unless the cache then could not hold one
    # request of max_model_len (a cache sized to exactly that gets them on top)
    fit = num_blocks_for(
        specs,
        block_size,
        element_size,
        memory_bytes,
        max_blocks_useful=max_num_seqs * blocks_per_seq + spare_blocks,
    )
    num_blocks = fit - spare_blocks if fit - spare_blocks >= blocks_per_seq else min(fit, max_num_seqs * blocks_per_seq)
    if agree is not None:  # tensor-parallel ranks: the same block numbering everywhere
        num_blocks = agree(num_blocks)
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"The KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks), fewer than "
            f"max_model_len={max_model_len}: one long request could never run. Raise "
            f"--kv-cache-memory or lower --max-model-len."
        )
    ops = platform.layer_ops(dtype_name) or REFERENCE_OPS
    return KVCache(
        groups,
        len(specs),
        num_blocks,
        block_size,
        dtype,
        device,
        ops,
        allocate=platform.allocate_kv_cache,
        num_state_slots=num_state_slots,
        spare_blocks=spare_blocks,
        num_state_snapshots=num_state_snapshots,
    )


MIB = 2**20


@dataclass(frozen=True)
class WeightMemory:
    """The bytes a loaded model holds on this rank (its own part under tensor parallelism):
    every tensor of its modules (parameters, buffers and any other tensor a method keeps, such
    as a platform's packed copy), each storage once; and of those, what the quantized linear
    layers hold beside what their weights and biases take dense in the compute dtype."""

    resident_bytes: int
    quantized_bytes: int
    quantized_dense_bytes: int
    num_quantized_layers: int
    compute_dtype: str
    rank: int = 0
    world_size: int = 1

    @property
    def quantized_fraction(self) -> float | None:
        """Quantized layers' bytes / their dense bytes; None without quantized layers."""
        return self.quantized_bytes / self.quantized_dense_bytes if self.quantized_dense_bytes else None

    def describe(self) -> str:
        """``weights: X MiB resident (Y MiB in quantized linear layers, Z% of their bfloat16 size)``."""
        where = f" (rank {self.rank} of {self.world_size})" if self.world_size > 1 else ""
        if self.quantized_fraction is None:
            detail = "no quantized linear layers"
        else:
            detail = (
                f"{self.quantized_bytes / MIB:.2f} MiB in {self.num_quantized_layers} quantized linear layers, "
                f"{self.quantized_fraction:.1%} of their {self.compute_dtype} size"
            )
        return f"weights{where}: {self.resident_bytes / MIB:.2f} MiB resident ({detail})"


def weight_memory(model: torch.nn.Module, quantized: list[MergedLinear]) -> WeightMemory:
    """The :class:`WeightMemory` of a loaded ``model`` whose ``quantized`` layers a quantizer took."""
    sizes = _storage_sizes(model.modules())
    quantized_sizes = _storage_sizes(m for layer in quantized for m in layer.modules())
    dense = sum(
        (sum(layer.output_sizes) * layer.input_size + (sum(layer.output_sizes) if layer.has_bias else 0))
        * layer.dtype.itemsize
        for layer in quantized
    )
    tp = next((m.tp for m in model.modules() if isinstance(m, MergedLinear)), SINGLE)
    return WeightMemory(
        resident_bytes=sum(sizes.values()),
        quantized_bytes=sum(quantized_sizes.values()),
        quantized_dense_bytes=dense,
        num_quantized_layers=len(quantized),
        compute_dtype=str(next(iter({layer.dtype for layer in quantized}), "")).removeprefix("torch."),
        rank=tp.rank,
        world_size=tp.size,
    )


def _storage_sizes(modules) -> dict[int, int]:
    """Bytes of each distinct storage the modules' tensors live in (parameters, buffers and
    plain tensor attributes), by storage address; a view counts its whole storage once."""
    sizes: dict[int, int] = {}
    for module in modules:
        attributes = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in [*module._parameters.values(), *module._buffers.values(), *attributes]:
            if tensor is None or tensor.device.type == "meta":
                continue
            try:
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque layout (mkldnn): its elements
                key, size = id(tensor), tensor.numel() * tensor.element_size()
            if key == 0:  # nothing allocated (an empty tensor)
                continue
            sizes[key] = max(size, sizes.get(key, 0))
    return sizes
