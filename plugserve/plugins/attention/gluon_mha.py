"""Ragged MHA (prefill, and the chunked prefix's pass) for Hopper in Gluon: `mha_prefill.mha_varlen` for
configs with `gluon` set (`mha_gluon_fits`), scheduled as FlashAttention-3's forward kernel is at head dim 192
(no ping-pong between the consumers).

One program per (block of 128 queries, request, head), three warp-specialized partitions:
- a producer warp (24 registers) loads the query's two 64-row halves, then each key block's K and V into slot
  j % 2 of two-slot rings once both consumers have released that slot's previous block (empty barriers of count
  2), each part on its own ready barrier;
- two consumer warpgroups (240 registers each) take 64 query rows each. Step j issues the scores of key block j
  ([64, BLOCK_N] x the 192 columns as a 128- and a 64-column part), then the PV product of block j - 1 with its
  probabilities from registers, waits for the scores only, releases K j, runs block j's softmax while PV j - 1
  is still on the tensor cores, then waits for it, releases V j - 1 and rescales the output.
The consumers never wait for each other: each releases a slot on its own, and the producer refills it once both
have (one 8-warp partition waiting on a CTA barrier for each refill was slower: docs/kernels.md).

Causal (bottom-right): blocks below a query block's first diagonal and kv_len skip every mask; the blocks across
them are masked; the last query blocks, which see the most keys, start first. TMA boxes past a request's rows read
the next request's (finite: their scores are masked, their queries' outputs not stored) or zeros past the tensor.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from plugserve.plugins.attention.common import mha_softmax
from plugserve.plugins.gluon_support import release, tma_load

BLOCK_M = gl.constexpr(128)  # queries a program: 64 for each of two consumer warpgroups
HALF_M = gl.constexpr(64)  # query rows a consumer warpgroup: its wgmma M
S_WARPS = gl.constexpr([4, 1])  # a consumer partition's warps over rows and columns
# Consumer 1's and the producer's registers, FA3's split; Triton gives consumer 0 (the kernel's own warps) the same
# 240 and the producer warpgroup's 3 idle warps the rest.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _producer(q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1, q2, k1, k2, v, q_ready, k_ready, v_ready, k_empty,
              v_empty, q_row, k_col, v_col, kv_start, n_blocks, D1: gl.constexpr, BLOCK_N: gl.constexpr):
    """The TMA warp: the query's two 64-row halves, then each key block's K and V into slot j % 2 once both
    consumers have released that slot's previous block."""
    if n_blocks > 0:
        mbarrier.expect(q_ready, 2 * (q1_desc.block_type.nbytes + q2_desc.block_type.nbytes))
        for c in gl.static_range(2):
            tma_load(q1_desc, [q_row + c * HALF_M, k_col], q_ready, q1.index(c))
            tma_load(q2_desc, [q_row + c * HALF_M, k_col + D1], q_ready, q2.index(c))
    for j in range(n_blocks):
        slot = j % 2
        row = kv_start + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), ((j - 2) // 2) & 1, pred=j >= 2)
        mbarrier.expect(k_ready.index(slot), k1_desc.block_type.nbytes + k2_desc.block_type.nbytes)
        tma_load(k1_desc, [row, k_col], k_ready.index(slot), k1.index(slot))
        tma_load(k2_desc, [row, k_col + D1], k_ready.index(slot), k2.index(slot))
        mbarrier.wait(v_empty.index(slot), ((j - 2) // 2) & 1, pred=j >= 2)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [row, v_col], v_ready.index(slot), v.index(slot))


@gluon.jit
def _softmax(scores, j, full_blocks, rows, kv_len, diagonal, m, denom, qk_scale, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """`common.mha_softmax` of key block j's raw scores [64, BLOCK_N]: blocks from full_blocks on may hold
    keys past kv_len or (causal) past a row's diagonal, and take its masked path."""
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if j >= full_blocks:
        probs, m, denom, alpha = mha_softmax(m, denom, scores, rows, keys, kv_len, diagonal, qk_scale, True, CAUSAL)
    else:
        probs, m, denom, alpha = mha_softmax(m, denom, scores, rows, keys, kv_len, diagonal, qk_scale, False, CAUSAL)
    return probs, m, denom, alpha


@gluon.jit
def _consumer(q1, q2, k1, k2, v, q_ready, k_ready, v_ready, k_empty, v_empty, out_ptr, lse_ptr, q_start, q_len,
              m_block, h, kv_len, diagonal, n_blocks, full_blocks, stride_o_t, stride_o_h, stride_lse_t,
              stride_lse_h, qk_scale, C: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr):
    """Query rows C * 64 ... of the block, one warpgroup: each step issues the scores of key block j and the PV
    product of block j - 1, waits for the scores, runs block j's softmax beside PV j - 1, then rescales."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=S_WARPS,
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=S_WARPS, instr_shape=[16, DV, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = v.dtype
    rows = m_block * BLOCK_M + C * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    m = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    denom = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF_M, DV], gl.float32, o_layout)
    if n_blocks > 0:
        mbarrier.wait(q_ready, 0)
        q_lo, q_hi = q1.index(C), q2.index(C)
        mbarrier.wait(k_ready.index(0), 0)
        scores = warpgroup_mma(q_lo, k1.index(0).permute((1, 0)), gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout),
                               use_acc=False, is_async=True)
        scores = warpgroup_mma(q_hi, k2.index(0).permute((1, 0)), scores, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        release(k_empty.index(0))
        probs, m, denom, alpha = _softmax(scores, 0, full_blocks, rows, kv_len, diagonal, m, denom, qk_scale,
                                          BLOCK_N, CAUSAL, s_layout)
        p = gl.convert_layout(probs.to(dtype), p_operand)
        for j in range(1, n_blocks):
            slot = j % 2
            prev = (j - 1) % 2
            mbarrier.wait(k_ready.index(slot), (j // 2) & 1)
            scores = warpgroup_mma(q_lo, k1.index(slot).permute((1, 0)),
                                   gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            scores = warpgroup_mma(q_hi, k2.index(slot).permute((1, 0)), scores, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // 2) & 1)
            acc = warpgroup_mma(p, v.index(prev), acc, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            release(k_empty.index(slot))
            probs, m, denom, alpha = _softmax(scores, j, full_blocks, rows, kv_len, diagonal, m, denom, qk_scale,
                                              BLOCK_N, CAUSAL, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            release(v_empty.index(prev))
            p = gl.convert_layout(probs.to(dtype), p_operand)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = (n_blocks - 1) % 2
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // 2) & 1)
        acc = warpgroup_mma(p, v.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # Rows that saw no key: out 0 (acc is 0), lse -inf.
    seen = denom > 0
    safe_denom = gl.where(seen, denom, 1.0)
    rows_o = m_block * BLOCK_M + C * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(safe_denom, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(out_ptr + (q_start + rows_o).to(gl.int64)[:, None] * stride_o_t + h * stride_o_h + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows_o < q_len)[:, None])
    # m and log2(denom) are base 2; times ln 2 gives the natural-log lse the contract asks for.
    lse = gl.where(seen, (m + gl.log2(safe_denom)) * LN2, float("-inf"))
    gl.store(lse_ptr + (q_start + rows).to(gl.int64) * stride_lse_t + h * stride_lse_h, lse, mask=rows < q_len)


@gluon.jit
def _gluon_mha_kernel(
    q1_desc, q2_desc, k1_desc, k2_desc, v_desc, out_ptr, lse_ptr, cu_q_ptr, cu_kv_ptr,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, qk_scale,
    D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """q*_desc: q [T, H * (D1 + D2)] as [64, D1] and [64, D2] boxes; k*_desc: k [Tk, H * (D1 + D2)] as
    [BLOCK_N, D1] and [BLOCK_N, D2] boxes; v_desc: v [Tk, H * DV] as [BLOCK_N, DV] boxes. out [T, H, DV] in q's
    dtype, lse [T, H] float32 (natural log). qk_scale: the softmax scale times log2(e). num_warps 4: consumer 0;
    consumer 1 and the producer are workers."""
    gl.static_assert(num_warps == 4, "consumer 0 runs the kernel's warps; consumer 1 and the producer are workers")
    m_block = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    req = gl.program_id(1)
    h = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + req)
    q_len = gl.load(cu_q_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_start = gl.load(cu_kv_ptr + req)
    kv_len = gl.load(cu_kv_ptr + req + 1) - kv_start
    # Bottom-right causality: query i sees keys j <= kv_len - q_len + i.
    diagonal = kv_len - q_len
    kv_end = gl.minimum(kv_len, diagonal + (m_block + 1) * BLOCK_M) if CAUSAL else kv_len
    full = gl.minimum(kv_len, diagonal + m_block * BLOCK_M + 1) if CAUSAL else kv_len
    n_blocks = gl.cdiv(gl.maximum(kv_end, 0), BLOCK_N)
    full_blocks = gl.maximum(full, 0) // BLOCK_N

    dtype: gl.constexpr = q1_desc.dtype
    q1 = gl.allocate_shared_memory(dtype, [2, HALF_M, D1], q1_desc.layout)
    q2 = gl.allocate_shared_memory(dtype, [2, HALF_M, D2], q2_desc.layout)
    k1 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D1], k1_desc.layout)
    k2 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D2], k2_desc.layout)
    v = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DV], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_consumer, (q1, q2, k1, k2, v, q_ready, k_ready, v_ready, k_empty, v_empty, out_ptr, lse_ptr, q_start, q_len,
                     m_block, h, kv_len, diagonal, n_blocks, full_blocks, stride_o_t, stride_o_h, stride_lse_t,
                     stride_lse_h, qk_scale, 0, DV, BLOCK_N, CAUSAL)),
        (_consumer, (q1, q2, k1, k2, v, q_ready, k_ready, v_ready, k_empty, v_empty, out_ptr, lse_ptr, q_start, q_len,
                     m_block, h, kv_len, diagonal, n_blocks, full_blocks, stride_o_t, stride_o_h, stride_lse_t,
                     stride_lse_h, qk_scale, 1, DV, BLOCK_N, CAUSAL)),
        (_producer, (q1_desc, q2_desc, k1_desc, k2_desc, v_desc, q1, q2, k1, k2, v, q_ready, k_ready, v_ready,
                     k_empty, v_empty, q_start + m_block * BLOCK_M, h * (D1 + D2), h * DV, kv_start, n_blocks, D1,
                     BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(q_ready)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           cu_q: torch.Tensor, cu_kv: torch.Tensor, max_q_len: int, qk_scale: float, causal: bool,
           block_n: int) -> None:
    """`mha_prefill.mha_varlen` for a Gluon config (`mha_gluon_fits` checked the shapes): q [T, H, D1 + D2],
    k [Tk, H, D1 + D2], v [Tk, H, DV] bf16 / fp16 with heads packed in their rows; out [T, H, DV], lse [T, H]."""
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    d_qk, d_v = q.shape[2], v.shape[2]
    d1 = 1 << (d_qk.bit_length() - 1)

    def boxes(x: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], element)
        return TensorDescriptor.from_tensor(x.flatten(1), [rows, cols], layout)

    grid = (-(-max_q_len // BLOCK_M.value), cu_q.shape[0] - 1, q.shape[1])
    _gluon_mha_kernel[grid](
        boxes(q, 64, d1), boxes(q, 64, d_qk - d1), boxes(k, block_n, d1),
        boxes(k, block_n, d_qk - d1), boxes(v, block_n, d_v), out, lse, cu_q, cu_kv,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), qk_scale,
        D1=d1, D2=d_qk - d1, DV=d_v, BLOCK_N=block_n, CAUSAL=causal, num_warps=4,
    )
