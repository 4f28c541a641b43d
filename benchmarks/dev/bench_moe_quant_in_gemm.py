"""The `triton` MoE backend's block-FP8 forward with its activations quantized inside the grouped GEMMs
(`fused_experts(quant_in_gemm=True)`, the default up to `QUANT_IN_GEMM_MAX_TOKENS` tokens) against the quantizer's
launches before each pass (quant_in_gemm=False), to place that limit. One rank's DeepSeek-V3 experts (default TP 4:
E 256, H 7168, N 512 per rank, top-8; random block-FP8 weights and router logits), each batch's forward both ways with
the backend's launch config for its token count, replayed from a CUDA graph with a cold L2 as a decode step runs
it (`time_cold_graph_ms`). Prints per (E, N, top_k, T) the unfused and fused microseconds, fused / unfused, and
whether both outputs are the same bits (they must be).

    python -m benchmarks.dev.bench_moe_quant_in_gemm --tp 4 --batch-sizes 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.gpu_timing import time_cold_graph_ms
from benchmarks.shootout import expert_weights
from plugserve.core.config import preset_config
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import ceil_div
from plugserve.plugins.moe.triton import TritonMoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3", help="a preset with block-FP8 experts")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size: each rank's intermediate width")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (= --tp or 1): rank 0's experts")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_quant_in_gemm times CUDA kernels: run it on a GPU")
    if args.ep not in (1, args.tp):
        parser.error(f"--ep must be 1 or --tp ({args.tp}), got {args.ep}")
    from plugserve.plugins.moe.experts import QUANT_IN_GEMM_MAX_TOKENS, fused_experts
    from plugserve.plugins.moe.grouped_gemm import MIN_BLOCK_N

    device = torch.device("cuda")
    torch.manual_seed(0)
    spec = preset_config(args.model).moe_spec(torch.bfloat16, args.tp, args.ep, 0)
    if not spec.is_fp8:
        parser.error(f"{args.model} has unquantized experts: nothing is quantized before its GEMMs")
    backend = TritonMoE(spec, device)
    packed = backend.prepare(MoEWeights(*expert_weights(spec, device)))
    e, h, n, k = spec.num_local_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    router = spec.router
    # One token's top-k sum in the w2 pass, as the backend runs it (its own arrival counts, zeros between launches).
    arrived = torch.zeros(ceil_div(h, MIN_BLOCK_N), dtype=torch.int32, device=device)
    print(f"{args.model} TP {args.tp} EP {args.ep}: E={e} N={n} H={h} top_k={k}, bfloat16 activations; the backend "
          f"quantizes in the GEMMs up to T={QUANT_IN_GEMM_MAX_TOKENS}", flush=True)
    for tokens in args.batch_sizes:
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        bias = torch.randn(router.num_experts, device=device) * 0.1 if router.topk_method == "noaux_tc" else None
        weights, ids = backend.route(torch.randn(tokens, router.num_experts, device=device), bias)
        ids = ids - spec.first_expert  # as forward: other ranks' experts fall outside [0, E) and drop
        config = backend.config(tokens)
        ways = [partial(fused_experts, x, packed.w13, packed.w2, packed.w13_scale_inv, packed.w2_scale_inv, ids,
                        weights, router.routed_scaling_factor, config, spec.block_shape, arrived, quant_in_gemm=fused)
                for fused in (False, True)]
        same = torch.equal(ways[0](), ways[1]())
        unfused_us, fused_us = (time_cold_graph_ms(way, reps=args.reps) * 1e3 for way in ways)
        print(f"E={e} N={n} top_k={k} T={tokens}: unfused {unfused_us:.1f} us, fused {fused_us:.1f} us, "
              f"ratio {fused_us / unfused_us:.3f}, same bits: {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
