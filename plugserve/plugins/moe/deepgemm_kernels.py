"""Layouts and Triton kernels around DeepGEMM's grouped GEMMs for the `deepgemm` MoE backend. Imported lazily
(by `plugserve.plugins.moe.deepgemm`): with TRITON_INTERPRET=1 set before this import they run on the CPU.

Notation: T tokens, k experts per token, P = T * k token-expert pairs (pair p = t * k + j), E experts,
H hidden size, I intermediate size. Both layouts give each pair one row of the GEMMs' A / D matrices,
`dst[p]` (-1: the pair's expert id is outside [0, E) and it contributes nothing):

- masked (decode): A is [E, max_m, H]; expert e's pairs take rows e * max_m + 0, 1, ... in pair order,
  `masked_m[e]` of them. max_m is a multiple of 128, the largest row tile of the masked kernel, so that no
  tile of one expert reaches into the next one's rows; each expert gets at most T <= max_m pairs when a
  token's k experts are distinct, as every router gives them.
- contiguous (prefill): A is [M, H] with expert e's pairs in rows [start_e, start_e + count_e), start_e a
  multiple of the alignment (128 on sm90) right after the previous expert's padded rows: DeepGEMM's
  "psum" form of the contiguous layout, `psum[e] = start_e + count_e`, from which the kernel derives each
  expert's rows itself and schedules only their tiles. M is the worst case for P pairs, so nothing waits
  for the host; the rows past the last expert are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugserve.core.layers.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, ceil_div
from plugserve.plugins.moe.align import moe_align_block_size
from plugserve.plugins.triton_shared import INTERPRETED, round_to_e4m3_grid

GROUP = 128  # quantization group along K
MASKED_ROW_MULTIPLE = 128  # the masked kernel's tiles are 64 or 128 rows
TMA_ALIGNMENT = 4  # float32 scales: each K group's column of scales starts 16-byte aligned
_LAYOUT_BLOCK = 128  # pairs per program of the masked layout kernel
_LAYOUT_SUB = 32  # pairs compared at once
_QUANT_GROUPS = 4  # 1 x 128 groups per program of the quantizer
_REDUCE_BLOCK_H = 1024  # hidden columns per program of the top-k reduction


@dataclass(frozen=True)
class MaskedLayout:
    """dst [P] int32 (e * max_m + rank of the pair among expert e's, or -1); masked_m [E] int32."""

    dst: torch.Tensor
    masked_m: torch.Tensor
    max_m: int


@dataclass(frozen=True)
class ContiguousLayout:
    """dst [P] int32 (A row, or -1); psum [E] int32 (start_e + count_e); num_rows: M, a multiple of the
    alignment, enough for any P pairs."""

    dst: torch.Tensor
    psum: torch.Tensor
    num_rows: int


@triton.jit
def _masked_layout_kernel(
    ids_ptr, dst_ptr, masked_m_ptr, num_pairs, max_m,
    NUM_EXPERTS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
):
    """BLOCK pairs per program: each pair's rank among the earlier pairs of its expert (its row in the
    expert's group), and, from the expert's last pair, the expert's count. A rank past max_m (a token
    naming one expert twice) is dropped rather than written into the next expert's rows."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    valid = (pair < num_pairs) & (ids >= 0) & (ids < NUM_EXPERTS)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    after = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_pairs, SUB):
        other = start + tl.arange(0, SUB)
        other_ids = tl.load(ids_ptr + other, mask=other < num_pairs, other=-1)
        same = (ids[:, None] == other_ids[None, :]) & valid[:, None]
        before += tl.sum((same & (other[None, :] < pair[:, None])).to(tl.int32), 1)
        after += tl.sum((same & (other[None, :] > pair[:, None])).to(tl.int32), 1)
    tl.store(dst_ptr + pair, tl.where(valid & (before < max_m), ids * max_m + before, -1), mask=pair < num_pairs)
    tl.store(masked_m_ptr + ids, tl.minimum(before + 1, max_m), mask=valid & (after == 0))


def masked_layout(topk_ids: torch.Tensor, num_experts: int, max_m: int) -> MaskedLayout:
    """topk_ids [T, k] integer -> the masked layout with groups of max_m rows (a multiple of 128, >= T)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    num_pairs = ids.numel()
    dst = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    masked_m = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    if num_pairs:
        _masked_layout_kernel[(triton.cdiv(num_pairs, _LAYOUT_BLOCK),)](
            ids, dst, masked_m, num_pairs, max_m, NUM_EXPERTS=num_experts, BLOCK=_LAYOUT_BLOCK, SUB=_LAYOUT_SUB,
        )
    return MaskedLayout(dst, masked_m, max_m)


def contiguous_layout(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> ContiguousLayout:
    """topk_ids [T, k] integer -> the psum contiguous layout with expert starts at multiples of `alignment`.
    moe_align_block_size sorts the pairs into exactly these rows; dst is its inverse permutation."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    aligned = moe_align_block_size(topk_ids, num_experts, alignment)
    rows = aligned.sorted_ids.numel()
    # Padding slots hold the pair index num_pairs: they all land in dst's extra last entry, cut off.
    dst = torch.full((num_pairs + 1,), -1, dtype=torch.int32, device=ids.device)
    dst.scatter_(0, aligned.sorted_ids.long(), torch.arange(rows, dtype=torch.int32, device=ids.device))
    valid = (ids >= 0) & (ids < num_experts)
    bins = torch.where(valid, ids.long(), num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, bins, torch.ones_like(bins))[:num_experts]
    padded = (counts + alignment - 1) // alignment * alignment
    psum = (padded.cumsum(0) - padded + counts).to(torch.int32)
    return ContiguousLayout(dst[:num_pairs], psum, rows)


@triton.jit
def _quant_rows_kernel(
    src_ptr, dst_ptr, q_ptr, s_ptr, cols, num_groups, rows_per_group,
    stride_src, stride_q, stride_s_group, stride_s_row, stride_s_col,
    TOP_K: tl.constexpr, SILU_MUL: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr,
    EPS: tl.constexpr, QMAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    """GROUPS 1 x GROUP_SIZE groups of pair p's row r = dst[p] (nothing when r < 0), quantized as the
    reference quantizer does: scale = max(amax, EPS) / QMAX and clamp(x / scale), both correctly rounded.
    Source: SILU_MUL: silu(src[r, :cols]) * src[r, cols:2 cols] (the w13 GEMM's gate and up halves);
    else src[p // TOP_K] (the pair's token). Row r's scale of group g is at
    (r // rows_per_group) * stride_s_group + (r % rows_per_group) * stride_s_row + g * stride_s_col."""
    pair = tl.program_id(0)
    row = tl.load(dst_ptr + pair)
    if row < 0:
        return
    row = row.to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = col < cols
    if SILU_MUL:
        gate = tl.load(src_ptr + row * stride_src + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src_ptr + row * stride_src + cols + col, mask=mask, other=0.0).to(tl.float32)
        x = gate * tl.sigmoid(gate) * up
    else:
        x = tl.load(src_ptr + (pair // TOP_K).to(tl.int64) * stride_src + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), EPS), QMAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -QMAX), QMAX)
    if ROUND_IN_FP32:
        q = round_to_e4m3_grid(q)
    tl.store(q_ptr + row * stride_q + col, q.to(tl.float8e4nv), mask=mask)
    scale_offset = (row // rows_per_group) * stride_s_group + (row % rows_per_group) * stride_s_row
    tl.store(s_ptr + scale_offset + group * stride_s_col, scale, mask=group < num_groups)


def quantize_rows(
    src: torch.Tensor, dst: torch.Tensor, num_groups: int, rows_per_group: int, *, top_k: int = 1,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per 1 x 128 group into the rows `dst` [P] names of a [num_groups, rows_per_group, K] e4m3
    tensor, with scales [num_groups, rows_per_group, ceil(K/128)] float32 stored MN-major and TMA-aligned
    (a [num_groups, ceil(K/128), rows_per_group] buffer, transposed; rows_per_group a multiple of 4), the
    layout DeepGEMM's sm90 kernels read without copying. Rows no pair names are left unwritten.

    silu_mul: src [rows, 2K] (any dtype) holds each row's gate and up halves: row dst[p] gets
    silu(gate) * up of row dst[p]. Else src [T, K] holds the tokens: row dst[p] gets token p // top_k."""
    cols = src.shape[1] // 2 if silu_mul else src.shape[1]
    groups = ceil_div(cols, GROUP)
    if rows_per_group % TMA_ALIGNMENT:
        raise ValueError(f"rows_per_group must be a multiple of {TMA_ALIGNMENT}, got {rows_per_group}")
    src = src.contiguous()
    q = torch.empty((num_groups, rows_per_group, cols), dtype=FP8_DTYPE, device=src.device)
    scales = torch.empty((num_groups, groups, rows_per_group), dtype=torch.float32, device=src.device)
    if dst.numel() and cols:
        per_program = min(_QUANT_GROUPS, triton.next_power_of_2(groups))
        _quant_rows_kernel[(dst.numel(), triton.cdiv(groups, per_program))](
            src, dst, q, scales, cols, groups, rows_per_group,
            src.stride(0), q.stride(1), scales.stride(0), scales.stride(2), scales.stride(1),
            TOP_K=top_k, SILU_MUL=silu_mul, GROUP_SIZE=GROUP, GROUPS=per_program, EPS=SCALE_EPS, QMAX=FP8_MAX,
            ROUND_IN_FP32=INTERPRETED, num_warps=4,
        )
    return q, scales.transpose(1, 2)


@triton.jit
def _topk_reduce_kernel(
    y_ptr, dst_ptr, weights_ptr, out_ptr, hidden, stride_y, stride_out, scaling,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = scaling * sum_j weights[t, j] * y[dst[t * k + j]] over the slots with dst >= 0, in float32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.zeros([BLOCK_H], dtype=tl.int32) + tl.load(dst_ptr + token * TOP_K + j)
        weight = tl.load(weights_ptr + token * TOP_K + j)
        y = tl.load(y_ptr + tl.maximum(row, 0).to(tl.int64) * stride_y + cols, mask=(cols < hidden) & (row >= 0),
                    other=0.0)
        acc += y.to(tl.float32) * weight
    tl.store(out_ptr + token * stride_out + cols, (acc * scaling).to(out_ptr.dtype.element_ty), mask=cols < hidden)


def topk_reduce(
    y: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor, scaling: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """y [rows, H] (the w2 GEMM's output), dst [T * k] int32, topk_weights [T, k] -> [T, H] of out_dtype:
    scaling * sum_j topk_weights[t, j] * y[dst[t * k + j]]."""
    num_tokens, top_k = topk_weights.shape
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=y.device)
    if num_tokens:
        block_h = min(_REDUCE_BLOCK_H, triton.next_power_of_2(hidden))
        _topk_reduce_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            y, dst, topk_weights.float().contiguous(), out, hidden, y.stride(0), out.stride(0), scaling,
            TOP_K=top_k, BLOCK_H=block_h,
        )
    return out
