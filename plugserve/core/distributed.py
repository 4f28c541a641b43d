"""Process groups over torch.distributed: NCCL on GPUs, gloo on the CPU.

A `ParallelGroup` is the set of ranks a layer splits its work over (the tensor-parallel group). Its
collectives return their input untouched at world size 1, so single-device code that goes through
them pays one integer comparison and no communication. Rank 0's batch headers travel host to host, so no rank
waits on its GPU to receive one: as bytes through a shared-memory channel where every rank runs on one host
(`core/shm_broadcast.py`), else, and Python objects always, over a gloo group of the same ranks.
"""

from __future__ import annotations

import bisect
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plugserve.core.interfaces import CommBackend
from plugserve.core.shm_broadcast import ShmChannel

# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call); torch 2.4 has only the old one.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# How long a rank waits for rank 0's next object: as long as the server may sit idle.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class CommRoutes:
    """Which comm backends a sum of b bytes tries, in order, the first that takes it summing: `orders[i]` for the
    first i with b <= `edges[i]`, the last order above the last edge (no edges: `orders[0]` for every size).
    `chain`: every backend built, in the order they were built (each rank built the same ones: collectives)."""

    chain: tuple[CommBackend, ...] = ()
    edges: tuple[int, ...] = ()
    orders: tuple[tuple[CommBackend, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.orders) != max(1, len(self.edges)) and (self.orders or self.edges):
            raise ValueError(f"{len(self.edges)} size edges need as many orders, not {len(self.orders)}")
        if list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"size edges {self.edges} must increase")

    @classmethod
    def declared(cls, chain: tuple[CommBackend, ...]) -> CommRoutes:
        """Every size tries `chain` in its order."""
        return cls(chain, (), (chain,) if chain else ())

    def backends(self, n_bytes: int) -> tuple[CommBackend, ...]:
        """The backends a sum of `n_bytes` bytes tries, in order (a bisect: sums are on the decode hot path)."""
        if not self.orders:
            return ()
        return self.orders[min(bisect.bisect_left(self.edges, n_bytes), len(self.orders) - 1)]


@dataclass(frozen=True)
class ParallelGroup:
    """Rank `rank` of `world_size` ranks. `group`: their torch.distributed process group (None: the
    default group, or no torch.distributed at all at world size 1). `control`: a gloo group of the same
    ranks for `broadcast_object` (None: `group`). `comm`: by message size, the comm backends a sum goes to, the
    first that takes it (none, or none that takes it: `group`'s own all-reduce). `channel`: rank 0's shared-memory
    channel to the others for `broadcast_bytes` (None: the control group)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None
    comm: CommRoutes = CommRoutes()
    channel: ShmChannel | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of size {self.world_size}")

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or `op`) x over the ranks (any shape and dtype, the same on every rank) -> the result: x itself,
        reduced in place, or a new tensor where a comm backend out of place takes it."""
        if self.world_size == 1:
            return x
        if op == dist.ReduceOp.SUM:
            for backend in self.comm.backends(x.numel() * x.element_size()):
                if backend.takes(x):
                    return backend.all_reduce(x)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def with_comm(self, comm: CommRoutes) -> ParallelGroup:
        """This group, its sums through the comm backends `comm` routes them to."""
        return replace(self, comm=comm)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into x on every rank, in place; returns x (the same shape and dtype on every rank)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self._global(0), group=self.group)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable `obj` (what the others pass is ignored), returned on every rank."""
        if self.world_size == 1:
            return obj
        box, control = [obj], self.control if self.control is not None else self.group
        dist.broadcast_object_list(box, src=self._global(0), group=control)
        return box[0]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` (the others pass None) on every rank, without pickling where the ranks share a host."""
        if self.world_size == 1:
            return data  # type: ignore[return-value]
        if self.channel is not None:
            if self.rank == 0 and self.channel.send(data):  # type: ignore[arg-type]
                return data  # type: ignore[return-value]
            if self.rank != 0 and (received := self.channel.receive()) is not None:
                return received
        return self.broadcast_object(data)  # no channel, or too big for its slots

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x [..., n, ...] on each rank -> [..., world_size * n, ...], the ranks' tensors concatenated
        along `dim` in rank order (x itself at world size 1)."""
        if self.world_size == 1:
            return x
        # The collective concatenates along dim 0: gather there, then move the rank blocks into `dim`.
        dim = dim % x.dim()
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((self.world_size * moved.shape[0], *moved.shape[1:]))
        _all_gather_into_tensor(out, moved, group=self.group)
        return out.movedim(0, dim)

    def gather_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x [counts[rank], ...] on each rank (counts the same list on every rank) -> [world_size * m, ...]
        on every rank, m = max(counts): rank r's rows at [r m, r m + counts[r]), zeros after them (one
        all-gather needs equal sizes). x itself at world size 1."""
        if self.world_size == 1:
            return x
        pad = max(counts) - x.shape[0]
        return self.all_gather(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x, dim=0)

    def own_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Of x [world_size * max(counts), ...] laid out as `gather_rows` leaves it, this rank's [counts[rank], ...]."""
        if self.world_size == 1:
            return x
        start = self.rank * max(counts)
        return x[start : start + counts[self.rank]]


def real_rows(counts: Sequence[int], width: int) -> torch.Tensor:
    """[len(counts) * width] bool (CPU): which rows of rows gathered `width` a rank (`ParallelGroup.gather_rows`
    leaves width = max(counts); a CUDA graph its captured size) are some rank's real rows, rank r's first counts[r]."""
    return (torch.arange(width)[None, :] < torch.tensor(counts)[:, None]).flatten()


