"""Absorbed MLA decode for Hopper in Gluon, scheduled as FlashMLA's sm90 kernel is ("seesaw"): stage 1 of
`mla_decode.mla_attention` for configs with `gluon` set (`mla_gluon_fits`).

The two warpgroups are warp-specialized partitions that take key blocks in turns, as FlashMLA does (its
docs/20250422-new-kernel-deep-dive.md), so that the tensor cores never wait while both run a softmax:
warpgroup 0 scores block b and warpgroup 1 block b + 1, each a [64, 64] x 576 wgmma (N = 64), and each holds half
of the [64, 512] output (the latent's low / high 256 columns, 128 float32 registers a thread). Per pair of blocks:

    WG0: softmax of b against the running max (sM) -> m0;  signal scale0   | WG1: wait scale0; softmax of b + 1
         O_L += P0 V_b,L (P0 from registers)                                |      against m0 -> m1; signal scale1
         wait scale1; P0 *= exp2(m0 - m1) into shared memory; signal P0     |      P1 into shared memory; signal P1
         O_L *= exp2(m0 - m1); O_L += P1 V_b+1,L (P1 from shared memory)    |      O_R *= exp2(m_prev - m1);
         scores of b + 2                                                    |      O_R += P1 V_b+1,R + P0 V_b,R
                                                                            |      scores of b + 3

so one warpgroup's softmax runs beside the other's wgmma. A stage's parts are refilled by the warpgroup that read
them last, as soon as its wgmma on them retires: the low latent half of stage 0 (block b) by WG0 after P0 V_b,L,
its high half and rope key by WG1 after P0 V_b,R; stage 1 likewise. Each part has its own TMA barrier, so the next
scores wait only for the parts they read.

Each warpgroup keeps the row sum of its own blocks' probabilities; the two are added once at the end. Shared
memory: the query's latent (64 KB; its rope part is a register operand of each warpgroup's score wgmma, so that
the second probability buffer fits), two 64-key stages (147 KB) and the two [64, 64] probability buffers (16 KB):
229 KB. The sequence's last, partial block is loaded through masked pointers, zeros past kv_len (a stale row of
the pool times a zero probability must not be NaN).

Every shared buffer a loop reads is indexed by `_opaque_zero` (plus 0 or 1): with constant indices the compiler
hoists the loop's wgmma descriptors (two registers each) out of it and spills them, and every wgmma then waits for
a local-memory load (docs/kernels.md has the profile).

An e4m3 pool (FP8: `--kv-cache-dtype fp8_e4m3`) runs both products as 8-bit wgmmas, at twice the 16-bit rate
(`AttentionBackend.rounds_decode_to_e4m3`: the kit's oracle rounds the query alike and bounds the rest):
- the query is rounded to e4m3 here, with one scale per head (its largest magnitude over the 576 dims / 448); with
  the pool's scale and the softmax scale that makes each head's score scale;
- probabilities are e4m3 too, 2^8 times too large (exp2(s - m + 8), at most 256, so that small ones keep their
  3-bit mantissa instead of flushing to zero), and the row sums with them, so that the output is unchanged;
- the query's rope part and every probability block are A operands in shared memory, not registers;
- an 8-bit wgmma reads its B operand K-major only, so the latent block [64 keys, 256] that P V multiplies is
  transposed in shared memory into [256, 64 keys] (`_transpose`), by a third warpgroup (`_transposer`: 32 registers
  a thread, warpgroups 0 and 1 at 240 and 232) as soon as a block lands, beside the other two's wgmmas and
  softmaxes; each P V waits for its block's copy (v_ready), the transposer for both P V wgmmas on the stage's last
  copy (v_free).
Shared memory: 36 KB of query, the stages' 72 KB, 64 KB of transposed halves and 12 KB of probabilities.
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

from plugserve.plugins.attention.common import mla_program
from plugserve.plugins.attention.gluon_mla_blocks import BLOCK_N, IO_LAYOUT, fill_block, load_rows
from plugserve.plugins.gluon_support import release

BLOCK_H = gl.constexpr(64)  # heads a program: one warpgroup's wgmma M
WORKER_REGS = gl.constexpr(256)  # warpgroup 1's registers: with warpgroup 0 at 256 too, the whole register file
# FP8: warpgroup 1's and the transposer's registers; warpgroup 0 gets what they leave, 240. Of the splits that fit,
# the one where ptxas spills least (`tools/compile_sm90.py`).
WORKER_REGS8 = gl.constexpr(232)
TRANSPOSER_REGS = gl.constexpr(32)
# A [64 keys, 128] chunk of an e4m3 latent block as `_transpose` holds it: a thread has 16 dims (one 16-byte shared
# load) of 4 keys, a warp's lanes 16 key groups side by side, so that its stores fill whole 64-key rows of the
# transposed buffer (with a thread's dims side by side across lanes, as a blocked layout has them, 8 of a warp's
# stores met in each bank: docs/kernels.md).
T_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0]],
    lane_bases=[[4, 0], [8, 0], [16, 0], [32, 0], [0, 16]],
    warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[64, 128]))
E4M3_MAX = gl.constexpr(448.0)
P_SHIFT8 = gl.constexpr(8.0)  # e4m3 probabilities are exp2(s - m + P_SHIFT8)


@gluon.constexpr_function
def _mma_layout(n, fp8):
    """One warpgroup's wgmma accumulator [64, n]: its scores (n = 64) or its output half (n = 256, DeepSeek's latent,
    `mla_gluon_fits`). An 8-bit wgmma instruction takes k 32 at a time, a 16-bit one 16."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32 if fp8 else 16])


