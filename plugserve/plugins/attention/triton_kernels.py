"""Triton kernels of the `triton` attention backend, and the launchers that size their grids.

Imported only once the backend is built (see `triton.py`): `triton.jit` decides when a kernel is
defined whether it compiles for the GPU or runs in the interpreter (TRITON_INTERPRET=1), so this
module must not be imported before that variable is set.

Kernels:
    _mla_kernel           absorbed MLA over the paged latent cache, one program per
                          (query token, KV split, block of heads); partial outputs + log2-sum-exp2
    _mla_reduce_kernel    combines the KV splits of one (token, head)
    _mha_kernel           flash attention over packed (varlen) requests, causal bottom-right or not
    _merge_kernel         log-sum-exp merge of two attention states

Softmaxes run in base 2 (exp2 is one instruction; exp is exp2 plus a multiply): scores are scaled
by sm_scale * log2(e), and log-sum-exps are converted back to natural log where they leave a kernel.
All accumulation is float32.

Arguments that change with every batch (token, pair and split counts, and the strides that follow them) are
`do_not_specialize_on_alignment`: Triton would otherwise compile a variant for each count divisible by 16 and
one for the rest, the later inside a request after the warm-up. Their == 1 variants stay.

The decode kernels (MLA and its split merge) launch as programmatic dependents on Hopper and newer GPUs
(`plugserve.core.triton_pdl`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.triton_support import tma_source

LOG2E = math.log2(math.e)
# tl.dot needs every operand dimension >= 16.
MIN_DOT = 16
# KV splits: at least `mla_min_split_keys` keys each (MLA_SPLIT_KEYS_PER_HEAD per head, at least
# MLA_MIN_SPLIT_KEYS; also enforced in the kernel, for CUDA graphs sized for the longest sequence), at most
# MLA_MAX_SPLITS, programs filling MLA_MIN_FILL of the SMs in one wave, else in each of at most MLA_MAX_WAVES waves.
MLA_SPLIT_KEYS_PER_HEAD = 2
MLA_MIN_SPLIT_KEYS = 32
MLA_MAX_SPLITS = 128
MLA_MIN_FILL = 0.8
MLA_MAX_WAVES = 2
# Splits the MLA reduce merges per step ([16, 512] fp32 partials: 64 registers a thread on 4 warps).
MLA_REDUCE_SPLITS = 16
# W_UV columns per program of the reduce that also projects: a [R, 16] tile (64 float32 registers a thread at R = 512).
MLA_REDUCE_BLOCK_V = 16


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


def _launch_first_fitting(kernel, grid: tuple[int, ...] | Callable[[dict], tuple[int, ...]],
                          args: tuple | Callable[[dict], tuple], configs: list[dict], key: tuple) -> None:
    """Launch `kernel[grid](*args, **config)` with the first of `configs` (block sizes, num_warps,
    num_stages; largest first) whose shared memory this GPU holds (`grid` and `args` may be functions
    of the config). Tiles tuned on H100 (228 KB) overflow smaller GPUs (~100 KB on sm86 / sm89) and wide
    or fp32 heads; Triton raises OutOfResources before launching, so a refused config had no effect."""
    refused: OutOfResources | None = None
    for index in range(_FITTING_CONFIG.get(key, 0), len(configs)):
        config = configs[index]
        try:
            kernel[grid](*(args(config) if callable(args) else args), **config)
        except OutOfResources as exc:
            refused = exc
            continue
        _FITTING_CONFIG[key] = index
        return
    raise refused or ValueError("no config to launch")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take strides for every dim but the last, whose unit stride keeps loads vectorized.
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------------
# Absorbed MLA over the paged latent cache
#
# Stage 1 (`_mla_kernel`): one program per (query token, KV split, block of BLOCK_H heads), head blocks
# fastest so that the programs sharing a split's KV tiles run side by side and the second one reads them
# from L2. All heads of a block share every KV tile (MQA over the latent), so a block is the M of both
# dots: scores [BLOCK_H, BLOCK_N] = q_nope . latent^T + q_rope . rope^T, then out += probs . latent. The
# 512-wide latent is handled as two halves (the [BLOCK_H, R] fp32 accumulator is two [BLOCK_H, R/2]
# ones, and TMA boxes are at most 256 wide). KV blocks are num_stages-deep software-pipelined loads
# (cp.async through pointers, or TMA boxes when a block lies inside one page). Only the last block of a
# sequence is masked. Stage 2 (`_mla_reduce_kernel`) merges the splits' partial outputs by their
# log-sum-exps. Launch parameters are `MlaConfig`; the host picks them and the split count by shape only,
# never from tensor contents, so a CUDA graph captured for a batch size stays valid for any lengths.


@dataclass(frozen=True)
class MlaConfig:
    """Launch parameters of `_mla_kernel`.

    block_h: heads per program (the M of both dots; 64 takes sm90's wgmma, 16 / 32 mma.sync); block_n:
    keys per pipelined KV block; num_warps, num_stages: as in Triton; tma: load full KV blocks as TMA
    boxes through tensor descriptors (`mla_tma_fits`) instead of cp.async through pointers; reload_q:
    load the query block inside the KV loop. Triton then hoists the load and keeps the block in shared
    memory, reading it into registers for each KV block; held from outside the loop, it stays in
    registers throughout, which mma.sync (operand A in registers in every warp) cannot afford. gluon: stage 1
    is `gluon_mla._gluon_mla_kernel` instead (`mla_gluon_fits`: 64-key blocks in two stages; a call with a draft
    tree takes `_mla_kernel` with the same blocks)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    reload_q: bool = False
    gluon: bool = False

    def __str__(self) -> str:
        return (f"h{self.block_h}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
                + ("-tma" if self.tma else "") + ("-reloadq" if self.reload_q else "")
                + ("-gluon" if self.gluon else ""))


def mla_block_h(num_heads: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> int:
    """Heads per program. Every head of a block reuses each KV tile the block loads, so larger blocks
    read less (128 heads in blocks of 64: each tile is read twice, once from DRAM, once from L2).
    64 is the most a program holds, its [64, 512] fp32 accumulator taking 128 registers a thread on 8
    warps, and only with sm90's wgmma; with mma.sync (sm80 / sm89) 64 heads leave no registers for the
    operands, so 32 there. fp32 (FMA dots, accuracy checks only): 16. In the interpreter (None) the
    largest block runs the fewest Python steps. At least 16, tl.dot's smallest M; a partial last block
    is masked."""
    if dtype == torch.float32 and capability is not None:
        return MIN_DOT
    most = 64 if capability is None or capability >= (9, 0) else 32
    return min(most, _pow2_at_least(num_heads, MIN_DOT))


def mla_config(num_heads: int, dtype: torch.dtype, capability: tuple[int, int] | None, page_size: int,
               kv_lora_rank: int, rope_dim: int) -> MlaConfig:
    """Launch parameters by shape, from the H100 sweeps (benchmarks/dev/sweep_triton_mla.py) and ptxas' register
    counts (none spill) and shared memory for sm90 (Triton 3.6):
    - 64 heads (wgmma): 64-key blocks, 2 stages (the 72 KB query block and two 73 KB KV blocks: 221 KB,
      240 registers), as TMA boxes where a block lies inside a page. At 128 heads this took 1071 us at batch
      128 x 8192 keys and 282 us at 32 x 8192, against 1342 and 354 us with 32-key blocks and 5 stages
      (session 11, call 1): half the blocks halve the per-block softmax and accumulator rescaling. Triton
      gives a chained dot's warps all to M, so both warpgroups of the 8 compute the same [64, 64] scores;
      the [64, 512] accumulator is split between them. (Moving the score dots into a branch so that the
      warpgroups split the keys instead, which the sweep measured, spilled at 255 registers and ran 1.3x
      slower.)
      On sm90, where `mla_gluon_fits`, the same blocks run as the Gluon kernel (`gluon_mla`), whose
      warpgroups take key blocks in turns: 532 us at 128 x 8192 and 166 us at 32 x 8192 on the H200 (session
      15), against 700 and 190 us for session 14's lockstep Gluon kernel.
    - 16 / 32 heads (mma.sync): its A operand sits in registers in every warp, 144 of them for a
      [16, 576] query held across the loop, so the query is loaded in the loop instead (`reload_q`:
      kept in shared memory, read per block). Keys must be more than the heads and at least 8 a warp,
      else Triton duplicates rows across warps: 16 x 32 keys on 4 warps (190 registers, 94 KB: two
      programs an SM), 32 x 64 on 8. 5 stages: the pipeliner shares num_stages - 1 between the page-index
      load and the KV load that depends on it, so 5 gives each 2.
    - fp32 (FMA dots, accuracy checks only): 16 x 16, one stage.
    The interpreter runs every program in Python: the biggest blocks, one warp."""
    block_h = mla_block_h(num_heads, dtype, capability)
    if capability is None:
        return MlaConfig(block_h, 64, 1, 1)
    if dtype == torch.float32:
        return MlaConfig(block_h, 16, 4, 1, reload_q=True)
    if block_h == 64:
        config = MlaConfig(64, 64, 8, 2)
        config = replace(config, tma=mla_tma_fits(config, kv_lora_rank, rope_dim, page_size, capability))
        return replace(config, gluon=mla_gluon_fits(config, kv_lora_rank, rope_dim, page_size, dtype, capability))
    return MlaConfig(block_h, 2 * block_h, 4 if block_h == MIN_DOT else 8, 5, reload_q=True)


def mla_tma_fits(config: MlaConfig, kv_lora_rank: int, rope_dim: int, page_size: int,
                 capability: tuple[int, int] | None) -> bool:
    """Can the KV blocks be TMA boxes: a block inside one page (its rows contiguous), boxes that cover
    the latent halves and the rope key exactly, and sm90+ (None: the interpreter, which emulates them)."""
    half_r = _pow2_at_least(kv_lora_rank, 2 * MIN_DOT) // 2
    return (page_size % config.block_n == 0 and kv_lora_rank == 2 * half_r
            and rope_dim == _pow2_at_least(rope_dim, MIN_DOT) and (capability is None or capability >= (9, 0)))


def mla_gluon_fits(config: MlaConfig, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: torch.dtype,
                   capability: tuple[int, int] | None) -> bool:
    """Can `config` run as the Gluon kernel (`gluon_mla`): 64 heads on 8 warps (two warpgroups), 64-key blocks in
    two stages, DeepSeek's latent 512 + rope 64 in bf16 / fp16, key blocks inside one page, on sm90: its wgmma is
    Hopper's alone (Blackwell's tensor cores take tcgen05), and Gluon kernels do not run in the interpreter
    (None)."""
    return (config.block_h == 64 and config.num_warps == 8 and (kv_lora_rank, rope_dim) == (512, 64)
            and (config.block_n, config.num_stages) == (64, 2) and page_size % config.block_n == 0
            and dtype in (torch.bfloat16, torch.float16)
            and capability is not None and capability[0] == 9)


def mla_min_split_keys(num_heads: int) -> int:
    """The fewest keys a KV split of `num_heads` heads takes. A split costs its partial output, [H, R] float32
    written and read again: per head about as much as 2 keys' latent rows (bf16, R + P = 576), so a split
    of 2 keys a head moves as much partial as KV. Every key of a split is read in sequence, one dependent
    load after another, so at small batch the fewer keys a split has, the shorter the step: 256 keys at
    128 heads, 32 at 16 (DeepSeek-V2-Lite, or V3 over 8 ranks), where 256 would read a 288-key decode in
    one split of 8 blocks."""
    return max(MLA_MIN_SPLIT_KEYS, _pow2_at_least(MLA_SPLIT_KEYS_PER_HEAD * num_heads))


def mla_num_splits(rows: int, max_kv_len: int, multiprocessors: int, min_keys: int) -> int:
    """KV splits for `rows` (query token, head block) rows, counting one resident program per SM (the big-block
    configs' case): the most whose programs fit one wave, when that wave fills at least MLA_MIN_FILL of the SMs
    (each split's keys are read in sequence, so fewer keys a split is a shorter step: at 128 heads on the H100,
    batch 1 x 32768 keys took 58.4 us in 66 splits against 65.3 us in 53, batch 8 x 8192 85.1 against 98.4 us
    in 8 splits against 7; session 11, call 6); else the fewest filling MLA_MIN_FILL of every wave, or 1 if
    those take more than MLA_MAX_WAVES waves. At most MLA_MAX_SPLITS (the most there are if none fills), and
    at least `min_keys` keys each (`mla_min_split_keys`). Splitting costs partials written and read again,
    so it is for batches that leave SMs idle, and the wave bound keeps a launch's partials near 2 x SMs x
    128 KB (in L2). On 132 SMs, 128 heads in blocks of 64 (256 keys a split): batch 1 -> 66 splits (132
    programs), batch 32 -> 2 (128), batch 40 -> 3 (240 programs in 2 waves), batch 50 -> 1 (5 would fill 4
    waves), 64 and up -> 1. Under CUDA graphs `max_kv_len` is the longest a graph serves, so the count
    depends on the batch size only; the kernel itself keeps splits at `min_keys` keys and leaves the rest
    empty on shorter sequences."""
    limit = max(1, min(MLA_MAX_SPLITS, triton.cdiv(max_kv_len, min_keys)))
    one_wave = min(limit, multiprocessors // rows)
    if one_wave and rows * one_wave >= MLA_MIN_FILL * multiprocessors:
        return one_wave
    for splits in range(1, limit + 1):
        programs = rows * splits
        waves = triton.cdiv(programs, multiprocessors)
        if programs >= MLA_MIN_FILL * waves * multiprocessors:
            return splits if waves <= MLA_MAX_WAVES else 1
    return limit


def mla_workspace_size(num_tokens: int, num_heads: int, num_splits: int) -> int:
    """Partial outputs ([T, H, splits] rows of R fp32 and one log-sum-exp each) a launch needs; 0 for one split."""
    return num_tokens * num_heads * num_splits if num_splits > 1 else 0


@triton.jit
def _mla_load_q(q_rows, q_rope_rows, head_mask, R: tl.constexpr, P: tl.constexpr, HALF_R: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """The query block: latent halves [BLOCK_H, HALF_R] and rope [BLOCK_H, BLOCK_P] from its rows' pointers
    [BLOCK_H, 1]; masked heads and columns are 0."""
    r = tl.arange(0, HALF_R)
    p = tl.arange(0, BLOCK_P)
    q_lo = tl.load(q_rows + r[None, :], mask=head_mask[:, None], other=0.0)
    q_hi = tl.load(q_rows + HALF_R + r[None, :], mask=head_mask[:, None] & (HALF_R + r < R)[None, :], other=0.0)
    q_rope = tl.load(q_rope_rows + p[None, :], mask=head_mask[:, None] & (p < P)[None, :], other=0.0)
    return q_lo, q_hi, q_rope


@triton.jit
def _mla_block(
    q_lo, q_hi, q_rope, q_rows, q_rope_rows, head_mask, kv_ptr, kv, kv_rope, block_table_row, stride_kv, b, kv_len,
    tree_start, tree_bits, m, denom, acc_lo, acc_hi, qk_scale,
    R: tl.constexpr, P: tl.constexpr, HALF_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, TREE: tl.constexpr, TMA: tl.constexpr, RELOAD_Q: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Online softmax over key block b (keys b * BLOCK_N ...): returns the updated row max m and denominator
    [BLOCK_H] and accumulator halves [BLOCK_H, HALF_R], all float32 and base 2. MASKED: keys from kv_len
    on are dropped (only the sequence's last block has any); that block is read through pointers even
    under TMA, so that nothing past kv_len enters the dots (0 * inf would poison them). TREE (with MASKED):
    key tree_start + j, a draft-tree node, is seen only where bit j of tree_bits is set. RELOAD_Q: the
    query block is loaded here (q_lo, q_hi, q_rope are None), see `MlaConfig.reload_q`."""
    if RELOAD_Q:
        q_lo, q_hi, q_rope = _mla_load_q(q_rows, q_rope_rows, head_mask, R, P, HALF_R, BLOCK_P)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA and not MASKED:
        # The block lies inside one page, so its rows are contiguous: one page lookup, three boxes.
        first = b * BLOCK_N
        row = tl.load(block_table_row + first // PAGE_SIZE) * PAGE_SIZE + first % PAGE_SIZE
        lo = kv.load([row, 0])
        hi = kv.load([row, HALF_R])
        rope = kv_rope.load([row, R])
    else:
        r = tl.arange(0, HALF_R)
        p = tl.arange(0, BLOCK_P)
        if MASKED:
            valid = (n < kv_len)[:, None]
            page = tl.load(block_table_row + n // PAGE_SIZE, mask=n < kv_len, other=0)
        else:
            valid = tl.full([BLOCK_N, 1], 1, tl.int1)
            page = tl.load(block_table_row + n // PAGE_SIZE)
        rows = kv_ptr + (page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE)[:, None] * stride_kv
        lo = tl.load(rows + r[None, :], mask=valid, other=0.0)
        hi = tl.load(rows + HALF_R + r[None, :], mask=valid & (HALF_R + r < R)[None, :], other=0.0)
        rope = tl.load(rows + R + p[None, :], mask=valid & (p < P)[None, :], other=0.0)

    scores = tl.dot(q_lo, tl.trans(lo), input_precision=INPUT_PRECISION)
    scores = tl.dot(q_hi, tl.trans(hi), scores, input_precision=INPUT_PRECISION)
    scores = tl.dot(q_rope, tl.trans(rope), scores, input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        visible = n < kv_len
        if TREE:
            node = n - tree_start
            bit = (tree_bits >> tl.where(node > 0, node, 0).to(tl.int64)) & 1
            visible = visible & ((node < 0) | (bit != 0))
        scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # Without TREE every block holds a visible key, so m_new is finite from the first block on (alpha = 0 there);
    # a tree's split may open on nodes its query does not see, leaving m at -inf until a visible key (alpha and
    # probs must then be 0, not NaN).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if TREE else m_new
    alpha = tl.exp2(m - m_ref)
    probs = tl.exp2(scores - m_ref[:, None])
    denom = denom * alpha + tl.sum(probs, 1)
    probs = probs.to(lo.dtype)
    acc_lo = tl.dot(probs, lo, acc_lo * alpha[:, None], input_precision=INPUT_PRECISION)
    acc_hi = tl.dot(probs, hi, acc_hi * alpha[:, None], input_precision=INPUT_PRECISION)
    return m_new, denom, acc_lo, acc_hi


@triton.jit
def _mla_program(num_heads, num_splits, min_split_blocks, token_req_ptr, token_kv_len_ptr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """This MLA decode program's work, the same for `_mla_kernel` and `gluon_mla._gluon_mla_kernel` (one program per
    token, KV split and block of BLOCK_H heads, heads fastest): (head block, split, token t and its request (int64),
    kv_len, its key blocks first .. last - 1). Splits are of whole blocks, at least min_split_blocks each: only the
    sequence's last block is partial, and the late splits of a short sequence are empty (first >= last)."""
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    split = (pid // head_blocks) % num_splits
    t = (pid // head_blocks // num_splits).to(tl.int64)
    kv_len = tl.load(token_kv_len_ptr + t)
    num_blocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(num_blocks, num_splits), min_split_blocks)
    first = split * per_split
    return (pid % head_blocks, split, t, tl.load(token_req_ptr + t).to(tl.int64), kv_len, first,
            tl.minimum(first + per_split, num_blocks))


@triton.jit(do_not_specialize_on_alignment=["stride_bt", "stride_lse_t", "stride_lse_h", "num_splits"])
def _mla_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, kv, kv_rope, block_table_ptr, token_req_ptr, token_kv_len_ptr, tree_start_ptr,
    tree_bits_ptr, out_ptr, lse_ptr,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_kv, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
    num_heads, num_splits, min_split_blocks, qk_scale,
    R: tl.constexpr, P: tl.constexpr, HALF_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, TREE: tl.constexpr, TMA: tl.constexpr, RELOAD_Q: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # kv_ptr: the pool [num_slots, R + P]; kv / kv_rope (TMA, else None): descriptors of its [BLOCK_N, HALF_R]
    # and [BLOCK_N, BLOCK_P] boxes. SPLIT: out_ptr / lse_ptr are float32 partials and base-2 log-sum-exps
    # (unit stride over splits), else out_ptr is the output and no lse is kept. TREE: the token is a draft-tree
    # node whose keys from tree_start[t] on are the tree's nodes, seen per tree_bits[t]; every block from the
    # tree's first on is masked. PDL: launched as a programmatic dependent (plugserve.core.triton_pdl).
    programmatic_prologue(PDL)
    head_block, split, t, req, kv_len, first, last = _mla_program(
        num_heads, num_splits, min_split_blocks, token_req_ptr, token_kv_len_ptr, BLOCK_H, BLOCK_N)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    lse_ptrs = lse_ptr + t * stride_lse_t + heads * stride_lse_h + split
    if first >= last:
        if SPLIT:
            tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=head_mask)  # weight 0
        return

    q_rows = q_nope_ptr + t * stride_qn_t + heads[:, None] * stride_qn_h
    q_rope_rows = q_rope_ptr + t * stride_qr_t + heads[:, None] * stride_qr_h
    if RELOAD_Q:
        q_lo, q_hi, q_rope = None, None, None
    else:
        q_lo, q_hi, q_rope = _mla_load_q(q_rows, q_rope_rows, head_mask, R, P, HALF_R, BLOCK_P)
    block_table_row = block_table_ptr + req * stride_bt
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF_R], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF_R], tl.float32)
    if TREE:
        tree_start = tl.load(tree_start_ptr + t)
        tree_bits = tl.load(tree_bits_ptr + t)
        full = tl.minimum(last, tree_start // BLOCK_N)
    else:
        tree_start = 0
        tree_bits = 0
        full = tl.minimum(last, kv_len // BLOCK_N)
    for b in range(first, full):
        m, denom, acc_lo, acc_hi = _mla_block(
            q_lo, q_hi, q_rope, q_rows, q_rope_rows, head_mask, kv_ptr, kv, kv_rope, block_table_row, stride_kv, b,
            kv_len, tree_start, tree_bits, m, denom, acc_lo, acc_hi, qk_scale,
            R, P, HALF_R, BLOCK_P, BLOCK_N, PAGE_SIZE, False, False, TMA, RELOAD_Q, INPUT_PRECISION,
        )
    if TREE:
        for b in range(tl.maximum(first, full), last):
            m, denom, acc_lo, acc_hi = _mla_block(
                q_lo, q_hi, q_rope, q_rows, q_rope_rows, head_mask, kv_ptr, kv, kv_rope, block_table_row, stride_kv,
                b, kv_len, tree_start, tree_bits, m, denom, acc_lo, acc_hi, qk_scale,
                R, P, HALF_R, BLOCK_P, BLOCK_N, PAGE_SIZE, True, True, TMA, RELOAD_Q, INPUT_PRECISION,
            )
    elif full < last:
        m, denom, acc_lo, acc_hi = _mla_block(
            q_lo, q_hi, q_rope, q_rows, q_rope_rows, head_mask, kv_ptr, kv, kv_rope, block_table_row, stride_kv, full,
            kv_len, tree_start, tree_bits, m, denom, acc_lo, acc_hi, qk_scale,
            R, P, HALF_R, BLOCK_P, BLOCK_N, PAGE_SIZE, True, False, TMA, RELOAD_Q, INPUT_PRECISION,
        )

    r = tl.arange(0, HALF_R)
    out_rows = out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s
    tl.store(out_rows + r[None, :], (acc_lo / denom[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    tl.store(out_rows + HALF_R + r[None, :], (acc_hi / denom[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (HALF_R + r < R)[None, :])
    if SPLIT:
        tl.store(lse_ptrs, m + tl.log2(denom), mask=head_mask)


@triton.jit(do_not_specialize_on_alignment=["stride_pl_t", "stride_pl_h", "num_splits"])
def _mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, w_vc_ptr,
    stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_o_t, stride_o_h, stride_w_h, stride_w_r,
    num_splits,
    R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    # One (token, head): an online log-sum-exp merge over the splits, BLOCK_S at a time. Empty splits
    # have lse -inf, weight 0, and their (unwritten) partials are not read. V > 0: program (t, h, v-block) also
    # multiplies the merged latent, rounded to out's dtype, by w_vc[h, :, v-block] (W_UV) and stores that
    # [BLOCK_V] slice of out [T, H, V]: each v-block's program merges the same splits again, which at decode costs
    # less than a bmm's launch.
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.arange(0, BLOCK_R)
    parts_ptr = part_out_ptr + t * stride_po_t + h * stride_po_h + r[None, :]
    lse_ptr = part_lse_ptr + t * stride_pl_t + h * stride_pl_h
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        splits = first + s
        lse2 = tl.load(lse_ptr + splits, mask=splits < num_splits, other=float("-inf"))
        # Split 0 holds key 0, so m is finite after the first chunk.
        m_new = tl.maximum(m, tl.max(lse2, 0))
        scale = tl.exp2(m - m_new)
        weights = tl.exp2(lse2 - m_new)
        parts = tl.load(parts_ptr + splits[:, None] * stride_po_s, mask=(weights > 0)[:, None] & (r < R)[None, :],
                        other=0.0)
        acc = acc * scale + tl.sum(weights[:, None] * parts, 0)
        total = total * scale + tl.sum(weights, 0)
        m = m_new
    latent = (acc / total).to(out_ptr.dtype.element_ty)
    if V > 0:
        v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        w = tl.load(w_vc_ptr + h.to(tl.int64) * stride_w_h + r[:, None] * stride_w_r + v[None, :],
                    mask=(r < R)[:, None] & (v < V)[None, :], other=0.0)
        projected = tl.sum(latent.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
        tl.store(out_ptr + t * stride_o_t + h * stride_o_h + v, projected.to(out_ptr.dtype.element_ty), mask=v < V)
    else:
        tl.store(out_ptr + t * stride_o_t + h * stride_o_h + r, latent, mask=r < R)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_buffer: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    page_size: int,
    sm_scale: float,
    config: MlaConfig,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    w_vc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA, one row per query token.

    q_nope [T, H, R], q_rope [T, H, P] (fp16 / bf16 / fp32, last dim contiguous); kv_buffer
    [num_slots, R + P] of q's dtype (latent, then rope key); block_table [B, max_pages] int32;
    token_req [T] int32 (each token's block-table row); token_kv_len [T] int32 (keys the token sees:
    positions 0..len-1 of its request, at least 1). `config`: launch parameters (`mla_config`);
    `num_splits` >= 1 KV splits per token (`mla_num_splits`): with more than one, float32 partials
    [T, H, splits, R] and log-sum-exps [T, H, splits] go to `workspace` (two flat float32 buffers of at
    least `mla_workspace_size` rows times R, and rows; allocated here when None), then a second kernel
    reduces them. `tree`: every token is a draft-tree node (token_kv_len then counts its request's whole
    tree): (tree_start [T] int32, the position of its request's first node; tree_bits [T] int64, bit j set
    when it sees node j, itself and its ancestors; at most 64 nodes). Returns out [T, H, R] in q's dtype, or with
    w_vc [H, R, V] (W_UV, q's dtype) out rounded to q's dtype times w_vc per head, [T, H, V]: in the reduce kernel
    when there are splits, else by a bmm.
    """
    t, h, r = q_nope.shape
    p = q_rope.shape[2]
    device = q_nope.device
    out = torch.empty(t, h, r, dtype=q_nope.dtype, device=device)
    if t == 0:
        return out
    q_nope, q_rope = _last_dim_contiguous(q_nope), _last_dim_contiguous(q_rope)
    block_table = _last_dim_contiguous(block_table)
    checked = device.type == "cuda" and (config.tma or config.gluon)
    capability = torch.cuda.get_device_capability(device) if checked else None
    if config.tma and not mla_tma_fits(config, r, p, page_size, capability):
        raise ValueError(f"MLA config {config} cannot use TMA with page size {page_size}, latent {r}, rope {p}")
    if config.gluon and not mla_gluon_fits(config, r, p, page_size, q_nope.dtype, capability):
        raise ValueError(f"MLA config {config} cannot run the Gluon kernel with page size {page_size}, latent {r}, "
                         f"rope {p}, {q_nope.dtype} on {'the CPU' if capability is None else f'sm{capability}'}")
    if config.gluon and tree is not None:
        config = replace(config, gluon=False)  # the Gluon kernel has no draft trees
    if num_splits == 1:
        # Written straight into `out`: the split dim has stride 0 and no lse is kept.
        part_out, part_lse = out, out
        o_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        rows = mla_workspace_size(t, h, num_splits)
        if workspace is None:
            workspace = (torch.empty(rows * r, dtype=torch.float32, device=device),
                         torch.empty(rows, dtype=torch.float32, device=device))
        if workspace[0].numel() < rows * r or workspace[1].numel() < rows:
            raise ValueError(f"MLA workspace of {workspace[1].numel()} rows is too small for {t} tokens x {h} heads "
                             f"x {num_splits} splits")
        part_out = workspace[0][: rows * r].view(t, h, num_splits, r)
        part_lse = workspace[1][:rows].view(t, h, num_splits)
        o_strides, lse_strides = part_out.stride()[:3], part_lse.stride()[:2]
    pdl = launch_options(q_nope)  # both kernels' (one device)
    grid = (t * num_splits * triton.cdiv(h, config.block_h),)
    if config.gluon:
        from plugserve.plugins.attention import gluon_mla

        gluon_mla.launch(grid, q_nope, q_rope, kv_buffer, block_table, token_req, token_kv_len, part_out, part_lse,
                         o_strides, lse_strides, num_splits, triton.cdiv(mla_min_split_keys(h), config.block_n),
                         sm_scale * LOG2E, page_size)
    else:
        _launch_mla_kernel(grid, config, q_nope, q_rope, kv_buffer, block_table, token_req, token_kv_len, tree,
                           part_out, part_lse, o_strides, lse_strides, num_splits, page_size, sm_scale, pdl)
    if num_splits == 1:
        return out if w_vc is None else torch.bmm(out.transpose(0, 1), w_vc).transpose(0, 1)
    v = 0 if w_vc is None else w_vc.shape[2]
    if w_vc is not None:
        out = torch.empty(t, h, v, dtype=q_nope.dtype, device=device)
        w_vc = _last_dim_contiguous(w_vc)
    _mla_reduce_kernel[(t, h, triton.cdiv(v, MLA_REDUCE_BLOCK_V) if v else 1)](
        part_out, part_lse, out, w_vc,
        *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
        w_vc.stride(0) if v else 0, w_vc.stride(1) if v else 0, num_splits,
        R=r, BLOCK_S=min(MLA_REDUCE_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_R=triton.next_power_of_2(r),
        V=v, BLOCK_V=MLA_REDUCE_BLOCK_V, **pdl,
    )
    return out


def _launch_mla_kernel(grid: tuple[int], config: MlaConfig, q_nope: torch.Tensor, q_rope: torch.Tensor,
                       kv_buffer: torch.Tensor, block_table: torch.Tensor, token_req: torch.Tensor,
                       token_kv_len: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None,
                       part_out: torch.Tensor, part_lse: torch.Tensor, o_strides: tuple[int, int, int],
                       lse_strides: tuple[int, int], num_splits: int, page_size: int, sm_scale: float,
                       pdl: dict) -> None:
    """Stage 1 of `mla_attention` as `_mla_kernel`: `config`, else the first of its fallbacks that compiles here
    (arguments as `mla_attention` made them)."""
    r, p, h = q_nope.shape[2], q_rope.shape[2], q_nope.shape[1]
    half_r = _pow2_at_least(r, 2 * MIN_DOT) // 2
    block_p = _pow2_at_least(p, MIN_DOT)
    shape = dict(R=r, P=p, HALF_R=half_r, BLOCK_P=block_p, BLOCK_H=config.block_h, PAGE_SIZE=page_size,
                 SPLIT=num_splits > 1, TREE=tree is not None, INPUT_PRECISION=_input_precision(q_nope.dtype), **pdl)
    tree_start, tree_bits = tree if tree is not None else (token_kv_len, token_kv_len)  # unread without TREE

    def args(launch: dict) -> tuple:
        if launch["TMA"]:
            kv = TensorDescriptor.from_tensor(kv_buffer, [launch["BLOCK_N"], half_r])
            kv_rope = TensorDescriptor.from_tensor(kv_buffer, [launch["BLOCK_N"], block_p])
        else:
            kv, kv_rope = None, None
        return (q_nope, q_rope, kv_buffer, kv, kv_rope, block_table, token_req, token_kv_len, tree_start, tree_bits,
                part_out, part_lse,
                q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), kv_buffer.stride(0),
                block_table.stride(0), *o_strides, *lse_strides, h, num_splits,
                triton.cdiv(mla_min_split_keys(h), launch["BLOCK_N"]), sm_scale * LOG2E)

    launches = [shape | dict(BLOCK_N=c.block_n, TMA=c.tma, RELOAD_Q=c.reload_q, num_warps=c.num_warps,
                             num_stages=c.num_stages)
                for c in _mla_fallbacks(config)]
    _launch_first_fitting(_mla_kernel, grid, args, launches, ("mla", q_nope.device, q_nope.dtype, r, p, page_size,
                                                              config, num_splits > 1, tree is not None))


def _mla_fallbacks(config: MlaConfig) -> list[MlaConfig]:
    """`config`, then smaller ones for GPUs with less shared memory (~100 KB on sm86 / sm89): fewer stages,
    then smaller key blocks, down to 16 keys unpipelined. block_h stays: the split count and the graph
    workspace were sized for it."""
    smaller = [replace(config, num_stages=s) for s in range(config.num_stages - 1, 0, -1)]
    n = config.block_n // 2
    while n >= MIN_DOT:
        smaller.append(replace(config, block_n=n, num_stages=1))
        n //= 2
    return [config, *smaller]


# ----------------------------------------------------------------------------------------------------
# Ragged MHA (flash attention over packed requests)


@triton.jit
def _mha_scores(q1, q2, k_cols, k1_desc, k2_desc, row, k_col, d1, d2, offs_n, kv_len,
                D_QK: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, MASKED: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Raw scores [M, N] float32 of `_mha_kernel`'s queries against keys offs_n (k_cols [1, N]: pointers to their
    rows of this head; with TMA, boxes at key row `row` and columns k_col of the descriptors instead). MASKED:
    keys past kv_len load as zeros. A TMA box past kv_len reads the next request's keys (finite; `_mha_softmax`
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
def _mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """Online softmax of one key block's raw scores: (probabilities [M, N] float32, m_new, denom_new, alpha, the
    factor the accumulator takes). MASKED: the block may hold keys past kv_len or (CAUSAL) past a row's diagonal;
    unmasked blocks skip every mask and the -inf guard (every score is finite there)."""
    if MASKED:
        visible = (offs_n < kv_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= diagonal + offs_m[:, None])
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row with no visible key yet keeps m = -inf; shifting it by 0 keeps its weights at 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        probs = tl.exp2(scores - shift[:, None])
    else:
        # The scale and the shift in one FMA per score (the scale is positive: the max commutes with it).
        m_new = tl.maximum(m, tl.max(scores, 1) * qk_scale)
        shift = m_new
        probs = tl.exp2(scores * qk_scale - shift[:, None])
    alpha = tl.exp2(m - shift)
    return probs, m_new, denom * alpha + tl.sum(probs, 1), alpha


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
        probs, m, denom, alpha = _mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale,
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
        probs, m, denom, alpha = _mha_softmax(m, denom, scores, offs_m, offs_n, kv_len, diagonal, qk_scale,
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
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
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

    _launch_first_fitting(_mha_kernel, grid, launch_args, configs,
                          ("mha", q.device, q.dtype, d_qk, d_v, causal, config))
    return out, lse


def _mha_tma_fits(*tensors: torch.Tensor) -> bool:
    """Each of q / k [T, H, Dqk] and v [T, H, Dv] read as a [T, H * D] TMA source: heads packed within a row."""
    return all(x.stride(1) == x.shape[2] and x.stride(2) == 1 and tma_source(x.flatten(1)) for x in tensors)


class MhaConfig(NamedTuple):
    """Launch parameters of `_mha_kernel`: queries and keys per block, num_warps, num_stages, whether Triton
    warp-specializes the unmasked key loop (producer warps loading K / V beside the consumers' dots), and whether
    K and V blocks load as TMA boxes (taken where k and v pack their heads in 16-byte aligned rows, pointers
    otherwise). gluon: `gluon_mha._gluon_mha_kernel` instead (`mha_gluon_fits`: 128 queries on two consumer
    warpgroups, num_warps 8, beside a TMA producer warp; two stages of block_n keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    tma: bool = False
    gluon: bool = False


# sm90's default where it fits: FA3's tiles at DeepSeek's 192 / 128 head dims (0.77-0.85 of the limit on the H200,
# against 0.56-0.63 for `_mha_kernel`'s best config; session 15).
GLUON_MHA = MhaConfig(128, 128, 8, 2, gluon=True)


def mha_gluon_fits(config: MhaConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   capability: tuple[int, int] | None) -> bool:
    """Can `config` run as the Gluon kernel (`gluon_mha`): 128 x block_n tiles on 8 consumer warps, two stages; bf16 /
    fp16 with heads packed in rows (TMA boxes); the qk head dim a power of two of at most 256 plus a smaller
    power-of-two tail (192 = 128 + 64), a value head dim of at most 128 (the [128, Dv] float32 output in
    registers) and the tiles within sm90's shared memory; on sm90 (wgmma; the interpreter, None, runs no
    Gluon)."""
    d_qk, d_v = q.shape[2], v.shape[2]
    d1 = 1 << (d_qk.bit_length() - 1)
    d2 = d_qk - d1
    shared = 2 * (128 * d_qk + 2 * config.block_n * (d_qk + d_v))
    return ((config.block_m, config.num_warps, config.num_stages) == (128, 8, 2) and config.block_n in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and MIN_DOT <= d2 < d1 <= 256 and d2 & (d2 - 1) == 0 and MIN_DOT <= d_v <= 128 and d_v & (d_v - 1) == 0
            and shared <= 220 * 1024 and _mha_tma_fits(q, k, v) and capability is not None and capability[0] == 9)


def mha_configs(on_gpu: bool, block_dv: int, itemsize: int) -> list[MhaConfig]:
    """The fastest first. 128 x 64 tiles on 8 warps led an H100 sweep at qk 192 / v 128 in bf16 (~380
    TFLOP/s causal at 4k tokens; 64 x 64 on 4 warps ~340). Value heads over 128 or fp32 tiles start lower,
    to keep the [BLOCK_M, Dv] fp32 accumulator in registers; the rest of the list is for smaller shared
    memories."""
    if not on_gpu:
        return [MhaConfig(32, 32, 1, 1)]
    configs = [MhaConfig(128, 64, 8, 3), MhaConfig(64, 64, 4, 2), MhaConfig(32, 64, 4, 2), MhaConfig(32, 32, 4, 1),
               MhaConfig(16, 16, 4, 1)]
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
