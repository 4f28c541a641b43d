"""Kernel timing as serving runs kernels: replayed from a CUDA graph (no host launch overhead, as in the
decode graphs) with a cold L2 (in a model's step every layer's weights evict the previous layer's, so a
weight-streaming kernel never finds its operands cached). The tuning scripts time their candidates with it.
And the memory ceilings their "fraction of the limit" divides by: the read rate (a read-only stream, what
weight-streaming kernels do; a copy runs slower) and the copy rate (read + write), measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# Larger than any GPU's L2 (H100 50 MB, H200 60 MB, B200 126 MB).
FLUSH_BYTES = 256 << 20


def time_cold_graph_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of one replay of fn captured in a CUDA graph, L2 flushed before each replay (the
    flush is outside the timed events). Raises what capture or launch raises (a configuration that does
    not compile here, or fn that cannot be captured)."""
    for _ in range(warmup):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # the side-stream warm-up capture expects
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_gbps(device: torch.device, n_bytes: int, warmup: int = 3, reps: int = 10) -> float:
    """GB/s of reading `n_bytes` once (a bfloat16 tensor reduced to one value by `sum` and by `amax`; the faster
    of the two): the ceiling of a kernel that streams its operands, which a copy's rate understates."""
    src = torch.ones(n_bytes // 2, dtype=torch.bfloat16, device=device)
    seconds = min(_median_seconds(lambda: src.sum(dtype=torch.float32), device, warmup, reps),
                  _median_seconds(lambda: src.amax(), device, warmup, reps))
    return n_bytes / seconds / 1e9


def memory_ceilings(device: torch.device, n_bytes: int) -> dict[str, float]:
    """read_gbps, copy_gbps and memory_gbps, the faster of the two: the limit of a kernel's bytes. Whichever stream
    a GPU runs faster bounds the achievable rate from below (on an H200 the copy's read + write measured faster than
    torch's reductions read), so a limit with the slower one could be beaten."""
    read, copy = read_gbps(device, n_bytes), copy_gbps(device, n_bytes)
    return {"read_gbps": read, "copy_gbps": copy, "memory_gbps": max(read, copy)}


def copy_gbps(device: torch.device, n_bytes: int, warmup: int = 3, reps: int = 10) -> float:
    """GB/s of copying `n_bytes`, counting the read and the write (2 * n_bytes moved): the ceiling of read + write
    work, beside read_gbps."""
    src = torch.ones(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_seconds(lambda: dst.copy_(src), device, warmup, reps) / 1e9
