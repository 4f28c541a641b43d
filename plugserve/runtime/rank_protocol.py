"""What rank 0 sends the other ranks before each step, so that every rank runs it: per DP group, the step's kind
and the batch's lengths (int64 words, host to host: `ParallelGroup.broadcast_bytes`) and one device tensor of its
input ids, sampled rows, block table and the step's extra inputs (stream-ordered: the ids may still be being
sampled). Without DP attention there is one group, every rank's. A speculative step (`runtime/speculative.py`)
sends what rank 0 alone decides during it (drawn drafts, accepted tokens) with `from_leader`, for every DP group
at once (`GroupRows`: each rank keeps its group's rows)."""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from plugserve.core.distributed import ParallelGroup, unpad_rows
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool


class Step(enum.IntEnum):
    """What the other ranks run with a part: the model's forward (`ModelRunner`), or one of the speculative
    worker's steps (`SpeculativeWorker.follow`), each a fixed sequence of forwards."""

    FORWARD = 0
    SPEC_EXTEND = 1  # a prefill, then the NextN layer; extra: next ids [T], then block-table rows [S]
    SPEC_ROUND = 2  # greedy chains in the round's CUDA graph; extra: block-table rows [B] (so for every round)
    SPEC_CHAINS_GREEDY = 3  # chains, eagerly, every request greedy (the first draft is kept state)
    SPEC_CHAINS_SAMPLED = 4  # chains, eagerly, the first draft from the draft's logits
    SPEC_TREE = 5  # draft trees


class Part(NamedTuple):
    """One DP group's share of a forward: input_ids [T] int64 and sample_rows [S] int64 on the device, with its
    batch (without DP attention, the one group's: the whole forward), and a step's extra inputs [E] int64."""

    input_ids: torch.Tensor
    batch: ForwardBatch
    sample_rows: torch.Tensor
    extra: torch.Tensor | None = None


class Header(NamedTuple):
    """A DP group's batch as rank 0 sends it (the lengths; the tensors follow in one payload)."""

    mode: ForwardMode
    seq_lens: list[int]
    extend_lens: list[int]
    width: int  # block-table columns
    num_sampled: int
    step: Step = Step.FORWARD
    num_extra: int = 0

    @classmethod
    def of(cls, part: Part | None, step: Step = Step.FORWARD) -> Header | None:
        if part is None:
            return None
        batch = part.batch
        return cls(batch.mode, batch.seq_lens_cpu, batch.extend_lens_cpu, batch.block_table.shape[1],
                   part.sample_rows.numel(), step, 0 if part.extra is None else part.extra.numel())

    @property
    def sizes(self) -> list[int]:
        """Elements of its input ids, sample rows, block table and extra inputs in the payload."""
        return [sum(self.extend_lens), self.num_sampled, len(self.seq_lens) * self.width, self.num_extra]


class GroupRows(NamedTuple):
    """How a speculative step's rows split over the DP groups: `counts[g]` of group g (its requests in a round,
    its sampled rows in a prefill), this rank's group `index`; `dp` False: one group, every rank's. Under DP
    attention every forward gathers every group's tokens before its MLPs and every LM head every group's rows,
    so each call names every group's count: `counts` times the rows each counted one has there."""

    counts: list[int]
    index: int
    dp: bool

    def times(self, per: int) -> list[int] | None:
        """Every group's rows at `per` rows per counted one, for the model's DP gathers (None without DP
        attention: no gathers)."""
        return [c * per for c in self.counts] if self.dp else None

    def own(self, x: torch.Tensor, per: int = 1) -> torch.Tensor:
        """Of x [sum(counts) * per, ...], every group's rows in group order, this rank's group's."""
        start = sum(self.counts[: self.index]) * per
        return x[start : start + self.counts[self.index] * per]

    def gather(self, group: ParallelGroup, x: torch.Tensor) -> torch.Tensor:
        """x [counts[index], ...] on each rank -> every group's [sum(counts), ...], in group order, on every
        rank (x itself without DP attention)."""
        return unpad_rows(group.gather_rows(x, self.counts), self.counts) if self.dp else x


MODES = list(ForwardMode)


