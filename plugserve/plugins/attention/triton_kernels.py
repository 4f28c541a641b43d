"""Triton kernels of the `triton` attention backend, and the launchers that size their grids.

Imported only once the backend is built (see `triton.py`): `triton.jit` decides when a kernel is
defined whether it compiles for the GPU or runs in the interpreter (TRITON_INTERPRET=1), so this
module must not be imported before that variable is set.

Kernels:
    _set_kv_kernel        latent ++ rope key of n tokens into their pool rows, one program per token
    _mla_kernel           absorbed MLA over the paged latent cache, one program per
                          (query token, block of heads, KV split); partial outputs + log2-sum-exp2
    _mla_reduce_kernel    combines the KV splits of one (token, head)
    _mha_kernel           flash attention over packed (varlen) requests, causal bottom-right or not
    _merge_kernel         log-sum-exp merge of two attention states

Softmaxes run in base 2 (exp2 is one instruction; exp is exp2 plus a multiply): scores are scaled
by sm_scale * log2(e), and log-sum-exps are converted back to natural log where they leave a kernel.
All accumulation is float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = math.log2(math.e)
# tl.dot needs every operand dimension >= 16.
MIN_DOT = 16
MLA_MIN_KEYS_PER_SPLIT = 256
MLA_MAX_SPLITS = 64
# The MLA accumulator [BLOCK_H, R] fp32 held in registers: 64 heads x 512 on 8 warps.
MLA_ACC_ELEMENTS = 64 * 512


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _input_precision(dtype: torch.dtype) -> str:
    """fp32 operands: exact products ("ieee"); the setting does not change fp16/bf16 dots. fp32 is the
    accuracy dtype here, not a serving one: single TF32 risks the kit's 2e-3 lse bound on 576-wide
    scores, and "tf32x3" needs over 232 KB of shared memory for the MLA kernel's fp32 tiles on H100
    even at 16 keys a block. "ieee" runs as FMA loops: correct, but ~1000x slower than bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Index of the config that fits, per launch key: tried once per process, then launched directly.
_FITTING_CONFIG: dict[tuple, int] = {}


def _launch_first_fitting(kernel, grid: tuple[int, ...] | Callable[[dict], tuple[int, ...]], args: tuple,
                          configs: list[dict], key: tuple) -> None:
    """Launch `kernel[grid](*args, **config)` with the first of `configs` (block sizes, num_warps,
    num_stages; largest first) whose shared memory this GPU holds (`grid` may be a function of the
    config). Tiles
    tuned on H100 (228 KB) overflow smaller GPUs (~100 KB on sm86 / sm89) and wide or fp32 heads;
    Triton raises OutOfResources before launching, so a refused config had no effect."""
    refused: OutOfResources | None = None
    for index in range(_FITTING_CONFIG.get(key, 0), len(configs)):
        try:
            kernel[grid](*args, **configs[index])
        except OutOfResources as exc:
            refused = exc
            continue
        _FITTING_CONFIG[key] = index
        return
    raise refused or ValueError("no config to launch")


# ----------------------------------------------------------------------------------------------------
# set_kv


