"""Kernel tests that run compiled on a GPU and in Triton's interpreter on the CPU.

`triton.jit` decides when a function is defined whether it is interpreted, Triton's own library (tl.sigmoid,
tl.cumsum, ...) included, which is defined when triton is first imported, possibly by an earlier test. So unless
TRITON_INTERPRET=1 was set before this process started (tests/conftest.py sets it where no GPU is visible), a
module's kernel tests run in a child pytest of that module started with it. A test module takes both halves:

    kernels = kernels_fixture("plugserve.plugins.moe.align")
    test_kernels_in_the_interpreter = interpreter_child(__file__)
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

# The kernels can run in this process: compiled on a GPU, or interpreted because TRITON_INTERPRET=1 came first.
KERNELS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]


def kernels_fixture(module: str) -> Callable[[], ModuleType]:
    """A module-scoped fixture giving the kernel module `module`, skipping where its kernels cannot run here."""

    @pytest.fixture(scope="module")
    def kernels() -> ModuleType:
        if not KERNELS_HERE:
            pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernels_in_the_interpreter")
        return importlib.import_module(module)

    return kernels


def interpreter_child(test_file: str, timeout: int = 600) -> Callable[[], None]:
    """The test that reruns `test_file` in a child pytest with TRITON_INTERPRET=1 where its kernels cannot run in
    this process (skipped where they can)."""

    @pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests run in this process")
    def test_kernels_in_the_interpreter() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]

    return test_kernels_in_the_interpreter
