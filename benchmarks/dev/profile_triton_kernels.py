"""One warm launch of each hot Triton kernel at a shape the issue's targets name, for a profiler:

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        -k regex:'_mla_kernel|_mha_kernel|_w8a8_block_fp8_matmul|_fused_moe_gemm' -c 8 \\
        python benchmarks/dev/profile_triton_kernels.py

MLA decode at batch 64 x 8192 keys (128 heads, or `--heads H`; `--kv-cache-dtype fp8_e4m3`: from an e4m3 cache),
causal MHA prefill of 4096 tokens (128 heads, qk 192, v 128), block-FP8 GEMM at M=4096 on (N, K) = (7168, 16384) (or
`--gemm M N K`), fused MoE (E=256 top-8, V3 experts as one GPU of TP8 holds them) at 1 token (or `--moe-tokens T`);
`--kernels` picks some of them. Each runs twice (compile, then the profiled launch)."""

from __future__ import annotations

import argparse

import torch

from plugserve.conformance.batches import random_batch
from plugserve.conformance.cases import V3_ROUTER
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import KV_DTYPES, AttentionSpec, GemmSpec, MoESpec
from plugserve.plugins.attention.mha_prefill import mha_varlen
from plugserve.plugins.attention.triton import TritonAttention
from plugserve.plugins.gemm.triton import TritonFp8Gemm
from plugserve.plugins.moe.triton import TritonMoE

KERNELS = ["mla", "mha", "gemm", "moe"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemm", type=int, nargs=3, default=[4096, 7168, 16384], metavar=("M", "N", "K"))
    parser.add_argument("--moe-tokens", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                        help="the MLA decode's KV cache: the activations' bf16 (auto) or e4m3")
    parser.add_argument("--heads", type=int, default=128, help="the MLA decode's heads (V3 at P ranks: 128 / P)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS, help="which kernels to launch")
    args = parser.parse_args()
    gemm_m, gemm_n, gemm_k = args.gemm
    device, dtype = torch.device("cuda"), torch.bfloat16
    spec = AttentionSpec(num_heads=args.heads, dtype=dtype, page_size=64,
                         kv_cache_dtype=KV_DTYPES.get(args.kv_cache_dtype))
    batch = random_batch(ForwardMode.DECODE, [8192] * 64, [1] * 64, spec, device, num_layers=1)
    attention = TritonAttention(spec, device)
    attention.plan(batch)
    q_nope = torch.randn(64, args.heads, 512, device=device, dtype=dtype)
    q_rope = torch.randn(64, args.heads, 64, device=device, dtype=dtype)
    q, k = (torch.randn(4096, 128, 192, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(4096, 128, 128, device=device, dtype=dtype)
    cu_seqlens = torch.tensor([0, 4096], dtype=torch.int32, device=device)

    gemm = TritonFp8Gemm(GemmSpec(dtype=dtype), device)
    packed = gemm.prepare(*quantize_block_fp8(torch.randn(gemm_n, gemm_k, device=device) / gemm_k**0.5, (128, 128)))
    x = torch.randn(gemm_m, gemm_k, device=device, dtype=dtype)

    moe_spec = MoESpec(7168, 256, dtype, torch.float8_e4m3fn, router=V3_ROUTER)
    moe = TritonMoE(moe_spec, device)
    w13 = [quantize_block_fp8(torch.randn(512, 7168, device=device) / 85) for _ in range(256)]
    w2 = [quantize_block_fp8(torch.randn(7168, 256, device=device) / 16) for _ in range(256)]
    weights = moe.prepare(MoEWeights(torch.stack([w for w, _ in w13]), torch.stack([w for w, _ in w2]),
                                     torch.stack([s for _, s in w13]), torch.stack([s for _, s in w2])))
    tokens = torch.randn(args.moe_tokens, 7168, device=device, dtype=dtype)
    topk_weights, topk_ids = moe.route(torch.randn(args.moe_tokens, 256, device=device),
                                       torch.zeros(256, device=device))

    launches = {
        "mla": lambda: attention.forward_mla(q_nope, q_rope, 0),
        "mha": lambda: mha_varlen(q, k, v, cu_seqlens, cu_seqlens, 4096, 192**-0.5, True),
        "gemm": lambda: gemm.apply(x, packed),
        "moe": lambda: moe.forward(tokens, weights, topk_ids, topk_weights, 2.5),
    }
    for _ in range(2):
        for name in args.kernels:
            launches[name]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
