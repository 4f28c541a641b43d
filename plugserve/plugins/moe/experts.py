"""The routed experts' forward of the `triton` MoE backend (`fused_experts`) and its top-k sum kernel. Imported
lazily (by `plugserve.plugins.moe.triton`), so that loading the plugin never imports Triton; with
TRITON_INTERPRET=1 set before this import the kernels run on the CPU in Triton's interpreter.

Notation: T tokens, k experts per token (top-k), P = T * k token-expert pairs (pair p = t * k + j is
slot j of token t), E experts, H hidden size, I expert intermediate size.

Pipeline of `fused_experts`:
  1. `align_pairs`: pairs sorted by expert in runs padded to BLOCK_M (`plugserve.plugins.moe.align`).
  2. block-FP8 only: `per_token_group_quant` of x [T, H] (1 x 128 groups).
  3. w13 pass of `grouped_gemm`: h[p] = silu(x[t] @ W_gate^T) * (x[t] @ W_up^T), [P, I].
  4. block-FP8 only: `per_token_group_quant` of h.
  5. w2 pass: y[p] = weight[p] * routed_scaling_factor * (h[p] @ W2^T), [P, H].
  6. `_topk_sum_kernel`: out[t] = sum_j y[t * k + j], [T, H]. For one token the w2 pass does this sum itself
     (its SUM_PAIRS epilogue), unless its config cuts K or the call is batch-invariant.

Batch-invariant calls (`fused_experts(batch_invariant=True)`) take one path at every token count: the pairs sorted
by `moe_align_block_size` for one token too, and the top-k sum kernel, so a token's sums are the same ops alone or in
a batch (the caller passes one launch config for every token count).

On Hopper and newer GPUs every kernel of the chain launches as a programmatic dependent
(`plugserve.core.triton_pdl`), so that each one's launch hides behind the tail of the one before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.moe.align import align_pairs, moe_align_block_size
from plugserve.plugins.moe.configs import MoEConfig
from plugserve.plugins.moe.grouped_gemm import grouped_gemm
from plugserve.plugins.moe.quant import per_token_group_quant

_SUM_BLOCK_H = 1024  # hidden columns per program of the top-k sum


@triton.jit
def _topk_sum_kernel(
    y_ptr, ids_ptr, out_ptr, H, num_experts, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum over the k slots of token t with an expert id in [0, E) of y[t * k + j], in float32."""
    programmatic_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.zeros([BLOCK_H], dtype=tl.int32) + tl.load(ids_ptr + token * TOP_K + j)
        used = (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + (token * TOP_K + j) * stride_y + cols, mask=(cols < H) & used, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    config: MoEConfig,
    block_shape: tuple[int, int] = (128, 128),
    arrived: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] in x's dtype, or float8_e4m3fn
    with block scales [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)]; topk_ids [T, k] int
    (ids outside [0, E) contribute nothing), topk_weights [T, k] float32. Returns [T, H] of x's dtype:
    routed_scaling_factor * sum_j topk_weights[t, j] * W2 (silu(W_gate x) * (W_up x)) of expert
    topk_ids[t, j]. With FP8 weights x and h are quantized per 1 x bk token group before their GEMMs.
    arrived: int32 zeros, at least one per column block of the w2 pass (kept by the caller across launches,
    left at 0): one token's top-k sum then happens inside the w2 pass (SUM_PAIRS), not in a kernel of its own.
    batch_invariant: no one-token path (see the module docstring); `arrived` is then unused."""
    num_tokens, hidden = x.shape
    num_experts, intermediate, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    fp8 = w13_scale_inv is not None
    ids = topk_ids.to(torch.int32).contiguous()
    align = moe_align_block_size if batch_invariant else align_pairs
    alignment = align(ids, num_experts, config.block_m)
    num_pairs = alignment.num_pairs

    a, a_scale = per_token_group_quant(x, block_shape[1]) if fp8 else (x.contiguous(), None)
    # FP8: h stays float32 until it is quantized, as the reference quantizes the float32 product.
    h = torch.empty(num_pairs, intermediate, dtype=torch.float32 if fp8 else x.dtype, device=x.device)
    grouped_gemm(a, a_scale, w13, w13_scale_inv, h, alignment, config.w13, a_row_div=top_k, silu_mul=True,
                 block_shape=block_shape)
    h, h_scale = per_token_group_quant(h, block_shape[1]) if fp8 else (h, None)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    in_pass = (alignment.per_pair and arrived is not None and config.w2.split_k == 1
               and arrived.numel() >= triton.cdiv(hidden, config.w2.block_n))
    grouped_gemm(h, h_scale, w2, w2_scale_inv, y, alignment, config.w2, a_row_div=1, silu_mul=False,
                 topk_weights=topk_weights.float().contiguous(), routed_scaling_factor=routed_scaling_factor,
                 block_shape=block_shape, pair_sum=(out.view(-1), arrived) if in_pass else None)
    if in_pass:
        return out
    block_h = min(_SUM_BLOCK_H, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, ids, out, hidden, num_experts, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h,
        **launch_options(y),
    )
    return out