@gluon.constexpr_function
def _a_operand(n, fp8):
    """A 16-bit wgmma A operand in registers (probabilities, the rope query) whose accumulator is [64, n]. (8-bit A
    operands are read from shared memory.)"""
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(n, fp8), k_width=2)


@gluon.constexpr_function
def _rows_of(n, fp8):
    """The per-head vectors [64] beside a [64, n] accumulator."""
    return gl.SliceLayout(1, _mma_layout(n, fp8))


@gluon.jit
def _rope_query(q_rope_ptr, q_rope_s, t, head_block, num_heads, stride_qr_t, stride_qr_h, P: gl.constexpr,
                FP8: gl.constexpr):
    """The head block's rope query [64, P] as a wgmma A operand: in registers (16-bit; loaded in the scores' layout,
    whose conversion to the operand's stays in registers: from a blocked layout it would take 8 KB of shared memory
    in each warpgroup, which the stages leave no room for), or (FP8) q_rope_s, where the kernel stored it in e4m3."""
    if FP8:
        operand = q_rope_s
    else:
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=_rows_of(BLOCK_N, FP8))
        operand = gl.convert_layout(load_rows(q_rope_ptr + t * stride_qr_t, heads, stride_qr_h, heads < num_heads, P,
                                               _mma_layout(BLOCK_N, FP8)), _a_operand(BLOCK_N, FP8))
    return operand


@gluon.jit
def _scores(q_lo, q_hi, q_rope, kv_lo, kv_hi, kv_rope, lo_ready, hi_ready, phase, FP8: gl.constexpr,
            PAGE_SIZE: gl.constexpr):
    """Raw scores [64, 64] float32 of the block in a stage (kv_lo, kv_hi, kv_rope: its parts), each part's wgmma issued
    once its barrier (phase) says it has landed; after cp.async fills (`gluon_mla_blocks.fill_block`) behind a proxy
    fence, which also covers the other warpgroup's P V wgmmas on the stage, issued after this one's next signal."""
    mbarrier.wait(lo_ready, phase)
    if PAGE_SIZE % BLOCK_N != 0:
        fence_async_shared()
    scores = warpgroup_mma(q_lo, kv_lo.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32,
                                                                 _mma_layout(BLOCK_N, FP8)),
                           use_acc=False, is_async=True)
    mbarrier.wait(hi_ready, phase)
    if PAGE_SIZE % BLOCK_N != 0:
        fence_async_shared()
    scores = warpgroup_mma(q_hi, kv_hi.permute((1, 0)), scores, is_async=True)
    scores = warpgroup_mma(q_rope, kv_rope.permute((1, 0)), scores, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(scores,))


