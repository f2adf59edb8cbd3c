"""How engine-cpu builds, caches, chooses and loads its kernels."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cpu_isa import ISA_VARIANTS

from engine_cpu import native

V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ENGINE_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    "flags, chosen",
    [
        (set(), "generic"),
        ({"avx", "avx2", "fma"}, "generic"),  # x86-64-v3 needs all of its flags
        (V3, "avx2"),
        (V4 - {"avx512vl"}, "avx2"),
        (V4, "avx512"),
        (V4 | {"avx512_bf16", "avx512_vnni"}, "avx512bf16"),
        (V4 | {"avx512_bf16"}, "avx512"),  # the bf16 builds use VNNI too (int8 activations)
        (V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}, "amx"),
        (V4 | {"avx512_bf16", "avx512_vnni", "amx_tile"}, "avx512bf16"),  # AMX tiles without their bf16 products
        (V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}, "avx512bf16"),  # nor int8 ones
        (V4 | {"amx_tile", "amx_bf16"}, "avx512"),
        (V3 | {"avx512_bf16"}, "avx2"),
    ],
)
def test_the_most_capable_variant_the_cpu_runs_is_chosen(x86, flags, chosen):
    assert native.chosen_variant(frozenset(flags)).name == chosen
    runnable = [v.name for v in native.runnable_variants(frozenset(flags))]
    assert runnable[-1] == chosen and runnable[0] == "generic"


def test_off_x86_only_the_generic_build_runs(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert [v.name for v in native.runnable_variants(frozenset(V4 | {"avx512_bf16"}))] == ["generic"]


def test_a_forced_variant_is_used_and_one_the_cpu_cannot_run_is_refused(x86, monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_ISA", "avx2")
    assert native.chosen_variant(frozenset(V4)).name == "avx2"
    monkeypatch.setenv("ENGINE_CPU_ISA", "avx512bf16")
    with pytest.raises(ValueError, match="cannot run that build; it lacks avx512_bf16.*runs: generic, avx2, avx512"):
        native.chosen_variant(frozenset(V4))
    monkeypatch.setenv("ENGINE_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="not a kernel variant; known: generic, avx2, avx512, avx512bf16, amx"):
        native.chosen_variant(frozenset(V4))


def test_cpu_flags_are_read_from_cpuinfo():
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    flags = native.cpu_flags()
    assert flags and ("sse2" in flags or native.platform.machine() not in ("x86_64", "AMD64"))


EXPECTED_ISA = {
    "generic": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"},
    "avx512bf16": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"},
    "amx": {
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    },
}


@pytest.mark.parametrize("name", ISA_VARIANTS)
def test_each_runnable_variant_is_compiled_for_its_instruction_set_only(name):
    kernels = native.load(name)
    assert kernels is not None, f"the {name} build failed (see the engine.cpu log)"
    assert set(kernels.compiled_isa()) == EXPECTED_ISA[name]
    assert kernels.gemv_supported() == (name in ("avx512bf16", "amx"))
    # the tiles also need the kernel's permission, which Linux grants from 5.16
    assert kernels.amx_supported() == (name == "amx" and amx_permitted())


def amx_permitted() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return libc.syscall(arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


def test_different_flags_sources_or_variants_are_different_builds(tmp_path):
    source = tmp_path / "a.cpp"
    source.write_text("int a() { return 1; }\n")
    generic, avx2 = native.VARIANTS_BY_NAME["generic"], native.VARIANTS_BY_NAME["avx2"]
    key = native.build_key(generic, [source])
    assert key == native.build_key(generic, [source])
    assert key != native.build_key(avx2, [source])
    (tmp_path / "b.h").write_text("#pragma once\n")  # a header beside the sources counts
    assert native.build_key(generic, [source]) != key
    source.write_text("int a() { return 2; }\n")
    assert native.build_key(generic, [source]) != key


LOAD_WITHOUT_COMPILING = textwrap.dedent(
    """
    import logging, sys
    import torch.utils.cpp_extension

    def no_compiling(*args, **kwargs):
        raise SystemExit("a cached build was compiled again")

    torch.utils.cpp_extension.load = no_compiling
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from engine_cpu import native
    kernels = native.load()
    print("variant", kernels.variant)
    """
)


def test_a_cached_build_loads_without_compiling_whatever_path_says():
    kernels = native.load()
    if kernels is None:
        pytest.fail("the engine-cpu kernels failed to build")
    env = {**os.environ, "PATH": "/nonexistent"}  # no ninja, no compiler
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_COMPILING], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"variant {kernels.variant}" in done.stdout
    assert "building" not in done.stdout


TINY = """
#include <torch/csrc/utils/pybind.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def tiny_variant(name: str) -> native.Variant:
    return native.Variant(name, (), frozenset())


