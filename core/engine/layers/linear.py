"""Linear layers whose weight may be several checkpoint tensors stacked on the
output dim, computed by a swappable :class:`LinearMethod`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import SINGLE as SINGLE_RANK
from engine.distributed.parallel_state import TensorParallel, resolve_tp
from engine.interfaces.ops import REFERENCE_OPS, LayerOps
from engine.interfaces.quantizer import LinearMethod, Quantizer
from engine.layers.quantized_checkpoint import dense_tensor, quantized_checkpoint


class UnquantizedLinearMethod(LinearMethod):
    """A plain ``weight`` [out, in] (and ``bias`` [out]) applied with ``F.linear``."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        total = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(total, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class MergedLinear(nn.Module):
    """y = x Wᵀ + b with W = cat(W_0, W_1, ...) along the output dim.

    ``output_sizes`` lists the row count of each shard (e.g. q, k, v); a shard is
    filled from its own checkpoint tensors with :meth:`load_checkpoint_tensor`. A
    single output size is a plain linear layer. The engine may give the layer a
    quantized method before loading (:func:`quantize_model`) or a faster
    unquantized one after (:func:`apply_linear_method`).

    Under tensor parallelism a layer holds one rank's part (see :func:`ColumnParallelLinear`,
    :func:`QKVParallelLinear`, :func:`RowParallelLinear`): ``output_sizes`` and ``input_size``
    are then this rank's, ``out_slices`` gives each shard's ``(start, length)`` rows of the
    checkpoint tensor (zero-padded up to the shard's size), ``in_slice`` the ``(start,
    length)`` input columns, and ``reduce`` sums the output over the ranks. Each checkpoint
    tensor is cut to this rank's part before the method sees it, so quantizers' methods
    apply per shard as they are.

    Every layer here takes the rank's group as ``tp`` (a model passes ``ModelInit.tp``);
    ``tp=None`` falls back to the deprecated :func:`~engine.distributed.parallel_state.get_tp`
    for code written against engine 0.1.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod | None = None,
        *,
        out_slices: list[tuple[int, int]] | None = None,
        full_output_sizes: list[int] | None = None,
        in_slice: tuple[int, int] | None = None,
        full_input_size: int | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.has_bias = bias
        self.dtype = dtype
        self.out_slices = out_slices
        self.full_output_sizes = list(full_output_sizes or output_sizes)
        self.in_slice = in_slice
        self.full_input_size = full_input_size or input_size
        self.tp = resolve_tp(tp)
        self.reduce = in_slice is not None and self.tp.is_parallel
        # the platform's layer ops (set when the model loads), for methods that call its kernels
        self.ops: LayerOps = REFERENCE_OPS
        self.set_method(method or UnquantizedLinearMethod())

    def set_method(self, method: LinearMethod) -> None:
        """Replace the layer's parameters by those ``method`` creates (before loading)."""
        for name in list(self._parameters):
            delattr(self, name)
        self._received: set[tuple[str, int]] = set()  # (checkpoint tensor name, shard) loaded so far
        self.method = method
        method.create_weights(self, self.input_size, self.output_sizes, self.has_bias, self.dtype)

    def _rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into shard ``shard`` of the ``weight`` or ``bias`` parameter."""
        param = getattr(self, param_name)
        tensor = dense_tensor(f"{param_name}[{shard}]", tensor, param.dtype)
        target = param.data[self._rows(shard)]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Shard {shard} of {param_name} expects shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}."
            )
        target.copy_(tensor)

    def load_checkpoint_tensor(self, name: str, shard: int, tensor: torch.Tensor) -> bool:
        """Hand the checkpoint tensor ``name`` (``weight``, ``bias``, ``weight.absmax``, ...)
        of output shard ``shard`` to the method; True once every tensor of every shard
        arrived."""
        if not 0 <= shard < len(self.output_sizes):
            raise IndexError(f"Shard {shard} out of range for a layer of {len(self.output_sizes)} shard(s).")
        kept = quantized_checkpoint(tensor)
        if kept is not None:  # a quantized weight passed on with its scale (engine.model_loader.dequant)
            wanted = self.method.checkpoint_tensors(self)
            if kept.weight_name in wanted and kept.scale_name in wanted:
                self._load(kept.weight_name, shard, tensor)
                self._load(kept.scale_name, shard, kept.scale)
                return not self.missing_tensors()
            tensor = kept.dense(tensor)  # a method that takes dense weights
        self._load(name, shard, tensor)
        return not self.missing_tensors()

    def _load(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        self.method.load_weight(self, name, shard, self.method.local_part(self, name, shard, tensor))
        self._received.add((name, shard))

    def missing_tensors(self) -> list[str]:
        """Checkpoint tensors not loaded yet, as ``name[shard]``."""
        return [
            f"{name}[{shard}]"
            for shard in range(len(self.output_sizes))
            for name in self.method.checkpoint_tensors(self)
            if (name, shard) not in self._received
        ]

    def local_part(self, name: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` of shard ``shard``: its rows
        (dim 0) of a column-parallel layer, its input columns (dim 1) of a row-parallel one,
        whose bias only rank 0 adds. A view where it can be, so that a memory-mapped
        checkpoint is read only where this rank's part lies."""
        if self.out_slices is not None:
            start, length = self.out_slices[shard]
            full, local = self.full_output_sizes[shard], self.output_sizes[shard]
            if tensor.dim() == 0 or tensor.shape[0] != full:
                raise ValueError(self._unsplittable(name, tensor, f"its first dim is not the {full} output rows"))
            part = tensor.narrow(0, start, length)
            if length < local:  # the last rank's part of an unevenly split vocabulary
                part = torch.cat([part, part.new_zeros(local - length, *part.shape[1:])])
            return part
        if self.in_slice is not None:
            start, length = self.in_slice
            if tensor.dim() == 1 and tensor.shape[0] == sum(self.output_sizes):  # the bias, added once
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            if tensor.dim() != 2 or tensor.shape[1] != self.full_input_size:
                raise ValueError(self._unsplittable(name, tensor, f"it has no dim of {self.full_input_size} inputs"))
            return tensor.narrow(1, start, length)
        return tensor

    def _unsplittable(self, name: str, tensor: torch.Tensor, why: str) -> str:
        return (
            f"Checkpoint tensor {name!r} {tuple(tensor.shape)} of a {type(self.method).__name__} layer cannot "
            f"be split across {self.tp.size} tensor-parallel ranks: {why}. Load this checkpoint with "
            f"--tensor-parallel-size 1, or an unquantized one and quantize while loading."
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self.tp.all_reduce(y) if self.reduce else y

    def forward_silu_and_mul(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``ops.silu_and_mul(forward(x))`` of a gate/up layer, by the method's fused kernel where
        it has one for these rows (``LinearMethod.apply_silu_and_mul``)."""
        fused_kernel = getattr(self.method, "apply_silu_and_mul", None)
        if fused_kernel is not None and not self.reduce:
            fused = fused_kernel(self, x)
            if fused is not None:
                return fused
        return ops.silu_and_mul(self.forward(x))


def Linear(input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> MergedLinear:
    """A plain linear layer, whole on every rank."""
    return MergedLinear(input_size, [output_size], bias, dtype, tp=SINGLE_RANK)


def ColumnParallelLinear(
    input_size: int,
    output_sizes: list[int],
    bias: bool,
    dtype: torch.dtype,
    what: str = "output size",
    *,
    tp: TensorParallel | None = None,
) -> MergedLinear:
    """Each output shard split evenly over the ranks of ``tp`` (rank ``r`` holds rows
    ``r·n/size ..``); the output stays split (each rank computes its heads or its part of the MLP)."""
    tp = resolve_tp(tp)
    if not tp.is_parallel:
        return MergedLinear(input_size, output_sizes, bias, dtype, tp=tp)
    slices = [tp.split(size, what) for size in output_sizes]
    return MergedLinear(
        input_size,
        [length for _, length in slices],
        bias,
        dtype,
        out_slices=slices,
        full_output_sizes=output_sizes,
        tp=tp,
    )


def QKVParallelLinear(
    input_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bias: bool,
    dtype: torch.dtype,
    *,
    tp: TensorParallel | None = None,
) -> MergedLinear:
    """Fused q, k, v projections of this rank's query heads and KV heads (KV heads replicated
    when there are fewer than ranks, see :meth:`TensorParallel.kv_heads`)."""
    tp = resolve_tp(tp)
    full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if not tp.is_parallel:
        return MergedLinear(input_size, full, bias, dtype, tp=tp)
    q_start, q_count = tp.split(num_heads, "num_attention_heads")
    kv_start, kv_count = tp.kv_heads(num_kv_heads)
    kv = (kv_start * head_dim, kv_count * head_dim)
    slices = [(q_start * head_dim, q_count * head_dim), kv, kv]
    return MergedLinear(
        input_size, [length for _, length in slices], bias, dtype, out_slices=slices, full_output_sizes=full, tp=tp
    )


def RowParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool,
    dtype: torch.dtype,
    what: str = "input size",
    *,
    tp: TensorParallel | None = None,
) -> MergedLinear:
    """The input split evenly over the ranks of ``tp`` (each holds the columns of its heads or
    its part of the MLP), the partial outputs summed over them."""
    tp = resolve_tp(tp)
    if not tp.is_parallel:
        return MergedLinear(input_size, [output_size], bias, dtype, tp=tp)
    start, length = tp.split(input_size, what)
    return MergedLinear(length, [output_size], bias, dtype, in_slice=(start, length), full_input_size=input_size, tp=tp)


def ParallelLMHead(
    hidden_size: int, vocab_size: int, dtype: torch.dtype, *, tp: TensorParallel | None = None
) -> MergedLinear:
    """The LM head split over the vocabulary as :class:`VocabEmbedding` splits it (so a tied
    head shares the embedding's part); :func:`gather_logits` puts the logits together."""
    tp = resolve_tp(tp)
    if not tp.is_parallel:
        return MergedLinear(hidden_size, [vocab_size], False, dtype, tp=tp)
    start, length, padded = tp.padded_split(vocab_size)
    return MergedLinear(
        hidden_size, [padded], False, dtype, out_slices=[(start, length)], full_output_sizes=[vocab_size], tp=tp
    )


def gather_logits(head: MergedLinear, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` for the whole vocabulary: every rank's part, gathered."""
    logits = head(hidden)
    if head.out_slices is None:
        return logits
    return head.tp.all_gather(logits, dim=-1)[..., : head.full_output_sizes[0]]


def gather_argmax(head: MergedLinear, hidden: torch.Tensor) -> torch.Tensor | None:
    """``argmax(gather_logits(head, hidden))`` ([N] int64, the first of equal logits) by the
    head's method (``LinearMethod.apply_argmax``) without the logits, where it has a way; None
    where it has none or the vocabulary is split over ranks."""
    picker = getattr(head.method, "apply_argmax", None)
    if picker is None or head.out_slices is not None or head.reduce:
        return None
    return picker(head, hidden)


def linear_layers(model: nn.Module) -> dict[str, MergedLinear]:
    """Every :class:`MergedLinear` of ``model`` by module path."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)}


def tied_linear_layers(model: nn.Module) -> dict[str, str]:
    """Linear layers whose weight is another module's parameter (an LM head tied to the
    embedding): layer path -> the module that owns the weight. They load nothing."""
    owners = {
        id(param): path
        for path, module in model.named_modules()
        if not isinstance(module, MergedLinear)
        for param in module.parameters(recurse=False)
    }
    return {
        path: owners[id(param)]
        for path, layer in linear_layers(model).items()
        for param in layer.parameters()
        if id(param) in owners
    }


def route_linear_tensor(
    layers: dict[str, MergedLinear], name: str, stacked: dict[str, tuple[str, int]] | None = None
) -> tuple[str, int, str] | None:
    """Where the checkpoint tensor ``name`` goes when it belongs to a linear layer:
    ``(layer path, shard, tensor name within the layer)``, else None.

    ``stacked`` maps a checkpoint module name to the fused module holding it and its
    shard (``{"q_proj": ("qkv_proj", 0), ...}``). The tensor name is whatever follows
    the module (``weight``, ``bias``, ``weight.absmax``, ``SCB``, ...), so a model's
    loader routes quantized checkpoints without knowing their layout.
    """
    parts = name.split(".")
    for end in range(1, len(parts)):
        module = parts[end - 1]
        if stacked and module in stacked:  # fused where the model fuses it (a layer of that name may stand alone)
            fused, shard = stacked[module]
            path = ".".join([*parts[: end - 1], fused])
            if path in layers:
                return path, shard, ".".join(parts[end:])
        path = ".".join(parts[:end])
        if path in layers:
            return path, 0, ".".join(parts[end:])
    return None


def quantize_model(model: nn.Module, quantizer: Quantizer) -> tuple[list[str], list[str]]:
    """Give every linear layer of a model not loaded yet the method ``quantizer``
    chooses for it. Returns the layer paths (quantized, declined)."""
    tied = tied_linear_layers(model)
    quantized, declined = [], []
    for path, layer in linear_layers(model).items():
        method = quantizer.get_linear_method(path)
        if method is None:
            declined.append(path)
            continue
        if path in tied:
            raise ValueError(
                f"Quantizer {quantizer.name!r} chose to quantize {path}, whose weight is tied to {tied[path]}; "
                f"a quantizer must decline tied layers."
            )
        layer.set_method(method)
        quantized.append(path)
    return quantized, declined


def apply_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Switch every unquantized :class:`MergedLinear` of a loaded model to ``method``
    and let it repack the weights, then see them all together
    (``process_model_after_loading``). Returns the number of layers switched."""
    layers = []
    for module in model.modules():
        if isinstance(module, MergedLinear) and type(module.method) is UnquantizedLinearMethod:
            module.method = method
            method.process_weights_after_loading(module)
            layers.append(module)
    if layers:
        method.process_model_after_loading(layers)
    return len(layers)


class RowByRowLinearMethod(LinearMethod):
    """Another method applied to one row at a time (``--batch-invariant``): a kernel may choose
    its blocking, and so the order of its sums, by the number of rows, but the same call on the
    same single row computes the same thing, so each row's result no longer depends on the rows
    beside it. Correct for any method and as slow as a row's weight stream; a platform with a
    batch-invariant kernel offers it instead (``Platform.batch_invariant_linear_method``)."""

    batch_invariant = True

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        self.inner.create_weights(layer, input_size, output_sizes, bias, dtype)

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        return self.inner.checkpoint_tensors(layer)

    def load_weight(self, layer: nn.Module, name: str, shard: int, tensor: torch.Tensor) -> None:
        self.inner.load_weight(layer, name, shard, tensor)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return self.inner.apply(layer, x)
        out = torch.cat([self.inner.apply(layer, rows[i : i + 1]) for i in range(rows.shape[0])])
        return out.view(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: nn.Module, method: LinearMethod) -> int:
    """Give every unquantized :class:`MergedLinear` of a loaded model ``method`` (a
    batch-invariant one, which may repack the weights); a layer with another method (quantized)
    that does not declare ``batch_invariant`` is run one row at a time. Returns the number of
    layers changed."""
    count = 0
    for module in model.modules():
        if not isinstance(module, MergedLinear):
            continue
        if type(module.method) is UnquantizedLinearMethod:
            module.method = method
            method.process_weights_after_loading(module)
        elif not getattr(module.method, "batch_invariant", False):
            module.method = RowByRowLinearMethod(module.method)
        else:
            continue
        count += 1
    return count


def shard_parameter(param: nn.Parameter, dim: int, start: int, full_size: int) -> nn.Parameter:
    """Make ``param`` (this rank's part of a checkpoint tensor: ``param.shape[dim]`` of its
    ``full_size`` entries along ``dim``, from ``start``) load by cutting its part out of the
    full tensor (see :func:`engine.layers.decoder.load_parameter`). Returns ``param``."""
    length = param.shape[dim]

    def load_checkpoint(name: str, tensor: torch.Tensor) -> None:
        expected = (*param.shape[:dim], full_size, *param.shape[dim + 1 :])
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"{name}: model expects shape {tuple(expected)}, checkpoint has {tuple(tensor.shape)}.")
        param.data.copy_(tensor.narrow(dim, start, length))

    param.load_checkpoint = load_checkpoint  # type: ignore[attr-defined]
    return param


class VocabEmbedding(nn.Module):
    """Token embedding table: weight [vocab_size, hidden_size].

    Under tensor parallelism each rank holds ``ceil(vocab / size)`` rows (the last rank's
    zero-padded), embeds the tokens in its range and the ranks sum the results."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, *, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = resolve_tp(tp)
        self.vocab_size = vocab_size
        self.start, self.length, rows = (
            self.tp.padded_split(vocab_size) if self.tp.is_parallel else (0, vocab_size, vocab_size)
        )
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.load_checkpoint = self.load_checkpoint  # type: ignore[attr-defined]

    def load_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the full checkpoint table."""
        if tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(
                f"{name}: model expects shape {(self.vocab_size, self.weight.shape[1])}, "
                f"checkpoint has {tuple(tensor.shape)}."
            )
        self.weight.data[: self.length].copy_(tensor.narrow(0, self.start, self.length))
        self.weight.data[self.length :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.length)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(out)
