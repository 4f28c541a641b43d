"""Every benchmark script imports on the CPU: the GPU-only ones (profilers, sweeps) have no CPU test of their own,
and a stale import is otherwise found only on the GPU machine, a device call lost."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(benchmarks.__file__).parent
# The product benchmarks, the tuners (tune/) and the investigations (dev/), as dotted module names.
SCRIPTS = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for folder in (ROOT, ROOT / "tune", ROOT / "dev")
                 for p in folder.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name):
    importlib.import_module(f"benchmarks.{name}")