def test_a_build_killed_midway_is_recovered_by_the_next_start(tmp_path):
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY)
    root = tmp_path / "cache"
    variant = tiny_variant("killedtest")
    builder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from engine_cpu import native; "
            f"native.build(native.Variant('killedtest', (), frozenset()), Path({str(root)!r}), [Path({str(source)!r})])",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(root.glob("*.build-*/build.ninja")):  # compiling, with torch's own lock taken
        assert builder.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
        time.sleep(0.05)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    abandoned = list(root.glob("*.build-*"))
    assert abandoned and not list(root.glob(f"killedtest-{native.build_key(variant, [source])}"))

    module = native.build(variant, root, [source])
    assert module.answer() == 42
    assert not any(path.exists() for path in abandoned)


def test_the_process_that_builds_and_later_ones_name_the_build_alike(tmp_path):
    """Measurements of a build are stored under its ``build`` name: the process that compiled it
    (and imported it from its work directory) must give the same name as the next start, or
    that start would time every kernel again."""
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY)
    root = tmp_path / "cache"
    script = (
        "from pathlib import Path; from engine_cpu import native; "
        f"m = native.build(native.Variant('nametest', (), frozenset()), Path({str(root)!r}), [Path({str(source)!r})]); "
        "print(m.build, m.answer())"
    )
    names = []
    for _ in range(2):  # the first compiles, the second loads the cached build
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        names.append(done.stdout.split())
    key = native.build_key(tiny_variant("nametest"), [source])
    assert names == [[f"nametest-{key}", "42"]] * 2
    assert (root / f"nametest-{key}").is_dir()


def test_waiting_for_another_build_says_so_and_goes_on_when_its_holder_dies(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "PROGRESS_SECONDS", 0.2)
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, time; f = open({str(lock)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
            "time.sleep(1.0); import os; os._exit(0)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="engine.cpu"):
        with native._exclusive(lock, "the test kernels"):
            waited = time.monotonic() - start
            with open(lock) as f:  # held by this process now
                with pytest.raises(BlockingIOError):
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.wait()
    assert waited >= 0.5
    assert any(
        "waiting" in r.message and "another process building the test kernels" in r.message for r in caplog.records
    )


def test_the_build_command_refuses_unknown_variants(capsys):
    assert native.main(["avx9000"]) == 2
    assert "unknown variant(s) avx9000" in capsys.readouterr().err


def test_older_builds_of_a_variant_are_pruned_after_a_new_one(tmp_path):
    """After a build, the variant's builds beyond the most recently used KEEP_BUILDS go; other
    variants, builds in progress, lock files and the new build stay."""
    import os

    amx, avx2 = native.VARIANTS_BY_NAME["amx"], native.VARIANTS_BY_NAME["avx2"]
    now = 1_000_000_000
    keys = [f"amx-{i:020x}" for i in range(5)]
    for age, key in enumerate(keys):  # keys[0] used last, keys[4] longest ago
        (tmp_path / key).mkdir()
        (tmp_path / key / native.USED_STAMP).touch()
        os.utime(tmp_path / key / native.USED_STAMP, (now - age * 3600, now - age * 3600))
        (tmp_path / f"{key}.lock").touch()
    other = tmp_path / f"avx2-{0:020x}"
    other.mkdir()
    running = tmp_path / f"amx-{9:020x}.build-123"
    running.mkdir()
    new = f"amx-{8:020x}"
    (tmp_path / new).mkdir()
    removed = native.prune_builds(tmp_path, amx, keep=new, count=3)
    assert sorted(p.name for p in removed) == sorted(keys[2:])  # the new one and the 2 last used stay
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(
        [*keys[:2], new, other.name, running.name]
    )
    assert all((tmp_path / f"{key}.lock").exists() for key in keys)
    assert native.prune_builds(tmp_path, avx2, keep="none", count=3) == []


def test_importing_a_build_stamps_it(tmp_path):
    kernels = native.load()
    if kernels is None:
        pytest.skip("no native kernels here")
    # the build's directory (a module built in this process was loaded from its work directory)
    variant = native.VARIANTS_BY_NAME[kernels.variant]
    stamp = native.cache_root() / f"{variant.name}-{native.build_key(variant)}" / native.USED_STAMP
    assert stamp.exists()
