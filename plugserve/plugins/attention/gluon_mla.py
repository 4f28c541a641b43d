"""Absorbed MLA decode for Hopper written in Gluon: stage 1 of `triton_kernels.mla_attention` for configs with
`gluon` set (`mla_config`'s choice on sm90), `_mla_kernel`'s work with the score dot split between the two
warpgroups instead of duplicated.

Triton gives a chained dot's warps all to M, so with 64 heads (one warpgroup's M) on 8 warps both warpgroups of
`_mla_kernel` compute the same [64, BLOCK_N] scores, 576 deep, and split only the [64, 512] output: per key block
each warpgroup does 64 x 64 x 576 + 64 x 64 x 256 multiply-adds. Here the layouts are explicit: the scores' wgmma
layout puts the warpgroups side by side along the keys (warps [4, 2]), each scoring its BLOCK_N / 2 keys, the
probabilities go through shared memory, and the output's layout splits the latent columns: 64 x 32 x 576 +
64 x 64 x 256 each, a third less tensor work, and half the softmax each.

Programs, splits and partials are `_mla_kernel`'s (`_mla_program`; `_mla_reduce_kernel` merges the splits), without
draft trees. Full key blocks come as TMA boxes into a STAGES-deep ring; the sequence's last, partial block is loaded
through masked pointers into its stage, zeros past kv_len. A stage refills with the block STAGES on once both
warpgroups are done with it. Gluon kernels do not run in Triton's interpreter: tested on a GPU only.

Compiled for sm90 with Triton 3.6 (the GPU machine's): 255 registers, no spills; shared memory 225 KB at 64-key
blocks in 2 stages, 185 KB at 32 x 3. On the H100, 64 x 2 runs batch 32 x 8192 keys (128 heads) at 0.65 of the
limit, against 0.44 for `_mla_kernel` (session 14's results).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from plugserve.plugins.attention.triton_kernels import _mla_program

# Triton 3.9 names the TMA load async_load (async_copy_global_to_shared raises there); 3.6 has only the latter.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
BLOCK_H = gl.constexpr(64)  # heads a program: one warpgroup's wgmma M (`mla_gluon_fits`)


@gluon.jit
def _load_rows(base, rows, row_stride, row_mask, COLS: gl.constexpr, layout: gl.constexpr):
    """[len(rows), COLS] elements at base + rows * row_stride + col, 0 where row_mask is false."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    return gl.load(ptrs, mask=row_mask[:, None], other=0.0)


