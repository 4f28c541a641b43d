import dataclasses
import json

import pytest
import torch

from benchmarks import shootout
from plugserve.core.config import preset_config
from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.layers.linear import Linear
from plugserve.core.models.deepseek import DeepseekForCausalLM
from plugserve.registry import SelectionTable


def test_quick_shootout_writes_results_and_a_selection_table_auto_can_read(tmp_path):
    shootout.main(["--quick", "--device", "cpu", "--dtype", "float32", "--heads", "4", "--page-size", "16",
                   "--warmup", "1", "--reps", "2", "--reference-reps", "1", "--output-dir", str(tmp_path),
                   "--backends", "attention:torch_ref", "gemm:torch_ref", "moe:torch_ref"])
    data = json.loads((tmp_path / "shootout.json").read_text())
    assert {"read_gbps", "copy_gbps", "memory_gbps", "bf16_tflops", "fp8_tflops"} <= set(data["ceilings"])
    assert data["ceilings"]["memory_gbps"] == max(data["ceilings"]["read_gbps"], data["ceilings"]["copy_gbps"])
    kinds = {row["kind"] for row in data["rows"]}
    assert kinds == {"attention", "gemm", "moe"}
    assert all(row["us"] > 0 and row["fraction_of_limit"] > 0 for row in data["rows"])
    assert "| attention | decode |" in (tmp_path / "shootout.md").read_text()
    table = SelectionTable.model_validate_json((tmp_path / f"{Hardware.detect('cpu').device_key}.json").read_text())
    assert table.order("attention", Phase.DECODE, 4) == ["torch_ref"]
    assert (tmp_path / "moe.png").stat().st_size > 0


def test_the_memory_limit_is_the_faster_stream_and_a_row_past_it_fails_the_run():
    """Reading weights can stream faster than a copy: the limit divides bytes by the faster rate, so a case that
    reads faster than the copy rate is not "past the limit"; a row faster than its limit fails the run, naming it."""
    case = shootout.Case("moe", "decode", "t64", 4, 4000e9, 0.0, "bf16")
    ceilings = {"read_gbps": 4000.0, "copy_gbps": 2700.0, "memory_gbps": 4000.0, "bf16_tflops": 1.0, "fp8_tflops": 1.0}
    assert shootout.limit_seconds(case, ceilings) == pytest.approx(1.0)
    rows = [shootout.Row("moe", "decode", "t64", b, us, 0, 0, fraction, 64, "graph")
            for b, us, fraction in [("fast", 1.0, 0.98), ("impossible", 0.5, 1.59)]]
    shootout.check_limits(rows[:1])
    with pytest.raises(SystemExit, match=r"moe t64 impossible: 1\.59"):
        shootout.check_limits(rows)


def test_selection_table_ranks_by_summed_time_over_the_bucket():
    rows = [shootout.Row("gemm", "decode", s, b, us, 0, 0, 0, batch, "graph")
            for s, b, us, batch in [("m1", "a", 10, 1), ("m1", "b", 5, 1), ("m8", "a", 1, 8), ("m8", "b", 30, 8),
                                    ("m4", "a", 2, 4)]]
    table = shootout.selection_table(rows, "cpu", "cmd")
    buckets = table["rankings"]["gemm"]["decode"]
    assert buckets[0] == {"max_batch_size": 1, "order": ["b", "a"]}
    # In (1, 8] only "a" ran every case (m4 and m8), so only it competes there.
    assert buckets[1] == {"max_batch_size": 8, "order": ["a"]}