def unpad_rows(x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Of x [len(counts) * max(counts), ...] laid out as `ParallelGroup.gather_rows` leaves it, every rank's
    real rows in rank order: [sum(counts), ...]."""
    m = max(counts)
    return torch.cat([x[r * m : r * m + n] for r, n in enumerate(counts)])


SINGLE = ParallelGroup()  # one process, no torch.distributed


@dataclass(frozen=True)
class DPGroups:
    """DP attention's groups as one rank sees them, for D groups of A ranks each over a world of D * A (group g: ranks
    [g A, (g + 1) A)). `attention`: the A ranks of this rank's DP group, which split the group's heads (SINGLE at
    A = 1); `rows`: the D ranks at this rank's place in every DP group, its rank this rank's DP group: the MLP's
    `gather_rows` / `own_rows` run over them, so that each group's rows (the same on its A ranks) are gathered once
    and every rank of the world sees every group's."""

    attention: ParallelGroup
    rows: ParallelGroup


def dp_groups(group: ParallelGroup, dp_size: int) -> DPGroups:
    """`group`'s ranks as `dp_size` DP attention groups (`DPGroups`). Collective when a group has several ranks:
    every rank creates every subgroup, in the same order (torch.distributed's rule); none at one rank a group."""
    if group.world_size % dp_size:
        raise ValueError(f"{group.world_size} ranks do not split into {dp_size} DP attention groups")
    per = group.world_size // dp_size
    if per == 1:
        return DPGroups(SINGLE, group)
    attention = [dist.new_group([group._global(g * per + a) for a in range(per)]) for g in range(dp_size)]
    rows = [dist.new_group([group._global(g * per + a) for g in range(dp_size)]) for a in range(per)]
    g, a = divmod(group.rank, per)
    return DPGroups(ParallelGroup(a, per, attention[g]), ParallelGroup(g, dp_size, rows[a]))


def default_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on `device`: "nccl" on CUDA, else "gloo"."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel_group(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device | str,
    backend: str | None = None,
    timeout_s: float = 600.0,
    one_host: bool = True,
    store: dist.TCPStore | None = None,
) -> ParallelGroup:
    """Join the world of `world_size` processes as `rank` and return it as one group.

    `init_method`: "tcp://addr:port" of rank 0's store (every rank, on every node, passes the same one).
    `backend`: None picks `default_backend(device)`. `timeout_s` bounds the rendezvous and, on gloo,
    every collective: a rank that died makes the others fail after it rather than hang. The process
    group is initialized at world size 1 too, so that one rank runs the code path of many. Its
    `control` group waits for objects up to CONTROL_TIMEOUT: a worker waits for the next batch while the
    server idles. `one_host`: every rank runs on this host, so rank 0's bytes go through shared memory. `store`: the
    world's store this process already serves or reaches (`rendezvous_store`), else reached or served now.
    """
    backend = backend or default_backend(device)
    if backend == "nccl":
        # NCCL communicators belong to a device: bind this process's before the first collective ("cuda" alone
        # names the current one).
        device = torch.device(device)
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    store = store or rendezvous_store(init_method, rank, world_size, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    channel = _host_channel(rank, world_size, control) if one_host and world_size > 1 else None
    return ParallelGroup(rank, world_size, dist.group.WORLD, control, channel=channel)


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """The world's key-value store at "tcp://host:port": rank 0 serves it, the other ranks connect to it. Port 0: a
    port the system picks as rank 0 binds it (`TCPStore.port` says which), so no other process can take it between
    the choice and the bind, as it can a port picked free beforehand."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _host_channel(rank: int, world_size: int, control: dist.ProcessGroup) -> ShmChannel:
    """Rank 0's shared-memory channel to the other ranks of its host (collective: rank 0 creates it, the others
    attach by the name it sends)."""
    box: list[str | None] = [None]
    if rank == 0:
        _CHANNELS.append(ShmChannel.create(readers=world_size - 1))
        box = [_CHANNELS[-1].name]
    dist.broadcast_object_list(box, src=0, group=control)
    if rank:
        _CHANNELS.append(ShmChannel.attach(box[0], reader=rank - 1))  # type: ignore[arg-type]
    return _CHANNELS[-1]


_CHANNELS: list[ShmChannel] = []  # this process's, closed when it leaves the world


def _close_channels() -> None:
    while _CHANNELS:
        _CHANNELS.pop().close()


def destroy_parallel_group() -> None:
    """Leave the world joined by `init_parallel_group` (nothing if none was joined). On NCCL every rank must
    call it: each waits for the others."""
    _close_channels()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_parallel_group() -> None:
    """Leave the world without the other ranks (they exited, or died). gloo's groups are destroyed (nothing to wait
    for); NCCL's communicators are left to this process's exit: destroying them waits for ranks that are gone, and
    aborting them hung on the GPUs measured (docs/parallelism.md), so a process joins one NCCL world at most."""
    _close_channels()
    if dist.is_initialized() and not joined_nccl_world():
        dist.destroy_process_group()


def joined_nccl_world() -> bool:
    """Whether this process still holds an NCCL world (left to its exit by `leave_parallel_group`)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a single-node rendezvous (another process may take it before
    rank 0 binds it: callers retry or accept that race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_joined(main: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float, what: str) -> None:
    """main(rank, *args) in `nprocs` spawned processes (never forked: a fork of a process whose OpenMP pool has run
    may hang in the child's first parallel op, and a forked CUDA context is unusable), joined: a process's exception
    is raised here with its traceback; processes still running after `timeout_s` are killed and TimeoutError names
    `what`."""
    import torch.multiprocessing as mp

    context = mp.spawn(main, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{what} still running after {timeout_s} s")
