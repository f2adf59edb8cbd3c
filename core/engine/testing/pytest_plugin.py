"""pytest plugin of engine (entry point ``pytest11``): markers, options and passive
fixtures for plugin tests and the conformance kit (``engine.testing.kit``).
Nothing here is autouse.

- markers ``gpu`` (needs an accelerator) and ``slow``;
- option ``--engine-device NAME``: the platform kit tests run on (default: cpu);
- fixtures ``tiny_checkpoint`` (factory ``tiny_checkpoint(architecture, **overrides)
  -> (path, hf_model)``: a random-weight checkpoint in a fresh temp folder, with the
  HF model as the reference), ``engine_device`` and ``seeded_rng``;
- kit classes' ``expected_failures`` become strict xfails, and skipped kit checks
  are summed up by missing capability at the end of the run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine", "engine plugin conformance kit")
    group.addoption("--engine-device", default="cpu", help="Platform the kit's checks run on (default: cpu).")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an accelerator platform (see --engine-device)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.pluginmanager.register(_KitSkipSummary(), "engine-kit-skip-summary")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from engine.testing.kit.base import KitTests

    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, KitTests):
            continue
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        reason = cls.expected_failures.get(name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


class _KitSkipSummary:
    """Counts kit checks skipped for an undeclared capability and lists them at the end."""

    def __init__(self) -> None:
        self.skips: Counter = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from engine.testing.kit.base import CAPABILITY_PREFIX

        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2]).removeprefix("Skipped: ")
            if message.startswith(CAPABILITY_PREFIX):
                self.skips[message[len(CAPABILITY_PREFIX) :]] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.skips:
            terminalreporter.section("engine kit: checks skipped for undeclared capabilities")
            for capability, count in sorted(self.skips.items()):
                terminalreporter.line(f"{count:4d}  {capability}")


@pytest.fixture
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Any]]:
    from engine.testing.checkpoints import make_tiny_checkpoint

    def make(architecture: str, **overrides: Any) -> tuple[Path, Any]:
        path = tmp_path_factory.mktemp(architecture)
        return path, make_tiny_checkpoint(architecture, path, **overrides)

    return make


@pytest.fixture
def engine_device(request: pytest.FixtureRequest) -> str:
    """The platform name given by ``--engine-device`` (default cpu)."""
    return request.config.getoption("--engine-device")


@pytest.fixture
def seeded_rng() -> Any:
    """A ``torch.Generator`` seeded with 0, for reproducible random inputs."""
    import torch

    return torch.Generator().manual_seed(0)
