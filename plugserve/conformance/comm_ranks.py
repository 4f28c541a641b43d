"""The kit's ranks for comm backends: `world` processes spawned and joined over gloo (CPU) or NCCL (rank r on
cuda:r), each building the backend under test on the world's group and checking its sums against the oracle,
eagerly and, where the backend declares CUDA graphs, in graph replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plugserve.conformance.tolerances import assert_close
from plugserve.core.distributed import destroy_parallel_group, init_parallel_group, pick_free_port, spawn_joined
from plugserve.core.interfaces import CommBackend
from plugserve.core.specs import CommSpec

WORLDS = (2, 4)  # the ranks of a node's tensor-parallel groups that backends declare bounds for
TIMEOUT_S = 120.0  # a rank that never comes fails the case rather than hang it
# Rows x hidden: a decode step of one token to a prefill chunk's, odd widths among them.
SHAPES = [(1, 7), (3, 1024), (16, 2048), (64, 7168)]


def run_ranks(fn: Callable[..., None], world: int, *args: Any, device_type: str, timeout_s: float = TIMEOUT_S) -> None:
    """fn(rank, world, device, *args) on `world` spawned ranks (fn a module-level function); a rank's exception fails
    the caller with its traceback, ranks still running after `timeout_s` (also each collective's bound) are killed."""
    init_method = f"tcp://127.0.0.1:{pick_free_port()}"
    try:
        spawn_joined(_rank_main, (fn, world, init_method, device_type, timeout_s, args), world, timeout_s,
                     "comm ranks")
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def _rank_main(rank: int, fn: Callable[..., None], world: int, init_method: str, device_type: str, timeout_s: float,
               args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    init_parallel_group(rank, world, init_method, device, timeout_s=timeout_s)
    try:
        fn(rank, world, device, *args)
    finally:
        destroy_parallel_group()


def _inputs(shape: tuple[int, ...], world: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Every rank's tensor of `shape` (each rank draws them all: the oracle needs the others')."""
    generator = torch.Generator().manual_seed(shape[0] * 100_003 + shape[1])
    return [torch.randn(shape, generator=generator).to(device, dtype) for _ in range(world)]


def check_sums(rank: int, world: int, device: torch.device, name: str, dtype_name: str) -> None:
    """The comm backend `name` on this rank sums every shape it takes as the oracle (float64 sum of the ranks'
    tensors) does, within the dtype's tolerance; refuses a message past its declared bound; sums each element to
    the same bits in any message where it declares `batch_invariant`; and replays its sum in a CUDA graph on new inputs
    where it declares graphs."""
    from plugserve.registry import get_registry

    dtype = getattr(torch, dtype_name)
    cls: type[CommBackend] = get_registry().get("comm", name).cls  # type: ignore[assignment]
    backend = cls(CommSpec(world, dtype), device)  # type: ignore[call-arg]
    largest = cls.capabilities.largest(world)
    element = torch.empty(0, dtype=dtype).element_size()
    shapes = [s for s in SHAPES if largest is None or s[0] * s[1] * element <= largest]
    if largest is not None:
        shapes.append((1, largest // element))  # its bound, exactly
    if not shapes:
        raise AssertionError(f"{name} takes none of the kit's shapes ({largest} bytes at {world} ranks)")
    for shape in shapes:
        inputs = _inputs(shape, world, dtype, device)
        x = inputs[rank].clone()
        if not backend.takes(x):
            raise AssertionError(f"{name} does not take a {shape} {dtype_name} tensor within its bound")
        out = backend.all_reduce(x)
        assert out.shape == shape and out.dtype == dtype, f"{name}: {tuple(out.shape)} {out.dtype} for {shape}"
        assert_close(out, sum(i.double() for i in inputs), dtype, f"{name} all-reduce of {shape} {dtype_name}")
    if largest is not None:
        beyond = torch.zeros(largest // element + 2, dtype=dtype, device=device)
        assert not backend.takes(beyond), f"{name} takes {beyond.numel() * element} bytes, past its {largest}"
    if cls.capabilities.batch_invariant:
        _check_batch_invariance(cls(CommSpec(world, dtype, batch_invariant=True), device),  # type: ignore[call-arg]
                                max(shapes), dtype, device, rank, world)
    if device.type == "cuda" and cls.capabilities.cuda_graph:
        _check_graph_replay(backend, shapes[0], dtype, device, rank, world)


def _check_batch_invariance(backend: CommBackend, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                            rank: int, world: int) -> None:
    """A backend declaring `batch_invariant`, built for it: each element of a message sums to the same bits in
    messages of every size the kit has, from a few elements to the whole (so that a token's activations do not move
    with the batch around it)."""
    x = _inputs(shape, world, dtype, device)[rank]
    whole = backend.all_reduce(x.clone())
    for rows, cols in [*SHAPES[:-1], (shape[0] // 2, shape[1]), (1, shape[1])]:
        part = backend.all_reduce(x[:rows, :cols].contiguous())
        assert torch.equal(part, whole[:rows, :cols]), (
            f"{backend.name}: a [{rows}, {cols}] corner of a {list(shape)} message sums to other bits alone")


def _check_graph_replay(backend: CommBackend, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        rank: int, world: int) -> None:
    static = torch.zeros(shape, dtype=dtype, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        backend.all_reduce(static.clone())  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.all_reduce(static)
    for step in range(3):
        static.copy_(torch.full(shape, float(rank + step), dtype=dtype, device=device))
        graph.replay()
        torch.cuda.synchronize(device)
        want = float(world * (world - 1) // 2 + world * step)  # the sum over ranks r of r + step
        assert torch.equal(out, torch.full(shape, want, dtype=dtype, device=device)), (
            f"{backend.name}: graph replay {step} summed wrong")
