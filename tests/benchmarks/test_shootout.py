import json

import pytest

from benchmarks import shootout
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.registry import SelectionTable


def test_quick_shootout_writes_results_and_a_selection_table_auto_can_read(tmp_path):
    shootout.main(["--quick", "--device", "cpu", "--dtype", "float32", "--heads", "4", "--page-size", "16",
                   "--warmup", "1", "--reps", "2", "--reference-reps", "1", "--output-dir", str(tmp_path),
                   "--backends", "attention:torch_ref", "gemm:torch_ref", "moe:torch_ref"])
    data = json.loads((tmp_path / "shootout.json").read_text())
    assert {"copy_gbps", "bf16_tflops", "fp8_tflops"} <= set(data["ceilings"])
    kinds = {row["kind"] for row in data["rows"]}
    assert kinds == {"attention", "gemm", "moe"}
    assert all(row["us"] > 0 and row["fraction_of_limit"] > 0 for row in data["rows"])
    assert "| attention | decode |" in (tmp_path / "shootout.md").read_text()
    table = SelectionTable.model_validate_json((tmp_path / f"{Hardware.detect('cpu').device_key}.json").read_text())
    assert table.order("attention", Phase.DECODE, 4) == ["torch_ref"]
    assert (tmp_path / "moe.png").stat().st_size > 0


def test_selection_table_ranks_by_summed_time_over_the_bucket():
    rows = [shootout.Row("gemm", "decode", s, b, us, 0, 0, 0, batch, "graph")
            for s, b, us, batch in [("m1", "a", 10, 1), ("m1", "b", 5, 1), ("m8", "a", 1, 8), ("m8", "b", 30, 8),
                                    ("m4", "a", 2, 4)]]
    table = shootout.selection_table(rows, Hardware.detect("cpu"), "cmd")
    buckets = table["rankings"]["gemm"]["decode"]
    assert buckets[0] == {"max_batch_size": 1, "order": ["b", "a"]}
    # In (1, 8] only "a" ran every case (m4 and m8), so only it competes there.
    assert buckets[1] == {"max_batch_size": 8, "order": ["a"]}


def test_wrapper_overhead_compares_with_the_library_called_directly():
    row = shootout.Row("gemm", "decode", "m8", "x", 103.0, 0, 0, 0, 8, "graph", library_us=100.0)
    assert row.wrapper_overhead == pytest.approx(0.03)
    assert shootout.Row("gemm", "decode", "m8", "x", 1.0, 0, 0, 0, 8, "graph").wrapper_overhead is None
    assert shootout.library_call("no_such_backend", "gemm") is None
