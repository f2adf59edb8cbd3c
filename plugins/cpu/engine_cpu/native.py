"""The C++ kernels of engine-cpu: built once per instruction-set variant, loaded always.

The kernels are compiled with the system compiler for one of a few fixed x86
instruction-set levels (:data:`VARIANTS`), never ``-march=native``, so a build
runs on every CPU that has its level, wherever the cache lives. The variant is
chosen by the CPU's flags (the most capable one it can run) or forced with
``ENGINE_CPU_ISA=<name>``; ``ENGINE_CPU_NATIVE=0`` disables the kernels and
callers use their torch paths.

Builds are cached in ``ENGINE_CPU_KERNEL_CACHE`` (default
``~/.cache/engine-cpu/kernels``), one directory per key: the variant, the
compiler flags, the sources' bytes, and torch's and Python's versions. A cached build is imported directly, so nothing (PATH, which
``ninja`` runs, the working directory) can make a later start compile again.
A build runs in a private directory under an exclusive ``flock`` and is renamed
into place when complete: a build killed midway leaves no lock behind (the
kernel drops a dead process's ``flock``) and its directory is cleared by the
next builder. A build or a wait for another process's build reports its
progress every :data:`PROGRESS_SECONDS`. Each import stamps its build's directory; after a
new build, builds of the same variant beyond the :data:`KEEP_BUILDS` most recently used are
removed (another engine-cpu version sharing the cache rebuilds its own once, if it was one of
them), so upgrades do not pile up builds.

``python -m engine_cpu.native [VARIANT ...|all]`` builds ahead of time (for an
image, say).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

logger = logging.getLogger("engine.cpu")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "bindings.cpp",
        "paged_attention.cpp",
        "packed_attention.cpp",
        "prefill_attention.cpp",
        "layer_ops.cpp",
        "gemv.cpp",
        "amx_linear.cpp",
        "amx_attention.cpp",
        "dot_linear.cpp",
        "group_quant.cpp",
        "fp8_linear.cpp",
        "mamba2.cpp",
    )
]
# -fopenmp: at::parallel_for is inline and runs serially in code compiled without it
COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only")
PROGRESS_SECONDS = 15.0
KEEP_BUILDS = 3  # per variant, the most recently used (this one included)
USED_STAMP = "last-used"  # touched in a build's directory at each import


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: the compiler's ``-m`` flags and the CPU flags (as
    ``/proc/cpuinfo`` names them) a CPU needs to run it."""

    name: str
    march: tuple[str, ...]
    requires: frozenset[str]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# most capable last; each one's CPU flags include those of the ones before it