@gluon.jit
def _transpose(src, dst):
    """dst [C, 64] = src [64, C]^T (e4m3, C a multiple of 128), in [64, 128] chunks through registers: an 8-bit
    wgmma's B operand must be K-major, and a latent block lands key-major. The caller fences before a wgmma reads
    dst."""
    for c in gl.static_range(src.shape[1] // 128):
        chunk = src.slice(c * 128, 128, dim=1).load(T_LAYOUT)
        dst.slice(c * 128, 128, dim=0).store(gl.permute(chunk, (1, 0)))


@gluon.jit
def _scaled(scores, b, full, kv_len, qk_scale, FP8: gl.constexpr):
    """Scores in base 2 (times qk_scale: a scalar, or [64, 1] per head), keys past kv_len at -inf (only in the last
    block, b >= full)."""
    scores = scores * qk_scale
    if b >= full:
        keys = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _mma_layout(BLOCK_N, FP8)))
        scores = gl.where((keys < kv_len)[None, :], scores, float("-inf"))
    return scores


@gluon.jit
def _signal(bar):
    """Arrive on `bar` once this warpgroup's shared-memory writes are all done (count 1: one thread arrives)."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _opaque_zero(j):
    """0, as an instruction the compiler neither folds nor hoists out of loop iteration j (see the module's
    docstring)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _transposer(kv_lo, kv_hi, v_lo, v_hi, bars, v_ready, v_free, first, last):
    """FP8's third warpgroup: each block's latent halves transposed into v_lo / v_hi (the P V operands) once its
    stage has landed and the wgmmas that read the stage's previous copies have retired (v_free, one arrival from
    each warpgroup), then v_ready."""
    for k in range(last - first):
        s = k % 2
        n = k // 2
        mbarrier.wait(bars.index(s), n & 1)  # the stage's low half
        mbarrier.wait(bars.index(2 + s), n & 1)  # its high half and rope key
        if k >= 2:
            mbarrier.wait(v_free.index(s), (n - 1) & 1)
        _transpose(kv_lo.index(s), v_lo.index(s))
        _transpose(kv_hi.index(s), v_hi.index(s))
        fence_async_shared()
        release(v_ready.index(s))


@gluon.jit
def _v_operand(v, FP8: gl.constexpr):
    """A P V wgmma's B operand [64 keys, 256] from a latent half's buffer: the stage's own (16-bit), or its
    transposed copy [256, 64 keys] (FP8)."""
    if FP8:
        v = v.permute((1, 0))
    return v


@gluon.jit
def _score_operands(q_rope_ptr, q_rope_s, s_qscale, t, head_block, num_heads, stride_qr_t, stride_qr_h, qk_scale,
                    P: gl.constexpr, FP8: gl.constexpr):
    """A warpgroup's rope query operand (`_rope_query`) and what its raw scores are multiplied by: qk_scale, or (FP8)
    qk_scale times each head's query scale, [64, 1]."""
    q_rope = _rope_query(q_rope_ptr, q_rope_s, t, head_block, num_heads, stride_qr_t, stride_qr_h, P, FP8)
    if FP8:
        qk_scale = (s_qscale.load(_rows_of(BLOCK_N, FP8)) * qk_scale)[:, None]
    return q_rope, qk_scale


