import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from plugserve.backends_report import describe, print_report
from plugserve.cli import main
from plugserve.core.hardware import Hardware
from plugserve.core.names import KINDS
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.registry import TABLES_ENV, get_registry
from tests.imports import imported_after


def test_backends_json_lists_reference_backends_and_auto_picks(capsys):
    assert main(["backends", "--json", "--explain"]) == 0
    report = json.loads(capsys.readouterr().out)
    usable = {(b["kind"], b["name"]) for b in report["backends"] if b["available"]}
    assert {("attention", "torch_ref"), ("gemm", "torch_ref"), ("moe", "torch_ref")} <= usable
    picks = {(r["kind"], r["phase"], r["max_batch_size"]): r["backend"] for r in report["auto"]}
    assert picks[("gemm", "decode", 1)] is not None
    assert report["gemm_moe_rows"].startswith("gemm and moe: serve runs a call of M rows (tokens) on the decode pick")
    methods = [row["method"] for row in report["mla_dispatch"]["examples"]]
    assert methods == ["MHA", "MLA", "MHA", "MHA_CHUNKED_KV", "MLA", "MLA", "MLA"]
    kv_cache = {b["name"]: b["kv_cache"] for b in report["backends"] if b["kind"] == "attention"}
    assert kv_cache["torch_ref"] == "the activation dtype, bfloat16, float16, float32, float8_e4m3fn"
    assert kv_cache["triton"] == "the activation dtype, float8_e4m3fn"
    assert kv_cache["flashmla"].startswith("the activation dtype only (FlashMLA's dense decode reads bf16 only")
    invariant = {(b["kind"], b["name"]): b["batch_invariant"] for b in report["backends"]}
    assert invariant[("attention", "torch_ref")] == invariant[("moe", "torch_ref")] == "yes"
    assert invariant[("attention", "triton")] == invariant[("gemm", "triton")] == invariant[("moe", "triton")] == "yes"
    assert invariant[("gemm", "deepgemm")] == "no: DeepGEMM picks its block sizes by M"


def test_backends_table_and_kind_filter(capsys):
    assert main(["backends", "--kind", "moe"]) == 0
    out = capsys.readouterr().out
    assert "torch_ref" in out and "auto selection" in out and "attention" not in out


def test_backends_say_which_were_verified_only_against_stand_ins_of_their_library(capsys):
    """cutlass_mla (sm100) and fa3_mla (FA3's qv kernels) never ran on a GPU lent: their tests check them through a
    fake FlashInfer and a fake flash_attn_interface, and `backends` says so; every other built-in passed the kit
    against the oracle, on a GPU (torch_ref, the oracle's own backend, and gather_sum, not run on GPUs yet, on the
    CPU)."""
    assert main(["backends", "--json"]) == 0
    verified = {(b["kind"], b["name"]): b["verified"] for b in json.loads(capsys.readouterr().out)["backends"]}
    assert {key for key, where in verified.items() if where == "stand-ins"} == {("attention", "cutlass_mla"),
                                                                                 ("attention", "fa3_mla")}
    assert {key for key, where in verified.items() if where == "cpu"} == {(kind, "torch_ref") for kind in KINDS} | {
        ("comm", "gather_sum")}
    assert set(verified.values()) == {"gpu", "cpu", "stand-ins"}
    assert main(["backends", "--kind", "attention"]) == 0
    out = capsys.readouterr().out
    assert "stand-ins only" in next(line for line in out.splitlines() if "cutlass_mla" in line)
    assert "stand-ins: only against hand-written stand-ins of its library" in " ".join(out.split())

    class Claims(TorchRefAttention):
        verified = "somewhere"

    with pytest.raises(TypeError, match=r"Claims\.verified is 'somewhere', not one of"):
        Claims.check_declaration()


def test_broken_plugin_is_reported_and_the_command_still_succeeds(make_plugin):
    folder = make_plugin("broken-kernels", "broken_kernels_mod", "import this_module_does_not_exist\n")
    result = subprocess.run(
        [sys.executable, "-m", "plugserve", "backends", "--json"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(folder)}, check=False,
    )
    assert result.returncode == 0, result.stderr
    [broken] = json.loads(result.stdout)["broken_plugins"]
    assert broken["package"] == "broken-kernels"
    assert "No module named 'this_module_does_not_exist'" in broken["error"]


def test_unknown_kind_is_a_usage_error_naming_the_choices(capsys):
    try:
        main(["backends", "--kind", "conv"])
    except SystemExit as exit_:
        assert exit_.code == 2
    err = capsys.readouterr().err
    assert "--kind: invalid choice: 'conv'" in err and all(k in err for k in ("attention", "gemm", "moe"))


