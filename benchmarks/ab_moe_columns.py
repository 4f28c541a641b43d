"""The `triton` MoE backend's w2 pass with its tuned tile for M beside the same tile running several column blocks a
program (COLUMN_BLOCKS, `_grouped_gemm_columns_kernel`), on DeepSeek-V3's block-FP8 experts as one rank holds them:
each variant's output checked bit for bit against the tuned tile's, then the pass and the whole routed-experts
forward replayed from a CUDA graph with a cold L2 (as the tuner times them).

    python -m benchmarks.ab_moe_columns --tp 8 --batch-sizes 512 2048 4096
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

import torch

from benchmarks.gpu_timing import time_cold_graph_ms
from benchmarks.tune_fused_moe import MODELS, PREFILL_COLUMN_BLOCKS, ROUTED_SCALING, Experts, rank_spec
from plugserve.core.hardware import Hardware
from plugserve.plugins.moe.align import align_pairs
from plugserve.plugins.moe.experts import fused_experts
from plugserve.plugins.moe.grouped_gemm import grouped_gemm
from plugserve.plugins.moe.quant import per_token_group_quant
from plugserve.plugins.moe.triton import TritonMoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8, help="V3's I / tp must be at most COLUMN_MAX_K (512): tp >= 4")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 2048, 4096])
    args = parser.parse_args()
    device = torch.device("cuda")
    spec = rank_spec(MODELS["v3"], args.tp, 1, "fp8_w8a8")
    experts = Experts.random(spec, device)
    backend = TritonMoE(spec, device)
    k, h, n = spec.top_k, spec.hidden_size, spec.intermediate_size
    print(f"V3 TP {args.tp}: E={spec.num_experts} H={h} I={n} on {Hardware.detect(device).describe()}", flush=True)
    for m in args.batch_sizes:
        x = torch.randn(m, h, device=device, dtype=spec.dtype)
        weights, ids = backend.route(torch.randn(m, spec.num_experts, device=device),
                                     torch.randn(spec.num_experts, device=device) * 0.1)
        config = backend.config(m)
        alignment = align_pairs(ids.to(torch.int32), spec.num_experts, config.block_m)
        hidden = torch.randn(m * k, n, device=device, dtype=spec.dtype)
        a, a_scale = per_token_group_quant(hidden, spec.block_shape[1])
        base = replace(config.w2, column_blocks=1)
        reference = None
        for blocks in (1, *PREFILL_COLUMN_BLOCKS):
            tile = replace(base, column_blocks=blocks)
            out = torch.empty(m * k, h, device=device, dtype=spec.dtype)
            w2_pass = partial(grouped_gemm, a, a_scale, experts.w2, experts.w2_scale_inv, out, alignment, tile,
                              a_row_div=1, silu_mul=False, topk_weights=weights.float().view(-1).contiguous(),
                              routed_scaling_factor=ROUTED_SCALING, block_shape=spec.block_shape)
            forward = partial(fused_experts, x, experts.w13, experts.w2, experts.w13_scale_inv,
                              experts.w2_scale_inv, ids, weights, ROUTED_SCALING, replace(config, w2=tile),
                              spec.block_shape)
            try:
                w2_pass()
                reference = out.clone() if reference is None else reference
                same = torch.equal(out, reference)
                w2_us, forward_us = (time_cold_graph_ms(run) * 1e3 for run in (w2_pass, forward))
            except Exception as exc:  # out of shared memory (a long K unrolled): report, try the next variant
                print(f"M={m:<5} COLUMN_BLOCKS={blocks:<3} {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            print(f"M={m:<5} COLUMN_BLOCKS={blocks:<3} w2 pass {w2_us:8.1f} us  forward {forward_us:8.1f} us  "
                  f"{'same bits' if same else 'DIFFERENT from COLUMN_BLOCKS=1'}  ({tile.to_json()})", flush=True)


if __name__ == "__main__":
    main()