@triton.jit
def _set_kv_kernel(
    buf_ptr, slots_ptr, latent_ptr, rope_ptr,
    stride_buf, stride_latent, stride_rope,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = buf_ptr + tl.load(slots_ptr + i).to(tl.int64) * stride_buf
    r = tl.arange(0, BLOCK_R)
    latent = tl.load(latent_ptr + i * stride_latent + r, mask=r < R)
    tl.store(row + r, latent.to(buf_ptr.dtype.element_ty), mask=r < R)
    p = tl.arange(0, BLOCK_P)
    rope = tl.load(rope_ptr + i * stride_rope + p, mask=p < P)
    tl.store(row + R + p, rope.to(buf_ptr.dtype.element_ty), mask=p < P)


def set_kv(buffer: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Write latent [n, R] and k_rope [n, P] (any float dtype, last dim contiguous) into rows `slots`
    [n] int64 of buffer [num_slots, R + P], cast to the buffer's dtype. One launch for both parts."""
    n, r = latent.shape
    p = k_rope.shape[1]
    if n == 0:
        return
    latent, k_rope, slots = _last_dim_contiguous(latent), _last_dim_contiguous(k_rope), slots.contiguous()
    _set_kv_kernel[(n,)](
        buffer, slots, latent, k_rope,
        buffer.stride(0), latent.stride(0), k_rope.stride(0),
        R=r, P=p, BLOCK_R=triton.next_power_of_2(r), BLOCK_P=triton.next_power_of_2(p),
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take strides for every dim but the last, whose unit stride keeps loads vectorized.
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------------
# Absorbed MLA over the paged latent cache


@triton.jit
def _mla_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, block_table_ptr, token_req_ptr, token_kv_len_ptr, out_ptr, lse_ptr,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_kv, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
    num_heads, page_size, qk_scale,
    R: tl.constexpr, P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # One query token, BLOCK_H of its heads, one contiguous range (split) of the keys it sees.
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    kv_len = tl.load(token_kv_len_ptr + t)
    # Splits of whole BLOCK_N blocks; the last ones may be empty when kv_len is short.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_nope = tl.load(
        q_nope_ptr + t * stride_qn_t + heads[:, None] * stride_qn_h + r[None, :],
        mask=head_mask[:, None] & (r[None, :] < R), other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + t * stride_qr_t + heads[:, None] * stride_qr_h + p[None, :],
        mask=head_mask[:, None] & (p[None, :] < P), other=0.0,
    )

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        n = block_start + tl.arange(0, BLOCK_N)
        key_mask = n < end
        page = tl.load(block_table_ptr + req * stride_bt + n // page_size, mask=key_mask, other=0)
        rows = kv_ptr + (page.to(tl.int64) * page_size + n % page_size)[:, None] * stride_kv
        latent = tl.load(rows + r[None, :], mask=key_mask[:, None] & (r[None, :] < R), other=0.0)  # [N, R]
        k_rope = tl.load(rows + R + p[None, :], mask=key_mask[:, None] & (p[None, :] < P), other=0.0)  # [N, P]
        scores = tl.dot(q_nope, tl.trans(latent), input_precision=INPUT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=INPUT_PRECISION)
        scores = tl.where(key_mask[None, :], scores * qk_scale, float("-inf"))
        # Every block holds at least one visible key, so m_new is finite from the first block on.
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision=INPUT_PRECISION)
        m = m_new

    # An empty split (start >= end) writes out 0 and lse -inf, which the reduce weights by 0.
    seen = denom > 0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s + r[None, :],
        out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & (r[None, :] < R),
    )
    if STORE_LSE:
        lse2 = tl.where(seen, m + tl.log2(tl.where(seen, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * stride_lse_t + heads * stride_lse_h + split, lse2, mask=head_mask)


@triton.jit
def _mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_o_t, stride_o_h,
    NUM_SPLITS: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.arange(0, BLOCK_R)
    lse2 = tl.load(part_lse_ptr + t * stride_pl_t + h * stride_pl_h + s, mask=s < NUM_SPLITS, other=float("-inf"))
    # Split 0 always holds key 0, so the max is finite; empty splits get weight exp2(-inf) = 0.
    weights = tl.exp2(lse2 - tl.max(lse2, 0))
    parts = tl.load(
        part_out_ptr + t * stride_po_t + h * stride_po_h + s[:, None] * stride_po_s + r[None, :],
        mask=(s[:, None] < NUM_SPLITS) & (r[None, :] < R), other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + r, out.to(out_ptr.dtype.element_ty), mask=r < R)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_buffer: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    page_size: int,
    sm_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Absorbed MLA, one row per query token.

    q_nope [T, H, R], q_rope [T, H, P] (fp16 / bf16 / fp32, last dim contiguous); kv_buffer
    [num_slots, R + P] of q's dtype (latent, then rope key); block_table [B, max_pages] int32;
    token_req [T] int32 (each token's block-table row); token_kv_len [T] int32 (keys the token sees:
    positions 0..len-1 of its request). `num_splits` >= 1 KV splits per token; with more than one,
    float32 partials [T, H, num_splits, R] are reduced by a second kernel.
    Returns out [T, H, R] in q's dtype.
    """
    t, h, r = q_nope.shape
    p = q_rope.shape[2]
    out = torch.empty(t, h, r, dtype=q_nope.dtype, device=q_nope.device)
    if t == 0:
        return out
    q_nope, q_rope = _last_dim_contiguous(q_nope), _last_dim_contiguous(q_rope)
    block_table = _last_dim_contiguous(block_table)
    block_h = mla_block_h(h, r)
    grid = (t, triton.cdiv(h, block_h), num_splits)
    if num_splits == 1:
        # Written straight into `out`: the split dim has stride 0 and no lse is kept.
        part_out, part_lse = out, out
        o_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        part_out = torch.empty(t, h, num_splits, r, dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty(t, h, num_splits, dtype=torch.float32, device=q_nope.device)
        o_strides = part_out.stride()[:3]
        lse_strides = part_lse.stride()[:2]
    args = (
        q_nope, q_rope, kv_buffer, block_table, token_req, token_kv_len, part_out, part_lse,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), kv_buffer.stride(0),
        block_table.stride(0), *o_strides, *lse_strides,
        h, page_size, sm_scale * LOG2E,
    )
    shape = dict(R=r, P=p, BLOCK_H=block_h, BLOCK_R=_pow2_at_least(r, MIN_DOT), BLOCK_P=_pow2_at_least(p, MIN_DOT),
                 STORE_LSE=num_splits > 1, INPUT_PRECISION=_input_precision(q_nope.dtype))
    configs = [shape | dict(BLOCK_N=n, num_warps=w, num_stages=st)
               for n, w, st in _mla_configs(q_nope.is_cuda, block_h)]
    _launch_first_fitting(_mla_kernel, grid, args, configs,
                          ("mla", q_nope.device, q_nope.dtype, r, p, block_h, num_splits > 1))
    if num_splits > 1:
        _mla_reduce_kernel[(t, h)](
            part_out, part_lse, out,
            *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, R=r, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_R=triton.next_power_of_2(r),
        )
    return out


def mla_block_h(num_heads: int, kv_lora_rank: int) -> int:
    """Heads per MLA program (the M of its dots). All heads of a program share every K tile it reads,
    so more heads mean less KV traffic, until the [BLOCK_H, R] fp32 accumulator outgrows registers:
    64 x 512 (H100, 8 warps: 64 heads ran 2x faster than 16 at batch 64 x 4k keys). At least 16,
    tl.dot's smallest M; a partial last block is masked."""
    fits = max(MIN_DOT, MLA_ACC_ELEMENTS // _pow2_at_least(kv_lora_rank, MIN_DOT))
    return min(fits, _pow2_at_least(num_heads, MIN_DOT))


def _mla_configs(on_gpu: bool, block_h: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, num_warps, num_stages), the fastest first: the first two led a sweep on H100 at 128
    heads in bf16 (64 heads x 64 keys on 8 warps, 2 stages: 0.38 ms at batch 64 x 4k keys against
    0.79 ms for 16 heads x 32 keys on 4); smaller ones for smaller shared memories and fp32 tiles.
    The interpreter runs programs one after another, so there bigger key blocks mean fewer Python
    steps."""
    if not on_gpu:
        return [(64, 1, 1)]
    if block_h >= 64:
        return [(64, 8, 2), (32, 8, 2), (32, 8, 1), (16, 8, 1)]
    return [(32, 4, 2), (32, 4, 1), (16, 4, 1)]


def mla_num_splits(max_kv_len: int, num_tokens: int, num_heads: int, kv_lora_rank: int, multiprocessors: int
                   ) -> int:
    """KV splits per token so that tokens x head blocks x splits programs fill about two waves of
    `multiprocessors`, with at least MLA_MIN_KEYS_PER_SPLIT keys a split (shorter splits cost more in
    partial traffic and the reduce than they win) and at most MLA_MAX_SPLITS. Batch 1 at 32k keys
    and 128 heads on 132 SMs: 2 head blocks x 64 splits of 512 keys."""
    rows = num_tokens * triton.cdiv(num_heads, mla_block_h(num_heads, kv_lora_rank))
    wanted = triton.cdiv(2 * multiprocessors, max(rows, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, MLA_MIN_KEYS_PER_SPLIT), MLA_MAX_SPLITS))


# ----------------------------------------------------------------------------------------------------
# Ragged MHA (flash attention over packed requests)


@triton.jit
def _mha_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_kv_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    qk_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # One block of BLOCK_M queries of one request and one head. The qk head dim is covered by two
    # power-of-two blocks (192 = 128 + 64, 576 = 512 + 64) rather than one padded block (256, 1024).
    m_block = tl.program_id(0)
    req = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_start = tl.load(cu_kv_ptr + req)
    kv_len = tl.load(cu_kv_ptr + req + 1) - kv_start

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_mask = offs_m < q_len
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_q_t + h * stride_q_h
    d1 = tl.arange(0, BLOCK_D1)
    q1 = tl.load(q_rows + d1[None, :], mask=q_mask[:, None] & (d1[None, :] < D_QK), other=0.0)
    if BLOCK_D2 > 0:
        d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + d2[None, :], mask=q_mask[:, None] & (d2[None, :] < D_QK), other=0.0)
    dv = tl.arange(0, BLOCK_DV)

    # Bottom-right causality: query i sees keys j <= kv_len - q_len + i.
    diagonal = kv_len - q_len
    kv_end = tl.minimum(kv_len, diagonal + (m_block + 1) * BLOCK_M) if CAUSAL else kv_len

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for block_start in range(0, kv_end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        key_mask = offs_n < kv_len
        k_cols = k_ptr + (kv_start + offs_n).to(tl.int64)[None, :] * stride_k_t + h * stride_k_h
        k1 = tl.load(k_cols + d1[:, None], mask=key_mask[None, :] & (d1[:, None] < D_QK), other=0.0)  # [D1, N]
        scores = tl.dot(q1, k1, input_precision=INPUT_PRECISION)
        if BLOCK_D2 > 0:
            k2 = tl.load(k_cols + d2[:, None], mask=key_mask[None, :] & (d2[:, None] < D_QK), other=0.0)
            scores += tl.dot(q2, k2, input_precision=INPUT_PRECISION)
        visible = key_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= diagonal + offs_m[:, None])
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row with no visible key yet keeps m = -inf; shifting it by 0 keeps its weights at 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        probs = tl.exp2(scores - shift[:, None])
        denom = denom * alpha + tl.sum(probs, 1)
        v = tl.load(
            v_ptr + (kv_start + offs_n).to(tl.int64)[:, None] * stride_v_t + h * stride_v_h + dv[None, :],
            mask=key_mask[:, None] & (dv[None, :] < D_V), other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m = m_new

    # Rows that saw no key: out 0 (acc is 0), lse -inf.
    seen = denom > 0
    safe_denom = tl.where(seen, denom, 1.0)
    out_rows = (q_start + offs_m).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * stride_o_t + h * stride_o_h + dv[None, :],
        (acc / safe_denom[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask[:, None] & (dv[None, :] < D_V),
    )
    # m and log2(denom) are base 2; times ln 2 gives the natural-log lse the contract asks for.
    lse = tl.where(seen, (m + tl.log2(safe_denom)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + out_rows * stride_lse_t + h * stride_lse_h, lse, mask=q_mask)


def mha_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged MHA: q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (last dims contiguous), requests packed
    request-major; cu_q / cu_kv [B+1] int32 exclusive prefix sums of the per-request query / key
    counts; max_q_len the largest query count. Causal masks bottom-right.
    Returns out [T, H, Dv] in q's dtype and lse [T, H] float32 (natural log; -inf, out 0 where a
    query sees no key)."""
    t, h, d_qk = q.shape
    d_v = v.shape[2]
    out = torch.empty(t, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_d1 = max(MIN_DOT, 1 << (d_qk.bit_length() - 1))  # the largest power of two <= d_qk
    tail = d_qk - block_d1
    block_d2 = _pow2_at_least(tail, MIN_DOT) if tail > 0 else 0
    block_dv = _pow2_at_least(d_v, MIN_DOT)
    args = (
        q, k, v, out, lse, cu_q, cu_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        sm_scale * LOG2E,
    )
    shape = dict(D_QK=d_qk, D_V=d_v, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_dv, CAUSAL=causal,
                 INPUT_PRECISION=_input_precision(q.dtype))
    configs = [shape | dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
               for m, n, w, st in _mha_configs(q.is_cuda, block_dv, q.element_size())]
    num_requests = cu_q.shape[0] - 1

    def grid(meta: dict) -> tuple[int, int, int]:
        return triton.cdiv(max_q_len, meta["BLOCK_M"]), num_requests, h

    _launch_first_fitting(_mha_kernel, grid, args, configs, ("mha", q.device, q.dtype, d_qk, d_v, causal))
    return out, lse


def _mha_configs(on_gpu: bool, block_dv: int, itemsize: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), the fastest first. 128 x 64 tiles on 8 warps led an
    H100 sweep at qk 192 / v 128 in bf16 (~380 TFLOP/s causal at 4k tokens; 64 x 64 on 4 warps ~340).
    Value heads over 128 or fp32 tiles start lower, to keep the [BLOCK_M, Dv] fp32 accumulator in
    registers; the rest of the list is for smaller shared memories."""
    if not on_gpu:
        return [(32, 32, 1, 1)]
    configs = [(128, 64, 8, 3), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)]
    if block_dv <= 128 and itemsize <= 2:
        return configs
    return configs[1:] if block_dv <= 256 else configs[2:]


# ----------------------------------------------------------------------------------------------------
# Merge of two attention states


@triton.jit
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    stride_oa_t, stride_oa_h, stride_la_t, stride_la_h, stride_ob_t, stride_ob_h, stride_lb_t, stride_lb_h,
    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    num_heads,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    mask = head_mask[:, None] & (d[None, :] < D)
    lse_a = tl.load(lse_a_ptr + t * stride_la_t + heads * stride_la_h, mask=head_mask, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + t * stride_lb_t + heads * stride_lb_h, mask=head_mask, other=float("-inf"))
    top = tl.maximum(lse_a, lse_b)
    empty = top == float("-inf")
    shift = tl.where(empty, 0.0, top)
    weight_a = tl.exp(lse_a - shift)
    weight_b = tl.exp(lse_b - shift)
    # Both sides empty: total would be 0; 1 keeps log and division finite, the selects below set the result.
    total = tl.where(empty, 1.0, weight_a + weight_b)
    lse = tl.where(empty, float("-inf"), shift + tl.log(total))
    out_a = tl.load(out_a_ptr + t * stride_oa_t + heads[:, None] * stride_oa_h + d[None, :], mask=mask, other=0.0)
    out_b = tl.load(out_b_ptr + t * stride_ob_t + heads[:, None] * stride_ob_h + d[None, :], mask=mask, other=0.0)
    # A side with lse -inf saw no key: drop it with a select, since its out may hold NaN and 0 * NaN is NaN.
    out = tl.where((lse_a == float("-inf"))[:, None], 0.0, (weight_a / total)[:, None] * out_a.to(tl.float32))
    out += tl.where((lse_b == float("-inf"))[:, None], 0.0, (weight_b / total)[:, None] * out_b.to(tl.float32))
    tl.store(out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + t * stride_l_t + heads * stride_l_h, lse, mask=head_mask)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_* [T, H, D] (last dim contiguous), lse_* [T, H] float32 -> (out [T, H, D] in out_a's dtype,
    lse [T, H] float32): lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
    A side with lse -inf contributes nothing; both -inf gives out 0, lse -inf."""
    t, h, d = out_a.shape
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    if t == 0:
        return out, lse
    out_a, out_b = _last_dim_contiguous(out_a), _last_dim_contiguous(out_b)
    lse_a, lse_b = lse_a.float(), lse_b.float()
    block_h = min(16, triton.next_power_of_2(h))
    _merge_kernel[(t, triton.cdiv(h, block_h))](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        h, D=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
    )
    return out, lse
