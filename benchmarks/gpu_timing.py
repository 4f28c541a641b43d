"""Kernel timing as serving runs kernels: replayed from a CUDA graph (no host launch overhead, as in the
decode graphs) with a cold L2 (in a model's step every layer's weights evict the previous layer's, so a
weight-streaming kernel never finds its operands cached). The tuning scripts time their candidates with it.
"""

from __future__ import annotations

import statistics
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
