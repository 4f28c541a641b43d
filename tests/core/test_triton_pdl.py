"""Programmatic dependent launch: only for CUDA tensors of a Hopper or newer GPU with a Triton that offers it; the
interpreter's kernels launch without it."""

from __future__ import annotations

import pytest
import torch

from plugserve.core import triton_pdl


def test_cpu_tensors_launch_without_pdl() -> None:
    assert not triton_pdl.programmatic_launch(torch.zeros(1))
    assert triton_pdl.launch_options(torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("capability,expected", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_needs_hopper(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: bool) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    triton_pdl._programmatic_launch_on.cache_clear()
    try:
        assert triton_pdl._programmatic_launch_on(0) is expected
    finally:
        triton_pdl._programmatic_launch_on.cache_clear()


def test_pdl_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("PLUGSERVE_PDL", "0")
    triton_pdl._programmatic_launch_on.cache_clear()
    try:
        assert triton_pdl._programmatic_launch_on(0) is False
    finally:
        triton_pdl._programmatic_launch_on.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs a Hopper or newer GPU")
def test_hopper_kernels_launch_as_programmatic_dependents() -> None:
    assert triton_pdl.launch_options(torch.zeros(1, device="cuda")) == {"PDL": True, "launch_pdl": True}
