"""The MoE grouped GEMM as Triton kernels: C[p] = A[p] @ B[e]^T for the token-expert pairs p of each expert e, one
expert an M-block (`plugserve.plugins.moe.align`). Its two passes in `fused_experts`: w13, with SiLU-and-mul in the
epilogue, and w2, times each pair's top-k weight. A config's SPLIT_K cuts K into runs summed by each block's last
program (a decode batch's few M-blocks alone do not fill the GPU); its COLUMN_BLOCKS runs the w2 pass, whose K
(I, divided under tensor parallelism) is short, as `_grouped_gemm_columns_kernel`, whose programs take several
column blocks each with K unrolled, so that Triton pipelines the loop over them. Imported lazily, with the other
kernels of the `triton` MoE backend.

Notation: P token-expert pairs, E experts, N output columns, K the reduced dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.core.triton_tiles import split_k_arrivals, split_k_arrive, split_k_sum
from plugserve.plugins.moe.align import BlockAlignment
from plugserve.plugins.moe.configs import GemmConfig
from plugserve.plugins.triton_shared import INTERPRETED
from plugserve.plugins.triton_support import tma_source

MIN_BLOCK_N = 16  # the narrowest column block (tl.dot's minimum): sizes the w2 pass's arrival counts
# The column kernel unrolls K, and Triton's pipeline then buffers every step of a column block for each stage:
# longer Ks outgrow shared memory (docs/kernels.md, "Grouped GEMM") and loop in the general kernel.
COLUMN_MAX_K = 512


@triton.jit
def _mma(acc, a, b, a_scale, b_scale, FP8: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [BM, BN] float32 + a [BM, BK] @ b [BK, BN]; FP8: the product scaled per row and column."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # FP8: the block's product promoted into acc by one FMA an element (the scale is the block's outer product).
    return tl.fma(tl.dot(a, b), a_scale[:, None] * b_scale[None, :], acc) if FP8 else tl.dot(a, b, acc)


@triton.jit(do_not_specialize_on_alignment=["num_pairs"])
def _fused_moe_gemm_kernel(
    a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, sum_ptr, arrived_ptr, partial_ptr, split_arrivals_ptr,
    N, K, num_pairs, padded_rows, num_experts, b_rows, routed_scaling_factor,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_ps, stride_pm,
    PER_PAIR: tl.constexpr, A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    SUM_PAIRS: tl.constexpr, SPLIT_K: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[p, n] for the pairs p of one M-block (one expert e) and BLOCK_N columns:
    acc = A[p // A_ROW_DIV] @ B[e]^T (B [E, N or 2N, K]), float32 accumulation;
    SILU_MUL: B holds 2N rows (gate, then up) and C = silu(acc_gate) * acc_up;
    MUL_WEIGHT: C *= topk_weights[p] * routed_scaling_factor.
    FP8: A and B float8 with A scales per row and 1 x GROUP_K group, B scales per GROUP_N x GROUP_K
    block, applied per K-tile (BLOCK_K divides GROUP_K).
    PER_PAIR (`pair_blocks`): M-block p is pair p alone, of expert expert_ids[p], skipped when that id is dropped.
    SUM_PAIRS (PER_PAIR, one token): also sum[n] = sum over the used pairs p of C[p, n] in float32, in pair order,
    by the program of each column block that arrives last (an atomic count per column block in arrived_ptr, after
    every program's stores; set back to 0 for the next launch), so that no top-k sum kernel follows.
    SPLIT_K > 1 (not with SUM_PAIRS): program (block, s) runs the s-th of SPLIT_K runs of K blocks and stores its
    float32 accumulators (gate and up: 2 N columns) in slice s of a [SPLIT_K, P, N or 2N] workspace (stride_ps,
    stride_pm), counting itself in split_arrivals[block] (int32, zero between launches); the block's last program
    to arrive adds the slices in split order and runs the epilogue, so the result does not depend on arrival order.
    TMA: B tiles come as [BLOCK_N, BLOCK_K] boxes of b_desc, B viewed as [E * b_rows, K] (zero-filled past K and
    past the last expert; a box reaching past an expert's N rows reads the next rows, whose columns are not stored)."""
    programmatic_prologue(PDL)
    pid = tl.program_id(0)
    # Programs sweep GROUP_SIZE_M M-blocks per column of N-blocks, so weight tiles are reused in L2.
    num_pid_m = tl.cdiv(padded_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    rows_of_group = min(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % per_group) % rows_of_group
    pid_n = (pid % per_group) // rows_of_group
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    k_end = K
    if PER_PAIR:
        dropped = (expert < 0) | (expert >= num_experts)
        if SUM_PAIRS:  # a dropped pair's program still arrives: it computes and stores nothing
            k_end = tl.where(dropped, 0, K)
            pair = tl.where((tl.arange(0, BLOCK_M) == 0) & ~dropped, pid_m, num_pairs)
        else:
            if dropped:
                return
            pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        up_ptrs = b_ptrs + N * stride_bn
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        a_scale_ptrs = a_scale_ptr + a_row * stride_asm
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
        if SILU_MUL:
            up_scale_ptrs = b_scale_ptr + expert * stride_bse + ((offs_n + N) // GROUP_N) * stride_bsn

    b_row = (expert * b_rows + pid_n * BLOCK_N).to(tl.int32)  # TMA: the first weight row of this column block
    k_per_split = tl.cdiv(tl.cdiv(k_end, BLOCK_K), SPLIT_K) * BLOCK_K
    k_first = tl.program_id(1) * k_per_split
    a_ptrs += k_first * stride_ak
    b_ptrs += k_first * stride_bk
    if SILU_MUL:
        up_ptrs += k_first * stride_bk
    for k0 in range(k_first, tl.minimum(k_first + k_per_split, k_end), BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if TMA:
            b = tl.trans(b_desc.load([b_row, k0]))
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            k_group = k0 // GROUP_K
            a_scale = tl.load(a_scale_ptrs + k_group * stride_ask, mask=row_mask, other=0.0)
            b_scale = tl.load(b_scale_ptrs + k_group * stride_bsk, mask=n_mask, other=0.0)
        else:
            a_scale = 1.0  # unused
            b_scale = 1.0
        acc = _mma(acc, a, b, a_scale, b_scale, FP8, DOT_FP32)
        if SILU_MUL:
            if TMA:
                up = tl.trans(b_desc.load([b_row + N, k0]))
            else:
                up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            up_scale = tl.load(up_scale_ptrs + k_group * stride_bsk, mask=n_mask, other=0.0) if FP8 else 1.0
            acc_up = _mma(acc_up, a, up, a_scale, up_scale, FP8, DOT_FP32)
            up_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SPLIT_K > 1:
        part_mask = row_mask[:, None] & n_mask[None, :]
        part = partial_ptr + pair.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        tl.store(part + tl.program_id(1) * stride_ps, acc, mask=part_mask)
        if SILU_MUL:
            tl.store(part + tl.program_id(1) * stride_ps + N, acc_up, mask=part_mask)
        if split_k_arrive(split_arrivals_ptr + pid) < SPLIT_K - 1:
            return
        acc = split_k_sum(part, stride_ps, part_mask, SPLIT_K)
        if SILU_MUL:
            acc_up = split_k_sum(part + N, stride_ps, part_mask, SPLIT_K)
        tl.store(split_arrivals_ptr + pid, 0)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * (weight * routed_scaling_factor)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
    if SUM_PAIRS:
        tl.debug_barrier()  # every thread's stores before the arrival (release) below
        if tl.atomic_add(arrived_ptr + pid_n, 1, sem="acq_rel") == num_pid_m - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for p in range(num_pairs):
                other = tl.zeros([BLOCK_N], dtype=tl.int32) + tl.load(expert_ids_ptr + p)  # a vector mask
                used = (other >= 0) & (other < num_experts)
                total += tl.load(c_ptr + p * stride_cm + offs_n * stride_cn, mask=n_mask & used, other=0.0).to(
                    tl.float32)
            tl.store(sum_ptr + offs_n, total.to(sum_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(arrived_ptr + pid_n, 0)


@triton.jit(do_not_specialize_on_alignment=["num_pairs"])
def _grouped_gemm_columns_kernel(
    a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, num_pairs, b_rows, routed_scaling_factor,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    K: tl.constexpr, COLUMN_BLOCKS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_fused_moe_gemm_kernel`'s C = A[p] @ B[e]^T (times the pair's weight: MUL_WEIGHT) for a short K, the w2
    pass's (I / tp): program (m, c) takes M-block m's pairs through column blocks c * COLUMN_BLOCKS, ... one after
    another, with K unrolled in BLOCK_K steps, so that Triton pipelines the loop over column blocks: the next
    block's weight tile loads while this one's product and stores run. With a program a column block, each would
    fill and drain a pipeline of a few K steps alone. Programs walk the M-blocks first (grid axis 0), so the ones
    running together share an expert's weight tiles in L2 (no GROUP_SIZE_M). Sorted-pair alignment only (no
    SiLU-and-mul, split-K or pair sum); the K steps add up in the same order as `_fused_moe_gemm_kernel`'s."""
    programmatic_prologue(PDL)
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    rows = pair.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0) * routed_scaling_factor
    first_n = tl.program_id(1) * COLUMN_BLOCKS
    for pid_n in range(first_n, tl.minimum(first_n + COLUMN_BLOCKS, tl.cdiv(N, BLOCK_N))):
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if TMA:
                b = tl.trans(b_desc.load([(expert * b_rows + pid_n * BLOCK_N).to(tl.int32), k0]))
            else:
                b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
                            + (k0 + offs_k)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8:
                a_scale = tl.load(a_scale_ptr + rows * stride_asm + k0 // GROUP_K * stride_ask, mask=row_mask,
                                  other=0.0)
                b_scale = tl.load(b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
                                  + k0 // GROUP_K * stride_bsk, mask=n_mask, other=0.0)
            else:
                a_scale = 1.0  # unused
                b_scale = 1.0
            acc = _mma(acc, a, b, a_scale, b_scale, FP8, DOT_FP32)
        if MUL_WEIGHT:
            acc = acc * weight[:, None]
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    alignment: BlockAlignment,
    config: GemmConfig,
    *,
    a_row_div: int,
    silu_mul: bool,
    topk_weights: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    block_shape: tuple[int, int] = (128, 128),
    pair_sum: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One pass of the grouped GEMM into out [P, N] (see `_fused_moe_gemm_kernel`).

    a [rows, K] (row of pair p: p // a_row_div) of the activation dtype, or float8 with a_scale
    [rows, ceil(K/bk)]; w [E, N or 2N (silu_mul), K] of a's dtype, or float8 with w_scale
    [E, ceil(w.shape[1]/bn), ceil(K/bk)]; topk_weights [P] float32 to multiply by (times
    routed_scaling_factor). pair_sum (a per-pair alignment only): (sum [N], arrived [>= ceil(N / BLOCK_N)] int32
    zeros) to also write the sum of out's used rows into, by the same launch (SUM_PAIRS). config.split_k > 1: K cut
    into that many runs, summed in split order by each block's last program (a decode-sized batch's few blocks
    then fill the GPU). config.column_blocks > 1 (the w2 pass; sorted pairs, not one token's pair blocks):
    `_grouped_gemm_columns_kernel`."""
    fp8 = w_scale is not None
    if fp8 and block_shape[1] % config.block_k:
        raise ValueError(f"BLOCK_SIZE_K {config.block_k} must divide the FP8 block's K size {block_shape[1]}")
    n, k = out.shape[1], a.shape[1]
    # One token's pair blocks (a prefill config reached by the nearest-M lookup) run the general kernel.
    if config.column_blocks > 1 and not alignment.per_pair:
        if silu_mul or pair_sum is not None:
            raise ValueError("COLUMN_BLOCKS is the w2 pass's: no SiLU-and-mul or pair sum")
        _columns_gemm(a, a_scale, w, w_scale, out, alignment, config, a_row_div, topk_weights, routed_scaling_factor,
                      block_shape)
        return
    if pair_sum is not None and (not alignment.per_pair or pair_sum[1].numel() < triton.cdiv(n, config.block_n)):
        raise ValueError("pair_sum needs a per-pair alignment and an arrival count per column block")
    if pair_sum is not None and config.split_k > 1:
        raise ValueError("pair_sum needs SPLIT_K 1: the pair sum's last program must see every pair's finished row")
    blocks = alignment.num_blocks * triton.cdiv(n, config.block_n)
    grid = (blocks, config.split_k)
    # SPLIT_K: each split's float32 accumulators (gate and up side by side) for the last program of a block to add.
    partial = (torch.empty(config.split_k, alignment.num_pairs, 2 * n if silu_mul else n, dtype=torch.float32,
                           device=a.device) if config.split_k > 1 else None)
    split_arrivals = split_k_arrivals(a.device, blocks) if config.split_k > 1 else None
    # TMA (a speed hint): over the experts as one [E * rows, K] matrix, which needs them contiguous.
    tma = config.tma and w.is_contiguous() and tma_source(w.view(-1, k))
    b_desc = TensorDescriptor.from_tensor(w.view(-1, k), [config.block_n, config.block_k]) if tma else None
    _fused_moe_gemm_kernel[grid](
        a, w, b_desc, out, a_scale, w_scale, topk_weights,
        alignment.sorted_ids, alignment.expert_ids, alignment.num_padded,
        *(pair_sum if pair_sum is not None else (None, None)), partial, split_arrivals,
        n, k, alignment.num_pairs, alignment.num_blocks * alignment.block_m, w.shape[0], w.shape[1],
        routed_scaling_factor,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        *((partial.stride(0), partial.stride(1)) if partial is not None else (0, 0)),
        PER_PAIR=alignment.per_pair, A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, MUL_WEIGHT=topk_weights is not None,
        SUM_PAIRS=pair_sum is not None, SPLIT_K=config.split_k,
        FP8=fp8, GROUP_N=block_shape[0], GROUP_K=block_shape[1], DOT_FP32=INTERPRETED and a.dtype == torch.bfloat16,
        BLOCK_M=alignment.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_SIZE_M=config.group_m,
        TMA=tma, **launch_options(a), num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _columns_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                  out: torch.Tensor, alignment: BlockAlignment, config: GemmConfig, a_row_div: int,
                  topk_weights: torch.Tensor | None, routed_scaling_factor: float,
                  block_shape: tuple[int, int]) -> None:
    """`grouped_gemm` for config.column_blocks > 1: `_grouped_gemm_columns_kernel` (K a constexpr: one compile per
    intermediate size)."""
    fp8 = w_scale is not None
    n, k = out.shape[1], a.shape[1]
    if a_row_div != 1 or k > COLUMN_MAX_K:
        raise ValueError(f"COLUMN_BLOCKS is for the w2 pass (A by pair, a_row_div 1) with K <= {COLUMN_MAX_K}, got "
                         f"a_row_div {a_row_div} and K {k}")
    tma = config.tma and w.is_contiguous() and tma_source(w.view(-1, k))
    b_desc = TensorDescriptor.from_tensor(w.view(-1, k), [config.block_n, config.block_k]) if tma else None
    grid = (alignment.num_blocks, triton.cdiv(triton.cdiv(n, config.block_n), config.column_blocks))
    _grouped_gemm_columns_kernel[grid](
        a, w, b_desc, out, a_scale, w_scale, topk_weights,
        alignment.sorted_ids, alignment.expert_ids, alignment.num_padded,
        n, alignment.num_pairs, w.shape[1], routed_scaling_factor,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        K=k, COLUMN_BLOCKS=config.column_blocks, MUL_WEIGHT=topk_weights is not None,
        FP8=fp8, GROUP_N=block_shape[0], GROUP_K=block_shape[1], DOT_FP32=INTERPRETED and a.dtype == torch.bfloat16,
        BLOCK_M=alignment.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TMA=tma, **launch_options(a),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