@gluon.jit
def _refill(latent_desc, rope_desc, kv_lo, kv_hi, kv_rope, ready, block_table_row, b, stage, full, R: gl.constexpr,
            BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """TMA loads of key block b (when it is full, b < full) into `stage`, arriving on ready[stage]. A full block lies
    inside one page: one page lookup, three boxes (the latent halves and the rope key)."""
    row = gl.load(block_table_row + b * BLOCK_N // PAGE_SIZE, mask=b < full, other=0) * PAGE_SIZE \
        + b * BLOCK_N % PAGE_SIZE
    mbarrier.expect(ready.index(stage), 2 * latent_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=b < full)
    _tma_load(latent_desc, [row, 0], ready.index(stage), kv_lo.index(stage), pred=b < full)
    _tma_load(latent_desc, [row, R // 2], ready.index(stage), kv_hi.index(stage), pred=b < full)
    _tma_load(rope_desc, [row, R], ready.index(stage), kv_rope.index(stage), pred=b < full)


@gluon.jit
def _stage_block(kv_ptr, kv_lo, kv_hi, kv_rope, ready, block_table_row, stride_kv, b, i, full, kv_len,
                 R: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
                 io_layout: gl.constexpr):
    """Key block b, the program's i-th, in stage i % STAGES: a full block's TMA boxes waited for; the sequence's
    last, partial block loaded through masked pointers, zeros past kv_len, so that no stale row of the pool
    (0 * inf) enters the output."""
    stage = i % STAGES
    if b < full:
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    else:
        n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        valid = n < kv_len
        page = gl.load(block_table_row + n // PAGE_SIZE, mask=valid, other=0).to(gl.int64)
        slots = page * PAGE_SIZE + n % PAGE_SIZE
        kv_lo.index(stage).store(_load_rows(kv_ptr, slots, stride_kv, valid, R // 2, io_layout))
        kv_hi.index(stage).store(_load_rows(kv_ptr + R // 2, slots, stride_kv, valid, R // 2, io_layout))
        kv_rope.index(stage).store(_load_rows(kv_ptr + R, slots, stride_kv, valid, P, io_layout))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _scores(q_lo, q_hi, q_rope, kv_lo, kv_hi, kv_rope, stage, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
            s_layout: gl.constexpr):
    """The raw scores [BLOCK_H, BLOCK_N] of the block in `stage`, as three async wgmma groups (the latent halves,
    the rope key): wait on the result before reading it."""
    scores = warpgroup_mma(q_lo, kv_lo.index(stage).permute((1, 0)),
                           gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    scores = warpgroup_mma(q_hi, kv_hi.index(stage).permute((1, 0)), scores, is_async=True)
    return warpgroup_mma(q_rope, kv_rope.index(stage).permute((1, 0)), scores, is_async=True)


@gluon.jit
def _softmax(scores, b, full, kv_len, keys, m, denom, qk_scale, BLOCK_N: gl.constexpr):
    """Online softmax of block b's raw scores, base 2: (probabilities [BLOCK_H, BLOCK_N] float32, row max, denominator,
    alpha, the factor the accumulator takes). Keys past kv_len (only in the last block, b >= full) are dropped."""
    scores = scores * qk_scale
    if b >= full:
        scores = gl.where((b * BLOCK_N + keys < kv_len)[None, :], scores, float("-inf"))
    m_new = gl.maximum(m, gl.max(scores, 1))
    alpha = gl.exp2(m - m_new)
    probs = gl.exp2(scores - m_new[:, None])
    return probs, m_new, denom * alpha + gl.sum(probs, 1), alpha


@gluon.jit
def _gluon_mla_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, latent_desc, rope_desc, block_table_ptr, token_req_ptr, token_kv_len_ptr,
    out_ptr, lse_ptr,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_kv, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
    num_heads, num_splits, min_split_blocks, qk_scale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
    SPLIT: gl.constexpr, num_warps: gl.constexpr,
):
    """kv_ptr: the pool [num_slots, R + P]; latent_desc / rope_desc: its [BLOCK_N, R / 2] and [BLOCK_N, P] TMA
    boxes. SPLIT: out_ptr / lse_ptr are float32 partials and base-2 log-sum-exps (unit stride over splits), else
    out_ptr is the output. qk_scale: the softmax scale times log2(e)."""
    HALF_R: gl.constexpr = R // 2
    gl.static_assert(num_warps == 8, "two warpgroups: keys split for the scores, latent columns for the output")
    head_block, split, t, req, kv_len, first, last = _mla_program(
        num_heads, num_splits, min_split_blocks, token_req_ptr, token_kv_len_ptr, BLOCK_H, BLOCK_N)
    full = gl.minimum(last, kv_len // BLOCK_N)

    # Scores [64, BLOCK_N]: warpgroup w scores keys w * BLOCK_N / 2 ...; output halves [64, R / 2]: warpgroup w
    # holds columns w * R / 4 ... of each.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, HALF_R // 2, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty

    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, io_layout))
    head_mask = heads < num_heads
    lse_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_layout)
    lse_ptrs = lse_ptr + t * stride_lse_t + lse_heads * stride_lse_h + split
    if first >= last:
        if SPLIT:
            gl.store(lse_ptrs, gl.full([BLOCK_H], float("-inf"), gl.float32, row_layout), mask=lse_heads < num_heads)
        return

    half_smem: gl.constexpr = latent_desc.layout
    rope_smem: gl.constexpr = rope_desc.layout
    q_layout_half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF_R], dtype)
    q_layout_rope: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, P], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    q_lo = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF_R], q_layout_half)
    q_hi = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF_R], q_layout_half)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, P], q_layout_rope)
    kv_lo = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF_R], half_smem)
    kv_hi = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF_R], half_smem)
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, P], rope_smem)
    probs_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    block_table_row = block_table_ptr + req * stride_bt
    for i in gl.static_range(STAGES):
        _refill(latent_desc, rope_desc, kv_lo, kv_hi, kv_rope, ready, block_table_row, first + i, i, full, R, BLOCK_N,
                PAGE_SIZE)

    q_base = q_nope_ptr + t * stride_qn_t
    q_lo.store(_load_rows(q_base, heads, stride_qn_h, head_mask, HALF_R, io_layout))
    q_hi.store(_load_rows(q_base + HALF_R, heads, stride_qn_h, head_mask, HALF_R, io_layout))
    q_rope.store(_load_rows(q_rope_ptr + t * stride_qr_t, heads, stride_qr_h, head_mask, P, io_layout))
    fence_async_shared()
    gl.thread_barrier()

    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, row_layout)
    denom = gl.zeros([BLOCK_H], gl.float32, row_layout)
    acc_lo = gl.zeros([BLOCK_H, HALF_R], gl.float32, o_layout)
    acc_hi = gl.zeros([BLOCK_H, HALF_R], gl.float32, o_layout)
    # One block at a time: scores, softmax, PV. A stage serves one step, so the other STAGES - 1 load while it
    # computes. (Issuing the next block's scores beside this block's PV, to hide the softmax, holds two stages a
    # step: with the two that fit, the next load then had nothing to hide behind, and ncu found the warps waiting
    # on its barrier a quarter of the time; 0.50 of the limit against 0.65 at batch 32 x 8192 keys.)
    for i in range(last - first):
        b = first + i
        stage = i % STAGES
        _stage_block(kv_ptr, kv_lo, kv_hi, kv_rope, ready, block_table_row, stride_kv, b, i, full, kv_len, R, P,
                     BLOCK_N, PAGE_SIZE, STAGES, io_layout)
        scores = _scores(q_lo, q_hi, q_rope, kv_lo, kv_hi, kv_rope, stage, BLOCK_H, BLOCK_N, s_layout)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        probs, m, denom, alpha = _softmax(scores, b, full, kv_len, keys, m, denom, qk_scale, BLOCK_N)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc_lo = acc_lo * alpha_o
        acc_hi = acc_hi * alpha_o
        # Each warpgroup stores its keys' probabilities and multiplies all of them by its latent columns.
        probs_smem.store(probs.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc_lo = warpgroup_mma(probs_smem, kv_lo.index(stage), acc_lo, is_async=True)
        acc_hi = warpgroup_mma(probs_smem, kv_hi.index(stage), acc_hi, is_async=True)
        acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
        # Both warpgroups are done with the stage and the probabilities: the stage refills with the block STAGES on.
        gl.thread_barrier()
        _refill(latent_desc, rope_desc, kv_lo, kv_hi, kv_rope, ready, block_table_row, b + STAGES, stage, full, R,
                BLOCK_N, PAGE_SIZE)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    denom_o = gl.convert_layout(denom, gl.SliceLayout(1, o_layout))[:, None]
    o_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HALF_R, layout=gl.SliceLayout(0, o_layout))
    out_rows = out_ptr + t * stride_o_t + o_heads[:, None] * stride_o_h + split * stride_o_s + cols[None, :]
    o_mask = (o_heads < num_heads)[:, None]
    gl.store(out_rows, (acc_lo / denom_o).to(out_ptr.dtype.element_ty), mask=o_mask)
    gl.store(out_rows + HALF_R, (acc_hi / denom_o).to(out_ptr.dtype.element_ty), mask=o_mask)
    if SPLIT:
        gl.store(lse_ptrs, m + gl.log2(denom), mask=lse_heads < num_heads)


