"""The token/expert alignment of the MoE grouped GEMM as Triton kernels: token-expert pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M, so that every M-block of the GEMM belongs to one expert
(`moe_align_block_size`). One token (decode at batch 1) needs no sorting: its k experts are distinct, so each pair
is its own M-block (`pair_blocks`, no kernel). Imported lazily, with the other kernels of the `triton` MoE backend.

Notation: T tokens, k experts per token, P = T * k pairs (pair p = t * k + j is slot j of token t), E experts.
Arguments that change with every batch (pair, chunk and block counts) are `do_not_specialize_on_alignment`:
Triton would otherwise compile a variant for each count divisible by 16 and one for the rest, the later inside a
request after the warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugserve.core.triton_pdl import launch_options, programmatic_prologue

# Up to this many pairs (512 tokens x top-8) one program aligns them in one launch, faster there than three kernels
# (docs/kernels.md, "Alignment"); beyond, three kernels over chunks of _ALIGN_CHUNK pairs.
_ALIGN_SINGLE_MAX_PAIRS = 4096
_ALIGN_SORT = 512  # pairs the one-program kernel sorts at once (larger sorts cost more per pair)
_ALIGN_FILL = 1024  # slots (or M-blocks) it marks as padding at once
_ALIGN_CHUNK = 256  # pairs per program of the multi-program kernels
_ALIGN_SUB = 32  # pairs compared at once when ranking pairs within a chunk
_ALIGN_BLOCKS = 256  # M-blocks labelled at once by the scan kernel


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