VARIANTS = (
    Variant("generic", (), frozenset()),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    # every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) has AVX512-VNNI
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), _V4 | {"avx512_bf16", "avx512_vnni"}),
    Variant(
        "amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
        _V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
    ),
)
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as the kernel reports them in ``/proc/cpuinfo``; empty where
    it cannot be read (then only the generic build runs)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runnable_variants(flags: frozenset[str] | None = None) -> list[Variant]:
    """The variants this CPU can execute, least capable first (only ``generic`` off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [VARIANTS_BY_NAME["generic"]]
    flags = cpu_flags() if flags is None else flags
    return [v for v in VARIANTS if v.requires <= flags]


def chosen_variant(flags: frozenset[str] | None = None) -> Variant:
    """``ENGINE_CPU_ISA`` where set (refused when this CPU cannot run it), else the most
    capable variant this CPU runs."""
    runnable = runnable_variants(flags)
    forced = os.environ.get("ENGINE_CPU_ISA", "").strip()
    if not forced:
        return runnable[-1]
    if forced not in VARIANTS_BY_NAME:
        raise ValueError(f"ENGINE_CPU_ISA={forced!r} is not a kernel variant; known: {', '.join(VARIANTS_BY_NAME)}.")
    variant = VARIANTS_BY_NAME[forced]
    if variant not in runnable:
        missing = sorted(variant.requires - (cpu_flags() if flags is None else flags))
        raise ValueError(
            f"ENGINE_CPU_ISA={forced}: this CPU ({cpu_model()}) cannot run that build; it lacks {', '.join(missing)}. "
            f"It runs: {', '.join(v.name for v in runnable)}."
        )
    return variant


def disabled() -> bool:
    return os.environ.get("ENGINE_CPU_NATIVE", "1") in ("0", "false", "False")


def load(variant: str | None = None) -> ModuleType | None:
    """The kernels of ``variant`` (default: :func:`chosen_variant`), built on first use; None
    when disabled or when no compiler works (the reason is logged once)."""
    if disabled():
        return None
    name = variant if variant is not None else chosen_variant().name
    return _load(name)


_LOADED: list[ModuleType] = []  # every variant loaded in this process


def loaded_modules() -> list[ModuleType]:
    """The kernel modules :func:`load` has returned so far (one per variant)."""
    return list(_LOADED)


@functools.lru_cache(maxsize=None)
def _load(name: str) -> ModuleType | None:
    try:
        module = build(VARIANTS_BY_NAME[name])
    except Exception as exc:  # no compiler, headers missing, a build error
        logger.warning("engine-cpu kernels (%s) unavailable, using the torch paths: %s", name, exc)
        return None
    module.variant = name
    _LOADED.append(module)
    return module


def cache_root() -> Path:
    configured = os.environ.get("ENGINE_CPU_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engine-cpu" / "kernels"


def cflags(variant: Variant) -> list[str]:
    return [*COMMON_CFLAGS, *variant.march]


def build_key(variant: Variant, sources: Sequence[Path] = SOURCES) -> str:
    """What a build depends on, hashed: a change to any of it is a different build. Nothing
    read from the environment (PATH: which compiler or ninja would run) goes in, so a cached
    build is found from any shell."""
    import torch

    digest = hashlib.sha256()
    for part in (
        variant.name,
        " ".join(cflags(variant)),
        torch.__version__,
        getattr(torch.version, "git_version", ""),
        sys.version,
    ):
        digest.update(part.encode() + b"\0")
    headers = {h for source in sources for h in Path(source).parent.glob("*.h")}
    for path in sorted({Path(p) for p in sources} | headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def module_name(variant: Variant) -> str:
    return f"engine_cpu_kernels_{variant.name}"


def build(variant: Variant, root: Path | None = None, sources: Sequence[Path] = SOURCES) -> ModuleType:
    """Import the cached build of ``variant``, building it first if there is none."""
    root = cache_root() if root is None else root
    key = f"{variant.name}-{build_key(variant, sources)}"
    library = root / key / f"{module_name(variant)}.so"
    if library.exists():
        return _import(variant, library)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{key}.lock", f"the {variant.name} kernels"):
        if not library.exists():  # another process may have finished it while this one waited
            _clear_abandoned(root, f"{key}.build-")
            work = root / f"{key}.build-{os.getpid()}"
            with _progress(f"building engine-cpu kernels ({variant.name}, {len(sources)} files; first use only)"):
                module = _compile(variant, work, sources)
            os.replace(work, root / key)  # the loaded library stays mapped
            sys.modules.setdefault(module_name(variant), module)
            _stamp(root / key)
            prune_builds(root, variant, keep=key)
    return _import(variant, library)


def _stamp(directory: Path) -> None:
    """Mark a build as used now (a read-only cache just goes unstamped)."""
    try:
        (directory / USED_STAMP).touch()
    except OSError:
        pass


def _last_used(directory: Path) -> float:
    stamp = directory / USED_STAMP
    try:
        return stamp.stat().st_mtime if stamp.exists() else directory.stat().st_mtime
    except OSError:
        return 0.0


def prune_builds(root: Path, variant: Variant, keep: str, count: int = KEEP_BUILDS) -> list[Path]:
    """Remove the builds of ``variant`` under ``root`` beyond the ``count`` most recently used
    (``keep``, the key just built, always stays); returns the directories removed. Builds in
    progress (``*.build-<pid>``) and lock files are left alone."""
    pattern = f"{variant.name}-" + "[0-9a-f]" * 20
    builds = sorted(
        (path for path in root.glob(pattern) if path.is_dir() and path.name != keep),
        key=_last_used,
        reverse=True,
    )
    removed = builds[max(count - 1, 0) :]
    for path in removed:
        logger.info("removing an older kernel build (not among the %d last used): %s", count, path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _compile(variant: Variant, work: Path, sources: Sequence[Path]) -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    module = load_extension(
        name=module_name(variant),
        sources=[str(path) for path in sources],
        extra_include_paths=sorted({str(Path(path).parent) for path in sources}),
        extra_cflags=cflags(variant),
        extra_ldflags=["-fopenmp"],
        build_directory=str(work),
        verbose=False,
    )
    if not (work / f"{module_name(variant)}.so").exists():
        raise RuntimeError(f"the build in {work} produced no {module_name(variant)}.so")
    return module


def _import(variant: Variant, library: Path) -> ModuleType:
    """The build at ``library``, imported once; its ``build`` attribute names it (the cache
    directory's name, variant and key): what measurements of it are stored under, the same in
    the process that built it (which imported it from its work directory) as in every later one."""
    name = module_name(variant)
    module = sys.modules.get(name)
    if module is None:
        import torch  # noqa: F401  (the extension links against libtorch, loaded by this import)

        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        _stamp(library.parent)
    module.build = library.parent.name
    return module


def _clear_abandoned(root: Path, prefix: str) -> None:
    """Directories of builds that died midway (this process holds the build lock, so no
    build of this key is running)."""
    for path in root.glob(prefix + "*"):
        logger.info("removing an abandoned kernel build: %s", path)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path``; while another process holds it, says so every
    PROGRESS_SECONDS. The kernel releases a ``flock`` when its holder dies, so a killed
    build never leaves a lock that blocks the next start."""
    with open(lock_path, "a+") as f:
        start = time.monotonic()
        reported = start
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - reported >= PROGRESS_SECONDS:
                    logger.warning(
                        "waiting %.0f s for another process building %s (lock %s)", now - start, what, lock_path
                    )
                    reported = now
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress(message: str) -> Iterator[None]:
    """Logs ``message`` now, then the time so far every PROGRESS_SECONDS until the block ends."""
    logger.info(message)
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(PROGRESS_SECONDS):
            logger.info("%s: %.0f s so far", message.partition(" (")[0], time.monotonic() - start)

    thread = threading.Thread(target=report, name="engine-cpu-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    logger.info("built in %.0f s", time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    """Build the given variants (default: the chosen one; ``all``: every one this CPU runs)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = sys.argv[1:] if argv is None else argv
    if names == ["all"]:
        variants = runnable_variants()
    elif names:
        unknown = [n for n in names if n not in VARIANTS_BY_NAME]
        if unknown:
            print(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS_BY_NAME)}", file=sys.stderr)
            return 2
        variants = [VARIANTS_BY_NAME[n] for n in names]
    else:
        variants = [chosen_variant()]
    for variant in variants:
        build(variant)
        print(f"{variant.name}: {cache_root() / (variant.name + '-' + build_key(variant))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
