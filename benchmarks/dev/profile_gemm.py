"""Where a small-M block-FP8 GEMM's time goes: each V3 weight shape's backend call replayed from a CUDA graph with
a cold L2 (as the shootout times it), beside the GPU time of each kernel in it (torch profiler over the same
replays). The difference is what the kernels' boundaries cost: launch latency, grid drain, tails.

    python -m benchmarks.dev.profile_gemm --batch-sizes 1 8 64 --backend triton
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_timing import FLUSH_BYTES, time_cold_graph_ms
from benchmarks.tune.tune_fp8_gemm import V3_SHAPES
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.registry import get_registry


def kernel_times_us(fn, reps: int) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel fn launches, over `reps` graph replays with L2 flushed
    between them (the flush's own kernel left out)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    flush.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        torch.cuda.synchronize()
    flush_names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in flush_names:
            totals[event.name] += event.device_time
    return {name: total / reps for name, total in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None, help="JSON of every row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_gemm times CUDA kernels: run it on a GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    backend = get_registry().get("gemm", args.backend).cls(GemmSpec(dtype=dtype), device)
    rows = []
    for (n, k), role in V3_SHAPES.items():
        packed = backend.prepare(*quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, (128, 128)))
        for m in args.batch_sizes:
            x = torch.randn(m, k, device=device, dtype=dtype)
            call = lambda x=x, packed=packed: backend.apply(x, packed)  # noqa: E731
            total_us = time_cold_graph_ms(call, reps=args.reps) * 1e3
            kernels = kernel_times_us(call, args.reps)
            busy = sum(kernels.values())
            rows.append({"n": n, "k": k, "m": m, "role": role, "total_us": total_us, "kernels_us": kernels})
            detail = ", ".join(f"{name.split('(')[0][:40]} {us:.1f}" for name, us in kernels.items())
            print(f"m{m:<5} n{n:<6} k{k:<6} {total_us:7.1f} us  kernels {busy:6.1f} us  "
                  f"between {total_us - busy:5.1f} us  [{detail}]", flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
