"""benchmarks/gpu_timing.py: graph-replay timing with a cold L2 (GPU only)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_timing import time_cold_graph_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA-graph replays: needs a GPU")


def test_times_the_replayed_work_not_the_host() -> None:
    """A copy of 256 MiB takes its bytes over the bandwidth; an empty graph a few microseconds."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_cold_graph_ms(lambda: dst.copy_(src))
    small = torch.zeros(1, device="cuda")
    assert time_cold_graph_ms(lambda: small.add_(1)) < 0.05 < copy_ms < 5.0
    assert small.item() >= 20  # the warm-up, the side-stream run and the replays all ran


def test_capture_failure_raises() -> None:
    with pytest.raises(RuntimeError):
        time_cold_graph_ms(lambda: torch.ones(1, device="cuda").item())
