"""Unquantized bf16 linear layers on the CPU.

For batch-1 decode, ``F.linear`` on bf16 reaches about a third of the memory
bandwidth that oneDNN's matmul on a weight reordered once into its blocked
layout does, and oneDNN in turn reaches a little over half of what a plain
kernel streaming a [N/16][K/2][16][2] packing gets. With more rows the same packing
feeds a register-blocked kernel (6 rows x 64 columns a pass), which on an AMD EPYC
(Zen 5, AVX512-BF16) runs llama58m's layers at about 800 GFLOP/s from 64 rows with the
weights coming from memory and about 1 TFLOP/s for prefill chunks, against oneDNN's 600-780
and 670-990. On a CPU with AMX the same packing is also the B operand of AMX tile
products (csrc/amx_linear.cpp), and oneDNN uses AMX too. Which wins differs by CPU and by
shape and row count, so:

- every layer keeps oneDNN's packed weight;
- with the native kernels on an AVX512-BF16 CPU, it also keeps a copy packed for
  ``gemv`` (csrc/gemv.cpp) and, where the CPU, the build and the OS allow AMX,
  ``amx_linear``. The copy costs the weight's size again, so it is made only
  while the copies stay under ``DECODE_COPY_FRACTION`` of the machine's memory
  (``ENGINE_CPU_DECODE_GEMV=0`` turns it off);
- which of them runs is measured per layer shape and row band at load
  (:mod:`engine_cpu.tuning`); with the measurement off, ``gemv`` runs for 1 to
  ``GEMV_MAX_ROWS`` rows and oneDNN beyond.

With ``--batch-invariant`` a row's sums must not follow the row count, which oneDNN's
blocking does: bf16 layers then run ``gemv`` for every row count in its fixed-order mode
(:class:`BatchInvariantGemvLinearMethod`), slower for prefill than oneDNN; without
AVX512-BF16, and in fp32, ``dot_linear`` (csrc/dot_linear.cpp: one dot product per output in
an order fixed by K; :class:`DotLinearMethod`).
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import UnquantizedLinearMethod
from engine_cpu.tuning import ROW_BANDS, band_of

logger = logging.getLogger("engine.cpu")

GEMV_MAX_ROWS = 64
DECODE_COPY_FRACTION = 0.25


@functools.cache
def onednn_available() -> bool:
    """Whether oneDNN's packed bf16 linear runs on this CPU: torch's oneDNN takes the bf16 path
    only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, so an AVX2-only CPU has the library but
    not the path. Probed once, by packing a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K / 2, 16, 2]: output columns padded with zeros to a multiple of 16."""
    from engine_cpu.memory import huge_page_zeros

    n, k = weight.shape
    blocks = -(-n // 16)
    padded = weight.new_zeros(blocks * 16, k)
    padded[:n] = weight
    packed = huge_page_zeros((blocks, k // 2, 16, 2), weight.dtype)  # streamed whole every decode step
    packed.copy_(padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3))
    return packed


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """Reorders ``weight`` into oneDNN's layout once, after loading, and, given
    ``kernels``, packs a second copy for the ``gemv`` and ``amx_linear`` kernels.

    Which one runs is chosen per layer shape and row band (1 to ``GEMV_MAX_ROWS`` rows
    in bands, and one band beyond) by timing both on the loaded model
    (:mod:`engine_cpu.tuning`; ``ENGINE_CPU_TUNING=0``: ``gemv`` up to ``GEMV_MAX_ROWS`` rows,
    oneDNN beyond); a layer whose shape never chooses a kernel of the copy gives it back. The oneDNN tensor replaces the layer's ``weight`` attribute (a tied embedding
    keeps the original tensor); results equal ``F.linear`` up to the order of the fp32 sums.
    """

    def __init__(self, kernels: ModuleType | None = None, copy_budget_bytes: int | None = None) -> None:
        self.kernels = kernels
        self.copy_budget_bytes = copy_budget_bytes  # None: no limit
        self.choices: dict[tuple[int, int], tuple[str, ...]] = {}
        self.greedy_choices: dict[tuple[int, int], tuple[str, ...]] = {}  # heads' pick kernels
        self.measured = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        if self._gemv_copy_fits(weight):
            layer.gemv_weight = pack_gemv_weight(weight)
            layer.packed_kernels, layer.packed_beyond = _GEMV_ROWS, _NONE_BEYOND
            layer.gemv_out = weight.shape[0]
            layer.gemv_bias = layer.bias.data if layer.bias is not None else _EMPTY
            # a gated MLP's gate/up whose halves start at a 16-column block: amx_gated_linear
            sizes = list(layer.output_sizes)
            layer.gated_half = sizes[0] if len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % 16 == 0 else 0
            if self.copy_budget_bytes is not None:
                self.copy_budget_bytes -= layer.gemv_weight.numel() * layer.gemv_weight.element_size()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def candidates(self) -> dict[str, object]:
        """The kernels timed for each shape and band: oneDNN, and those reading the packed copy.
        A gated MLP's gate/up layer times each with what follows it in the model: amx as
        ``amx_gated_linear``, the others followed by ``silu_and_mul``."""
        found = {"gemv": functools.partial(self._timed, "gemv"), "onednn": functools.partial(self._timed, None)}
        if self.kernels.amx_supported():
            found["amx"] = functools.partial(self._timed, "amx_linear")
        return found

    def _timed(self, kernel: str | None, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """What a candidate computes in the model: ``kernel`` (None: oneDNN), and for a gate/up
        layer the activation too."""
        half = layer.__dict__.get("gated_half", 0)
        if half and kernel == "amx_linear":
            out = torch.empty(rows.shape[0], half, dtype=rows.dtype)
            self.kernels.amx_gated_linear(out, rows, layer.gemv_weight, layer.gemv_bias)
            return out
        product = self._onednn(layer, rows) if kernel is None else self._packed(kernel, layer, rows)
        if not half:
            return product
        out = torch.empty(rows.shape[0], half, dtype=rows.dtype)
        self.kernels.silu_and_mul(out, product)
        return out

    def process_model_after_loading(self, layers: list[nn.Module]) -> None:
        from engine_cpu import tuning

        with_copy = [layer for layer in layers if getattr(layer, "gemv_weight", None) is not None]
        if not with_copy or tuning.mode() == "off":
            return
        choices = tuning.choose(
            with_copy,
            self.candidates(),
            torch.bfloat16,
            # the candidates' meaning is part of the key: gate/up layers are timed with their activation
            f"{self.kernels.build} gate/up with silu",
        )
        self.choices = {shape: m.choice for shape, m in choices.items()}
        self.measured = True
        for layer in with_copy:
            choice = self.choices[tuning.shape_of(layer)]
            if all(name == "onednn" for name in choice):
                del layer.gemv_weight  # never used: give the memory back
                continue
            layer.packed_kernels = tuple(
                None if rows == 0 else PACKED_KERNELS.get(choice[tuning.band_of(rows)])
                for rows in range(GEMV_MAX_ROWS + 1)
            )
            layer.packed_beyond = tuple(PACKED_KERNELS.get(name) for name in choice[_FIRST_BEYOND:])
        logger.info("bf16 linear kernels by shape and rows: %s", self.describe())

    def describe(self) -> str | None:
        if not self.choices:
            return None
        text = _describe_bands(self.choices)
        if self.greedy_choices:
            text += f"; greedy picks {_describe_bands(self.greedy_choices)}"
        return text

    def _gemv_copy_fits(self, weight: torch.Tensor) -> bool:
        if self.kernels is None or weight.dtype != torch.bfloat16 or weight.shape[1] % 8 != 0:
            return False
        size = weight.numel() * weight.element_size()
        return self.copy_budget_bytes is None or size <= self.copy_budget_bytes

    def _packed(self, kernel: str, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """rows @ W^T by the native ``kernel`` (gemv or amx_linear) on the layer's packed copy."""
        out = torch.empty(rows.shape[0], layer.gemv_out, dtype=rows.dtype)
        getattr(self.kernels, kernel)(out, rows, layer.gemv_weight, layer.gemv_bias)
        return out

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in one pass (``amx_gated_linear``: no [rows, 2I] product in between,
        bitwise what ``amx_linear`` then ``silu_and_mul`` give) where amx_linear is the kernel
        chosen for these rows of a gate/up layer; None elsewhere."""
        attrs = layer.__dict__
        half = attrs.get("gated_half", 0)
        if not half or attrs.get("gemv_weight") is None or x.dtype != torch.bfloat16:
            return None
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if _packed_kernel(attrs, n) != "amx_linear" or rows.stride(-1) != 1:
            return None
        out = torch.empty(n, half, dtype=x.dtype)
        self.kernels.amx_gated_linear(out, rows, attrs["gemv_weight"], attrs["gemv_bias"])
        return out if rows is x else out.view(*x.shape[:-1], half)

    def apply_argmax(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy pick where amx_linear is the kernel chosen for these rows (None
        elsewhere), exactly what ``amx_linear`` then ``argmax`` give, the outputs never stored:
        ``amx_linear_argmax``, or ``amx_linear_argmax_screened`` (most columns ruled out on an
        int8 copy of the weight first) in the row bands where timing it at the first pick
        (:meth:`_greedy_screen`) found it faster."""
        attrs = layer.__dict__
        if attrs.get("gemv_weight") is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
            return None
        n = x.shape[0]
        if _packed_kernel(attrs, n) != "amx_linear":
            return None
        screen = attrs["greedy_screen"] if "greedy_screen" in attrs else self._greedy_screen(layer)
        if screen is None or screen[1][band_of(n)] != "screened":
            return self._picks(layer, x)
        return self._picks(layer, x, screen[0])

    def _picks(self, layer: nn.Module, x: torch.Tensor, screen: tuple | None = None) -> torch.Tensor:
        """x's greedy picks by ``amx_linear_argmax``, or with the head's int8 ``screen`` by
        ``amx_linear_argmax_screened``."""
        attrs = layer.__dict__
        picks = torch.empty(x.shape[0], dtype=torch.int64)
        weight, bias, n = attrs["gemv_weight"], attrs["gemv_bias"], attrs["gemv_out"]
        if screen is None:
            self.kernels.amx_linear_argmax(picks, x, weight, bias, n)
        else:
            self.kernels.amx_linear_argmax_screened(picks, x, weight, bias, n, *screen)
        return picks

    def _greedy_screen(self, layer: nn.Module) -> tuple[tuple, tuple[str, ...]] | None:
        """At a head's first greedy pick: its int8 copy for ``amx_linear_argmax_screened``
        (:func:`pack_screen_weight`) and, per row band, which of the two pick kernels ran faster
        (:mod:`engine_cpu.tuning`, stored like the linear kernels' choices); None (and the copy
        given back) where the screened kernel cannot run or never wins."""
        from engine_cpu import tuning

        screen = None
        size = layer.gemv_weight.numel() * 3  # the int8 and row-major bf16 copies: 3 bytes a weight
        fits = self.copy_budget_bytes is None or size <= self.copy_budget_bytes
        if fits and tuning.mode() != "off":
            tensors = pack_screen_weight(layer.gemv_weight, layer.gemv_out, layer.gemv_bias)
            if tensors is not None:
                candidates = {
                    "amx": self._picks,
                    "screened": lambda lay, rows: self._picks(lay, rows, tensors),
                }
                measured = tuning.choose([layer], candidates, torch.bfloat16, f"{self.kernels.build} greedy picks")[
                    tuning.shape_of(layer)
                ]
                if "screened" in measured.choice:
                    screen = (tensors, measured.choice)
                    if self.copy_budget_bytes is not None:
                        self.copy_budget_bytes -= size
                    self.greedy_choices[tuning.shape_of(layer)] = measured.choice
                    logger.info("greedy picks by shape and rows: %s", _describe_bands(self.greedy_choices))
        layer.greedy_screen = screen
        return screen

    @staticmethod
    def _onednn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this for every layer: the packed copy's attributes are read from
        # the instance dict (nn.Module's __getattr__ costs a microsecond a lookup)
        attrs = layer.__dict__
        gemv_weight = attrs.get("gemv_weight")
        if gemv_weight is not None and x.dtype == torch.bfloat16:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            n = rows.shape[0]
            kernel = _packed_kernel(attrs, n)
            if kernel is not None and rows.stride(-1) == 1:
                out = torch.empty(n, attrs["gemv_out"], dtype=x.dtype)
                getattr(self.kernels, kernel)(out, rows, gemv_weight, attrs["gemv_bias"])
                return out if rows is x else out.view(*x.shape[:-1], out.shape[-1])
        return self._onednn(layer, x)


