"""The Gluon block-FP8 GEMM (`plugins/gemm/gluon_gemm.py`) beside the Triton kernel with its tuned config for M, on
DeepSeek-V3's weight shapes at prefill sizes: the same quantized operands, each checked against the torch reference
first, then replayed from a CUDA graph with a cold L2; fractions of the dense FP8 GEMM measured in the same run.

    python -m benchmarks.ab_gluon_gemm --batch-sizes 256 512 1024 4096
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.gpu_timing import time_cold_graph_ms
from benchmarks.shootout import measure_ceilings
from benchmarks.tune_fp8_gemm import V3_SHAPES
from plugserve.conformance.tolerances import assert_close
from plugserve.core.interfaces import GemmSpec
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.plugins.gemm import gluon_gemm, triton_kernels
from plugserve.plugins.gemm.torch_ref import block_fp8_matmul
from plugserve.plugins.gemm.triton import TritonFp8Gemm, pick_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 512, 1024, 4096])
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device, quick=False)
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.bfloat16), device)
    sms = backend.hardware.multiprocessors
    print(f"dense fp8 {ceilings['fp8_tflops']:.0f} TFLOP/s", flush=True)
    for n, k in V3_SHAPES:
        packed = backend.prepare(*quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, (128, 128)))
        for m in args.batch_sizes:
            x_q, x_s = triton_kernels.per_token_group_quant_fp8(torch.randn(m, k, device=device, dtype=torch.bfloat16),
                                                                128, column_major_scales=True)
            expected = block_fp8_matmul(x_q, x_s, packed.weight, packed.weight_scale_inv, (128, 128), torch.bfloat16)
            operands = (x_q, x_s, packed.weight, packed.weight_scale_inv)
            config = pick_config(m, packed.configs, (128, 128), n, k, sms)
            runs = {"triton": partial(triton_kernels.w8a8_block_fp8_matmul, *operands, (128, 128), torch.bfloat16,
                                      config),
                    "gluon": partial(gluon_gemm.gluon_block_fp8_matmul, *operands, torch.bfloat16, sms)}
            limit_us = 2 * m * n * k / (ceilings["fp8_tflops"] * 1e12) * 1e6
            times = {}
            for name, run in runs.items():
                try:
                    assert_close(run(), expected, torch.bfloat16, name)
                    times[name] = time_cold_graph_ms(run) * 1e3
                except Exception as exc:  # report and go on: the next kernel or shape still runs
                    print(f"m{m} n{n} k{k} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            print(f"m{m:<5} n{n:<6} k{k:<6} " + "  ".join(f"{name} {us:8.1f} us {limit_us / us:.2f}"
                                                          for name, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