def test_serve_rejects_a_bad_flag_value_naming_the_flag(capsys):
    for argv, expected in [
        (["--max-running-requests", "0"], "--max-running-requests"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: invalid choice: 'int8' (choose from 'auto', 'bfloat16'"),
        (["--tp-size", "3", "--nnodes", "2"], "--tp-size 3 does not split over --nnodes 2"),
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr"),
        (["--tp-size", "4", "--ep-size", "2"], "--ep-size 2 must be 1 or --tp-size (4)"),
        (["--dtype", "fp64"], "--dtype: invalid choice: 'fp64'"),
    ]:
        try:
            main(["serve", *argv])
        except SystemExit as exit_:
            assert exit_.code == 2
        assert expected in capsys.readouterr().err


def test_serve_with_an_unusable_backend_lists_the_usable_ones():
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--decode-attention-backend", "flashmla_missing"])
    message = str(exit_.value)
    assert "--decode-attention-backend" in message and "registered: " in message and "torch_ref" in message


def test_random_seed_is_sglangs_spelling_of_seed():
    import argparse

    from plugserve.server.launch import add_server_args, server_args_from

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from(parser.parse_args(["--random-seed", "7"]), parser).seed == 7
    assert server_args_from(parser.parse_args(["--seed", "8"]), parser).seed == 8


def test_explain_names_the_table_used_and_why(tmp_path, monkeypatch, capsys):
    table = {"device_name": "NVIDIA H200", "tp_size": 8, "rankings": {}}
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))
    gh200 = Hardware("cuda", "NVIDIA GH200 480GB", (9, 0), 96 * 2**30, 132)
    report = describe(get_registry(), gh200, ["moe"], explain=True)
    assert report["selection_table"] == {
        "path": str(tmp_path / "NVIDIA_H200.json"),
        "reason": "no selection table for NVIDIA GH200 480GB; using NVIDIA_H200, the closest measured "
                  "(H200: the nearest measured family to the GH200, same sm90)",
        "tp_size": 8,
        "ep_size": 1,
    }
    print_report(report, explain=True, console=Console(width=300))
    out = capsys.readouterr().out
    assert "Selection table: " + str(tmp_path / "NVIDIA_H200.json") in out and "shapes of tp 8, ep 1)" in out


def test_help_imports_neither_torch_nor_transformers():
    """`plugserve --help` and `plugserve serve --help` answer at once: the heavy imports wait for a command."""
    code = ("from plugserve.cli import build_parser\nfor argv in (['--help'], ['serve', '--help']):\n"
            "    try:\n        build_parser().parse_args(argv)\n    except SystemExit:\n        pass")
    assert imported_after(code, ("torch", "transformers")) == []


def test_backends_show_the_measured_all_reduce_order_per_world_or_say_it_is_declared(tmp_path, monkeypatch, capsys):
    """Worlds the table ranks: their buckets with the backends usable here (symmetric_memory is not, on the CPU),
    torch_ref last; the other worlds, or a table without comm, by declared priority, saying why."""
    table = {"device_name": "cpu", "rankings": {}, "comm": {"2": [
        {"max_bytes": 16 << 10, "order": ["symmetric_memory", "torch_ref"]},
        {"max_bytes": 1 << 20, "order": ["torch_ref", "symmetric_memory"]}], "4": [
        {"max_bytes": 1 << 20, "order": ["torch_ref"]}]}}
    (tmp_path / "cpu.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))
    assert main(["backends", "--kind", "comm", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["comm_measured"]
    assert measured["table"] == "cpu.json" and list(measured["worlds"]) == ["2", "4"]
    assert measured["worlds"]["2"] == [{"max_bytes": 16 << 10, "order": ["torch_ref"]},
                                       {"max_bytes": 1 << 20, "order": ["torch_ref"]}]
    report = describe(get_registry(), Hardware.detect("cpu"), ["comm"], explain=True)
    report["comm_measured"]["worlds"]["2"][0]["order"].insert(0, "fast")  # as where a faster one is usable
    print_report(report, explain=True, console=Console(width=400))
    out = capsys.readouterr().out
    assert "all-reduce order at 2 ranks, measured (cpu.json): up to 16 KiB: fast > torch_ref; above: torch_ref" in out
    assert "all-reduce order at 4 ranks, measured (cpu.json): any size: torch_ref" in out
    assert ("all-reduce chain of other worlds (auto, by declared priority: cpu.json ranks all-reduces at 2, 4 ranks "
            "only; --all-reduce-backend names one): torch_ref (any size)") in out
    (tmp_path / "cpu.json").write_text(json.dumps(table | {"comm": {}}))
    assert main(["backends", "--kind", "comm", "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "all-reduce order" not in out
    assert "all-reduce chain (auto, by declared priority: cpu.json ranks no all-reduce;" in out
