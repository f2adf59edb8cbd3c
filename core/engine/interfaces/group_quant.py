"""Group-quantized linear weights: the one packed layout every integer-weight quantizer
converts its checkpoint into, and the torch reference of its matmul.

A weight W [N, K] (N outputs, K inputs) is stored as integers ``q[n, k]`` in ``[0, 2**bits)``
with a float32 ``scale`` and ``offset`` per output row and group of ``group_size``
consecutive inputs:

    W[n, k] = scales[n, k // group_size] * q[n, k] - offsets[n, k // group_size]

This form holds every common integer format exactly, since float32 represents each
product below without rounding:

- GPTQ / AWQ / compressed-tensors ``pack-quantized``: ``scale * (q - zero)``, so
  ``offset = scale * zero`` (symmetric: ``zero = 2**(bits-1)``);
- GGUF Q8_0 / Q4_0: ``d * (q - 8)`` style, ``offset = d * 8`` (Q8_0: ``q + 128``, ``offset = 128 d``);
- GGUF Q4_K / Q5_K: ``d * sc * q - dmin * m`` per 32 inputs, ``scale = d * sc``, ``offset = dmin * m``;
- GGUF Q6_K: ``d * sc * (q - 32)`` per 16 inputs.

Storage (:class:`GroupQuantWeight`):

- ``qweight`` uint8: ``bits == 4``: [N, K / 2], input ``k`` of row ``n`` in byte ``k // 2``, the
  low nibble for even ``k``, the high nibble for odd ``k``; ``bits == 8``: [N, K], one value a
  byte (5- and 6-bit formats are stored this way too);
- ``scales``, ``offsets`` float32 [N, K / group_size];
- ``input_order`` int64 [K] or None: when set, the weight's input ``k`` multiplies
  ``x[:, input_order[k]]`` (GPTQ act-order, whose groups are scattered over the inputs: the
  inputs are gathered so that each group is contiguous).

A platform computes it in :meth:`engine.interfaces.ops.LayerOps.group_quant_linear` (its own
kernel), whose reference is :func:`group_quant_linear` here: float32 sums of ``x``
times the dequantized weight, a block of inputs at a time, so that no dense copy of the
whole weight is ever held.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

STORAGE_BITS = (4, 8)
HELD_TENSORS = ("qweight", "scales", "offsets", "input_order")  # what attach() registers
# inputs dequantized at once by the reference, per output row (bounds its scratch memory)
BLOCK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class GroupQuantWeight:
    """One linear layer's group-quantized weight (the layout in the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    group_size: int
    in_features: int
    out_features: int
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in STORAGE_BITS:
            raise ValueError(f"group-quantized weights are stored in {STORAGE_BITS} bits a value, not {self.bits}")
        if g <= 0 or k % g or g % 2:
            raise ValueError(f"group_size {g} must be even and divide the {k} inputs")
        packed = k * self.bits // 8
        if tuple(self.qweight.shape) != (n, packed) or self.qweight.dtype != torch.uint8:
            raise ValueError(
                f"qweight is {tuple(self.qweight.shape)} {self.qweight.dtype}; a {self.bits}-bit [{n}, {k}] "
                f"weight is stored as ({n}, {packed}) torch.uint8"
            )
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if tuple(t.shape) != (n, k // g) or t.dtype != torch.float32:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}; expected ({n}, {k // g}) torch.float32")
        if self.input_order is not None and (
            tuple(self.input_order.shape) != (k,) or self.input_order.dtype != torch.int64
        ):
            raise ValueError(f"input_order must be ({k},) torch.int64, got {tuple(self.input_order.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (packed values, scales, offsets and input order)."""
        tensors = [self.qweight, self.scales, self.offsets]
        if self.input_order is not None:
            tensors.append(self.input_order)
        return sum(t.numel() * t.element_size() for t in tensors)

    def order_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] with its inputs in the weight's order (itself when there is no ``input_order``)."""
        return x if self.input_order is None else x.index_select(-1, self.input_order)

    @classmethod
    def from_values(
        cls,
        values: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bits: int,
        *,
        input_order: torch.Tensor | None = None,
    ) -> GroupQuantWeight:
        """Pack integer ``values`` [N, K] (each in ``[0, 2**bits)``, any integer dtype) with their
        ``scales`` / ``offsets`` [N, K / group_size] (converted to float32); ``bits`` up to 4 are
        stored in 4 bits, up to 8 in 8."""
        n, k = values.shape
        if not 1 <= bits <= 8:
            raise ValueError(f"values of {bits} bits cannot be stored in a byte")
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
            raise ValueError(
                f"{bits}-bit values must lie in [0, {1 << bits}), got {int(values.min())}..{int(values.max())}"
            )
        groups = scales.shape[-1]
        if groups == 0 or k % groups:
            raise ValueError(f"{groups} groups do not divide the {k} inputs")
        storage = 4 if bits <= 4 else 8
        return cls(
            pack(values, storage),
            scales.to(torch.float32).contiguous(),
            offsets.to(torch.float32).contiguous(),
            storage,
            k // groups,
            k,
            n,
            None if input_order is None else input_order.to(torch.int64).contiguous(),
        )

    def values(self) -> torch.Tensor:
        """The integers q [N, K] (uint8)."""
        return unpack(self.qweight, self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K] in float32 (then ``dtype``), inputs in the weight's order."""
        return _dequantize_block(self, 0, self.in_features).to(dtype)

    def attach(self, layer: torch.nn.Module, suffix: str = "") -> GroupQuantWeight:
        """Register the tensors as frozen parameters of ``layer`` (``qweight<suffix>``,
        ``scales<suffix>``, ``offsets<suffix>`` and, when set, ``input_order<suffix>``), so that
        the engine counts and moves them with the layer, and return the weight made of them."""
        held = {}
        for name in HELD_TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                layer.register_parameter(f"{name}{suffix}", torch.nn.Parameter(tensor, requires_grad=False))
                held[name] = getattr(layer, f"{name}{suffix}")
        return dataclasses.replace(self, **held)

    def to(self, device: torch.device | str) -> GroupQuantWeight:
        order = None if self.input_order is None else self.input_order.to(device)
        return GroupQuantWeight(
            self.qweight.to(device),
            self.scales.to(device),
            self.offsets.to(device),
            self.bits,
            self.group_size,
            self.in_features,
            self.out_features,
            order,
        )


def join(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
    """Weights of one layout (bits, group size, inputs and input order) stacked along the
    outputs: one weight whose rows are the parts' rows in turn."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if not all(joinable(first, part) for part in parts[1:]):
        raise ValueError("only weights of one layout (bits, group size, inputs, input order) join")
    return GroupQuantWeight(
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.offsets for p in parts]),
        first.bits,
        first.group_size,
        first.in_features,
        sum(p.out_features for p in parts),
        first.input_order,
    )


def joinable(a: GroupQuantWeight, b: GroupQuantWeight) -> bool:
    """Whether :func:`join` takes ``a`` and ``b`` together."""
    if (a.bits, a.group_size, a.in_features) != (b.bits, b.group_size, b.in_features):
        return False
    if a.input_order is None or b.input_order is None:
        return a.input_order is None and b.input_order is None
    return torch.equal(a.input_order, b.input_order)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] integers in ``[0, 2**bits)`` -> uint8 storage (``bits`` 4 or 8, the module's layout)."""
    v = values.to(torch.uint8)
    if bits == 8:
        return v.contiguous()
    if bits != 4 or v.shape[-1] % 2:
        raise ValueError(f"cannot pack {tuple(values.shape)} values in {bits} bits (4-bit needs an even K)")
    return (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 storage -> [N, K] uint8 values (the inverse of :func:`pack`)."""
    if bits == 8:
        return qweight
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def _dequantize_block(w: GroupQuantWeight, start: int, end: int) -> torch.Tensor:
    """Float32 W[:, start:end] (start and end whole groups, even)."""
    per_byte = 8 // w.bits
    q = unpack(w.qweight[:, start // per_byte : end // per_byte], w.bits).float()  # [N, end - start]
    g = w.group_size
    scales = w.scales[:, start // g : end // g].repeat_interleave(g, dim=1)
    offsets = w.offsets[:, start // g : end // g].repeat_interleave(g, dim=1)
    return scales * q - offsets


def group_quant_linear(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, K] times the dequantized ``w``, transposed, plus ``bias``: [T, N] in ``x``'s dtype.

    Float32 sums of x (as its dtype holds it) times the float32 weight, a block of whole groups of
    inputs at a time."""
    x = w.order_inputs(x)
    xf = x.float()
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32, device=x.device)
    block = max(w.group_size, BLOCK_ELEMENTS // max(w.out_features, 1) // w.group_size * w.group_size)
    for start in range(0, w.in_features, block):
        end = min(start + block, w.in_features)
        y += xf[:, start:end] @ _dequantize_block(w, start, end).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool = False) -> GroupQuantWeight:
    """Round-to-nearest group quantization of a dense ``weight`` [N, K] (min/max per group, the
    range always holding 0; symmetric: the zero at ``2**(bits-1)``). For tests and on-the-fly use."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k} inputs")
    maxq = (1 << bits) - 1
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scales = (hi - lo) / maxq
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = torch.full_like(scales, float((maxq + 1) // 2)) if symmetric else torch.round(-lo / scales)
    q = (torch.round(w / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, maxq)
    return GroupQuantWeight.from_values(q.view(n, k).to(torch.uint8), scales, scales * zeros, bits)
