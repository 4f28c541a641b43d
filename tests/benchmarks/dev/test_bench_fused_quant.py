"""The fused-quantization bench's CPU-side parts: its comparison of the two ways, interpreted with the timing faked,
and its refusal of the CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dev import bench_fused_quant
from plugserve.plugins.gemm.triton import default_config


def test_compare_times_both_ways_per_m_and_checks_their_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_fused_quant, "time_cold_graph_ms",
                        lambda fn, reps: 2.0 if fn.func is bench_fused_quant.unfused else 1.0)
    rows = bench_fused_quant.compare(200, 300, [1, 3], torch.float32, 1, torch.device("cpu"))
    assert [(row["m"], row["unfused_us"], row["fused_us"], row["same_bits"]) for row in rows] == [
        (1, 2000.0, 1000.0, True), (3, 2000.0, 1000.0, True)]
    assert rows[0]["config"] == default_config(1)  # no tuned file for the CPU


def test_refuses_the_cpu() -> None:
    with pytest.raises(SystemExit, match="run it on a CUDA GPU"):
        bench_fused_quant.main(["--shapes", "2112,7168"])
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        bench_fused_quant.main(["--shapes", "7168x"])
