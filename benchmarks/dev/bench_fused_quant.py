"""The "triton" GEMM backend's two ways at small M, per weight shape and batch size M: the quantization kernel then
the GEMM (unfused), against the GEMM quantizing its activation blocks itself (fused, one launch; what `apply` runs up
to FUSED_QUANT_MAX_M rows, plugserve/plugins/gemm/triton.py). Both with the launch config the backend takes for
that shape and M on this GPU (its tuned file, else `default_config`), each replayed from a CUDA graph with a cold L2
(benchmarks/gpu_timing.py, as the tuner times configs). Prints per (N, K, M): unfused us (quantization + GEMM),
fused us, fused / unfused, and whether the two outputs have the same bits. The largest M whose ratio stays below 1
on every shape is the threshold to set.

    python -m benchmarks.dev.bench_fused_quant                                    # V3's shapes, M 1-64
    python -m benchmarks.dev.bench_fused_quant --shapes 6144,1536 7168,4096 --batch-sizes 1 8 16 32
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence

import torch

from benchmarks.gpu_timing import time_cold_graph_ms
from benchmarks.tune.tune_fp8_gemm import DTYPES, V3_SHAPES, parse_shape
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm.triton import TritonFp8Gemm, pick_config

BLOCK = (128, 128)


def unfused(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype,
            config: dict[str, int]) -> torch.Tensor:
    """x [M, K] -> [M, N] in dtype as `apply` runs it above FUSED_QUANT_MAX_M: quantization kernel, then the GEMM."""
    from plugserve.plugins.gemm import triton_kernels

    x_q, x_s = triton_kernels.per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True)
    return triton_kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype, config)


def compare(n: int, k: int, batch_sizes: Sequence[int], dtype: torch.dtype, reps: int,
            device: torch.device) -> list[dict]:
    """For an [n, k] weight, per M: {"n", "k", "m", "unfused_us", "fused_us", "same_bits", "config"}."""
    from plugserve.plugins.gemm import triton_kernels

    backend = TritonFp8Gemm(GemmSpec(dtype=dtype), device)
    sms = backend.hardware.multiprocessors if device.type == "cuda" else None
    packed = backend.prepare(*quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, BLOCK))
    w_q, w_s = packed.weight, packed.weight_scale_inv
    rows = []
    for m in batch_sizes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        config = pick_config(m, packed.configs, BLOCK, n, k, sms)
        two = functools.partial(unfused, x, w_q, w_s, dtype, config)
        one = functools.partial(triton_kernels.w8a8_block_fp8_matmul, x, None, w_q, w_s, BLOCK, dtype, config)
        rows.append({"n": n, "k": k, "m": m, "unfused_us": time_cold_graph_ms(two, reps=reps) * 1e3,
                     "fused_us": time_cold_graph_ms(one, reps=reps) * 1e3, "same_bits": torch.equal(two(), one()),
                     "config": config})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="N,K", default=None,
                        help="weight shapes, N,K or NxK (default: DeepSeek-V3's, benchmarks/tune/tune_fp8_gemm.py)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], metavar="M")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="activation and output dtype")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("bench_fused_quant times compiled kernels: run it on a CUDA GPU without TRITON_INTERPRET=1")
    torch.manual_seed(0)
    print(f"{'N':>6} {'K':>6} {'M':>5} {'unfused us':>11} {'fused us':>9} {'ratio':>6}  same bits  config")
    for n, k in args.shapes or list(V3_SHAPES):
        for row in compare(n, k, args.batch_sizes, DTYPES[args.dtype], args.reps, torch.device("cuda")):
            print(f"{n:6d} {k:6d} {row['m']:5d} {row['unfused_us']:11.1f} {row['fused_us']:9.1f} "
                  f"{row['fused_us'] / row['unfused_us']:6.2f}  {row['same_bits']!s:9}  {row['config']}", flush=True)


if __name__ == "__main__":
    main()
