"""Triton kernels of the `triton` MoE backend and their launchers. Imported lazily (by
`plugserve.plugins.moe.triton`), so that merely loading the plugin never imports Triton; with
TRITON_INTERPRET=1 set before this import the kernels run on the CPU in Triton's interpreter.

Notation: T tokens, k experts per token (top-k), P = T * k token-expert pairs (pair p = t * k + j is
slot j of token t), E experts, H hidden size, I expert intermediate size.

Pipeline of `fused_experts`:
  1. `moe_align_block_size`: pairs sorted by expert, each expert's run padded to a multiple of
     BLOCK_M, so that every M-block of the grouped GEMM belongs to one expert. One token (decode at
     batch 1) needs no sorting: its k experts are distinct, so each pair is its own M-block
     (`pair_blocks`, no kernel).
  2. block-FP8 only: `per_token_group_quant` of x [T, H] (1 x 128 groups).
  3. w13 pass of `_fused_moe_gemm_kernel`: h[p] = silu(x[t] @ W_gate^T) * (x[t] @ W_up^T), [P, I]
     (SiLU-and-mul fused into the epilogue: each program holds the gate and the up tile). A config's SPLIT_K
     cuts K into runs, summed in split order by each block's last program before the epilogue: at one token
     the few M-blocks alone do not fill the GPU.
  4. block-FP8 only: `per_token_group_quant` of h.
  5. w2 pass: y[p] = weight[p] * routed_scaling_factor * (h[p] @ W2^T), [P, H]. Its K (I, divided under tensor
     parallelism) is short: a config's COLUMN_BLOCKS runs it as `_grouped_gemm_columns_kernel`, whose programs
     take several column blocks each with K unrolled, so that the loop over them is what Triton pipelines.
  6. `_topk_sum_kernel`: out[t] = sum_j y[t * k + j], [T, H]. For one token the w2 pass does this sum itself
     (its SUM_PAIRS epilogue: the last program of each column block to finish adds that block's k rows), unless
     its config cuts K.

Arguments that change with every batch (pair, chunk and block counts) are `do_not_specialize_on_alignment`:
Triton would otherwise compile a variant for each count divisible by 16 and one for the rest, the later inside a
request after the warm-up.

On Hopper and newer GPUs every kernel here launches as a programmatic dependent (`plugserve.core.triton_pdl`:
the PDL constexpr), so that the chain above hides its launches behind each other's tails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.core.interfaces import RouterConfig
from plugserve.core.layers.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS
from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.gemm.triton_kernels import split_k_arrive, split_k_sum
from plugserve.plugins.moe.configs import GemmConfig, MoEConfig
from plugserve.plugins.triton_support import split_k_arrivals, tma_source

# Triton's interpreter (triton 3.9) computes tl.dot on bfloat16 operands wrongly and rounds
# float32 -> float8 casts wrongly (no carry into the exponent): under it, bfloat16 tiles are widened
# to float32 before tl.dot, and quantized activations are cast to float8 by torch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# `_grouped_topk_kernel`'s GROUPING: how experts are grouped before the top-k.
NO_GROUPS, GROUP_BY_MAX, GROUP_BY_TOP2_SUM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

# moe_align_block_size: up to this many pairs (512 tokens x top-8) one program aligns them in one launch
# (H100, E = 64 / 256: 2.5-5 us up to 384 pairs, 8 us at 768, 11 at 1536, 20 at 3072, 31 at 4096, where the
# three kernels took 30-50 us); beyond, three kernels over chunks of _ALIGN_CHUNK pairs.
_ALIGN_SINGLE_MAX_PAIRS = 4096
_ALIGN_SORT = 512  # pairs the one-program kernel sorts at once (larger sorts cost more per pair)
_ALIGN_FILL = 1024  # slots (or M-blocks) it marks as padding at once
_ALIGN_CHUNK = 256  # pairs per program of the multi-program kernels
_ALIGN_SUB = 32  # pairs compared at once when ranking pairs within a chunk
_ALIGN_BLOCKS = 256  # M-blocks labelled at once by the scan kernel
_QUANT_GROUPS = 8  # 1 x group_size groups per program of the activation quantizer
_SUM_BLOCK_H = 1024  # hidden columns per program of the top-k sum
MIN_BLOCK_N = 16  # the narrowest GEMM column block (tl.dot's minimum): sizes the w2 pass's arrival counts
# fused_router: at most this many tokens (its last program selects every token's experts one after another), over
# about ROUTER_PROGRAMS programs.
FUSED_ROUTER_MAX_TOKENS = 4
ROUTER_PROGRAMS = 64


# ----------------------------------------------------------------------------------------------------
# Router


@triton.jit
def _select_experts(
    logits_row, bias_ptr, weights_ptr, ids_ptr, token,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    VOLATILE: tl.constexpr,
):
    """DeepSeek's gate for one token from its float32 logits at `logits_row` (VOLATILE: written by other
    programs of this launch, so read past the L1 cache) into row `token` of the outputs. Experts are laid out
    [group, expert in group] (one group: greedy). Rows of the outputs hold TOP_K routed then NUM_SHARED fused
    shared experts (ids E.., `shared_weight`)."""
    group = tl.arange(0, GROUPS_PAD)
    expert = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_PAD)[None, :]
    valid = (group[:, None] < NUM_GROUPS) & (tl.arange(0, GROUP_PAD)[None, :] < GROUP_SIZE)
    logits = tl.load(logits_row + expert, mask=valid, other=float("-inf"), volatile=VOLATILE).to(tl.float32)
    if SOFTMAX:
        shifted = tl.exp(logits - tl.max(tl.max(logits, 1), 0))
        scores = shifted / tl.sum(tl.sum(shifted, 1), 0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:  # noaux_tc: the bias decides which experts are chosen, not their weights
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUPING != NO_GROUPS:
        top1 = tl.max(choice, 1)
        if GROUPING == GROUP_BY_MAX:
            group_score = top1
        else:  # the sum of the two best experts of each group
            column = tl.arange(0, GROUP_PAD)[None, :]
            first = tl.min(tl.where(choice == top1[:, None], column, GROUP_PAD), 1)
            group_score = top1 + tl.max(tl.where(column == first[:, None], float("-inf"), choice), 1)
        group_score = tl.where(group < NUM_GROUPS, group_score, float("-inf"))
        keep = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.min(tl.where(group_score == tl.max(group_score, 0), group, GROUPS_PAD), 0)
            keep = keep | (group == best)
            group_score = tl.where(group == best, float("-inf"), group_score)
        dropped = 0.0 if MASK_TO_ZERO else float("-inf")
        choice = tl.where(keep[:, None] & valid, choice, tl.where(valid, dropped, float("-inf")))

    slot = tl.arange(0, TOPK_PAD)
    topk_weights = tl.zeros([TOPK_PAD], dtype=tl.float32)
    topk_ids = tl.zeros([TOPK_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == best, expert, GROUPS_PAD * GROUP_PAD), 1), 0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), 1), 0)
        topk_weights = tl.where(slot == j, weight, topk_weights)
        topk_ids = tl.where(slot == j, pick, topk_ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if RENORMALIZE:
        topk_weights = topk_weights / (tl.sum(topk_weights, 0) + 1e-20)
    row = token * (TOP_K + NUM_SHARED)
    tl.store(weights_ptr + row + slot, topk_weights, mask=slot < TOP_K)
    tl.store(ids_ptr + row + slot, topk_ids, mask=slot < TOP_K)
    if NUM_SHARED > 0:
        shared = tl.arange(0, SHARED_PAD)
        on = shared < NUM_SHARED
        tl.store(weights_ptr + row + TOP_K + shared, tl.full(shared.shape, shared_weight, tl.float32), mask=on)
        tl.store(ids_ptr + row + TOP_K + shared, NUM_GROUPS * GROUP_SIZE + shared, mask=on)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_logits,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    PDL: tl.constexpr,
):
    """One token per program: `_select_experts` from its row of router logits."""
    programmatic_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    _select_experts(logits_ptr + token * stride_logits, bias_ptr, weights_ptr, ids_ptr, token,
                    NUM_GROUPS, GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOPK_PAD, SOFTMAX, GROUPING,
                    HAS_BIAS, MASK_TO_ZERO, RENORMALIZE, NUM_SHARED, SHARED_PAD, shared_weight, False)


@triton.jit
def _fused_router_kernel(
    x_ptr, gate_ptr, logits_ptr, arrived_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_tokens, hidden, stride_x, stride_gate,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    TOKENS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program e: the gate's logits of experts [e * BLOCK_E, (e + 1) * BLOCK_E) for every token into the float32
    scratch logits [num_tokens, E] (contiguous). The program that arrives last (an atomic count in arrived_ptr,
    after every program's stores) selects every token's experts from the whole rows, and sets the count back to
    0 for the next launch (a CUDA graph's replay too)."""
    programmatic_prologue(PDL)
    experts = NUM_GROUPS * GROUP_SIZE
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.arange(0, TOKENS_PAD)
    k = tl.arange(0, BLOCK_K)
    token_ok, expert_ok = t < num_tokens, e < experts
    acc = tl.zeros([TOKENS_PAD, BLOCK_E], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + k
        w = tl.load(gate_ptr + e[:, None].to(tl.int64) * stride_gate + kk[None, :],
                    mask=expert_ok[:, None] & (kk < hidden)[None, :], other=0.0)
        x = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :], mask=token_ok[:, None] & (kk < hidden)[None, :],
                    other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(logits_ptr + t[:, None] * experts + e[None, :], acc, mask=token_ok[:, None] & expert_ok[None, :])
    tl.debug_barrier()  # every thread's stores before the arrival (release) below
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for token in range(num_tokens):
            _select_experts(logits_ptr + token * experts, bias_ptr, weights_ptr, ids_ptr, token,
                            NUM_GROUPS, GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOPK_PAD, SOFTMAX,
                            GROUPING, HAS_BIAS, MASK_TO_ZERO, RENORMALIZE, NUM_SHARED, SHARED_PAD, shared_weight,
                            True)
        tl.atomic_xchg(arrived_ptr, 0)