@gluon.jit
def _warpgroup0(q, q_rope_s, kv_lo, kv_hi, kv_rope, v_lo, p_smem, p_own, s_max, s_scale1, s_l, s_qscale, bars,
                v_ready, v_free, latent_desc, kv_ptr, q_rope_ptr, out_ptr, lse_ptr, block_table_row, stride_kv, t,
                head_block, split, num_heads, stride_qr_t, stride_qr_h, stride_o_t, stride_o_h, stride_o_s,
                stride_lse_t, stride_lse_h, first, last, full, kv_len, qk_scale, kv_scale, R: gl.constexpr,
                P: gl.constexpr,
                PAGE_SIZE: gl.constexpr, SPLIT: gl.constexpr, FP8: gl.constexpr):
    """Blocks first, first + 2, ...: their scores and softmax, and the output's low latent half over every block.
    v_lo: the low halves' P V operands (`_v_operand`); p_own (FP8): P0 in e4m3 for this warpgroup's own wgmma."""
    P16: gl.constexpr = gl.bfloat16 if FP8 else p_smem.dtype
    ROW_S: gl.constexpr = _rows_of(BLOCK_N, FP8)
    ROW_O: gl.constexpr = _rows_of(R // 2, FP8)
    q_rope, score_scale = _score_operands(q_rope_ptr, q_rope_s, s_qscale, t, head_block, num_heads, stride_qr_t,
                                          stride_qr_h, qk_scale, P, FP8)
    lo_ready, hi_ready = bars.index(0), bars.index(2)
    scale0_ready, scale1_ready, p0_ready, p1_ready = bars.index(4), bars.index(5), bars.index(6), bars.index(7)
    l1_ready, l_ready = bars.index(8), bars.index(9)

    acc = gl.zeros([BLOCK_H, R // 2], gl.float32, _mma_layout(R // 2, FP8))
    denom = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    scores = _scores(q.index(0), q.index(1), q_rope, kv_lo.index(0), kv_hi.index(0), kv_rope.index(0), lo_ready,
                     hi_ready, 0, FP8, PAGE_SIZE)
    for j in range(gl.cdiv(last - first, 2)):
        z = _opaque_zero(j)
        b = first + 2 * j
        second = b + 1 < last
        s = _scaled(scores, b, full, kv_len, score_scale, FP8)
        m_old = s_max.load(ROW_S)
        m0 = gl.maximum(m_old, gl.max(s, 1))
        scale0 = gl.exp2(m_old - m0)
        probs = gl.exp2(s - (m0 - P_SHIFT8 if FP8 else m0)[:, None])
        denom = denom * scale0 + gl.sum(probs, 1)
        gl.thread_barrier()  # every thread has read sM before it changes
        s_max.store(m0)
        _signal(scale0_ready)
        acc = acc * gl.convert_layout(scale0, ROW_O)[:, None]
        # Only the 16-bit probabilities stay live (register room): P0 for warpgroup 1 is rounded twice, once here
        # and once after it moves to the pair's max (exactly once where that max is this block's).
        p0 = probs.to(P16)
        if FP8:
            p_own.store(p0.to(p_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.wait(v_ready.index(z), j & 1)
            acc = warpgroup_mma(p_own, _v_operand(v_lo.index(z), FP8), acc, is_async=True)
        else:
            acc = warpgroup_mma(gl.convert_layout(p0, _a_operand(R // 2, FP8)), kv_lo.index(z), acc, is_async=True)
        mbarrier.wait(scale1_ready, j & 1)
        scale1 = s_scale1.load(ROW_S)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if FP8:
            release(v_free.index(z))
        # Stage 0's low half is read by no one else: it refills with block b + 2 now.
        fill_block(latent_desc, kv_ptr, kv_lo.index(z), lo_ready, block_table_row, stride_kv, b + 2, last, full,
                   kv_len, 0, R // 2, PAGE_SIZE)
        # P0 against the pair's max, for warpgroup 1's half; this warpgroup's half and sum move to that max too.
        p_smem.index(z).store((p0.to(gl.float32) * scale1[:, None]).to(p_smem.dtype))
        _signal(p0_ready)
        denom = denom * scale1
        acc = acc * gl.convert_layout(scale1, ROW_O)[:, None]
        if second:
            mbarrier.wait(p1_ready, j & 1)
            if FP8:
                mbarrier.wait(v_ready.index(z + 1), j & 1)
            acc = warpgroup_mma(p_smem.index(z + 1), _v_operand(v_lo.index(z + 1), FP8), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if FP8:
                release(v_free.index(z + 1))
            fill_block(latent_desc, kv_ptr, kv_lo.index(z + 1), bars.index(1), block_table_row, stride_kv, b + 3, last,
                       full, kv_len, 0, R // 2, PAGE_SIZE)
        if b + 2 < last:
            scores = _scores(q.index(z), q.index(z + 1), q_rope, kv_lo.index(z), kv_hi.index(z), kv_rope.index(z),
                             lo_ready, hi_ready, (j + 1) & 1, FP8, PAGE_SIZE)

    # Both halves' sums at the pair's final max: warpgroup 1's is added here, and the total goes back to it.
    mbarrier.wait(l1_ready, 0)
    denom = denom + s_l.load(ROW_S)
    m = s_max.load(ROW_S)
    gl.thread_barrier()
    s_l.store(denom)
    _signal(l_ready)
    _store_half(acc, denom, out_ptr, t, head_block, split, num_heads, stride_o_t, stride_o_h, stride_o_s, 0, kv_scale,
                R, FP8)
    if SPLIT:
        lse_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        lse = m + gl.log2(denom) - P_SHIFT8 if FP8 else m + gl.log2(denom)
        gl.store(lse_ptr + t * stride_lse_t + lse_heads * stride_lse_h + split, lse, mask=lse_heads < num_heads)


@gluon.jit
def _warpgroup1(q, q_rope_s, kv_lo, kv_hi, kv_rope, v_hi, p_smem, s_max, s_scale1, s_l, s_qscale, bars, v_ready,
                v_free, latent_desc,
                rope_desc, kv_ptr, q_rope_ptr, out_ptr, block_table_row, stride_kv, t, head_block, split, num_heads,
                stride_qr_t, stride_qr_h, stride_o_t, stride_o_h, stride_o_s, first, last, full, kv_len, qk_scale,
                kv_scale, R: gl.constexpr, P: gl.constexpr, PAGE_SIZE: gl.constexpr, FP8: gl.constexpr):
    """Blocks first + 1, first + 3, ...: their scores and softmax, and the output's high latent half over every
    block. v_hi: the high halves' P V operands (`_v_operand`)."""
    ROW_S: gl.constexpr = _rows_of(BLOCK_N, FP8)
    ROW_O: gl.constexpr = _rows_of(R // 2, FP8)
    q_rope, score_scale = _score_operands(q_rope_ptr, q_rope_s, s_qscale, t, head_block, num_heads, stride_qr_t,
                                          stride_qr_h, qk_scale, P, FP8)
    lo_ready, hi_ready = bars.index(1), bars.index(3)
    scale0_ready, scale1_ready, p0_ready, p1_ready = bars.index(4), bars.index(5), bars.index(6), bars.index(7)
    l1_ready, l_ready = bars.index(8), bars.index(9)

    acc = gl.zeros([BLOCK_H, R // 2], gl.float32, _mma_layout(R // 2, FP8))
    denom = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    m_prev = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    scores = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, _mma_layout(BLOCK_N, FP8))
    if first + 1 < last:
        scores = _scores(q.index(0), q.index(1), q_rope, kv_lo.index(1), kv_hi.index(1), kv_rope.index(1), lo_ready,
                         hi_ready, 0, FP8, PAGE_SIZE)
    for j in range(gl.cdiv(last - first, 2)):
        z = _opaque_zero(j)
        b = first + 2 * j
        second = b + 1 < last
        mbarrier.wait(scale0_ready, j & 1)
        m0 = s_max.load(ROW_S)
        if second:
            s = _scaled(scores, b + 1, full, kv_len, score_scale, FP8)
        else:
            s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, _mma_layout(BLOCK_N, FP8))
        m1 = gl.maximum(m0, gl.max(s, 1))
        gl.thread_barrier()  # every thread has read sM before it changes
        s_max.store(m1)
        s_scale1.store(gl.exp2(m0 - m1))
        _signal(scale1_ready)
        probs = gl.exp2(s - (m1 - P_SHIFT8 if FP8 else m1)[:, None])
        factor = gl.exp2(m_prev - m1)
        denom = denom * factor + gl.sum(probs, 1)
        acc = acc * gl.convert_layout(factor, ROW_O)[:, None]
        m_prev = m1
        if FP8:
            # P0's wgmma is issued at one place for both cases: with a copy in each branch, ptxas (triton 3.6's) read
            # the second k-step's B descriptor, in the branch without P1, from registers only the other one sets.
            if second:
                p_smem.index(z + 1).store(probs.to(p_smem.dtype))
                _signal(p1_ready)
                mbarrier.wait(v_ready.index(z + 1), j & 1)
                acc = warpgroup_mma(p_smem.index(z + 1), _v_operand(v_hi.index(z + 1), FP8), acc, is_async=True)
                # Stage 1's high half and rope key are read by no one else now (transposed, scored): they refill
                # with block b + 3.
                fill_block(latent_desc, kv_ptr, kv_hi.index(z + 1), hi_ready, block_table_row, stride_kv, b + 3, last,
                           full, kv_len, R // 2, R // 2, PAGE_SIZE)
                fill_block(rope_desc, kv_ptr, kv_rope.index(z + 1), hi_ready, block_table_row, stride_kv, b + 3, last,
                           full, kv_len, R, P, PAGE_SIZE)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                release(v_free.index(z + 1))
            mbarrier.wait(p0_ready, j & 1)
            mbarrier.wait(v_ready.index(z), j & 1)
            acc = warpgroup_mma(p_smem.index(z), _v_operand(v_hi.index(z), FP8), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            release(v_free.index(z))
        elif second:
            p1 = probs.to(p_smem.dtype)
            p_smem.index(z + 1).store(p1)
            _signal(p1_ready)
            p1 = gl.convert_layout(p1, _a_operand(R // 2, FP8))
            acc = warpgroup_mma(p1, kv_hi.index(z + 1), acc, is_async=True)
            mbarrier.wait(p0_ready, j & 1)
            acc = warpgroup_mma(p_smem.index(z), kv_hi.index(z), acc, is_async=True)
            warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
            # Stage 1's high half and rope key are read by no one else now: they refill with block b + 3.
            fill_block(latent_desc, kv_ptr, kv_hi.index(z + 1), hi_ready, block_table_row, stride_kv, b + 3, last, full,
                       kv_len, R // 2, R // 2, PAGE_SIZE)
            fill_block(rope_desc, kv_ptr, kv_rope.index(z + 1), hi_ready, block_table_row, stride_kv, b + 3, last, full,
                       kv_len, R, P, PAGE_SIZE)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            mbarrier.wait(p0_ready, j & 1)
            acc = warpgroup_mma(p_smem.index(z), kv_hi.index(z), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        fill_block(latent_desc, kv_ptr, kv_hi.index(z), bars.index(2), block_table_row, stride_kv, b + 2, last, full,
                   kv_len, R // 2, R // 2, PAGE_SIZE)
        fill_block(rope_desc, kv_ptr, kv_rope.index(z), bars.index(2), block_table_row, stride_kv, b + 2, last, full,
                   kv_len, R, P, PAGE_SIZE)
        if b + 3 < last:
            scores = _scores(q.index(z), q.index(z + 1), q_rope, kv_lo.index(z + 1), kv_hi.index(z + 1),
                             kv_rope.index(z + 1), lo_ready, hi_ready, (j + 1) & 1, FP8, PAGE_SIZE)

    s_l.store(denom)
    _signal(l1_ready)
    mbarrier.wait(l_ready, 0)
    denom = s_l.load(ROW_S)
    _store_half(acc, denom, out_ptr, t, head_block, split, num_heads, stride_o_t, stride_o_h, stride_o_s, R // 2,
                kv_scale, R, FP8)


@gluon.jit
def _store_half(acc, denom, out_ptr, t, head_block, split, num_heads, stride_o_t, stride_o_h, stride_o_s, col0,
                kv_scale, R: gl.constexpr, FP8: gl.constexpr):
    """acc / denom (FP8: times the pool's kv_scale) into the output's (or the split's partial's) columns
    col0 .. col0 + R / 2."""
    O_LAYOUT: gl.constexpr = _mma_layout(R // 2, FP8)
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
    cols = col0 + gl.arange(0, R // 2, layout=gl.SliceLayout(0, O_LAYOUT))
    ptrs = out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s + cols[None, :]
    if FP8:
        denom = denom / kv_scale
    out = acc / gl.convert_layout(denom, gl.SliceLayout(1, O_LAYOUT))[:, None]
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads < num_heads)[:, None])


@gluon.jit
def _gluon_mla_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, latent_desc, rope_desc, block_table_ptr, token_req_ptr, token_kv_len_ptr,
    out_ptr, lse_ptr,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_kv, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
    num_heads, num_splits, min_split_blocks, qk_scale, kv_scale,
    R: gl.constexpr, P: gl.constexpr, PAGE_SIZE: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr,
):
    """kv_ptr: the pool [num_slots, R + P], of q's dtype or e4m3 (FP8: value / kv_scale); latent_desc / rope_desc: its
    [64, R / 2] and [64, P] TMA boxes. SPLIT: out_ptr / lse_ptr are float32 partials and base-2 log-sum-exps (unit
    stride over splits), else out_ptr is the output. qk_scale: the softmax scale times log2(e) (FP8: and kv_scale).
    num_warps 4: warpgroup 0; warpgroup 1 is the worker."""
    gl.static_assert(num_warps == 4, "warpgroup 0 runs the kernel's warps, warpgroup 1 a worker partition")
    head_block, split, t, req, kv_len, first, last = mla_program(
        num_heads, num_splits, min_split_blocks, token_req_ptr, token_kv_len_ptr, BLOCK_H, BLOCK_N)
    full = gl.minimum(last, kv_len // BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, IO_LAYOUT)
    if first >= last:
        if SPLIT:
            heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_layout)
            gl.store(lse_ptr + t * stride_lse_t + heads * stride_lse_h + split,
                     gl.full([BLOCK_H], float("-inf"), gl.float32, row_layout), mask=heads < num_heads)
        return

    dtype: gl.constexpr = kv_ptr.dtype.element_ty  # of the operands: q's, or e4m3 (FP8)
    FP8: gl.constexpr = dtype != q_nope_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R // 2], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q = gl.allocate_shared_memory(dtype, [2, BLOCK_H, R // 2], q_layout)
    kv_lo = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R // 2], latent_desc.layout)
    kv_hi = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R // 2], latent_desc.layout)
    kv_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, P], rope_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], p_layout)
    if FP8:  # each stage's latent halves transposed (the P V operands, `_v_operand`); 8-bit A operands
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R // 2, BLOCK_N], dtype)
        v_lo = gl.allocate_shared_memory(dtype, [2, R // 2, BLOCK_N], v_layout)
        v_hi = gl.allocate_shared_memory(dtype, [2, R // 2, BLOCK_N], v_layout)
        q_rope_s = gl.allocate_shared_memory(dtype, [BLOCK_H, P], gl.NVMMASharedLayout.get_default_for([BLOCK_H, P],
                                                                                                       dtype))
        p_own = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_free.index(i), count=2)
    else:  # the stages' own halves; the rope query and P0 in registers; no transposer (unused here)
        v_lo, v_hi, q_rope_s, p_own = kv_lo, kv_hi, q, p_smem
    # Per head: the running row max, exp2(m0 - m1) of the pair, the row-sum exchange, the query's scale (FP8).
    s_max = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stats_layout)
    s_scale1 = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stats_layout)
    s_l = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stats_layout)
    s_qscale = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stats_layout)
    # lo_ready[2], hi_ready[2] (a stage's high half and rope key: two fills, two arrivals), then scale0, scale1,
    # p0, p1, l1 and l ready (one arrival each).
    bars = gl.allocate_shared_memory(gl.int64, [10, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(10):
        mbarrier.init(bars.index(i), count=2 if i == 2 or i == 3 else 1)
    if not FP8:
        v_ready, v_free = bars, bars  # (unused)
    fence_async_shared()
    gl.thread_barrier()

    block_table_row = block_table_ptr + req * stride_bt
    for s in gl.static_range(2):
        fill_block(latent_desc, kv_ptr, kv_lo.index(s), bars.index(s), block_table_row, stride_kv, first + s, last,
                   full, kv_len, 0, R // 2, PAGE_SIZE)
        fill_block(latent_desc, kv_ptr, kv_hi.index(s), bars.index(2 + s), block_table_row, stride_kv, first + s,
                   last, full, kv_len, R // 2, R // 2, PAGE_SIZE)
        fill_block(rope_desc, kv_ptr, kv_rope.index(s), bars.index(2 + s), block_table_row, stride_kv, first + s,
                   last, full, kv_len, R, P, PAGE_SIZE)
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_layout)
    q_base = q_nope_ptr + t * stride_qn_t
    q_lo = load_rows(q_base, heads, stride_qn_h, heads < num_heads, R // 2, IO_LAYOUT)
    q_hi = load_rows(q_base + R // 2, heads, stride_qn_h, heads < num_heads, R // 2, IO_LAYOUT)
    if FP8:  # each head's scale: its largest magnitude over the latent and rope parts, at e4m3's largest value
        rope = load_rows(q_rope_ptr + t * stride_qr_t, heads, stride_qr_h, heads < num_heads, P, IO_LAYOUT)
        amax = gl.maximum(gl.maximum(gl.max(gl.abs(q_lo), 1), gl.max(gl.abs(q_hi), 1)), gl.max(gl.abs(rope), 1))
        q_scale = gl.maximum(amax.to(gl.float32), 1e-30) / E4M3_MAX
        s_qscale.store(q_scale)
        q_rope_s.store((rope.to(gl.float32) / q_scale[:, None]).to(dtype))
        q_lo = (q_lo.to(gl.float32) / q_scale[:, None]).to(dtype)
        q_hi = (q_hi.to(gl.float32) / q_scale[:, None]).to(dtype)
    q.index(0).store(q_lo)
    q.index(1).store(q_hi)
    s_max.store(gl.full([BLOCK_H], float("-inf"), gl.float32, row_layout))
    fence_async_shared()
    gl.thread_barrier()

    # The argument lists are written twice: a tuple variable would lose their constexprs.
    if FP8:
        gl.warp_specialize([
            (_warpgroup0, (q, q_rope_s, kv_lo, kv_hi, kv_rope, v_lo, p_smem, p_own, s_max, s_scale1, s_l, s_qscale,
                           bars, v_ready, v_free, latent_desc, kv_ptr, q_rope_ptr, out_ptr, lse_ptr, block_table_row,
                           stride_kv, t, head_block, split, num_heads, stride_qr_t, stride_qr_h, stride_o_t,
                           stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, first, last, full, kv_len, qk_scale,
                           kv_scale, R, P, PAGE_SIZE, SPLIT, FP8)),
            (_warpgroup1, (q, q_rope_s, kv_lo, kv_hi, kv_rope, v_hi, p_smem, s_max, s_scale1, s_l, s_qscale, bars,
                           v_ready, v_free, latent_desc, rope_desc, kv_ptr, q_rope_ptr, out_ptr, block_table_row,
                           stride_kv, t, head_block, split, num_heads, stride_qr_t, stride_qr_h, stride_o_t,
                           stride_o_h, stride_o_s, first, last, full, kv_len, qk_scale, kv_scale, R, P, PAGE_SIZE,
                           FP8)),
            (_transposer, (kv_lo, kv_hi, v_lo, v_hi, bars, v_ready, v_free, first, last)),
        ], [4, 4], [WORKER_REGS8, TRANSPOSER_REGS])
    else:
        gl.warp_specialize([
            (_warpgroup0, (q, q_rope_s, kv_lo, kv_hi, kv_rope, v_lo, p_smem, p_own, s_max, s_scale1, s_l, s_qscale,
                           bars, v_ready, v_free, latent_desc, kv_ptr, q_rope_ptr, out_ptr, lse_ptr, block_table_row,
                           stride_kv, t, head_block, split, num_heads, stride_qr_t, stride_qr_h, stride_o_t,
                           stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, first, last, full, kv_len, qk_scale,
                           kv_scale, R, P, PAGE_SIZE, SPLIT, FP8)),
            (_warpgroup1, (q, q_rope_s, kv_lo, kv_hi, kv_rope, v_hi, p_smem, s_max, s_scale1, s_l, s_qscale, bars,
                           v_ready, v_free, latent_desc, rope_desc, kv_ptr, q_rope_ptr, out_ptr, block_table_row,
                           stride_kv, t, head_block, split, num_heads, stride_qr_t, stride_qr_h, stride_o_t,
                           stride_o_h, stride_o_s, first, last, full, kv_len, qk_scale, kv_scale, R, P, PAGE_SIZE,
                           FP8)),
        ], [4], [WORKER_REGS])
    for i in gl.static_range(10):
        mbarrier.invalidate(bars.index(i))


def launch(grid: tuple[int], q_nope: torch.Tensor, q_rope: torch.Tensor, kv_buffer: torch.Tensor,
           block_table: torch.Tensor, token_req: torch.Tensor, token_kv_len: torch.Tensor, part_out: torch.Tensor,
           part_lse: torch.Tensor, o_strides: tuple[int, int, int], lse_strides: tuple[int, int], num_splits: int,
           min_split_blocks: int, qk_scale: float, page_size: int, kv_scale: float = 1.0) -> None:
    """Stage 1 of `mla_decode.mla_attention` for a Gluon config (`mla_gluon_fits` checked the shapes):
    q_nope [T, H, 512], q_rope [T, H, 64] bf16 / fp16, last dims contiguous; the pool kv_buffer [num_slots, 576] of
    q's dtype, or float8_e4m3fn holding value / kv_scale; part_out / part_lse and their strides as `_mla_kernel` takes
    them."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[
        kv_buffer.dtype]
    r, p = q_nope.shape[2], q_rope.shape[2]
    latent_desc = TensorDescriptor.from_tensor(
        kv_buffer, [64, r // 2], gl.NVMMASharedLayout.get_default_for([64, r // 2], element))
    rope_desc = TensorDescriptor.from_tensor(kv_buffer, [64, p], gl.NVMMASharedLayout.get_default_for([64, p], element))
    _gluon_mla_kernel[grid](
        q_nope, q_rope, kv_buffer, latent_desc, rope_desc, block_table, token_req, token_kv_len, part_out, part_lse,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), kv_buffer.stride(0),
        block_table.stride(0), *o_strides, *lse_strides, q_nope.shape[1], num_splits, min_split_blocks,
        qk_scale * kv_scale, kv_scale, R=r, P=p, PAGE_SIZE=page_size, SPLIT=num_splits > 1, num_warps=4,
    )