def test_merge_into_files_attention_under_the_heads_it_ran(tmp_path):
    cpu = Hardware.detect("cpu").name
    rows = [shootout.Row("attention", "decode", "b1", b, us, 0, 0, 0, 1, "graph") for b, us in [("a", 2), ("b", 1)]]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(shootout.selection_table(
        [*rows, shootout.Row("gemm", "decode", "m1", "g", 1, 0, 0, 0, 1, "graph")], cpu, "all kinds")))
    flipped = [shootout.Row("attention", "decode", "b1", r.backend, 3 - r.us, 0, 0, 0, 1, "graph") for r in rows]
    shootout.merge_rankings(path, shootout.selection_table(flipped, cpu, "16 heads", attention_heads=16))
    table = SelectionTable.model_validate_json(path.read_text())
    assert table.order("attention", Phase.DECODE, 1) == ["b", "a"]  # 128 heads: unchanged
    assert table.order("attention", Phase.DECODE, 1, num_heads=16) == ["a", "b"]
    assert table.order("gemm", Phase.DECODE, 1) == ["g"] and "16 heads" in table.source
    with pytest.raises(SystemExit, match="ranked no backend"):
        shootout.merge_rankings(path, shootout.selection_table(rows[:0], cpu, "nothing", attention_heads=16))


def test_merge_into_reranks_the_measured_backends_in_their_places(tmp_path):
    """A run of two of a bucket's four backends swaps those two and leaves the others where they stood; a bucket
    the table lacks, or one that never held a measured backend, takes the measured order first."""
    cpu = Hardware.detect("cpu").name
    path = tmp_path / "table.json"
    before = [shootout.Row("gemm", "decode", "m8", b, us, 0, 0, 0, 8, "graph")
              for b, us in [("deep", 1), ("scaled", 2), ("cutlass", 3), ("triton", 4)]]
    path.write_text(json.dumps(shootout.selection_table(before, cpu, "all four")))
    now = [shootout.Row("gemm", "decode", shape, b, us, 0, 0, 0, batch, "graph")
           for shape, batch, b, us in [("m8", 8, "scaled", 5), ("m8", 8, "triton", 3),
                                       ("m64", 64, "scaled", 5), ("m64", 64, "triton", 6),
                                       ("m1", 1, "new", 1), ("m1", 1, "triton", 2)]]
    shootout.merge_rankings(path, shootout.selection_table(now, cpu, "two of them"))
    table = SelectionTable.model_validate_json(path.read_text())
    assert table.order("gemm", Phase.DECODE, 8) == ["deep", "triton", "cutlass", "scaled"]
    assert table.order("gemm", Phase.DECODE, 64) == ["scaled", "triton"]  # a bucket the table lacked
    assert table.order("gemm", Phase.DECODE, 1) == ["new", "triton"]
    assert "two of them" in table.source and "all four" in table.source


def test_wrapper_overhead_compares_with_the_library_called_directly():
    row = shootout.Row("gemm", "decode", "m8", "x", 103.0, 0, 0, 0, 8, "graph", library_us=100.0)
    assert row.wrapper_overhead == pytest.approx(0.03)
    assert shootout.Row("gemm", "decode", "m8", "x", 1.0, 0, 0, 0, 8, "graph").wrapper_overhead is None
    assert shootout.library_call("no_such_backend", "gemm") is None


@pytest.mark.parametrize(("name", "tp_size"), [("tiny", 1), ("tiny", 2), ("deepseek-v2-lite", 2), ("deepseek-v3", 8)])
def test_gemm_shapes_are_the_fp8_layers_one_rank_holds(name, tp_size):
    """Against the model itself on the meta device as rank 0 of tp_size (its routed experts go to the MoE backend)."""
    config = preset_config(name).quantized_fp8((16, 16)).with_layers(4)
    model = DeepseekForCausalLM(config, torch.float32, "meta", group=ParallelGroup(0, tp_size))
    held = {(m.out_features, m.in_features) for path, m in model.named_modules()
            if isinstance(m, Linear) and m.fp8_block and ".experts." not in path}
    assert sorted(set(shootout.gemm_shapes(config, tp_size))) == sorted(held)


