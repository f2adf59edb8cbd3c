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
- GGUF Q6_K: ``d * sc * (q - 32)`` per 16 inputs;
- MXFP4 (e2m1 values ``v``, a factor ``2^(s - 127)`` per 32 inputs): ``2 v`` is an integer in
  -12 .. 12, so ``q = 2 v + 12``, ``scale = 2^(s - 127) / 2`` and the zero 12 (:func:`from_mxfp4`).

Storage (:class:`GroupQuantWeight`):

- ``qweight`` uint8, ``bits`` a value stored (``STORAGE_BITS``):

  - ``bits == 4``: [N, K / 2], input ``k`` of row ``n`` in byte ``k // 2``, the low nibble for
    even ``k``, the high nibble for odd ``k``;
  - ``bits == 6`` (5- and 6-bit values, K a multiple of ``TOP_CHUNK`` = 128): [N, 3 K / 4], each
    row its low 4 bits as ``bits == 4`` lays them out (bytes ``[0, K / 2)``), then its top 2
    bits, 32 bytes per chunk of 128 inputs: byte ``i`` of chunk ``c`` holds those of inputs
    ``128 c + 2 i`` (bits 0-1), ``128 c + 2 i + 64`` (bits 2-3), ``128 c + 2 i + 1`` (bits 4-5)
    and ``128 c + 2 i + 65`` (bits 6-7). (A kernel that meets a chunk's low nibbles as two
    vectors of 64 bytes, the even inputs and the odd ones, gets both vectors' top bits from one
    load of 32 bytes with a shift per half.)
  - ``bits == 8``: [N, K], one value a byte;

- ``scales``, ``offsets`` float32 [N, K / group_size]; or, with two-level scales
  (``super_group > 0``, the GGUF k-quants' form: a small integer per group and a float per
  super-block of ``super_group`` groups), int8 codes [N, K / group_size] with float32
  ``super_scales``, ``super_offsets`` [N, K / group_size / super_group]: group ``j``'s scale is
  ``super_scales[n, j // super_group] * scales[n, j]`` rounded to float32 once (exact for the
  k-quants: a float16 times an 8-bit integer), and likewise its offset;
- or, where every group's offset is its scale times one integer ``zero`` (symmetric formats:
  GPTQ ``sym``, GGUF ``Q8_0`` / ``Q4_0`` / ``Q6_K``), ``offsets`` (and ``super_offsets``)
  None and ``zero`` set: the offset is the float32 product ``zero * scale``.
  :meth:`GroupQuantWeight.from_values` finds such a zero itself, keeping it only where those
  products are the very offsets it was given;
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
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.interfaces.ops import LayerOps

