"""What every Triton backend asks of the machine: programmatic dependent launch only for CUDA tensors of a
Hopper or newer GPU with a Triton that offers it."""

from __future__ import annotations

import pytest
import torch

from plugserve.plugins import triton_support


def test_programmatic_launch_is_off_for_cpu_tensors() -> None:
    assert not triton_support.programmatic_launch(torch.zeros(1))


@pytest.mark.parametrize("capability,expected", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_programmatic_launch_needs_hopper(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                          expected: bool) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    triton_support._programmatic_launch_on.cache_clear()
    try:
        assert triton_support._programmatic_launch_on(0) is expected
    finally:
        triton_support._programmatic_launch_on.cache_clear()