def test_quick_shootout_at_two_ranks_measures_one_ranks_shapes(tmp_path):
    common = ["--quick", "--device", "cpu", "--dtype", "float32", "--heads", "4", "--page-size", "16", "--warmup", "0",
              "--reps", "1", "--reference-reps", "1", "--tp-size", "2"]
    shootout.main([*common, "--output-dir", str(tmp_path / "tp"), "--backends", "attention:torch_ref",
                   "gemm:torch_ref", "moe:torch_ref"])
    data = json.loads((tmp_path / "tp" / "shootout.json").read_text())
    assert (data["tp_size"], data["ep_size"]) == (2, 1)
    shapes = {kind: {r["shape"] for r in data["rows"] if r["kind"] == kind} for kind in ("attention", "gemm", "moe")}
    assert all(s.endswith(" h2") for s in shapes["attention"])  # 4 heads over 2 ranks
    tiny = preset_config("tiny")
    assert {s.split(" ", 1)[1] for s in shapes["gemm"]} == {f"n{n} k{k}" for n, k in shootout.gemm_shapes(tiny, 2)}
    assert {s.split(" ", 1)[1] for s in shapes["moe"]} == {"e16top4 h256 i64 float32"}  # width 128 / 2, unquantized
    table = SelectionTable.model_validate_json((tmp_path / "tp" / f"{Hardware.detect('cpu').device_key}.json")
                                               .read_text())
    assert (table.tp_size, table.ep_size) == (2, 1)

    shootout.main([*common, "--ep-size", "2", "--kinds", "moe", "--output-dir", str(tmp_path / "ep"),
                   "--backends", "moe:torch_ref"])
    data = json.loads((tmp_path / "ep" / "shootout.json").read_text())
    assert (data["tp_size"], data["ep_size"]) == (2, 2)
    assert {r["shape"].split(" ", 1)[1] for r in data["rows"]} == {"e8of16top4 h256 i128 float32"}  # rank 0's experts


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size 3 must be 1 or --tp-size (2)"),
    (["--tp-size", "3"], "--heads 128 does not split over --tp-size 3"),
    (["--tp-size", "0"], "--tp-size 0 must be at least 1"),
    (["--tp-size", "256", "--heads", "256"],
     "--tp-size 256 --ep-size 1: num_attention_heads 128 does not split over 256"),  # V3's GEMMs
])
def test_parallelism_flags_are_checked_naming_the_flags(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        shootout.main([*flags, "--output-dir", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_moe_models_are_measured_as_published():
    """V3's experts in block-FP8, V2-Lite's in the activation dtype (its checkpoint's, and the tuned bf16 configs')."""
    v3, v2_lite = shootout.moe_specs(torch.bfloat16, 1, 1, quick=False)
    assert v3.is_fp8 and (v3.num_local_experts, v3.intermediate_size) == (256, 2048)
    assert not v2_lite.is_fp8 and (v2_lite.num_local_experts, v2_lite.intermediate_size) == (64, 1408)


def test_expert_weights_in_the_specs_format():
    spec = preset_config("tiny").moe_spec(torch.bfloat16)
    w13, w2 = shootout.expert_weights(spec, torch.device("cpu"))
    assert w13.shape == (16, 256, 256) and w2.shape == (16, 256, 128) and w13.dtype == w2.dtype == torch.bfloat16
    fp8 = preset_config("tiny").quantized_fp8().moe_spec(torch.bfloat16)
    q13, q2, s13, s2 = shootout.expert_weights(fp8, torch.device("cpu"))
    assert q13.dtype == q2.dtype == torch.float8_e4m3fn and s13.shape == (16, 2, 2) and s2.shape == (16, 2, 1)


def test_from_results_reranks_a_table_without_measuring(tmp_path):
    """An earlier run's shootout.json re-ranks its backends in a table (here b now ahead of a, c kept between)."""
    table, results = tmp_path / "table.json", tmp_path / "shootout.json"
    before = [shootout.Row("gemm", "decode", "m8", b, us, 0, 0, 0, 8, "graph")
              for b, us in [("a", 1), ("c", 2), ("b", 3)]]
    table.write_text(json.dumps(shootout.selection_table(before, "gpu", "first run")))
    rows = [shootout.Row("gemm", "decode", "m8", b, us, 0, 0, 0, 8, "graph") for b, us in [("a", 5), ("b", 4)]]
    results.write_text(json.dumps({"device": "gpu", "command": "second run", "tp_size": 1, "ep_size": 1,
                                   "rows": [dataclasses.asdict(r) | {"wrapper_overhead": None} for r in rows]}))
    shootout.main(["--from-results", str(results), "--merge-into", str(table)])
    merged = SelectionTable.model_validate_json(table.read_text())
    assert merged.order("gemm", Phase.DECODE, 8) == ["b", "c", "a"]
    assert "second run" in merged.source
    with pytest.raises(SystemExit):
        shootout.main(["--from-results", str(results)])


def test_attention_decode_rows_with_an_fp8_kv_cache(tmp_path, capsys):
    """--kv-cache-dtype auto fp8_e4m3: decode rows for both caches, the fp8 ones reading one byte a cached value;
    prefill rows once. Not merged into a selection table."""
    shootout.main(["--quick", "--device", "cpu", "--dtype", "float32", "--heads", "4", "--page-size", "16",
                   "--warmup", "0", "--reps", "1", "--reference-reps", "1", "--output-dir", str(tmp_path),
                   "--kinds", "attention", "--backends", "attention:torch_ref", "--kv-cache-dtype", "auto", "fp8_e4m3"])
    rows = {row["shape"]: row for row in json.loads((tmp_path / "shootout.json").read_text())["rows"]}
    decode = [shape for shape in rows if shape.startswith("decode")]
    assert sorted(decode) == ["decode b1 kv64 h4", "decode b1 kv64 h4 fp8kv", "decode b4 kv256 h4",
                              "decode b4 kv256 h4 fp8kv"]
    assert len(rows) == len(decode) + 2  # the two prefill rows, once
    fp8, wide = rows["decode b4 kv256 h4 fp8kv"], rows["decode b4 kv256 h4"]
    assert fp8["gbps"] * fp8["us"] * 4 == pytest.approx(wide["gbps"] * wide["us"])  # bytes: 1 vs 4 (float32)
    with pytest.raises(SystemExit):
        shootout.main(["--output-dir", str(tmp_path), "--merge-into", str(tmp_path / "t.json"),
                       "--kv-cache-dtype", "fp8_e4m3"])
    assert "--merge-into ranks the default KV cache" in capsys.readouterr().err


COMM_PLUGIN = """
import time
from typing import ClassVar

import torch

from plugserve.core.interfaces import CommCapabilities
from plugserve.plugins.comm.torch_ref import TorchDistributedAllReduce
from plugserve.registry import hookimpl


class SlowSums(TorchDistributedAllReduce):
    '''A correct sum of messages up to 8 KiB, then a nap: slower than torch_ref, even on a loaded machine.'''

    name: ClassVar[str] = "slow_sums"
    capabilities: ClassVar[CommCapabilities] = CommCapabilities(
        dtypes=frozenset({torch.float32}), devices=frozenset({"cpu"}), max_bytes={2: 8 << 10})

    def all_reduce(self, x):
        time.sleep(0.02)
        return super().all_reduce(x)


class WrongSums(TorchDistributedAllReduce):
    '''Off by one past the start-up check's 32 KiB: only the shootout's check of every size finds it.'''

    name: ClassVar[str] = "wrong_sums"

    def all_reduce(self, x):
        out = super().all_reduce(x)
        return out + 1 if x.numel() * x.element_size() > 32 << 10 else out


@hookimpl
def plugserve_backends():
    return [SlowSums, WrongSums]
"""


def test_comm_shootout_ranks_all_reduces_per_world_and_size_and_drops_wrong_sums(tmp_path, make_plugin, capsys):
    """Two gloo ranks: torch_ref and a slower fake at the size it takes, torch_ref alone above it, the fake that sums
    wrong reported and not ranked; rows without a limit, the table's comm buckets merged by order."""
    make_plugin("plugserve-test-comm", "test_comm_backends", COMM_PLUGIN)
    shootout.main(["--kinds", "comm", "--backends", "comm:torch_ref", "comm:slow_sums", "comm:wrong_sums", "--quick",
                   "--device", "cpu", "--dtype", "float32", "--warmup", "1", "--reps", "2", "--output-dir",
                   str(tmp_path)])
    out = capsys.readouterr().out
    assert "comm at 2 ranks, not ranked: wrong_sums at 8 x 2048: its sum differs" in out
    assert "auto's order at 2 ranks: up to 8 KiB: torch_ref > slow_sums; above: torch_ref" in out
    data = json.loads((tmp_path / "shootout.json").read_text())
    rows = {(r["shape"], r["backend"]): r for r in data["rows"]}
    assert set(rows) == {("w2 8 KiB t1 h2048", "torch_ref"), ("w2 8 KiB t1 h2048", "slow_sums"),
                         ("w2 64 KiB t8 h2048", "torch_ref")}
    assert all(r["fraction_of_limit"] is None and r["world"] == 2 and r["timing"] == "wall" for r in rows.values())
    assert rows["w2 8 KiB t1 h2048", "slow_sums"]["us"] > 20000 and rows["w2 64 KiB t8 h2048", "torch_ref"][
        "message_bytes"] == 64 << 10
    assert data["ceilings"] == {}  # comm alone measures no ceiling
    assert "| comm | any | w2 8 KiB t1 h2048 | slow_sums |" in (tmp_path / "shootout.md").read_text()
    table = SelectionTable.model_validate_json((tmp_path / f"{Hardware.detect('cpu').device_key}.json").read_text())
    assert [(b.max_bytes, b.order) for b in table.comm_buckets(2)] == [(8 << 10, ["torch_ref", "slow_sums"]),
                                                                      (64 << 10, ["torch_ref"])]
    assert table.rankings == {}


def test_merge_into_merges_comm_buckets_and_keeps_the_tables_other_rankings(tmp_path):
    """A comm run re-ranks its worlds (its backends where they stood), keeps the others' and every kind's rankings,
    and merges into a table of any tp size (an all-reduce is not a rank's shape)."""
    cpu = Hardware.detect("cpu").name
    path = tmp_path / "table.json"
    table = shootout.selection_table([shootout.Row("gemm", "decode", "m1", "g", 1, 0, 0, 0, 1, "graph")], cpu, "gemm",
                                     tp_size=8)
    path.write_text(json.dumps(table | {"comm": {"4": [{"max_bytes": 1 << 20, "order": ["sym", "torch_ref"]}],
                                                 "2": [{"max_bytes": 16 << 10, "order": ["sym", "other", "torch_ref"]},
                                                       {"max_bytes": 1 << 20, "order": ["torch_ref"]}]}}))

    def row(backend: str, n_bytes: int, us: float) -> shootout.Row:
        return shootout.Row("comm", "any", f"w2 {n_bytes}", backend, us, 0, 0, None, 1, "graph", world=2,
                            message_bytes=n_bytes)

    measured = [row("sym", 4 << 10, 2), row("torch_ref", 4 << 10, 1), row("sym", 16 << 10, 1),
                row("torch_ref", 16 << 10, 3), row("torch_ref", 4 << 20, 9)]
    shootout.merge_rankings(path, shootout.selection_table(measured, cpu, "comm run"))
    merged = SelectionTable.model_validate_json(path.read_text())
    assert [(b.max_bytes, b.order) for b in merged.comm_buckets(2)] == [
        (4 << 10, ["torch_ref", "other", "sym"]), (16 << 10, ["sym", "other", "torch_ref"]),
        (4 << 20, ["torch_ref"])]
    assert [(b.max_bytes, b.order) for b in merged.comm_buckets(4)] == [(1 << 20, ["sym", "torch_ref"])]
    assert merged.order("gemm", Phase.DECODE, 1) == ["g"] and merged.tp_size == 8 and "comm run" in merged.source
