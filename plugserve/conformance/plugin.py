"""pytest plugin of the conformance kit: options, backend parametrization and shared fixtures.

Registered for every pytest run through the `pytest11` entry point; it only acts on tests that ask
for the kit's fixtures (`attention_target`, `gemm_target`, `moe_target`, `mla_case`, ...). It imports torch, the
registry and the shape grids only for those: a project's pytest run that has plugserve installed pays nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from plugserve.core.names import KINDS, Kind

if TYPE_CHECKING:
    import torch

    from plugserve.core.hardware import Hardware
    from plugserve.core.interfaces import Backend
    from plugserve.registry import BackendEntry

DTYPE_NAMES = ("float32", "float16", "bfloat16")
PROFILES = ("small", "full")  # the shape grids: small ones for the CPU, DeepSeek-V3's sizes


def dtypes() -> dict[str, torch.dtype]:
    """The activation dtypes the kit checks, by name."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class Target:
    """One backend under test in one activation dtype."""

    entry: BackendEntry
    dtype: torch.dtype

    @property
    def cls(self) -> type[Backend]:
        return self.entry.cls

    def __str__(self) -> str:
        return f"{self.entry.name}-{str(self.dtype).removeprefix('torch.')}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plugserve", "plugserve conformance kit")
    group.addoption(
        "--plugserve-backend", action="append", default=[], metavar="KIND:NAME",
        help="backend to check, e.g. attention:triton (repeatable; default: every registered backend)",
    )
    group.addoption(
        "--plugserve-shapes", choices=PROFILES, default=None,
        help="shape grid: full DeepSeek-V3 sizes, or small ones for the CPU (default: full on a GPU)",
    )
    group.addoption("--plugserve-device", default=None, help="torch device (default: cuda if present, else cpu)")
    group.addoption("--plugserve-report", default=None, metavar="PATH",
                    help="write every kit test's outcome, duration and skip reason as JSON")
    group.addoption(
        "--plugserve-dtypes", default=None, metavar="D1,D2",
        help=f"restrict the activation dtypes checked (of {', '.join(DTYPE_NAMES)})",
    )
    group.addoption(
        "--plugserve-heads", default=None, metavar="H1,H2",
        help="run every attention case at these head counts instead of the grid's: one rank's heads under "
             "tensor parallelism (DeepSeek-V3's 128 at --tp-size 8: 16)",
    )