def _describe_bands(choices: dict[tuple[int, int], tuple[str, ...]]) -> str:
    """Each shape's kernel per run of row bands, e.g. ``32000x512: amx 1-16, onednn 17+``."""
    from engine_cpu import tuning

    parts = []
    for (n, k), choice in sorted(choices.items()):
        runs, lo = [], 1  # [first rows, last rows (None: every count above), kernel]
        for b, name in enumerate(choice):
            hi = tuning.ROW_BANDS[b] if b < len(choice) - 1 else None
            if runs and runs[-1][2] == name:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, name])
            lo = (hi or 0) + 1
        bands = ", ".join(
            f"{name} {a}+" if b is None else f"{name} {a}" if a == b else f"{name} {a}-{b}" for a, b, name in runs
        )
        parts.append(f"{n}x{k}: {bands}")
    return "; ".join(parts)


def pack_screen_weight(packed: torch.Tensor, n: int, bias: torch.Tensor) -> tuple | None:
    """What ``amx_linear_argmax_screened`` reads besides a weight packed by :func:`pack_gemv_weight`
    (n outputs): the weight rounded to int8 per output column (scale max|w| / 127) in the
    [ceil(n/16), K/4, 16, 4] layout of an int8 AMX tile, the scales, the sums of |q| per column,
    the largest scale, and the weight row-major again. None where the kernel cannot screen it
    (K not a multiple of 64, a weight or bias that is not finite, a bias too large for the bound)."""
    from engine_cpu.memory import huge_page_zeros

    blocks, half_k = packed.shape[:2]
    k = 2 * half_k
    if k % 64 or (bias.numel() and not (torch.isfinite(bias).all() and bias.float().abs().max() < 1e30)):
        return None
    rowmajor = packed.permute(0, 2, 1, 3).reshape(blocks * 16, k)[:n].contiguous()
    qweight = huge_page_zeros((blocks, k // 4, 16, 4), torch.int8)  # streamed whole at every pick
    scale, q1 = torch.zeros(blocks * 16), torch.zeros(blocks * 16)
    rounded = qweight.view(blocks, k // 4, 16, 4).permute(0, 2, 1, 3)  # [blocks, 16, K/4, 4]
    for b0 in range(0, blocks, 256):  # a few MB of fp32 at a time
        b1 = min(blocks, b0 + 256)
        w = rowmajor[b0 * 16 : b1 * 16].float()
        if not torch.isfinite(w).all():
            return None
        s = w.abs().amax(dim=1) / 127
        q = (w / s.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-127, 127)
        target = torch.zeros((b1 - b0) * 16, k, dtype=torch.int8)
        target[: w.shape[0]] = q.to(torch.int8)
        rounded[b0:b1].copy_(target.view(b1 - b0, 16, k // 4, 4))
        scale[b0 * 16 : b0 * 16 + w.shape[0]] = s
        q1[b0 * 16 : b0 * 16 + w.shape[0]] = q.abs().sum(dim=1)
    return qweight, scale, q1, float(scale.max()), rowmajor


def _packed_kernel(attrs: dict, rows: int) -> str | None:
    """The native kernel a layer with the packed copy (its instance ``attrs``) runs for ``rows``
    rows (None: oneDNN)."""
    return (
        attrs["packed_kernels"][rows]
        if rows <= GEMV_MAX_ROWS
        else attrs["packed_beyond"][band_of(rows) - _FIRST_BEYOND]
    )


# the native function each measured name that reads the packed copy runs (oneDNN: none)
PACKED_KERNELS = {"gemv": "gemv", "amx": "amx_linear"}
# the fixed rule: gemv for 1 to GEMV_MAX_ROWS rows, oneDNN beyond
_GEMV_ROWS = tuple(None if rows == 0 else "gemv" for rows in range(GEMV_MAX_ROWS + 1))
_EMPTY = torch.empty(0, dtype=torch.bfloat16)
# the measured bands past GEMV_MAX_ROWS (prefill chunks): a layer's packed_beyond has a kernel
# (or None: oneDNN) for each of them
_FIRST_BEYOND = band_of(GEMV_MAX_ROWS + 1)
_NONE_BEYOND = (None,) * (len(ROW_BANDS) - _FIRST_BEYOND)


class BatchInvariantGemvLinearMethod(UnquantizedLinearMethod):
    """``--batch-invariant`` bf16 linear layers: the ``gemv`` kernel for every row count, in its
    fixed-order mode (four partial sums per row whatever the number of rows), so each row is
    bitwise the same in any batch. The packed copy is kept beside the plain weight (which a
    tied embedding and the KV tier may read); a layer whose copy would pass the memory budget
    runs ``F.linear`` one row at a time instead."""

    batch_invariant = True

    def __init__(self, kernels: ModuleType, copy_budget_bytes: int | None = None) -> None:
        self.kernels = kernels
        self.copy_budget_bytes = copy_budget_bytes

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        size = weight.numel() * weight.element_size()
        fits = self.copy_budget_bytes is None or size <= self.copy_budget_bytes
        if weight.dtype == torch.bfloat16 and weight.shape[1] % 8 == 0 and fits:
            layer.gemv_weight = pack_gemv_weight(weight)
            if self.copy_budget_bytes is not None:
                self.copy_budget_bytes -= layer.gemv_weight.numel() * layer.gemv_weight.element_size()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        gemv_weight = getattr(layer, "gemv_weight", None)
        if gemv_weight is not None and x.dtype == torch.bfloat16 and rows.stride(-1) == 1:
            out = torch.empty(rows.shape[0], layer.weight.shape[0], dtype=x.dtype)
            bias = layer.bias if layer.bias is not None else _EMPTY
            self.kernels.gemv(out, rows, gemv_weight, bias, True)
        else:
            out = torch.cat([F.linear(rows[i : i + 1], layer.weight, layer.bias) for i in range(rows.shape[0])])
        return out.view(*x.shape[:-1], out.shape[-1])


def decode_gemv_enabled() -> bool:
    return os.environ.get("ENGINE_CPU_DECODE_GEMV", "1") not in ("0", "false", "False")


class DotLinearMethod(UnquantizedLinearMethod):
    """``--batch-invariant`` linear layers in fp32 or bf16 on any CPU: ``dot_linear`` sums each
    output as one dot product in an order fixed by K, so a row is bitwise the same in any batch."""

    batch_invariant = True

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], layer.weight.shape[0], dtype=x.dtype)
        bias = layer.bias if layer.bias is not None else torch.empty(0, dtype=x.dtype)
        self.kernels.dot_linear(out, rows, layer.weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