def encode_headers(headers: Sequence[Header | None]) -> bytes:
    """Every group's header as int64 words: [groups, then per group -1 (idle) or mode, requests, width, sampled,
    step, extra, seq_lens..., extend_lens...] (no pickling on the step's path)."""
    words = array("q", [len(headers)])
    for h in headers:
        if h is None:
            words.append(-1)
        else:
            words.extend([MODES.index(h.mode), len(h.seq_lens), h.width, h.num_sampled, h.step, h.num_extra,
                          *h.seq_lens, *h.extend_lens])
    return words.tobytes()


def decode_headers(data: bytes) -> list[Header | None]:
    """The headers `encode_headers` wrote."""
    words = array("q")
    words.frombytes(data)
    headers: list[Header | None] = []
    at = 1
    for _ in range(words[0]):
        if words[at] < 0:
            headers.append(None)
            at += 1
            continue
        mode, n, width, sampled, step, extra = words[at : at + 6]
        seq_lens, extend_lens = words[at + 6 : at + 6 + n].tolist(), words[at + 6 + n : at + 6 + 2 * n].tolist()
        headers.append(Header(MODES[mode], seq_lens, extend_lens, width, sampled, Step(step), extra))
        at += 6 + 2 * n
    return headers


def idle_part(pool: MLAKVPool) -> Part:
    """The part of a rank whose DP group has no batch this forward: an IDLE one (the MLP's collectives need
    every rank)."""
    empty = torch.zeros(0, dtype=torch.int64, device=pool.device)
    table = torch.zeros(0, 1, dtype=torch.int32, device=pool.device)
    return Part(empty, ForwardBatch.build(ForwardMode.IDLE, [], [], table, pool), empty)


def send(group: ParallelGroup, headers: list[Header | None], parts: list[Part | None]) -> None:
    """Rank 0: every group's batch to the other ranks."""
    group.broadcast_bytes(encode_headers(headers))
    group.broadcast(torch.cat([t for p in parts if p is not None for t in
                               (p.input_ids, p.sample_rows, p.batch.block_table.flatten().to(torch.int64),
                                *([] if p.extra is None else [p.extra]))]))


def from_leader(group: ParallelGroup, tensors: Sequence[torch.Tensor] | None, shapes: Sequence[tuple[int, ...]],
                device: torch.device) -> list[torch.Tensor]:
    """Rank 0's int64 `tensors` of `shapes`, on every rank, in one broadcast: what rank 0 alone decides in the
    middle of a step (tokens drawn with its generators, acceptance under its requests' penalties). Rank 0 passes
    them (and gets them back), the others None."""
    if tensors is not None:
        if group.world_size > 1:
            group.broadcast(torch.cat([t.reshape(-1) for t in tensors]))
        return list(tensors)
    sizes = [math.prod(s) for s in shapes]
    flat = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=device))
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]


def release(group: ParallelGroup) -> None:
    """Rank 0, once its forwards are over: the other ranks' `receive` returns None."""
    group.broadcast_bytes(b"")


def receive(group: ParallelGroup, dp_rank: int, pool: MLAKVPool, prepare: Callable[[ForwardBatch], ForwardBatch]
            ) -> tuple[Part | None, list[Header | None]] | None:
    """Ranks 1..P-1: this rank's group's part of the next forward (None when its group idles; the batch passed
    through `prepare` as rank 0 prepared it) and every group's header, or None once rank 0 releases them."""
    data = group.broadcast_bytes(None)
    if not data:
        return None
    headers = decode_headers(data)
    sizes = [[0, 0, 0, 0] if h is None else h.sizes for h in headers]
    payload = group.broadcast(torch.empty(sum(map(sum, sizes)), dtype=torch.int64, device=pool.device))
    header, start = headers[dp_rank], sum(map(sum, sizes[:dp_rank]))
    if header is None:
        return None, headers
    input_ids, sample_rows, table, extra = payload[start : start + sum(sizes[dp_rank])].split(header.sizes)
    table = table.view(len(header.seq_lens), header.width).to(torch.int32)
    batch = ForwardBatch.build(header.mode, header.seq_lens, header.extend_lens, table, pool)
    return Part(input_ids, prepare(batch), sample_rows, extra if header.num_extra else None), headers