def grouped_topk(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, router: RouterConfig, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's gate, as `torch_ref.select_experts`: router_logits [T, E] float32 (correction_bias [E],
    noaux_tc only) -> (topk_weights [T, k + num_shared] float32, topk_ids [T, k + num_shared] int32), best
    expert first, then the fused shared experts E .. E+S-1 weighted 1 / routed_scaling_factor.

    greedy: top-k of all scores; group_limited_greedy: top-k within the `topk_group` groups of the
    highest max score (other experts scored 0); noaux_tc: sigmoid scores plus the bias, groups ranked by
    the sum of their best two, other experts excluded, weights the unbiased scores."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.contiguous()
    width = router.top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    constants = _selection_constants(router, num_experts, num_shared, correction_bias is not None)
    _grouped_topk_kernel[(num_tokens,)](
        logits, correction_bias.contiguous() if correction_bias is not None else None, weights, ids, logits.stride(0),
        **constants, **launch_options(logits),
        num_warps=4 if constants["GROUPS_PAD"] * constants["GROUP_PAD"] > 256 else 1,
    )
    return weights, ids


def _selection_constants(router: RouterConfig, num_experts: int, num_shared: int, has_bias: bool) -> dict:
    """`_select_experts`' constexprs (and shared_weight) for `router` over num_experts experts."""
    grouped = router.topk_method != "greedy"
    num_groups = router.n_group if grouped else 1
    group_size = num_experts // num_groups
    grouping = {"greedy": NO_GROUPS, "group_limited_greedy": GROUP_BY_MAX, "noaux_tc": GROUP_BY_TOP2_SUM}
    return dict(
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, GROUPS_PAD=triton.next_power_of_2(num_groups),
        GROUP_PAD=triton.next_power_of_2(group_size), TOPK_GROUP=router.topk_group if grouped else 1,
        TOP_K=router.top_k, TOPK_PAD=triton.next_power_of_2(router.top_k),
        SOFTMAX=router.scoring_func == "softmax", GROUPING=grouping[router.topk_method], HAS_BIAS=has_bias,
        MASK_TO_ZERO=router.topk_method == "group_limited_greedy", RENORMALIZE=router.norm_topk_prob,
        NUM_SHARED=num_shared, SHARED_PAD=triton.next_power_of_2(max(num_shared, 1)),
        shared_weight=1.0 / router.routed_scaling_factor,
    )