def launch(grid: tuple[int], q_nope: torch.Tensor, q_rope: torch.Tensor, kv_buffer: torch.Tensor,
           block_table: torch.Tensor, token_req: torch.Tensor, token_kv_len: torch.Tensor, part_out: torch.Tensor,
           part_lse: torch.Tensor, o_strides: tuple[int, int, int], lse_strides: tuple[int, int], num_splits: int,
           min_split_blocks: int, qk_scale: float, page_size: int, block_n: int, stages: int) -> None:
    """Stage 1 of `triton_kernels.mla_attention` for a config that `mla_gluon_fits` (it checked the shapes and
    made the arguments): q_nope [T, H, 512], q_rope [T, H, 64] bf16 / fp16, last dims contiguous; the pool
    kv_buffer [num_slots, 576]; part_out / part_lse and their strides as `_mla_kernel` takes them."""
    element = gl.bfloat16 if q_nope.dtype == torch.bfloat16 else gl.float16
    r, p = q_nope.shape[2], q_rope.shape[2]
    latent_desc = TensorDescriptor.from_tensor(
        kv_buffer, [block_n, r // 2], gl.NVMMASharedLayout.get_default_for([block_n, r // 2], element))
    rope_desc = TensorDescriptor.from_tensor(
        kv_buffer, [block_n, p], gl.NVMMASharedLayout.get_default_for([block_n, p], element))
    _gluon_mla_kernel[grid](
        q_nope, q_rope, kv_buffer, latent_desc, rope_desc, block_table, token_req, token_kv_len, part_out, part_lse,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), kv_buffer.stride(0),
        block_table.stride(0), *o_strides, *lse_strides, q_nope.shape[1], num_splits, min_split_blocks, qk_scale,
        R=r, P=p, BLOCK_N=block_n, PAGE_SIZE=page_size, STAGES=stages, SPLIT=num_splits > 1, num_warps=8,
    )
