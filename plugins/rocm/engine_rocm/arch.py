"""AMD GPU architectures (gfx targets) and what the engine takes from each. Pure data and
string functions: nothing here imports torch or touches a device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchFamily:
    """One row of :data:`ARCH_TABLE`.

    ``pattern``: a gfx target (``"gfx942"``), or a prefix ending in ``xx`` that
    matches a whole generation (``"gfx12xx"`` matches gfx1200 and gfx1201).
    ``fp8_dtype``: torch dtype name of the E4M3 FP8 format the matrix cores take, or None.
    """

    pattern: str
    family: str
    products: str
    fp8_dtype: str | None

    def matches(self, arch: str) -> bool:
        if self.pattern.endswith("xx"):
            return arch.startswith(self.pattern[:-2])
        return arch == self.pattern


# MI300 (gfx942) computes in the "fnuz" FP8 variant (no negative zero, bias 8); MI350 and
# RDNA4 take the OCP format that float8_e4m3fn checkpoints store.
ARCH_TABLE: tuple[ArchFamily, ...] = (
    ArchFamily("gfx942", "CDNA3", "Instinct MI300X, MI300A, MI325X", "float8_e4m3fnuz"),
    ArchFamily("gfx950", "CDNA4", "Instinct MI350X, MI355X", "float8_e4m3fn"),
    ArchFamily("gfx90a", "CDNA2", "Instinct MI210, MI250, MI250X", None),
    ArchFamily("gfx908", "CDNA1", "Instinct MI100", None),
    ArchFamily("gfx906", "GCN5 (Vega 20)", "Instinct MI50, MI60, Radeon VII", None),
    ArchFamily("gfx12xx", "RDNA4", "Radeon RX 9070 (XT), Radeon AI PRO R9700", "float8_e4m3fn"),
    ArchFamily("gfx11xx", "RDNA3", "Radeon RX 7900 XTX, Radeon PRO W7900, Ryzen AI 300 iGPUs", None),
    ArchFamily("gfx10xx", "RDNA1/RDNA2", "Radeon RX 5700, RX 6900 XT, Radeon PRO W6800", None),
)

UNKNOWN_FAMILY = "unknown"


@dataclass(frozen=True)
class ArchCapabilities:
    """What the engine uses from one device's architecture.

    ``arch``: the gfx target without feature flags (``"gfx942"``).
    ``family``: its GPU generation (``"CDNA3"``), ``"unknown"`` for targets not in :data:`ARCH_TABLE`.
    ``fp8_dtype``: torch dtype name of its native FP8 format, or None (unknown targets get None).
    """

    arch: str
    family: str
    fp8_dtype: str | None

    @property
    def has_fp8(self) -> bool:
        return self.fp8_dtype is not None


def gfx_arch(gcn_arch_name: str) -> str:
    """The gfx target of a ``gcnArchName`` as torch reports it, without the feature flags:
    ``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``."""
    return gcn_arch_name.split(":", 1)[0].strip().lower()


def arch_capabilities(arch: str) -> ArchCapabilities:
    """Capabilities of a gfx target (feature flags are ignored), from the first matching table row."""
    arch = gfx_arch(arch)
    for row in ARCH_TABLE:
        if row.matches(arch):
            return ArchCapabilities(arch=arch, family=row.family, fp8_dtype=row.fp8_dtype)
    return ArchCapabilities(arch=arch or UNKNOWN_FAMILY, family=UNKNOWN_FAMILY, fp8_dtype=None)


def fp8_capable_archs() -> str:
    """The table's FP8-capable patterns, for error messages: ``"gfx942, gfx950, gfx12xx"``."""
    return ", ".join(row.pattern for row in ARCH_TABLE if row.fp8_dtype is not None)


def is_fp8_method(method: str) -> bool:
    """Whether a quantization method name denotes FP8 weights or activations (``fp8``, ``ptpc_fp8``, ...)."""
    return "fp8" in method.lower()