STORAGE_BITS = (4, 6, 8)
TOP_CHUNK = 128  # inputs whose top 2 bits share 32 bytes (bits == 6)
# what attach() registers
HELD_TENSORS = ("qweight", "scales", "offsets", "input_order", "super_scales", "super_offsets")
# inputs dequantized at once by the reference, per output row (bounds its scratch memory)
BLOCK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class GroupQuantWeight:
    """One linear layer's group-quantized weight (the layout in the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int
    input_order: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None
    super_group: int = 0  # groups a super-block (two-level scales); 0: float32 scales per group
    zero: int | None = None  # every offset is zero * its group's scale (offsets None)

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in STORAGE_BITS:
            raise ValueError(f"group-quantized weights are stored in {STORAGE_BITS} bits a value, not {self.bits}")
        if g <= 0 or k % g or g % 2:
            raise ValueError(f"group_size {g} must be even and divide the {k} inputs")
        if self.bits == 6 and k % TOP_CHUNK:
            raise ValueError(f"6-bit values are stored in chunks of {TOP_CHUNK} inputs; the weight has {k}")
        packed = k * self.bits // 8
        if tuple(self.qweight.shape) != (n, packed) or self.qweight.dtype != torch.uint8:
            raise ValueError(
                f"qweight is {tuple(self.qweight.shape)} {self.qweight.dtype}; a {self.bits}-bit [{n}, {k}] "
                f"weight is stored as ({n}, {packed}) torch.uint8"
            )
        groups, s = k // g, self.super_group
        code = torch.int8 if s else torch.float32
        if self.zero is not None and (
            self.offsets is not None or self.super_offsets is not None or not 0 <= self.zero < 256
        ):
            raise ValueError(f"zero {self.zero} (0..255) stands for the offsets: offsets and super_offsets are None")
        if self.zero is None and self.offsets is None:
            raise ValueError("offsets are None only with a zero")
        levels = ("scales",) if self.zero is not None else ("scales", "offsets")
        for name in levels:
            t = getattr(self, name)
            if tuple(t.shape) != (n, groups) or t.dtype != code:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}; expected ({n}, {groups}) {code}")
        if s:
            if s & (s - 1) or groups % s:
                raise ValueError(f"super_group {s} must be a power of two dividing the {groups} groups")
            for name in [f"super_{level}" for level in levels]:
                t = getattr(self, name)
                if t is None or tuple(t.shape) != (n, groups // s) or t.dtype != torch.float32:
                    got = None if t is None else (tuple(t.shape), t.dtype)
                    raise ValueError(f"{name} is {got}; expected ({n}, {groups // s}) torch.float32")
        elif self.super_scales is not None or self.super_offsets is not None:
            raise ValueError("super_scales and super_offsets come with super_group > 0")
        if self.input_order is not None and (
            tuple(self.input_order.shape) != (k,) or self.input_order.dtype != torch.int64
        ):
            raise ValueError(f"input_order must be ({k},) torch.int64, got {tuple(self.input_order.shape)}")

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The held tensors by name (those that are set)."""
        return {name: t for name in HELD_TENSORS if (t := getattr(self, name)) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (packed values, scales, offsets, super-block scales, input order)."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def group_scales(self) -> torch.Tensor:
        """Each group's scale, float32 [N, K / group_size] (``scales`` itself, or the two levels' product)."""
        return self._level(self.scales, self.super_scales)

    def group_offsets(self) -> torch.Tensor:
        """Each group's offset, float32 [N, K / group_size]."""
        return self._offsets()

    def _offsets(self, groups: slice = slice(None)) -> torch.Tensor:
        if self.zero is not None:
            return self._level(self.scales, self.super_scales, groups) * float(self.zero)
        return self._level(self.offsets, self.super_offsets, groups)

    def _level(self, codes: torch.Tensor, supers: torch.Tensor | None, groups: slice = slice(None)) -> torch.Tensor:
        """Float32 values of ``groups`` from one level of codes or two."""
        if not self.super_group:
            return codes[:, groups]
        return supers.repeat_interleave(self.super_group, dim=1)[:, groups] * codes[:, groups].float()

    def one_level(self) -> GroupQuantWeight:
        """The same weight with float32 scales and offsets per group (the same values): for a
        kernel that computes one-level scales and explicit offsets only."""
        if not self.super_group and self.zero is None:
            return self
        return dataclasses.replace(
            self,
            scales=self.group_scales(),
            offsets=self.group_offsets(),
            super_scales=None,
            super_offsets=None,
            super_group=0,
            zero=None,
        )

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
        super_scales: torch.Tensor | None = None,
        super_offsets: torch.Tensor | None = None,
    ) -> GroupQuantWeight:
        """Pack integer ``values`` [N, K] (each in ``[0, 2**bits)``, any integer dtype) with their
        ``scales`` / ``offsets`` [N, K / group_size] (converted to float32; with ``super_scales`` /
        ``super_offsets`` [N, K / group_size / super_group], integer codes converted to int8);
        ``bits`` up to 4 are stored in 4 bits, up to 6 in 6 (when K is a multiple of ``TOP_CHUNK``), up to 8 in 8.
        Offsets that are all one integer times their scale (float32 products, exactly) are kept
        as that ``zero``."""
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
        g = k // groups
        storage = 4 if bits <= 4 else 6 if bits <= 6 and k % TOP_CHUNK == 0 else 8
        two_level = super_scales is not None
        if two_level != (super_offsets is not None):
            raise ValueError("super_scales and super_offsets come together")
        if two_level:
            for name, codes in (("scales", scales), ("offsets", offsets)):
                if codes.numel() and (
                    codes.is_floating_point()
                    and not torch.equal(codes, codes.round())
                    or int(codes.min()) < -128
                    or int(codes.max()) > 127
                ):
                    raise ValueError(f"two-level {name} must be integer codes in [-128, 127]")
        code = torch.int8 if two_level else torch.float32
        weight = cls(
            pack(values, storage),
            scales.to(code).contiguous(),
            offsets.to(code).contiguous(),
            storage,
            g,
            k,
            n,
            None if input_order is None else input_order.to(torch.int64).contiguous(),
            None if not two_level else super_scales.to(torch.float32).contiguous(),
            None if not two_level else super_offsets.to(torch.float32).contiguous(),
            0 if not two_level else groups // super_scales.shape[-1],
        )
        return weight.with_zero()

    def with_zero(self) -> GroupQuantWeight:
        """The weight with its offsets kept as a ``zero`` where every group's offset is the
        float32 product of one integer in [0, 256) and its scale; else itself."""
        if self.zero is not None or self.offsets is None or not self.scales.numel():
            return self
        scales, offsets = self.group_scales(), self.group_offsets()
        nonzero = scales != 0
        if not bool(nonzero.any()):
            return self
        first = int(nonzero.flatten().nonzero()[0])
        zero = float(offsets.flatten()[first] / scales.flatten()[first])
        if zero != round(zero) or not 0 <= zero < 256 or not torch.equal(offsets, scales * zero):
            return self
        return dataclasses.replace(self, offsets=None, super_offsets=None, zero=int(zero))

    def values(self) -> torch.Tensor:
        """The integers q [N, K] (uint8)."""
        return unpack(self.qweight, self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K] in float32 (then ``dtype``), inputs in the weight's order."""
        return _dequantize_block(self, 0, self.in_features).to(dtype)

    def linear(self, ops: LayerOps, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] @ the weight transposed, by the platform's ``group_quant_linear``."""
        return ops.group_quant_linear(x, self)

    def joined(self, other: object) -> GroupQuantWeight | None:
        """This weight's rows then ``other``'s as one weight (:func:`join`) when they share a
        layout; else None."""
        if not isinstance(other, GroupQuantWeight) or not joinable(self, other):
            return None
        return join([self, other])

    def attach(self, layer: torch.nn.Module, suffix: str = "") -> GroupQuantWeight:
        """Register the tensors as frozen parameters of ``layer`` (``qweight<suffix>``,
        ``scales<suffix>``, ``offsets<suffix>`` and, when set, ``input_order<suffix>``), so that
        the engine counts and moves them with the layer, and return the weight made of them."""
        held = {}
        for name, tensor in self._tensors().items():
            layer.register_parameter(f"{name}{suffix}", torch.nn.Parameter(tensor, requires_grad=False))
            held[name] = getattr(layer, f"{name}{suffix}")
        return dataclasses.replace(self, **held)

    def to(self, device: torch.device | str) -> GroupQuantWeight:
        return dataclasses.replace(self, **{name: t.to(device) for name, t in self._tensors().items()})


