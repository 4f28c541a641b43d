"""Ragged MHA (prefill, and the chunked prefix's pass) in Triton: flash attention over packed requests
(`mha_varlen`), causal bottom-right or not. On sm90 it runs the Gluon twin (`gluon_mha`) where `mha_gluon_fits`.

Softmaxes run in base 2 (scores scaled by sm_scale * log2(e)); log-sum-exps leave in natural log; accumulation is
float32. Imported only once a backend is built: see `common`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.plugins.attention.common import (
    LOG2E,
    MIN_DOT,
    gluon_runs_on,
    input_precision,
    last_dim_contiguous,
    launch_first_fitting,
    mha_softmax,
    pow2_at_least,
)
from plugserve.plugins.triton_support import tma_source


def _mha_tma_fits(*tensors: torch.Tensor) -> bool:
    """Each of q / k [T, H, Dqk] and v [T, H, Dv] read as a [T, H * D] TMA source: heads packed within a row."""
    return all(x.stride(1) == x.shape[2] and x.stride(2) == 1 and tma_source(x.flatten(1)) for x in tensors)


class MhaConfig(NamedTuple):
    """Launch parameters of `_mha_kernel`: queries and keys per block, num_warps, num_stages, whether Triton
    warp-specializes the unmasked key loop (producer warps loading K / V beside the consumers' dots), and whether
    K and V blocks load as TMA boxes (taken where k and v pack their heads in 16-byte aligned rows, pointers
    otherwise). gluon: `gluon_mha`'s kernel instead (`mha_gluon_fits`: 128 queries on two consumer
    warpgroups, num_warps 8, beside a TMA producer warp; two stages of block_n keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    tma: bool = False
    gluon: bool = False


# sm90's default where it fits: FA3's tiles at DeepSeek's 192 / 128 head dims (docs/kernels.md).
GLUON_MHA = MhaConfig(128, 128, 8, 2, gluon=True)


def mha_gluon_fits(config: MhaConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   capability: tuple[int, int] | None) -> bool:
    """Can `config` run as the Gluon kernel (`gluon_mha`): 128 x block_n tiles on 8 consumer warps, two stages; bf16 /
    fp16 with heads packed in rows (TMA boxes); the qk head dim a power of two of at most 256 plus a smaller
    power-of-two tail (192 = 128 + 64), a value head dim of at most 128 (the [128, Dv] float32 output in
    registers) and the tiles within sm90's shared memory; where `gluon_runs_on(capability)` (sm90)."""
    d_qk, d_v = q.shape[2], v.shape[2]
    d1 = 1 << (d_qk.bit_length() - 1)
    d2 = d_qk - d1
    shared = 2 * (128 * d_qk + 2 * config.block_n * (d_qk + d_v))
    return ((config.block_m, config.num_warps, config.num_stages) == (128, 8, 2) and config.block_n in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and MIN_DOT <= d2 < d1 <= 256 and d2 & (d2 - 1) == 0 and MIN_DOT <= d_v <= 128 and d_v & (d_v - 1) == 0
            and shared <= 220 * 1024 and _mha_tma_fits(q, k, v) and gluon_runs_on(capability))


def mha_configs(on_gpu: bool, block_dv: int, itemsize: int) -> list[MhaConfig]:
    """The fastest first (an H100 sweep at qk 192 / v 128 in bf16: docs/kernels.md). Value heads over 128 or fp32
    tiles start lower, to keep the [BLOCK_M, Dv] fp32 accumulator in registers; the rest of the list is for smaller
    shared memories."""
    if not on_gpu:
        return [MhaConfig(32, 32, 1, 1)]
    configs = [MhaConfig(128, 64, 8, 3), MhaConfig(64, 64, 4, 2), MhaConfig(32, 64, 4, 2), MhaConfig(32, 32, 4, 1),
               MhaConfig(16, 16, 4, 1)]
    if block_dv <= 128 and itemsize <= 2:
        return configs
    return configs[1:] if block_dv <= 256 else configs[2:]


@triton.jit
def _mha_scores(q1, q2, k_cols, k1_desc, k2_desc, row, k_col, d1, d2, offs_n, kv_len,
                D_QK: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, MASKED: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Raw scores [M, N] float32 of `_mha_kernel`'s queries against keys offs_n (k_cols [1, N]: pointers to their
    rows of this head; with TMA, boxes at key row `row` and columns k_col of the descriptors instead). MASKED:
    keys past kv_len load as zeros. A TMA box past kv_len reads the next request's keys (finite; `mha_softmax`
    masks their scores) or zeros past the tensor, and its columns past D_QK meet zeros in q."""
    if TMA:
        k1 = tl.trans(k1_desc.load([row, k_col]))  # [D1, N]
    elif MASKED:
        k1 = tl.load(k_cols + d1[:, None], mask=(offs_n < kv_len)[None, :] & (d1[:, None] < D_QK), other=0.0)
    else:
        k1 = tl.load(k_cols + d1[:, None], mask=d1[:, None] < D_QK, other=0.0)
    scores = tl.dot(q1, k1, input_precision=INPUT_PRECISION)
    if BLOCK_D2 > 0:
        if TMA:
            k2 = tl.trans(k2_desc.load([row, k_col + BLOCK_D1]))
        elif MASKED:
            k2 = tl.load(k_cols + d2[:, None], mask=(offs_n < kv_len)[None, :] & (d2[:, None] < D_QK), other=0.0)
        else:
            k2 = tl.load(k_cols + d2[:, None], mask=d2[:, None] < D_QK, other=0.0)
        scores += tl.dot(q2, k2, input_precision=INPUT_PRECISION)
    return scores


@triton.jit
def _mha_values(v_rows, v_desc, row, v_col, dv, offs_n, kv_len, D_V: tl.constexpr, MASKED: tl.constexpr,
                TMA: tl.constexpr):
    """The value block [N, DV] of keys offs_n (v_rows [N, 1]: pointers to their rows of this head; with TMA, the box
    at key row `row`, column v_col)."""
    if TMA:
        return v_desc.load([row, v_col])
    if MASKED:
        return tl.load(v_rows + dv[None, :], mask=(offs_n < kv_len)[:, None] & (dv[None, :] < D_V), other=0.0)
    return tl.load(v_rows + dv[None, :], mask=dv[None, :] < D_V, other=0.0)


@triton.jit
def _mha_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_kv_ptr, k1_desc, k2_desc, v_desc,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    qk_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, TMA: tl.constexpr,
):
    # One block of BLOCK_M queries of one request and one head. The qk head dim is covered by two
    # power-of-two blocks (192 = 128 + 64, 576 = 512 + 64) rather than one padded block (256, 1024).
    # Causal: the last query blocks see the most keys and start first (the grid's first programs take them),
    # so that the short ones fill the tail of the launch instead of a long one running alone at the end.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
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
    d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2 if BLOCK_D2 > 0 else 1)
    q2 = q1
    if BLOCK_D2 > 0:
        q2 = tl.load(q_rows + d2[None, :], mask=q_mask[:, None] & (d2[None, :] < D_QK), other=0.0)
    dv = tl.arange(0, BLOCK_DV)

    # Bottom-right causality: query i sees keys j <= kv_len - q_len + i.
    diagonal = kv_len - q_len
    kv_end = tl.minimum(kv_len, diagonal + (m_block + 1) * BLOCK_M) if CAUSAL else kv_len
    # Keys every row of the block sees (below the block's first diagonal and kv_len), in whole blocks: no masks.
    full = tl.minimum(kv_len, diagonal + m_block * BLOCK_M + 1) if CAUSAL else kv_len
    full_end = tl.maximum(full, 0) // BLOCK_N * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = k_ptr + kv_start.to(tl.int64) * stride_k_t + h * stride_k_h
    v_base = v_ptr + kv_start.to(tl.int64) * stride_v_t + h * stride_v_h
    keys = tl.arange(0, BLOCK_N).to(tl.int64)
    # Keys every row sees, in whole blocks, software-pipelined: each step computes the next block's scores before
    # this block's PV product, which stays in flight through the next step's softmax, so that the tensor cores
    # work on PV while the warps compute exponentials. The last step's look-ahead re-reads the last block (unused), and
    # the first block's scores load masked: with no full block (full_end 0) they are unused, and may pass kv_len.
    last_full = tl.maximum(full_end - BLOCK_N, 0)
    scores = _mha_scores(q1, q2, k_base + keys[None, :] * stride_k_t, k1_desc, k2_desc, kv_start, h * D_QK, d1, d2,
                         keys, kv_len, D_QK, BLOCK_D1, BLOCK_D2, True, INPUT_PRECISION, TMA)
    for block_start in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = block_start + keys
        probs, m, denom, alpha = mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale,
                                              False, CAUSAL)
        next_start = tl.minimum(block_start + BLOCK_N, last_full)
        scores = _mha_scores(q1, q2, k_base + (next_start + keys)[None, :] * stride_k_t, k1_desc, k2_desc,
                             kv_start + next_start, h * D_QK, d1, d2, next_start + keys, kv_len, D_QK, BLOCK_D1,
                             BLOCK_D2, False, INPUT_PRECISION, TMA)
        v = _mha_values(v_base + offs_n[:, None] * stride_v_t, v_desc, kv_start + block_start, h * D_V, dv, offs_n,
                        kv_len, D_V, False, TMA)
        # acc is first touched here, after the look-ahead's wait: the previous step's PV product ran beside this
        # step's softmax and the look-ahead, and its wait is the look-ahead's.
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=INPUT_PRECISION)
    # The blocks crossing kv_len or a row's diagonal, masked.
    for block_start in range(full_end, kv_end, BLOCK_N):
        offs_n = block_start + keys
        scores = _mha_scores(q1, q2, k_base + offs_n[None, :] * stride_k_t, k1_desc, k2_desc, kv_start + block_start,
                             h * D_QK, d1, d2, offs_n, kv_len, D_QK, BLOCK_D1, BLOCK_D2, True, INPUT_PRECISION, TMA)
        probs, m, denom, alpha = mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale,
                                              True, CAUSAL)
        v = _mha_values(v_base + offs_n[:, None] * stride_v_t, v_desc, kv_start + block_start, h * D_V, dv, offs_n,
                        kv_len, D_V, True, TMA)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=INPUT_PRECISION)

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
    config: MhaConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged MHA: q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (last dims contiguous), requests packed
    request-major; cu_q / cu_kv [B+1] int32 exclusive prefix sums of the per-request query / key
    counts; max_q_len the largest query count. Causal masks bottom-right. `config`: launch exactly this one
    (benchmarks/dev/sweep_triton_mha.py); None, the Gluon kernel where `mha_gluon_fits` (sm90), else the first of
    `mha_configs` this GPU's shared memory holds. Returns out [T, H, Dv] in q's dtype and lse [T, H] float32
    (natural log; -inf, out 0 where a query sees no key)."""
    t, h, d_qk = q.shape
    d_v = v.shape[2]
    out = torch.empty(t, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    gluon = GLUON_MHA if config is None else config
    if gluon.gluon and mha_gluon_fits(gluon, q, k, v, capability):
        from plugserve.plugins.attention import gluon_mha

        gluon_mha.launch(q, k, v, out, lse, cu_q, cu_kv, max_q_len, sm_scale * LOG2E, causal, gluon.block_n)
        return out, lse
    if config is not None and config.gluon:
        raise ValueError(f"MHA config {config} cannot run the Gluon kernel with q {tuple(q.shape)} {q.dtype}, "
                         f"v {tuple(v.shape)} on {'the CPU' if capability is None else f'sm{capability}'}")
    block_d1 = max(MIN_DOT, 1 << (d_qk.bit_length() - 1))  # the largest power of two <= d_qk
    tail = d_qk - block_d1
    block_d2 = pow2_at_least(tail, MIN_DOT) if tail > 0 else 0
    block_dv = pow2_at_least(d_v, MIN_DOT)
    args = (
        q, k, v, out, lse, cu_q, cu_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        sm_scale * LOG2E,
    )
    shape = dict(D_QK=d_qk, D_V=d_v, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_dv, CAUSAL=causal,
                 INPUT_PRECISION=input_precision(q.dtype))
    candidates = [config] if config is not None else mha_configs(q.is_cuda, block_dv, q.element_size())
    configs = [shape | dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                            WARP_SPECIALIZE=c.warp_specialize, TMA=c.tma and _mha_tma_fits(k, v))
               for c in candidates]
    num_requests = cu_q.shape[0] - 1

    def grid(meta: dict) -> tuple[int, int, int]:
        return triton.cdiv(max_q_len, meta["BLOCK_M"]), num_requests, h

    def launch_args(meta: dict) -> tuple:
        if not meta["TMA"]:
            return (*args[:7], None, None, None, *args[7:])
        keys, values = k.flatten(1), v.flatten(1)  # [Tk, H * D]: rows of every head's columns
        boxes = (TensorDescriptor.from_tensor(keys, [meta["BLOCK_N"], block_d1]),
                 TensorDescriptor.from_tensor(keys, [meta["BLOCK_N"], max(block_d2, MIN_DOT)]),
                 TensorDescriptor.from_tensor(values, [meta["BLOCK_N"], block_dv]))
        return (*args[:7], *boxes, *args[7:])

    launch_first_fitting(_mha_kernel, grid, launch_args, configs,
                          ("mha", q.device, q.dtype, d_qk, d_v, causal, config))
    return out, lse
