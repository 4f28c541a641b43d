"""Where the `triton` MoE backend's time goes at prefill sizes: DeepSeek-V3's block-FP8 experts (one rank's under
tensor parallelism), each batch's forward replayed from a CUDA graph with a cold L2 (as the shootout times it),
beside the GPU time of each kernel in it (torch profiler over the same replays) and the limit the shootout counts:
max(activated experts' weight bytes / memory bandwidth (the faster of read and copy), FP8 flops / dense FP8 rate).

    python -m benchmarks.dev.profile_moe --tp-sizes 1 8 --batch-sizes 512 2048 4096
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.dev.profile_gemm import kernel_times_us
from benchmarks.gpu_timing import time_cold_graph_ms
from benchmarks.shootout import expert_weights, limit_seconds, measure_ceilings, moe_case
from plugserve.core.config import preset_config
from plugserve.core.interfaces import MoEWeights
from plugserve.plugins.moe.triton import TritonMoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_moe times CUDA kernels: run it on a GPU")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device, quick=False)
    print(f"read {ceilings['read_gbps']:.0f} GB/s, dense fp8 {ceilings['fp8_tflops']:.0f} TFLOP/s", flush=True)
    for tp in args.tp_sizes:
        spec = preset_config("deepseek-v3").moe_spec(torch.bfloat16, tp, 1, 0)
        backend = TritonMoE(spec, device)
        packed = backend.prepare(MoEWeights(*expert_weights(spec, device)))
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        for tokens in args.batch_sizes:
            x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
            weights, ids = backend.route(torch.randn(tokens, e, device=device), torch.randn(e, device=device) * 0.1)
            limit_us = limit_seconds(moe_case(spec, torch.bfloat16, ids), ceilings) * 1e6
            call = partial(backend.forward, x, packed, ids, weights, spec.router.routed_scaling_factor)
            total_us = time_cold_graph_ms(call, reps=args.reps) * 1e3
            kernels = kernel_times_us(call, args.reps)
            print(f"tp{tp} i{i} t{tokens}: {total_us:.1f} us, limit {limit_us:.1f} us ({limit_us / total_us:.2f}); "
                  f"kernels {sum(kernels.values()):.1f} us", flush=True)
            for name, us in sorted(kernels.items(), key=lambda item: -item[1]):
                print(f"    {us:8.1f} us  {us / total_us:5.1%}  {name.split('(')[0][:90]}", flush=True)


if __name__ == "__main__":
    main()
