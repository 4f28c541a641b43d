"""Absorbed MLA decode over the paged latent cache in Triton (`mla_attention`), and the host-side choices that
size its launches (`mla_config`, `mla_num_splits`). On sm90 stage 1 runs as the Gluon twin (`gluon_mla`) where
`mla_gluon_fits`.

Stage 1 (`_mla_kernel`): one program per (query token, KV split, block of BLOCK_H heads), head blocks fastest so
that the programs sharing a split's KV tiles run side by side and the second one reads them from L2. All heads of a
block share every KV tile (MQA over the latent), so a block is the M of both dots: scores [BLOCK_H, BLOCK_N] =
q_nope . latent^T + q_rope . rope^T, then out += probs . latent. The 512-wide latent is handled as two halves (the
[BLOCK_H, R] fp32 accumulator is two [BLOCK_H, R/2] ones, and TMA boxes are at most 256 wide). KV blocks are
num_stages-deep software-pipelined loads (cp.async through pointers, or TMA boxes when a block lies inside one
page). Only the last block of a sequence is masked. Stage 2 (`_mla_reduce_kernel`) merges the splits' partial
outputs by their log-sum-exps. Launch parameters are `MlaConfig`; the host picks them and the split count by shape
only, never from tensor contents, so a CUDA graph captured for a batch size stays valid for any lengths.

Batch-invariant launches (`mla_attention(fixed_splits=True)`, under --enable-deterministic-inference) split each
token's keys by its own length alone (`mla_fixed_num_splits`): splits of `mla_min_split_keys` keys from key 0, more
only past MLA_FIXED_MAX_SPLITS of them, always merged by stage 2 in chunks of MLA_REDUCE_SPLITS, the empty splits
past a token's own changing nothing: a row's sums are the same ops alone, in any batch, after a cached prefix
or inside a prefill.

Softmaxes run in base 2 (scores scaled by sm_scale * log2(e)); accumulation is float32. An fp8 (e4m3) pool is
upcast tile by tile in registers, to q's dtype; under 16-head blocks (V2-Lite, V3 at eight ranks) and a bfloat16 q,
to float16, and each latent tile is loaded twice, once per dot (`_mla_block`; 32-head blocks would spill): e4m3
converts to float16 in one instruction a pair (to bfloat16 in several), float16 holds every e4m3 value exactly and
has more mantissa than bfloat16 (q and the probabilities follow; q saturates at float16's largest finite value).
The pool's per-tensor scale s enters the scores' scale (q . s k = s (q . k)) and the output (sum p s v = s sum p v),
so no tile is multiplied. Per-batch counts and the strides that follow them are `do_not_specialize_on_alignment`, so
that no new variant compiles inside a request after the warm-up. Both kernels launch as programmatic dependents on
Hopper and newer (`plugserve.core.triton_pdl`). Imported only once a backend is built: see `common`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.attention.common import (
    LOG2E,
    MIN_DOT,
    gluon_runs_on,
    input_precision,
    last_dim_contiguous,
    launch_first_fitting,
    mla_program,
    pow2_at_least,
    saturate_to_f16,
)

# MLA_MIN_SPLIT_KEYS; also enforced in the kernel, for CUDA graphs sized for the longest sequence), at most
# MLA_MAX_SPLITS, programs filling MLA_MIN_FILL of the SMs in one wave, else in each of at most MLA_MAX_WAVES waves.
MLA_SPLIT_KEYS_PER_HEAD = 2
MLA_MIN_SPLIT_KEYS = 32
MLA_MAX_SPLITS = 128
MLA_MIN_FILL = 0.8
MLA_MAX_WAVES = 2
# Splits the MLA reduce merges per step ([16, 512] fp32 partials: 64 registers a thread on 4 warps).
MLA_REDUCE_SPLITS = 16
# Batch-invariant splits (`mla_fixed_num_splits`): a token's keys over at most this many. Its splits cannot follow the
# batch, so at batch 1 a long sequence gets no more programs than these times the head blocks; the bound keeps the
# partials at 32 [H, R] float32 rows a token (8 MiB at 128 heads of latent 512), which a CUDA graph's workspace holds
# for every token it serves.
MLA_FIXED_MAX_SPLITS = 32
# Batch-invariant launches hold at most this many partial rows ([R] float32 each: 128 MiB at latent 512); more tokens
# (a prefill, which deterministic inference runs as absorbed MLA) take a launch pair per slice of them. Decode at 128
# heads up to batch 32 over 4K-key contexts (16 splits) is one launch pair.
MLA_FIXED_WORKSPACE_ROWS = 1 << 16
# W_UV columns per program of the reduce that also projects: a [R, 16] tile (64 float32 registers a thread at R = 512).
MLA_REDUCE_BLOCK_V = 16


@dataclass(frozen=True)
class MlaConfig:
    """Launch parameters of `_mla_kernel`.

    block_h: heads per program (the M of both dots; 64 takes sm90's wgmma, 16 / 32 mma.sync); block_n:
    keys per pipelined KV block; num_warps, num_stages: as in Triton; tma: load full KV blocks as TMA
    boxes through tensor descriptors (`mla_tma_fits`) instead of cp.async through pointers; reload_q:
    load the query block inside the KV loop. Triton then hoists the load and keeps the block in shared
    memory, reading it into registers for each KV block; held from outside the loop, it stays in
    registers throughout, which mma.sync (operand A in registers in every warp) cannot afford. gluon: stage 1
    is `gluon_mla`'s kernel instead (`mla_gluon_fits`: 64-key blocks in two stages; a call with a draft
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
    return min(most, pow2_at_least(num_heads, MIN_DOT))


def mla_config(num_heads: int, dtype: torch.dtype, capability: tuple[int, int] | None, page_size: int,
               kv_lora_rank: int, rope_dim: int, kv_dtype: torch.dtype | None = None) -> MlaConfig:
    """Launch parameters by shape (docs/kernels.md gives the sweeps behind them; none spills on sm90):
    - 64 heads (sm90's wgmma): 64-key blocks in 2 stages, as TMA boxes where a block lies inside a page (half the
      blocks of 32-key ones halve the per-block softmax and rescaling); where `mla_gluon_fits`, the Gluon kernel.
    - 16 / 32 heads (mma.sync, whose A operand sits in registers in every warp): the query is loaded in the loop
      (`reload_q`); keys more than the heads and at least 8 a warp, else Triton duplicates rows across warps:
      16 x 32 keys on 4 warps, 32 x 64 on 8; 5 stages, since the pipeliner shares num_stages - 1 between the
      page-index load and the KV load that depends on it.
    - fp32 (FMA dots, accuracy checks only): 16 x 16, one stage.
    - The interpreter (capability None) runs every program in Python: the biggest blocks, one warp.
    `dtype` is q's (the activations'); a `kv_dtype` other than it (an fp8 pool) runs the Gluon kernel's 8-bit
    wgmmas where it fits, else loads KV blocks through pointers (upcast in registers), not as the Triton kernel's TMA
    boxes, which read the pool in q's dtype."""
    block_h = mla_block_h(num_heads, dtype, capability)
    if capability is None:
        return MlaConfig(block_h, 64, 1, 1)
    if dtype == torch.float32:
        return MlaConfig(block_h, 16, 4, 1, reload_q=True)
    if block_h == 64:
        config = MlaConfig(64, 64, 8, 2)
        if kv_dtype in (None, dtype):
            config = replace(config, tma=mla_tma_fits(config, kv_lora_rank, rope_dim, page_size, capability))
        return replace(config, gluon=mla_gluon_fits(config, kv_lora_rank, rope_dim, page_size, dtype, capability,
                                                    kv_dtype))
    if kv_dtype not in (None, dtype) and block_h == MIN_DOT:  # fp8: 64-key blocks on 8 warps (on 4 tiles spill)
        return MlaConfig(block_h, 64, 8, 5, reload_q=True)
    return MlaConfig(block_h, 2 * block_h, 4 if block_h == MIN_DOT else 8, 5, reload_q=True)


def mla_tma_fits(config: MlaConfig, kv_lora_rank: int, rope_dim: int, page_size: int,
                 capability: tuple[int, int] | None) -> bool:
    """Can the KV blocks be TMA boxes: a block inside one page (its rows contiguous), boxes that cover
    the latent halves and the rope key exactly, and sm90+ (None: the interpreter, which emulates them)."""
    half_r = pow2_at_least(kv_lora_rank, 2 * MIN_DOT) // 2
    return (page_size % config.block_n == 0 and kv_lora_rank == 2 * half_r
            and rope_dim == pow2_at_least(rope_dim, MIN_DOT) and (capability is None or capability >= (9, 0)))


def mla_gluon_fits(config: MlaConfig, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: torch.dtype,
                   capability: tuple[int, int] | None, kv_dtype: torch.dtype | None = None) -> bool:
    """Can `config` run as the Gluon kernel (`gluon_mla`): 64 heads on 8 warps (two warpgroups), 64-key blocks in
    two stages, DeepSeek's latent 512 + rope 64, q in bf16 / fp16 and the pool in q's dtype (`kv_dtype` None) or
    e4m3, where `gluon_runs_on(capability)` (sm90). Any `page_size` (its blocks as TMA boxes or rows by cp.async)."""
    return (config.block_h == 64 and config.num_warps == 8 and (kv_lora_rank, rope_dim) == (512, 64)
            and (config.block_n, config.num_stages) == (64, 2)
            and dtype in (torch.bfloat16, torch.float16) and kv_dtype in (None, dtype, torch.float8_e4m3fn)
            and gluon_runs_on(capability))


def mla_min_split_keys(num_heads: int) -> int:
    """The fewest keys a KV split of `num_heads` heads takes. A split costs its partial output, [H, R] float32
    written and read again: per head about as much as 2 keys' latent rows (bf16, R + P = 576), so a split
    of 2 keys a head moves as much partial as KV. Every key of a split is read in sequence, one dependent
    load after another, so at small batch the fewer keys a split has, the shorter the step: 256 keys at
    128 heads, 32 at 16 (DeepSeek-V2-Lite, or V3 over 8 ranks), where 256 would read a 288-key decode in
    one split of 8 blocks."""
    return max(MLA_MIN_SPLIT_KEYS, pow2_at_least(MLA_SPLIT_KEYS_PER_HEAD * num_heads))


def mla_num_splits(rows: int, max_kv_len: int, multiprocessors: int, min_keys: int) -> int:
    """KV splits for `rows` (query token, head block) rows, counting one resident program per SM (the big-block
    configs' case): the most whose programs fit one wave, when that wave fills at least MLA_MIN_FILL of the SMs
    (a split's keys are read in sequence, so fewer keys a split is a shorter step); else the fewest filling
    MLA_MIN_FILL of every wave, or 1 if those take more than MLA_MAX_WAVES waves. At most MLA_MAX_SPLITS (the most
    there are if none fills), and at least `min_keys` keys each (`mla_min_split_keys`). Splitting costs partials
    written and read again, so it is for batches that leave SMs idle; the wave bound keeps a launch's partials in
    L2. On 132 SMs, 128 heads in blocks of 64 (256 keys a split): batch 1 -> 66 splits, 32 -> 2, 40 -> 3 (2
    waves), 50 -> 1 (5 would fill 4 waves). Under CUDA graphs `max_kv_len` is the longest a graph serves, so the
    count depends on the batch size only; the kernel keeps splits at `min_keys` keys and leaves the rest empty on
    shorter sequences."""
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


def mla_fixed_num_splits(max_kv_len: int, min_keys: int) -> int:
    """The split count of a batch-invariant launch whose longest sequence has `max_kv_len` keys (under CUDA graphs
    the longest a graph serves): a split per `min_keys` keys (`mla_min_split_keys`, the least the batch-dependent
    count ever gives a split, so that a short sequence at batch 1 still spreads over SMs), at most
    MLA_FIXED_MAX_SPLITS.
    `mla_program` gives each split max(cdiv(blocks, count), min blocks) of a token's key blocks, which is then the
    token's own: the min-key blocks while its keys fit `count` such splits (and they do whenever count is below the
    bound), else cdiv(blocks, MLA_FIXED_MAX_SPLITS), for any batch that holds the token. So a token's splits start
    at the same keys whatever the batch; its count only decides how many empty splits the launch has."""
    return max(1, min(MLA_FIXED_MAX_SPLITS, triton.cdiv(max_kv_len, min_keys)))


def mla_fixed_tokens_per_launch(num_heads: int, num_splits: int) -> int:
    """The most tokens a batch-invariant launch pair takes: their partials within MLA_FIXED_WORKSPACE_ROWS."""
    return max(1, MLA_FIXED_WORKSPACE_ROWS // (num_heads * num_splits))


def mla_workspace_size(num_tokens: int, num_heads: int, num_splits: int, fixed_splits: bool = False) -> int:
    """Partial outputs ([T, H, splits] rows of R fp32 and one log-sum-exp each) a launch needs; 0 for one split but
    with `fixed_splits` (batch-invariant launches always reduce, at most `mla_fixed_tokens_per_launch` tokens at a
    time)."""
    if fixed_splits:
        return min(num_tokens, mla_fixed_tokens_per_launch(num_heads, num_splits)) * num_heads * num_splits
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
    query block is loaded here (q_lo, q_hi, q_rope are None), see `MlaConfig.reload_q`. KV tiles of another dtype
    than q's (an fp8 pool) are upcast as loaded (see the module's docstring); the caller applies the pool's
    scale."""
    if RELOAD_Q:
        q_lo, q_hi, q_rope = _mla_load_q(q_rows, q_rope_rows, head_mask, R, P, HALF_R, BLOCK_P)
    # An fp8 pool under 16-head blocks: see the module's docstring.
    fp8_16_heads: tl.constexpr = kv_ptr.dtype.element_ty == tl.float8e4nv and head_mask.shape[0] == 16
    compute_ty = q_rows.dtype.element_ty
    if fp8_16_heads and compute_ty == tl.bfloat16:
        compute_ty = tl.float16
        q_lo = saturate_to_f16(q_lo)
        q_hi = saturate_to_f16(q_hi)
        q_rope = saturate_to_f16(q_rope)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA and not MASKED:
        # The block lies inside one page, so its rows are contiguous: one page lookup, three boxes.
        first = b * BLOCK_N
        row = tl.load(block_table_row + first // PAGE_SIZE) * PAGE_SIZE + first % PAGE_SIZE
        lo = kv.load([row, 0])
        hi = kv.load([row, HALF_R])
        rope = kv_rope.load([row, R])
        lo_v, hi_v = lo, hi
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
        lo_rows, hi_rows = rows + r[None, :], rows + HALF_R + r[None, :]
        hi_mask = valid & (HALF_R + r < R)[None, :]
        lo = tl.load(lo_rows, mask=valid, other=0.0, eviction_policy="evict_last").to(compute_ty)
        hi = tl.load(hi_rows, mask=hi_mask, other=0.0, eviction_policy="evict_last").to(compute_ty)
        rope = tl.load(rows + R + p[None, :], mask=valid & (p < P)[None, :], other=0.0).to(compute_ty)
        if fp8_16_heads:  # one load a dot (the second from L2), or the pipeliner keeps the upcast tiles out of
            # shared memory: no 8-bit layout serves both the transposed score operand and the P V one
            lo_v = tl.load(lo_rows, mask=valid, other=0.0, eviction_policy="evict_first").to(compute_ty)
            hi_v = tl.load(hi_rows, mask=hi_mask, other=0.0, eviction_policy="evict_first").to(compute_ty)
        else:
            lo_v, hi_v = lo, hi

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
    acc_lo = tl.dot(probs, lo_v, acc_lo * alpha[:, None], input_precision=INPUT_PRECISION)
    acc_hi = tl.dot(probs, hi_v, acc_hi * alpha[:, None], input_precision=INPUT_PRECISION)
    return m_new, denom, acc_lo, acc_hi


@triton.jit(do_not_specialize_on_alignment=["stride_bt", "stride_lse_t", "stride_lse_h", "num_splits"])
def _mla_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, kv, kv_rope, block_table_ptr, token_req_ptr, token_kv_len_ptr, tree_start_ptr,
    tree_bits_ptr, out_ptr, lse_ptr,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_kv, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
    num_heads, num_splits, min_split_blocks, qk_scale, kv_scale,
    R: tl.constexpr, P: tl.constexpr, HALF_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, TREE: tl.constexpr, TMA: tl.constexpr, RELOAD_Q: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # kv_ptr: the pool [num_slots, R + P]; kv / kv_rope (TMA, else None): descriptors of its [BLOCK_N, HALF_R]
    # and [BLOCK_N, BLOCK_P] boxes. SPLIT: out_ptr / lse_ptr are float32 partials and base-2 log-sum-exps
    # (unit stride over splits), else out_ptr is the output and no lse is kept. TREE: the token is a draft-tree
    # node whose keys from tree_start[t] on are the tree's nodes, seen per tree_bits[t]; every block from the
    # tree's first on is masked. PDL: launched as a programmatic dependent (plugserve.core.triton_pdl). kv_scale:
    # the pool's (1.0 but for fp8), already in qk_scale; here it scales the output.
    programmatic_prologue(PDL)
    head_block, split, t, req, kv_len, first, last = mla_program(
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
    out_scale = kv_scale / denom[:, None]
    tl.store(out_rows + r[None, :], (acc_lo * out_scale).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    tl.store(out_rows + HALF_R + r[None, :], (acc_hi * out_scale).to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (HALF_R + r < R)[None, :])
    if SPLIT:
        tl.store(lse_ptrs, m + tl.log2(denom), mask=head_mask)


@triton.jit(do_not_specialize_on_alignment=["stride_pl_t", "stride_pl_h", "num_splits"])
def _mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, w_vc_ptr,
    stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_o_t, stride_o_h, stride_w_h, stride_w_r,
    num_splits,
    R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    FIXED: tl.constexpr, PDL: tl.constexpr,
):
    # One (token, head): an online log-sum-exp merge over the splits, BLOCK_S at a time. Empty splits
    # have lse -inf, weight 0, and their (unwritten) partials are not read. V > 0: program (t, h, v-block) also
    # multiplies the merged latent, rounded to out's dtype, by w_vc[h, :, v-block] (W_UV) and stores that
    # [BLOCK_V] slice of out [T, H, V]: each v-block's program merges the same splits again, which at decode costs
    # less than a bmm's launch. FIXED (batch-invariant splits): a chunk that does not raise the running max scales by
    # exactly 1, so that the all-empty chunks past a token's own splits (some launches have them) leave it unchanged.
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
        scale = tl.where(m_new == m, 1.0, tl.exp2(m - m_new)) if FIXED else tl.exp2(m - m_new)
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
    kv_scale: float = 1.0,
    fixed_splits: bool = False,
) -> torch.Tensor:
    """Absorbed MLA, one row per query token.

    q_nope [T, H, R], q_rope [T, H, P] (fp16 / bf16 / fp32, last dim contiguous); kv_buffer
    [num_slots, R + P] of q's dtype, or float8_e4m3fn holding value / kv_scale (latent, then rope key);
    block_table [B, max_pages] int32; token_req [T] int32 (each token's block-table row); token_kv_len [T] int32
    (keys the token sees: positions 0..len-1 of its request, at least 1). `config`: launch parameters (`mla_config`);
    `num_splits` >= 1 KV splits per token (`mla_num_splits`): with more than one, float32 partials
    [T, H, splits, R] and log-sum-exps [T, H, splits] go to `workspace` (two flat float32 buffers of at
    least `mla_workspace_size` rows times R, and rows; allocated here when None), then a second kernel
    reduces them. `tree`: every token is a draft-tree node (token_kv_len then counts its request's whole
    tree): (tree_start [T] int32, the position of its request's first node; tree_bits [T] int64, bit j set
    when it sees node j, itself and its ancestors; at most 64 nodes). Returns out [T, H, R] in q's dtype, or with
    w_vc [H, R, V] (W_UV, q's dtype) out rounded to q's dtype times w_vc per head, [T, H, V]: in the reduce kernel
    when there are splits, else by a bmm.
    fixed_splits (batch invariance): `num_splits` from `mla_fixed_num_splits`; each token's keys split by its own
    length alone, stage 1 through `_mla_kernel` (not Gluon), and the splits always merged by the reduce kernel in
    chunks of MLA_REDUCE_SPLITS (a workspace of `mla_workspace_size(..., fixed_splits=True)` rows), a launch pair per
    `mla_fixed_tokens_per_launch` tokens.
    """
    t, h, r = q_nope.shape
    step = mla_fixed_tokens_per_launch(h, num_splits) if fixed_splits else t
    if t > step:  # each slice's tokens compute as they would in one launch: their splits are their own
        return torch.cat([
            mla_attention(q_nope[i : i + step], q_rope[i : i + step], kv_buffer, block_table, token_req[i : i + step],
                          token_kv_len[i : i + step], page_size, sm_scale, config, num_splits, workspace,
                          None if tree is None else (tree[0][i : i + step], tree[1][i : i + step]), w_vc, kv_scale,
                          fixed_splits)
            for i in range(0, t, step)
        ])
    p = q_rope.shape[2]
    device = q_nope.device
    out = torch.empty(t, h, r, dtype=q_nope.dtype, device=device)
    if t == 0:
        return out
    q_nope, q_rope = last_dim_contiguous(q_nope), last_dim_contiguous(q_rope)
    block_table = last_dim_contiguous(block_table)
    checked = device.type == "cuda" and (config.tma or config.gluon)
    capability = torch.cuda.get_device_capability(device) if checked else None
    if config.tma and not mla_tma_fits(config, r, p, page_size, capability):
        raise ValueError(f"MLA config {config} cannot use TMA with page size {page_size}, latent {r}, rope {p}")
    if kv_buffer.dtype not in (q_nope.dtype, torch.float8_e4m3fn):
        raise ValueError(f"MLA decode reads a KV pool of q's dtype {q_nope.dtype} or float8_e4m3fn, not "
                         f"{kv_buffer.dtype}")
    if kv_buffer.dtype != q_nope.dtype and config.tma:
        raise ValueError(f"MLA config {config} reads the pool in q's dtype: an fp8 pool takes pointer loads")
    if config.gluon and not mla_gluon_fits(config, r, p, page_size, q_nope.dtype, capability, kv_buffer.dtype):
        raise ValueError(f"MLA config {config} cannot run the Gluon kernel with page size {page_size}, latent {r}, "
                         f"rope {p}, {q_nope.dtype} on {'the CPU' if capability is None else f'sm{capability}'}")
    if config.gluon and (tree is not None or fixed_splits):
        config = replace(config, gluon=False)  # the Gluon kernel has no draft trees and splits by the batch
    split = num_splits > 1 or fixed_splits
    if not split:
        # Written straight into `out`: the split dim has stride 0 and no lse is kept.
        part_out, part_lse = out, out
        o_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        rows = mla_workspace_size(t, h, num_splits, fixed_splits)
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
                         sm_scale * LOG2E, page_size, kv_scale)
    else:
        _launch_mla_kernel(grid, config, q_nope, q_rope, kv_buffer, block_table, token_req, token_kv_len, tree,
                           part_out, part_lse, o_strides, lse_strides, num_splits, split, page_size, sm_scale, kv_scale,
                           pdl)
    if not split:
        return out if w_vc is None else torch.bmm(out.transpose(0, 1), w_vc).transpose(0, 1)
    v = 0 if w_vc is None else w_vc.shape[2]
    if w_vc is not None:
        out = torch.empty(t, h, v, dtype=q_nope.dtype, device=device)
        w_vc = last_dim_contiguous(w_vc)
    _mla_reduce_kernel[(t, h, triton.cdiv(v, MLA_REDUCE_BLOCK_V) if v else 1)](
        part_out, part_lse, out, w_vc,
        *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
        w_vc.stride(0) if v else 0, w_vc.stride(1) if v else 0, num_splits,
        R=r, BLOCK_S=MLA_REDUCE_SPLITS if fixed_splits else min(MLA_REDUCE_SPLITS, triton.next_power_of_2(num_splits)),
        BLOCK_R=triton.next_power_of_2(r), V=v, BLOCK_V=MLA_REDUCE_BLOCK_V, FIXED=fixed_splits, **pdl,
    )
    return out


def _launch_mla_kernel(grid: tuple[int], config: MlaConfig, q_nope: torch.Tensor, q_rope: torch.Tensor,
                       kv_buffer: torch.Tensor, block_table: torch.Tensor, token_req: torch.Tensor,
                       token_kv_len: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None,
                       part_out: torch.Tensor, part_lse: torch.Tensor, o_strides: tuple[int, int, int],
                       lse_strides: tuple[int, int], num_splits: int, split: bool, page_size: int, sm_scale: float,
                       kv_scale: float, pdl: dict) -> None:
    """Stage 1 of `mla_attention` as `_mla_kernel`: `config`, else the first of its fallbacks that compiles here
    (arguments as `mla_attention` made them; split: partials to reduce, see `_mla_kernel`'s SPLIT)."""
    r, p, h = q_nope.shape[2], q_rope.shape[2], q_nope.shape[1]
    half_r = pow2_at_least(r, 2 * MIN_DOT) // 2
    block_p = pow2_at_least(p, MIN_DOT)
    shape = dict(R=r, P=p, HALF_R=half_r, BLOCK_P=block_p, BLOCK_H=config.block_h, PAGE_SIZE=page_size,
                 SPLIT=split, TREE=tree is not None, INPUT_PRECISION=input_precision(q_nope.dtype), **pdl)
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
                triton.cdiv(mla_min_split_keys(h), launch["BLOCK_N"]), sm_scale * LOG2E * kv_scale, kv_scale)

    launches = [shape | dict(BLOCK_N=c.block_n, TMA=c.tma, RELOAD_Q=c.reload_q, num_warps=c.num_warps,
                             num_stages=c.num_stages)
                for c in _mla_fallbacks(config)]
    launch_first_fitting(_mla_kernel, grid, args, launches, ("mla", q_nope.device, q_nope.dtype, kv_buffer.dtype, r, p,
                                                              page_size, config, split, tree is not None))


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