MXFP4_GROUP = 32  # elements sharing an MXFP4 exponent
MXFP4_ZERO = 12  # q = 2 v + 12 for an e2m1 value v
MXFP4_NAN = 255  # e8m0's NaN
# e2m1 code (sign bit 3, magnitude bits 0-2: 0, 0.5, 1, 1.5, 2, 3, 4, 6) -> twice its value
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def from_mxfp4(packed: torch.Tensor, exponents: torch.Tensor) -> GroupQuantWeight:
    """MXFP4 rows as a GroupQuantWeight, exactly: ``packed`` uint8 [N, K / 2] holds two e2m1 codes
    a byte (element 2j in the low nibble of byte j), ``exponents`` uint8 [N, K / 32] the biased
    exponent ``s`` of each 32 elements of a row (the factor ``2^(s - 127)``). Each element
    ``2^(s - 127) v`` is ``(2^(s - 127) / 2) ((2 v + 12) - 12)``: values ``2 v + 12`` in 0 .. 24,
    stored in 6 bits (8 where K is not a multiple of ``TOP_CHUNK``), a float32 scale per 32
    inputs and the zero 12. Raises ``ValueError`` for shapes that do not match and for the
    exponent 255 (NaN)."""
    rows, half = packed.shape
    if tuple(exponents.shape) != (rows, 2 * half // MXFP4_GROUP) or (2 * half) % MXFP4_GROUP:
        raise ValueError(
            f"MXFP4 rows of {2 * half} elements take one exponent per {MXFP4_GROUP}: [{rows}, "
            f"{2 * half // MXFP4_GROUP}], not {list(exponents.shape)}"
        )
    codes, biased = packed.view(torch.uint8), exponents.view(torch.uint8).to(torch.int32)
    if bool((biased == MXFP4_NAN).any()):
        raise ValueError(f"an MXFP4 exponent is {MXFP4_NAN} (NaN in the e8m0 format)")
    table = torch.tensor(E2M1_DOUBLED, dtype=torch.int16, device=codes.device) + MXFP4_ZERO
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
    scales = torch.exp2((biased - 128).float())  # 2^(s - 127) / 2
    return GroupQuantWeight.from_values(values, scales, scales * MXFP4_ZERO, 5)


def join(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
    """Weights of one layout (bits, group size, inputs and input order) stacked along the
    outputs: one weight whose rows are the parts' rows in turn."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if not all(joinable(first, part) for part in parts[1:]):
        raise ValueError("only weights of one layout (bits, group size, super-blocks, inputs, input order) join")
    stacked = {
        name: torch.cat([getattr(p, name) for p in parts])
        for name in ("qweight", "scales", "offsets", "super_scales", "super_offsets")
        if getattr(first, name) is not None
    }
    return dataclasses.replace(first, out_features=sum(p.out_features for p in parts), **stacked)


def joinable(a: GroupQuantWeight, b: GroupQuantWeight) -> bool:
    """Whether :func:`join` takes ``a`` and ``b`` together."""
    layout = ("bits", "group_size", "super_group", "zero", "in_features")
    if any(getattr(a, name) != getattr(b, name) for name in layout):
        return False
    if a.input_order is None or b.input_order is None:
        return a.input_order is None and b.input_order is None
    return torch.equal(a.input_order, b.input_order)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] integers in ``[0, 2**bits)`` -> uint8 storage (``bits`` 4, 6 or 8, the module's layout)."""
    v = values.to(torch.uint8)
    if bits == 8:
        return v.contiguous()
    if bits not in (4, 6) or v.shape[-1] % (2 if bits == 4 else TOP_CHUNK):
        raise ValueError(
            f"cannot pack {tuple(values.shape)} values in {bits} bits "
            f"(4-bit needs an even K, 6-bit a multiple of {TOP_CHUNK})"
        )
    low = v & 0x0F
    nibbles = low[:, 0::2] | (low[:, 1::2] << 4)
    if bits == 4:
        return nibbles.contiguous()
    top = (v >> 4).view(v.shape[0], -1, TOP_CHUNK)
    even, odd = top[..., 0::2], top[..., 1::2]  # [N, chunks, 64]: inputs 2 i and 2 i + 1 of a chunk
    half = TOP_CHUNK // 4
    crumbs = even[..., :half] | (even[..., half:] << 2) | (odd[..., :half] << 4) | (odd[..., half:] << 6)
    return torch.cat((nibbles, crumbs.reshape(v.shape[0], -1)), dim=1).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 storage -> [N, K] uint8 values (the inverse of :func:`pack`)."""
    if bits == 8:
        return qweight
    rows = qweight.shape[0]
    k = qweight.shape[1] * 8 // bits
    nibbles = qweight[:, : k // 2]
    values = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(rows, -1)
    if bits == 6:
        crumbs = qweight[:, k // 2 :].reshape(rows, -1, TOP_CHUNK // 4)
        even = torch.cat((crumbs & 0x03, (crumbs >> 2) & 0x03), dim=-1)
        odd = torch.cat(((crumbs >> 4) & 0x03, crumbs >> 6), dim=-1)
        values = values | (torch.stack((even, odd), dim=-1).reshape(rows, -1) << 4)
    return values


def _dequantize_block(w: GroupQuantWeight, start: int, end: int) -> torch.Tensor:
    """Float32 W[:, start:end] (start and end whole groups; 6 bits: whole chunks of TOP_CHUNK too)."""
    if w.bits == 6:
        k = w.in_features
        q = unpack(
            torch.cat((w.qweight[:, start // 2 : end // 2], w.qweight[:, k // 2 + start // 4 : k // 2 + end // 4]), 1),
            6,
        )
    else:
        per_byte = 8 // w.bits
        q = unpack(w.qweight[:, start // per_byte : end // per_byte], w.bits)
    g = w.group_size
    groups = slice(start // g, end // g)
    scales = w._level(w.scales, w.super_scales, groups).repeat_interleave(g, dim=1)
    offsets = w._offsets(groups).repeat_interleave(g, dim=1)
    return scales * q.float() - offsets


def group_quant_linear(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, K] times the dequantized ``w``, transposed, plus ``bias``: [T, N] in ``x``'s dtype.

    Float32 sums of x (as its dtype holds it) times the float32 weight, a block of whole groups of
    inputs at a time."""
    x = w.order_inputs(x)
    xf = x.float()
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32, device=x.device)
    unit = math.lcm(w.group_size, TOP_CHUNK) if w.bits == 6 else w.group_size  # what a block holds whole
    block = max(unit, BLOCK_ELEMENTS // max(w.out_features, 1) // unit * unit)
    for start in range(0, w.in_features, block):
        end = min(start + block, w.in_features)
        y += xf[:, start:end] @ _dequantize_block(w, start, end).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def quantize_groups(
    weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool = False, super_group: int = 0
) -> GroupQuantWeight:
    """Round-to-nearest group quantization of a dense ``weight`` [N, K] (min/max per group, the
    range always holding 0; symmetric: the zero at ``2**(bits-1)``). With ``super_group`` > 0
    the scales and offsets are two-level, as the GGUF k-quants hold them: 7-bit codes per group
    times a float32 per super-block of ``super_group`` groups (each group's range rounded up to
    its code, then its values rounded). For tests and on-the-fly use."""
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
    supers = None
    if super_group:
        # codes in [1, 127] of the super-block's largest scale; offsets: the zero times the scale
        per_super = scales.view(n, -1, super_group)
        unit = per_super.amax(dim=-1, keepdim=True) / 127
        codes = torch.ceil(per_super / unit).clamp(1, 127)
        scales = (unit * codes).view(n, -1)
        zeros = torch.full_like(scales, float((maxq + 1) // 2)) if symmetric else torch.round(-lo / scales)
        offsets = (zeros * scales).view(n, -1, super_group)
        zero_unit = offsets.amax(dim=-1, keepdim=True) / 127
        zero_unit = torch.where(zero_unit == 0, torch.ones_like(zero_unit), zero_unit)
        zero_codes = torch.round(offsets / zero_unit).clamp(0, 127)
        supers = (unit.squeeze(-1), zero_unit.squeeze(-1), codes.view(n, -1), zero_codes.view(n, -1))
        offsets = (zero_unit * zero_codes).view(n, -1)
    else:
        offsets = scales * zeros
    q = torch.round((w + offsets.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, maxq)
    values = q.view(n, k).to(torch.uint8)
    if supers is None:
        return GroupQuantWeight.from_values(values, scales, offsets, bits)
    unit, zero_unit, codes, zero_codes = supers
    return GroupQuantWeight.from_values(values, codes, zero_codes, bits, super_scales=unit, super_offsets=zero_unit)