class _Report:
    """Collects the kit's outcomes for --plugserve-report."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.results: list[dict[str, object]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else None
            # A failure's last line (the assertion or exception) says why, without the traceback.
            error = report.longreprtext.strip().splitlines()[-1] if report.failed and report.longreprtext else None
            self.results.append({"test": report.nodeid, "outcome": report.outcome, "when": report.when,
                                 "seconds": round(report.duration, 4), "skip_reason": reason, "error": error})

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import torch

        from plugserve.core.hardware import Hardware

        device = _device(session.config)
        hardware = Hardware.detect(device)
        counts = {o: sum(r["outcome"] == o for r in self.results) for o in ("passed", "failed", "skipped")}
        summary = {"device": hardware.name, "arch": hardware.arch, "torch": torch.__version__,
                   "shapes": _profile(session.config), "counts": counts, "results": self.results}
        with open(self.path, "w") as f:
            json.dump(summary, f, indent=1)


def pytest_configure(config: pytest.Config) -> None:
    _heads(config)  # a bad value is a usage error before collection
    path = config.getoption("--plugserve-report", default=None)
    if path:
        config.pluginmanager.register(_Report(path), "plugserve-report")


def _device(config: pytest.Config) -> torch.device:
    import torch

    chosen = config.getoption("--plugserve-device")
    return torch.device(chosen or ("cuda" if torch.cuda.is_available() else "cpu"))


def _profile(config: pytest.Config) -> str:
    return config.getoption("--plugserve-shapes") or ("full" if _device(config).type == "cuda" else "small")


def _heads(config: pytest.Config) -> list[int] | None:
    """--plugserve-heads as a list of positive ints, None when not given."""
    value = config.getoption("--plugserve-heads")
    if value is None:
        return None
    try:
        heads = [int(h) for h in value.split(",")]
    except ValueError:
        heads = []
    if not heads or min(heads) < 1:
        raise pytest.UsageError(f"--plugserve-heads {value!r}: expected positive head counts, e.g. 16 or 16,64")
    return heads


def _requested(config: pytest.Config) -> dict[Kind, list[str]] | None:
    """{kind: [names]} from --plugserve-backend, or None for every registered backend."""
    values = config.getoption("--plugserve-backend")
    if not values:
        return None
    from plugserve.registry import get_registry

    requested: dict[Kind, list[str]] = {}
    registry = get_registry()
    for value in values:
        kind, sep, name = value.partition(":")
        if not sep or kind not in KINDS:
            raise pytest.UsageError(f"--plugserve-backend {value!r}: expected KIND:NAME with KIND one of "
                                    f"{', '.join(KINDS)}")
        if name not in registry.backends[kind]:  # type: ignore[index]
            known = ", ".join(sorted(registry.backends[kind])) or "none"  # type: ignore[index]
            raise pytest.UsageError(f"--plugserve-backend {value!r}: no {kind} backend named {name!r} "
                                    f"(registered: {known})")
        requested.setdefault(kind, []).append(name)  # type: ignore[arg-type]
    return requested


def _targets(config: pytest.Config, kind: Kind) -> list:
    from plugserve.registry import get_registry

    registry = get_registry()
    requested = _requested(config)
    names = sorted(registry.backends[kind]) if requested is None else requested.get(kind, [])
    allowed = config.getoption("--plugserve-dtypes")
    by_name = dtypes()
    allowed_dtypes = {by_name[d.strip()] for d in allowed.split(",")} if allowed else set(by_name.values())
    params = []
    for name in names:
        entry = registry.backends[kind][name]
        claimed = [d for d in by_name.values() if d in entry.cls.capabilities.dtypes and d in allowed_dtypes]
        params += [Target(entry, d) for d in claimed]
    if not params:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no {kind} backend selected"), id="none")]
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    kit_kinds = [kind for kind in KINDS if f"{kind}_target" in metafunc.fixturenames]
    if not kit_kinds:
        return  # not a kit test: leave other projects' parameters (a `page_size` of theirs...) alone
    from plugserve.conformance import cases

    for kind in kit_kinds:
        metafunc.parametrize(f"{kind}_target", _targets(config, kind), ids=str)
    profile = _profile(config)
    grids = {
        "mla_case": cases.mla_cases,
        "graph_case": cases.graph_cases,
        "mha_case": cases.mha_cases,
        "gemm_case": cases.gemm_cases,
        "moe_case": cases.moe_cases,
        "router_case": cases.router_cases,
    }
    heads = _heads(config)
    for fixture, grid in grids.items():
        if fixture in metafunc.fixturenames:
            grid_cases = grid(profile)
            if heads is not None and fixture in cases.ATTENTION_GRIDS:
                grid_cases = cases.at_heads(grid_cases, heads)
            metafunc.parametrize(fixture, grid_cases, ids=str)
    if "attention_heads" in metafunc.fixturenames:  # the attention tests outside the grids
        metafunc.parametrize("attention_heads", heads or [cases.DEFAULT_HEADS], ids=lambda h: f"h{h}")
    if "page_size" in metafunc.fixturenames:
        # 128: the page size sm100 CUTLASS MLA forces; full shapes only, where a GPU runs them.
        page_sizes = [1, 16, 64] + ([128] if profile == "full" else [])
        metafunc.parametrize("page_size", page_sizes, ids=lambda p: f"page{p}")


@pytest.fixture
def plugserve_device(request: pytest.FixtureRequest) -> torch.device:
    """The device the kit runs on; seeds torch so every case draws the same inputs."""
    import torch

    torch.manual_seed(0)
    return _device(request.config)


@pytest.fixture
def plugserve_hardware(plugserve_device: torch.device) -> Hardware:
    from plugserve.core.hardware import Hardware

    return Hardware.detect(plugserve_device)


def require_available(target: Target, hardware: Hardware) -> None:
    """Skip, with the backend's own reason, when it cannot run on this machine."""
    from plugserve.registry import get_registry

    available = get_registry().availability(target.cls, hardware)
    if not available:
        pytest.skip(f"{target.entry.name} unavailable: {available.reason}")
