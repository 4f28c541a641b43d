"""benchmarks/gpu_timing.py: graph-replay timing with a cold L2 (GPU only); the read and copy rates."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_timing import copy_gbps, read_gbps, time_cold_graph_ms

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA-graph replays: needs a GPU")


def test_read_and_copy_rates_count_the_bytes_they_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every timed call taking 1 ms: reading n bytes is n / 1 ms, copying them 2 n / 1 ms (read and write)."""
    import benchmarks.gpu_timing as gpu_timing

    calls = []
    monkeypatch.setattr(gpu_timing, "_median_seconds", lambda fn, device, warmup, reps: calls.append(fn()) or 1e-3)
    n_bytes = 1 << 20
    assert read_gbps(torch.device("cpu"), n_bytes) == pytest.approx(n_bytes / 1e-3 / 1e9)
    assert copy_gbps(torch.device("cpu"), n_bytes) == pytest.approx(2 * n_bytes / 1e-3 / 1e9)
    assert calls[0].item() == n_bytes // 2 and calls[1].item() == 1  # sum and amax read every element


@needs_gpu
def test_times_the_replayed_work_not_the_host() -> None:
    """A copy of 256 MiB takes its bytes over the bandwidth; an empty graph a few microseconds."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_cold_graph_ms(lambda: dst.copy_(src))
    small = torch.zeros(1, device="cuda")
    assert time_cold_graph_ms(lambda: small.add_(1)) < 0.05 < copy_ms < 5.0
    assert small.item() >= 20  # the warm-up, the side-stream run and the replays all ran


@needs_gpu
def test_capture_failure_raises() -> None:
    with pytest.raises(RuntimeError):
        time_cold_graph_ms(lambda: torch.ones(1, device="cuda").item())