def fused_router(
    x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None, router: RouterConfig,
    num_shared: int, scratch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk(router_logits(x, gate), ...)` in one launch for a few tokens: x [T, H] (T <= FUSED_ROUTER_MAX_
    TOKENS, last dim contiguous), gate [E, H] contiguous (any float dtype; products summed in float32). scratch:
    (logits [>= T * E] float32, arrived [1] int32 zeros) kept by the caller across launches (the kernel leaves the
    count at 0 again). Same outputs as `grouped_topk`; no allocation but the outputs, no host sync."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    logits, arrived = scratch
    if num_tokens > FUSED_ROUTER_MAX_TOKENS or logits.numel() < num_tokens * num_experts:
        raise ValueError(f"fused_router takes at most {FUSED_ROUTER_MAX_TOKENS} tokens and scratch for them, got "
                         f"{num_tokens} tokens and {logits.numel()} scratch logits for {num_experts} experts")
    width = router.top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens_pad = triton.next_power_of_2(num_tokens)
    # Enough programs to stream the gate at bandwidth (V3's 256 x 7168 over 64), each a [tokens, BLOCK_E, BLOCK_K]
    # product of at most 8192 float32 (64 registers a thread on 4 warps).
    block_e = max(1, min(triton.next_power_of_2(num_experts) // ROUTER_PROGRAMS, 16))
    block_k = max(16, min(1024, triton.next_power_of_2(hidden), 8192 // (tokens_pad * block_e)))
    _fused_router_kernel[(triton.cdiv(num_experts, block_e),)](
        x, gate, logits, arrived, correction_bias.contiguous() if correction_bias is not None else None, weights, ids,
        num_tokens, hidden, x.stride(0), gate.stride(0),
        **_selection_constants(router, num_experts, num_shared, correction_bias is not None),
        TOKENS_PAD=tokens_pad, BLOCK_E=block_e, BLOCK_K=block_k, **launch_options(x), num_warps=4,
    )
    return weights, ids


# ----------------------------------------------------------------------------------------------------
# moe_align_block_size


@dataclass(frozen=True)
class BlockAlignment:
    """Token-expert pairs sorted by expert, each expert's run padded to a multiple of `block_m`.

    sorted_ids [num_blocks * block_m] int32: pair indices p = t * k + j, ascending within each expert,
    `num_pairs` in padding slots; expert_ids [num_blocks] int32: the expert of each M-block, -1 past
    the used blocks; num_padded [1] int32: used slots (a multiple of block_m), on the device so that
    nothing waits for the host. num_blocks is the worst case, sized without reading the ids."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int
    # One M-block per pair, in pair order (`pair_blocks`): block p holds pair p alone (its other BLOCK_M - 1 rows
    # padding), expert_ids is the top-k ids themselves, dropped ids included (the GEMM skips those blocks), and
    # sorted_ids / num_padded are unused.
    per_pair: bool = False

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.numel()


def pair_blocks(topk_ids: torch.Tensor, block_m: int) -> BlockAlignment:
    """The alignment of one token without a kernel: its k experts are distinct, so sorting its pairs by expert
    would give each its own M-block anyway. topk_ids [1, k] int32 contiguous (see `BlockAlignment.per_pair`)."""
    ids = topk_ids.reshape(-1)
    return BlockAlignment(ids, ids, ids, block_m, ids.numel(), per_pair=True)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """The grouped GEMM's alignment of a batch: `pair_blocks` for one token, else `moe_align_block_size`."""
    if topk_ids.shape[0] == 1:
        return pair_blocks(topk_ids.to(torch.int32).contiguous(), block_m)
    return moe_align_block_size(topk_ids, num_experts, block_m)


@triton.jit(do_not_specialize_on_alignment=["num_pairs", "num_blocks"])
def _align_single_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """The whole alignment in one program (decode-sized pair counts; one CHUNK of pairs at a time):
    per-expert counts (histograms), the padded runs placed by an exclusive scan, then per chunk, in
    pair order, one sort of the keys expert * CHUNK + pair, which orders the chunk's pairs by expert and
    by pair within each expert; the sorted pairs of expert e fill its next free slots."""
    programmatic_prologue(PDL)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)  # 0 past E: dropped ids are not counted
    for first_pair in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + first_pair + lane, mask=first_pair + lane < num_pairs, other=-1)
        kept = (ids >= 0) & (ids < NUM_EXPERTS)  # other ids are dropped
        counts += tl.histogram(tl.where(kept, ids, 0), EXPERTS_PAD, mask=kept)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    next_slot = tl.cumsum(padded, 0) - padded  # expert e's run: [next_slot[e], next_slot[e] + padded[e])
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    # Every slot and M-block starts as padding; the kept pairs and their blocks' experts overwrite them
    # after the barrier (it orders the stores of the program's threads to the same addresses).
    for first_slot in range(0, num_blocks * BLOCK_M, FILL):
        slot = first_slot + tl.arange(0, FILL)
        tl.store(sorted_ptr + slot, tl.zeros([FILL], dtype=tl.int32) + num_pairs, mask=slot < num_blocks * BLOCK_M)
    for first_block in range(0, num_blocks, FILL):
        block = first_block + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + block, tl.full([FILL], -1, dtype=tl.int32), mask=block < num_blocks)
    tl.debug_barrier()

    for first_pair in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + first_pair + lane, mask=first_pair + lane < num_pairs, other=-1)
        kept = (ids >= 0) & (ids < NUM_EXPERTS)
        keys = tl.sort(tl.where(kept, ids, NUM_EXPERTS) * CHUNK + lane)  # dropped pairs sort last
        expert = keys // CHUNK
        chunk_counts = tl.histogram(tl.where(kept, ids, 0), EXPERTS_PAD, mask=kept)
        # The i-th sorted pair is the (i - first[e])-th of its expert e in this chunk.
        first = tl.cumsum(chunk_counts, 0) - chunk_counts
        slot = lane + tl.gather(next_slot - first, tl.minimum(expert, EXPERTS_PAD - 1), 0)
        is_kept = expert < NUM_EXPERTS
        tl.store(sorted_ptr + slot, first_pair + keys % CHUNK, mask=is_kept)
        # Each used M-block holds at least one pair of its expert (a run pads less than BLOCK_M slots),
        # so these stores label every used block; pairs sharing a block store the same value.
        tl.store(expert_ids_ptr + slot // BLOCK_M, expert, mask=is_kept)
        next_slot += chunk_counts


@triton.jit(do_not_specialize_on_alignment=["num_pairs"])
def _align_count_kernel(
    ids_ptr, rank_ptr, counts_ptr, num_pairs,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per chunk of pairs: each pair's rank among the chunk's earlier pairs of its expert, and the
    chunk's count of every expert into counts [chunks, E]."""
    programmatic_prologue(PDL)
    chunk = tl.program_id(0)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    valid = (pair < num_pairs) & (ids >= 0) & (ids < NUM_EXPERTS)  # other ids are dropped
    ids = tl.where(valid, ids, -1)
    before = tl.zeros([CHUNK], dtype=tl.int32)
    for start in tl.static_range(0, CHUNK, SUB):
        other = chunk * CHUNK + start + tl.arange(0, SUB)
        other_ids = tl.load(ids_ptr + other, mask=other < num_pairs, other=-1)
        same = (ids[:, None] == other_ids[None, :]) & valid[:, None]
        before += tl.sum((same & (other[None, :] < pair[:, None])).to(tl.int32), 1)
    tl.store(rank_ptr + pair, before, mask=valid)
    expert = tl.arange(0, EXPERTS_PAD)
    counts = tl.histogram(tl.where(valid, ids, 0), EXPERTS_PAD, mask=valid)
    tl.store(counts_ptr + chunk * NUM_EXPERTS + expert, counts, mask=expert < NUM_EXPERTS)


@triton.jit(do_not_specialize_on_alignment=["num_chunks", "num_blocks"])
def _align_scan_kernel(
    counts_ptr, offsets_ptr, starts_ptr, expert_ids_ptr, num_padded_ptr, num_chunks, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: offsets [chunks, E], each chunk's offset within each expert's run (the counts
    [chunks, E] of the chunks before it; a separate buffer, since threads holding copies of one element
    are not synchronized between a load and a store); each expert's run starts after the padded runs
    of the experts before it; every M-block gets its expert."""
    programmatic_prologue(PDL)
    expert = tl.arange(0, EXPERTS_PAD)
    real = expert < NUM_EXPERTS
    total = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for chunk in range(num_chunks):
        tl.store(offsets_ptr + chunk * NUM_EXPERTS + expert, total, mask=real)
        total += tl.load(counts_ptr + chunk * NUM_EXPERTS + expert, mask=real, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + expert, ends - padded, mask=real)
    used = tl.sum(padded, 0)
    tl.store(num_padded_ptr, used)
    for first in range(0, num_blocks, BLOCKS):
        block = first + tl.arange(0, BLOCKS)
        # The block's expert is the first whose run ends after the block's start.
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(expert_ids_ptr + block, tl.where(block * BLOCK_M < used, owner, -1), mask=block < num_blocks)


@triton.jit(do_not_specialize_on_alignment=["num_pairs"])
def _align_scatter_kernel(
    ids_ptr, rank_ptr, offsets_ptr, starts_ptr, sorted_ptr, num_pairs,
    NUM_EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Each pair to its slot: its expert's start + its chunk's offset in that run + its rank."""
    programmatic_prologue(PDL)
    chunk = tl.program_id(0)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    valid = (pair < num_pairs) & (ids >= 0) & (ids < NUM_EXPERTS)
    slot = (
        tl.load(starts_ptr + ids, mask=valid, other=0)
        + tl.load(offsets_ptr + chunk * NUM_EXPERTS + ids, mask=valid, other=0)
        + tl.load(rank_ptr + pair, mask=valid, other=0)
    )
    tl.store(sorted_ptr + slot, pair, mask=valid)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """topk_ids [T, k] integer -> the pairs sorted by expert in runs padded to multiples of block_m.
    Ids outside [0, E) (-1: an expert another rank holds) are left out. Sizes come from the shapes
    alone and every output is written on the device: nothing syncs, and a CUDA graph can capture it.

    Up to _ALIGN_SINGLE_MAX_PAIRS pairs (decode) it is one launch of `_align_single_kernel`; beyond,
    a count kernel over chunks, a one-program scan and a scatter kernel."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    num_pairs, device = ids.numel(), ids.device
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    experts_pad = triton.next_power_of_2(num_experts)
    if 0 < num_pairs <= _ALIGN_SINGLE_MAX_PAIRS:
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
        expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
        num_padded = torch.empty(1, dtype=torch.int32, device=device)
        _align_single_kernel[(1,)](
            ids, sorted_ids, expert_ids, num_padded, num_pairs, num_blocks, NUM_EXPERTS=num_experts,
            EXPERTS_PAD=experts_pad, CHUNK=min(max(triton.next_power_of_2(num_pairs), 16), _ALIGN_SORT),
            BLOCK_M=block_m, FILL=_ALIGN_FILL, **launch_options(ids), num_warps=4,
        )
        return BlockAlignment(sorted_ids, expert_ids, num_padded, block_m, num_pairs)

    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    alignment = BlockAlignment(sorted_ids, expert_ids, num_padded, block_m, num_pairs)
    if num_pairs == 0:
        return alignment
    num_chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    pdl = launch_options(ids)  # the three kernels'
    _align_count_kernel[(num_chunks,)](
        ids, ranks, counts, num_pairs, NUM_EXPERTS=num_experts, EXPERTS_PAD=experts_pad, CHUNK=_ALIGN_CHUNK,
        SUB=_ALIGN_SUB, **pdl, num_warps=4,
    )
    _align_scan_kernel[(1,)](
        counts, offsets, starts, expert_ids, num_padded, num_chunks, num_blocks, NUM_EXPERTS=num_experts,
        EXPERTS_PAD=experts_pad, BLOCK_M=block_m, BLOCKS=_ALIGN_BLOCKS, **pdl, num_warps=4,
    )
    _align_scatter_kernel[(num_chunks,)](
        ids, ranks, offsets, starts, sorted_ids, num_pairs, NUM_EXPERTS=num_experts, CHUNK=_ALIGN_CHUNK,
        **pdl, num_warps=4,
    )
    return alignment


# ----------------------------------------------------------------------------------------------------
# Per-token-group FP8 quantization of activations


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, cols, num_groups, stride_x, stride_q, stride_scale,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """GROUPS 1 x GROUP groups of one row: scale = max(amax, EPS) / FP8_MAX, q = clamp(x / scale),
    with correctly rounded divisions, as the reference quantizer computes them."""
    programmatic_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = col < cols
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), EPS), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + col, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_scale + group, scale, mask=group < num_groups)


def per_token_group_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/group_size)] float32), bit for
    bit `quant.per_token_group_quant_fp8` (both divide with correct rounding: a reciprocal multiply, one
    ulp off for about half the scales, flips the fp8 rounding of ties, frequent in 16-bit inputs)."""
    x = x.contiguous()
    rows, cols = x.shape
    num_groups = triton.cdiv(cols, group_size)
    q = torch.empty(rows, cols, dtype=torch.float32 if INTERPRET else FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows:
        groups = min(_QUANT_GROUPS, triton.next_power_of_2(num_groups))
        _group_quant_kernel[(rows, triton.cdiv(num_groups, groups))](
            x, q, scales, cols, num_groups, x.stride(0), q.stride(0), scales.stride(0),
            GROUP=group_size, GROUPS=groups, FP8_MAX=FP8_MAX, EPS=SCALE_EPS, **launch_options(x),
        )
    return q.to(FP8_DTYPE), scales


# ----------------------------------------------------------------------------------------------------
# Grouped GEMM over the expert-sorted pairs


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


# The column kernel unrolls K, and Triton's pipeline then buffers every step of a column block for each stage: V3's
# I = 2048 (TP 1, 16 steps of 128) asked for 1.5 MB of shared memory, I = 512 (TP 4) 296 KB at 3 stages (H200 and
# H100, session 17); 512 fits at 2 stages. Longer Ks loop in the general kernel.
COLUMN_MAX_K = 512


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
        FP8=fp8, GROUP_N=block_shape[0], GROUP_K=block_shape[1], DOT_FP32=INTERPRET and a.dtype == torch.bfloat16,
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
        FP8=fp8, GROUP_N=block_shape[0], GROUP_K=block_shape[1], DOT_FP32=INTERPRET and a.dtype == torch.bfloat16,
        BLOCK_M=alignment.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TMA=tma, **launch_options(a),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


# ----------------------------------------------------------------------------------------------------
# Top-k reduction and the whole routed-experts forward


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
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] in x's dtype, or float8_e4m3fn
    with block scales [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)]; topk_ids [T, k] int
    (ids outside [0, E) contribute nothing), topk_weights [T, k] float32. Returns [T, H] of x's dtype:
    routed_scaling_factor * sum_j topk_weights[t, j] * W2 (silu(W_gate x) * (W_up x)) of expert
    topk_ids[t, j]. With FP8 weights x and h are quantized per 1 x bk token group before their GEMMs.
    arrived: int32 zeros, at least one per column block of the w2 pass (kept by the caller across launches,
    left at 0): one token's top-k sum then happens inside the w2 pass (SUM_PAIRS), not in a kernel of its own."""
    num_tokens, hidden = x.shape
    num_experts, intermediate, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    fp8 = w13_scale_inv is not None
    ids = topk_ids.to(torch.int32).contiguous()
    alignment = align_pairs(ids, num_experts, config.block_m)
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
