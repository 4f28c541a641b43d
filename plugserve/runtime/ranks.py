"""Tensor-parallel ranks as processes. Rank 0 is the Engine's process (HTTP, tokenizer, scheduler,
sampling); every other rank is a worker process whose `ModelRunner` follows rank 0's forwards.

Node n of --nnodes runs ranks [n k, (n + 1) k), k = tp_size / nnodes (node 0's first is rank 0), each
on its own device; all join one torch.distributed world at --dist-init-addr (one node without it: a free
local port). Workers are spawned (CUDA cannot be forked) and end with the process that started them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from plugserve.core.distributed import (
    ParallelGroup,
    init_parallel_group,
    joined_nccl_world,
    leave_parallel_group,
    rendezvous_store,
)
from plugserve.runtime.model_runner import ModelRunner, rank_device
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative import build_runner, follow
from plugserve.runtime.warmup import warm_up

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # for workers to leave once released, before they are killed


def init_address(args: ServerArgs) -> str:
    """The world's rendezvous, "tcp://host:port": --dist-init-addr, else port 0 on this host (rank 0's store binds a
    free one: `rendezvous_store`)."""
    return f"tcp://{args.dist_init_addr or '127.0.0.1:0'}"


def start_workers(args: ServerArgs, address: str) -> dict[int, BaseProcess]:
    """This node's ranks but rank 0, each a started worker process, by rank."""
    context = mp.get_context("spawn")
    first = args.node_rank * args.ranks_per_node
    workers = {rank: context.Process(target=_worker_main, args=(rank, args, address), name=f"plugserve-rank{rank}",
                                     daemon=True)
               for rank in range(max(first, 1), first + args.ranks_per_node)}
    for process in workers.values():
        process.start()
    return workers


def _worker_main(rank: int, args: ServerArgs, address: str) -> None:
    _exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    group = init_parallel_group(rank, args.tp_size, address, rank_device(args, rank), one_host=args.nnodes == 1)
    runner = build_runner(args, group)
    warm_up(runner)
    follow(runner)
    # Released: leave at once. NCCL's process-group teardown waits on the other ranks (and was seen hanging with
    # CUDA graphs alive); rank 0 aborts its side instead (`Ranks.stop`).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """End this process when the one that started it ends, however it ends (a kill leaves no one to
    release this rank, which would wait in its next collective until the timeout)."""
    parent = mp.parent_process()
    assert parent is not None, "a worker is a child process"

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="plugserve-parent-watch", daemon=True).start()


def first_exit(workers: dict[int, BaseProcess], stopping: threading.Event) -> tuple[int, int | None] | None:
    """Wait until a worker exits: (its rank, its exit code); None once `stopping` is set first."""
    by_sentinel = {process.sentinel: rank for rank, process in workers.items()}
    while not stopping.is_set():
        ready = wait(list(by_sentinel), timeout=0.2)
        if ready:
            rank = by_sentinel[ready[0]]  # type: ignore[index]
            workers[rank].join()
            return rank, workers[rank].exitcode
    return None


class Ranks:
    """Rank 0's side of a tensor-parallel world: this node's workers, started, and the world joined.
    `watch(on_exit)` reports a worker that exits before `stop` ("tensor-parallel rank 1 exited ...")."""

    def __init__(self, args: ServerArgs) -> None:
        if joined_nccl_world():
            raise RuntimeError("this process already ran a multi-GPU engine, whose NCCL world lives until the process "
                               "exits: start each multi-GPU engine in its own process")
        store = rendezvous_store(init_address(args), 0, args.tp_size)  # bound before the workers look for it
        address = f"tcp://{store.host}:{store.port}"
        self.workers = start_workers(args, address)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            self.group: ParallelGroup = init_parallel_group(0, args.tp_size, address, rank_device(args, 0),
                                                            one_host=args.nnodes == 1, store=store)
        except BaseException:
            self.stop(None)
            raise

    def watch(self, on_exit: Callable[[str], None]) -> None:
        def run() -> None:
            exited = first_exit(self.workers, self._stopping)
            if exited is not None and not self._stopping.is_set():
                rank, code = exited
                on_exit(f"tensor-parallel rank {rank} exited (exit code {code}): the model cannot run without it")

        self._watcher = threading.Thread(target=run, name="plugserve-rank-watch", daemon=True)
        self._watcher.start()

    def stop(self, runner: ModelRunner | None) -> None:
        """Release the workers through `runner` (None: they cannot be released, e.g. the forwards broke off),
        wait for them to exit, kill those left, and leave the world (NCCL's: at this process's exit, see
        `leave_parallel_group`)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()  # one thread at a time waits on the workers
        released = False
        if runner is not None:
            with contextlib.suppress(Exception):  # a worker already gone: the others are killed below
                runner.release_followers()
                released = True
        for process in self.workers.values():
            process.join(STOP_TIMEOUT_S if released else 0)
            if process.is_alive():
                process.kill()
                process.join()
        leave_parallel_group()


def run_node(args: ServerArgs) -> str | None:
    """Node --node-rank > 0: its ranks as workers, until they end. None when all ended well, else why not
    (the others are killed: the world cannot go on without one of its ranks)."""
    workers, never = start_workers(args, init_address(args)), threading.Event()
    while workers:
        exited = first_exit(workers, never)
        assert exited is not None, "only `stopping` ends the wait without an exit"
        rank, code = exited
        del workers[rank]
        if code != 0:
            for process in workers.values():
                process.kill()
            return f"tensor-parallel rank {rank} exited (exit code {code})"
    return None
