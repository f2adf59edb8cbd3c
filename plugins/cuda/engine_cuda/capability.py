"""What the engine takes from an NVIDIA GPU's compute capability: pure functions of
(major, minor), so every rule is tested without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

# the engine's Triton kernels (attention, fused MoE) need Turing or newer
MIN_CAPABILITY = (7, 5)
BF16_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores
FP8_CAPABILITY = (8, 9)  # Ada Lovelace and Hopper: e4m3 / e5m2 tensor cores

_ARCHITECTURES = {
    (7, 0): "Volta",
    (7, 2): "Volta",
    (7, 5): "Turing",
    (8, 0): "Ampere",
    (8, 6): "Ampere",
    (8, 7): "Ampere",
    (8, 9): "Ada Lovelace",
    (9, 0): "Hopper",
    (10, 0): "Blackwell",
    (10, 3): "Blackwell",
    (11, 0): "Blackwell",
    (12, 0): "Blackwell",
    (12, 1): "Blackwell",
}


def architecture_name(major: int, minor: int) -> str:
    """NVIDIA's name for the generation (``"unknown architecture"`` for capabilities newer or
    older than the table; newer ones keep every rule of the newest known)."""
    return _ARCHITECTURES.get((major, minor), "unknown architecture")


@dataclass(frozen=True)
class CudaCapability:
    major: int
    minor: int

    @property
    def version(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def sm(self) -> str:
        """The compiler's name for it: ``sm_90``."""
        return f"sm_{self.major}{self.minor}"

    @property
    def architecture(self) -> str:
        return architecture_name(self.major, self.minor)

    @property
    def supported(self) -> bool:
        return self.version >= MIN_CAPABILITY

    @property
    def has_bf16(self) -> bool:
        return self.version >= BF16_CAPABILITY

    @property
    def has_fp8(self) -> bool:
        return self.version >= FP8_CAPABILITY

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The compute dtypes the engine runs on this device, preferred first after float32
        (the order of ``Platform.supported_dtypes``)."""
        return ("float32", "bfloat16", "float16") if self.has_bf16 else ("float32", "float16")

    @property
    def default_dtype(self) -> str:
        """bf16 where the tensor cores have it (fp16's range overflows in some models), else fp16."""
        return "bfloat16" if self.has_bf16 else "float16"

    @property
    def fp8_dtype(self) -> str | None:
        return "float8_e4m3fn" if self.has_fp8 else None

    def describe(self) -> str:
        return f"compute capability {self.major}.{self.minor}, {self.architecture}"
