"""Compiling a cold start's kernels ahead (`precompile`): when the processes start, what they run (a replica's share
of the warm-up, its backends unchecked), the marker that skips them later, and on a GPU that the server's own
warm-up then compiles nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from plugserve.core.loader import read_config
from plugserve.runtime import backends, precompile, warmup
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.server_args import ServerArgs


@pytest.fixture
def gpu_files(tmp_path, monkeypatch) -> Path:
    """A driver folder naming one GPU, as /proc/driver/nvidia/gpus does."""
    gpus = tmp_path / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    (gpus / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\n")
    monkeypatch.setattr(precompile, "NVIDIA_GPUS", gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return gpus


def test_gpu_model_from_the_driver_files_and_none_without_a_gpu(gpu_files, tmp_path, monkeypatch):
    assert precompile.gpu_model("auto") == "NVIDIA H200"
    assert precompile.gpu_model("cpu") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert precompile.gpu_model("auto") is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(precompile, "NVIDIA_GPUS", tmp_path / "absent")
    assert precompile.gpu_model("cuda") is None


def test_marker_follows_the_flags_and_the_gpu_not_the_address(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    args = ServerArgs(model_preset="tiny")
    marker = precompile.compiled_marker(args, "NVIDIA H200")
    assert marker.parent == tmp_path
    assert precompile.compiled_marker(args.model_copy(update={"port": 31000}), "NVIDIA H200") == marker
    assert precompile.compiled_marker(args.model_copy(update={"max_running_requests": 7}), "NVIDIA H200") != marker
    assert precompile.compiled_marker(args, "NVIDIA H100 80GB HBM3") != marker


def test_no_processes_on_the_cpu_with_several_ranks_or_after_an_earlier_start(gpu_files, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    spawned: list[object] = []
    monkeypatch.setattr(precompile.multiprocessing, "get_context", lambda method: spawned.append(method))
    args = ServerArgs(model_preset="tiny")
    for case in (args.model_copy(update={"device": "cpu"}), args.model_copy(update={"skip_server_warmup": True})):
        precompile.start(case)
    precompile.compiled_marker(args, "NVIDIA H200").touch()
    precompile.start(args)
    assert spawned == []
    precompile.wait()  # nothing started: returns at once


class Exited:
    """A compiling process that has ended with `exitcode`, as `wait` sees it."""

    def __init__(self, exitcode: int) -> None:
        self.name, self.exitcode = f"compile-{exitcode}", exitcode

    def join(self, timeout: float) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def test_a_failed_process_leaves_no_marker_and_says_so(tmp_path, monkeypatch, caplog):
    marker = tmp_path / "marker"
    monkeypatch.setattr(precompile, "pending_marker", marker)
    monkeypatch.setattr(precompile, "processes", [Exited(0), Exited(1)])
    with caplog.at_level(logging.WARNING, logger=precompile.__name__):
        precompile.wait()
    assert not marker.exists()
    assert "compile-1 (exit code 1)" in caplog.text
    monkeypatch.setattr(precompile, "processes", [Exited(0)])
    precompile.wait()
    assert marker.exists() and precompile.processes == []


def test_no_room_beside_the_weights_is_said_and_not_retried(tmp_path, monkeypatch, caplog):
    marker = tmp_path / "marker"
    monkeypatch.setattr(precompile, "pending_marker", marker)
    monkeypatch.setattr(precompile, "processes", [Exited(precompile.NO_ROOM)])
    with caplog.at_level(logging.INFO, logger=precompile.__name__):
        precompile.wait()
    assert marker.exists() and "no room on the GPU" in caplog.text and "failed" not in caplog.text


def test_gpu_share_leaves_the_servers_weights_and_reserve(monkeypatch):
    config, _ = read_config(None, "deepseek-v2-lite")
    gib = 2**30
    weights = 29.26 * gib  # its bfloat16 parameters, as the meta device counts them

    def free(total: float, used: float = 0.0) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(total - used), int(total)))

    free(141 * gib)  # an H200 before the server loads: (141 GiB - weights - 10 %) / 8 - 1 GiB each
    share = precompile.gpu_share(config, torch.bfloat16, 8)
    assert share is not None and share * 141 * gib == pytest.approx((141 * gib - weights - 14.1 * gib) / 8 - gib,
                                                                    rel=1e-3)
    free(40 * gib)  # a 40 GB GPU: what the weights leave is under MIN_SHARE_BYTES a process
    assert precompile.gpu_share(config, torch.bfloat16, 8) is None
    free(141 * gib, used=120 * gib)  # another tenant's memory counts too
    assert precompile.gpu_share(config, torch.bfloat16, 1) is None


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_process_on_a_gpu_takes_its_share_then_warms_a_replica_up(device, monkeypatch):
    """`compile_share`'s path on a GPU, its CUDA calls faked: the share set as the process's memory fraction, then a
    runner over a dense and a MoE layer with random weights and a pool as wide as the block table, its part of the
    warm-up; no share, no runner."""
    from plugserve.runtime import model_runner

    calls: list[object] = []
    monkeypatch.setattr(model_runner, "rank_device", lambda args, rank: torch.device(device))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", str(d))))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: calls.append(("fraction", f)))
    monkeypatch.setattr(model_runner, "ModelRunner", lambda args, self_check: calls.append((args, self_check)))
    monkeypatch.setattr(warmup, "warm_up", lambda runner, part: calls.append(("part", part)))
    monkeypatch.setattr(precompile, "gpu_share", lambda config, dtype, parts: None)
    args = ServerArgs(model_preset="deepseek-v2-lite", load_format="auto")
    with pytest.raises(SystemExit) as ended:
        precompile.compile_share(args, 1, 8)
    assert ended.value.code == precompile.NO_ROOM
    assert calls == ([("device", "cuda:1")] if device == "cuda:1" else [])
    calls.clear()
    monkeypatch.setattr(precompile, "gpu_share", lambda config, dtype, parts: 0.07)
    precompile.compile_share(args, 1, 8)
    fraction, (replica, checked), part = calls[-3:]
    assert fraction == ("fraction", 0.07) and part == ("part", (1, 8)) and checked is False
    assert (replica.num_layers, replica.load_format) == (2, "dummy")  # V2-Lite: one dense layer, then MoE
    assert replica.max_total_tokens > 163840  # its context: the graphs' block tables are as wide


def test_a_replica_builds_its_backends_unchecked(monkeypatch):
    def refuse(backend, phase):
        raise AssertionError("a replica ran a self-check")

    monkeypatch.setattr(backends, "self_check", refuse)
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=512), self_check=False)
    assert runner.backends.model.attention_decode is not None
    with pytest.raises(Exception, match="self-check"):
        ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=512))


def test_a_part_of_the_warm_up_runs_every_nth_shape(monkeypatch):
    ran: list[tuple[str, int]] = []
    for name in ("warm_up_prefill", "warm_up_decode"):
        monkeypatch.setattr(warmup, name, lambda runner, n, _name=name: ran.append((_name, n)))
    runner = ModelRunner(ServerArgs(model_preset="tiny", max_total_tokens=512))
    warmup.warm_up(runner)
    every = list(ran)
    assert len(every) >= 3
    for k in range(2):
        ran.clear()
        warmup.warm_up(runner, part=(k, 2))
        assert ran == every[k::2]


def test_start_spawns_replicas_that_warm_up_and_leave_the_marker(gpu_files, tmp_path, monkeypatch):
    """On the CPU (the driver files faked) the replica's path runs for real in a spawned process: the tiny model
    with a dense and a MoE layer, its share of the warm-up."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "COMPILE_PROCESSES", 1)
    args = ServerArgs(model_preset="tiny", max_total_tokens=512)
    precompile.start(args)
    assert [p.name for p in precompile.processes] == ["compile-0"]
    precompile.wait()
    assert precompile.compiled_marker(args, "NVIDIA H200").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_warm_up_finds_every_kernel_compiled(tmp_path):
    """In a fresh process with an empty Triton cache: the compiling processes, then the runner (waiting for them
    before it sizes the memory, as the engine's does) and its warm-up, which must add nothing to the cache."""
    script = textwrap.dedent("""
        import os, sys
        from plugserve.runtime import precompile, warmup
        from plugserve.runtime.model_runner import ModelRunner
        from plugserve.runtime.server_args import ServerArgs
        args = ServerArgs(model_preset="tiny", cuda_graph_max_bs=8)
        precompile.start(args)
        assert precompile.processes, "no compiling processes started"
        runner = ModelRunner(args, before_sizing=precompile.wait)
        cache = sys.argv[1]
        before = set(os.listdir(cache))
        warmup.warm_up(runner)
        print("NEW", sorted(set(os.listdir(cache)) - before))
    """)
    cache = tmp_path / "triton"
    cache.mkdir()
    result = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NEW []" in result.stdout, result.stdout[-3000:]
