"""Every benchmark script imports on the CPU: the GPU-only ones (profilers, sweeps) have no CPU test of their own,
and a stale import is otherwise found only on the GPU machine, a device call lost."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import benchmarks

SCRIPTS = sorted(p.stem for p in Path(benchmarks.__file__).parent.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name):
    importlib.import_module(f"benchmarks.{name}")
