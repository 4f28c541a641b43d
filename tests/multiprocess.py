"""Runs a test function on several ranks: spawned processes joined over gloo on the CPU, or over NCCL with rank r
on cuda:r; or in one spawned process of its own (`run_in_process`: a multi-GPU engine, whose NCCL world lives until
its process exits); `multi_gpu(n)` marks a test that needs n GPUs."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import pytest
import torch
import torch.multiprocessing as mp

from plugserve.core.distributed import destroy_parallel_group, init_parallel_group, pick_free_port, spawn_joined

# Short enough that a collective whose peer never comes fails the test quickly, long enough for a rank
# that is slow to start on a loaded 2-core machine.
COLLECTIVE_TIMEOUT_S = 15.0
JOIN_TIMEOUT_S = 60.0
F = TypeVar("F", bound=Callable[..., Any])


def multi_gpu(count: int) -> list[pytest.MarkDecorator]:
    """The marks of a test that needs `count` GPUs: `multigpu` (`pytest -m multigpu` selects them on a lent
    machine of several GPUs), and a skip where fewer are visible. For `pytest.param(..., marks=...)`."""
    return [pytest.mark.multigpu, pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} GPUs")]


def needs_gpus(count: int) -> Callable[[F], F]:
    """Decorates a test with `multi_gpu(count)`'s marks."""
    def mark(test: F) -> F:
        for decorator in multi_gpu(count):
            test = decorator(test)
        return test

    return mark


def _rank_main(rank: int, fn: Callable[..., None], world_size: int, init_method: str, device: str,
               timeout_s: float, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    group = init_parallel_group(rank, world_size, init_method, f"cuda:{rank}" if device == "cuda" else device,
                                timeout_s=timeout_s)
    try:
        fn(group, *args)
    finally:
        destroy_parallel_group()


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2, device: str = "cpu",
              timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """fn(group: ParallelGroup, *args) on `world_size` spawned ranks (fn and args must pickle: a module-level
    function), on the CPU or (`device` "cuda") rank r on cuda:r. `timeout_s`: the world's collective timeout. A
    rank's exception fails the test with its traceback; ranks that outlast JOIN_TIMEOUT_S are killed and the test
    fails."""
    init_method = f"tcp://127.0.0.1:{pick_free_port()}"
    try:
        spawn_joined(_rank_main, (fn, world_size, init_method, device, timeout_s, args), world_size, JOIN_TIMEOUT_S,
                     "ranks")
    except TimeoutError as exc:
        pytest.fail(str(exc))


def _returning(fn: Callable[..., Any], args: tuple[Any, ...], results: Connection) -> None:
    try:
        results.send((True, fn(*args)))  # a pipe's send is done when it returns (a Queue's put is not)
    except BaseException:
        results.send((False, traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no NCCL teardown at exit (docs/parallelism.md, "Leaving")


def run_in_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> Any:
    """fn(*args) in a spawned process of its own, and its return value (fn, args and the value must pickle). Its
    exception fails the test with its traceback; a process that outlasts `timeout_s` is killed and the test fails."""
    context = mp.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_returning, args=(fn, args, writer))
    process.start()
    writer.close()
    try:
        if not reader.poll(timeout_s):
            pytest.fail(f"{fn.__name__} still running after {timeout_s} s")
        ok, value = reader.recv()
    except EOFError:
        pytest.fail(f"{fn.__name__}'s process ended without an answer")
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    if not ok:
        pytest.fail(f"{fn.__name__} failed in its process:\n{value}")
    return value
