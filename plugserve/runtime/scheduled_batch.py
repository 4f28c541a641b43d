"""`ScheduledBatch`: a batch the scheduler planned, ready to run; `part`, the batch of some of its requests alone
(what a failed batch is re-run as, `runtime/isolation.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.host_copy import to_device
from plugserve.runtime.grammar import BatchGrammar
from plugserve.runtime.request import Request


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    requests: list[Request]
    extend_lens: list[int]  # new tokens per request
    sampled: list[bool]  # whether each request gets a token from this forward (False mid chunked prefill)
    forward_batch: ForwardBatch
    input_ids: torch.Tensor  # [T] int64 on the device (TARGET_VERIFY: each request's last token, then k zeros)
    sample_rows: torch.Tensor  # [sum(sampled)] rows of the new tokens whose logits are sampled
    ends: list[int]  # each request's cached_len once this batch has run
    # Overlap: (input row, sampled row of the batch in flight) for inputs that batch is still producing
    resolve: list[tuple[int, int]]
    # Speculative prefill: [T] int64 on the device, the token after each new one (0 where it is being sampled)
    next_ids: torch.Tensor | None = None
    masks: BatchGrammar | None = None  # the sampled requests' structured-output masks (None: none)
    # --enable-mixed-chunk: the last `mixed` requests of an EXTEND batch are running ones decoding a token each
    mixed: int = 0

    @property
    def sampled_requests(self) -> list[Request]:
        """The requests this batch samples a token for, in the order of `sample_rows`."""
        return [r for r, s in zip(self.requests, self.sampled, strict=True) if s]

    def prefills(self, index: int) -> bool:
        """Whether the request at `index` computes prompt tokens here (not a decode step, mixed in or not)."""
        return self.mode is ForwardMode.EXTEND and index < len(self.requests) - self.mixed

    def with_inputs(self, input_ids: torch.Tensor) -> ScheduledBatch:
        """This batch with its inputs [T] int64 complete (the batch in flight's tokens filled in)."""
        return replace(self, input_ids=input_ids, resolve=[])

    def part(self, indices: Sequence[int], prepare: Callable[[ForwardBatch], ForwardBatch]) -> ScheduledBatch:
        """The batch of the requests at `indices` (ascending) alone: the same KV slots, positions and inputs, so
        that running it writes the same KV and samples the same logits as their rows of this batch.
        `prepare`: the runner's, to pick the part's attention method. Needs complete inputs (`with_inputs`)."""
        assert not self.resolve, "a part of a batch whose inputs are still being sampled"
        full = self.forward_batch
        starts = list(itertools.accumulate(self.extend_lens, initial=0))
        device = self.input_ids.device
        tokens = to_device(torch.tensor([t for i in indices for t in range(starts[i], starts[i + 1])],
                                        dtype=torch.int64), device)
        lens = [self.extend_lens[i] for i in indices]
        sampled = [self.sampled[i] for i in indices]
        rows = [end - 1 for end, s in zip(itertools.accumulate(lens), sampled, strict=True) if s]
        forward = ForwardBatch.build(self.mode, [full.seq_lens_cpu[i] for i in indices], lens,
                                     full.block_table[to_device(torch.tensor(list(indices)), full.block_table.device)],
                                     full.kv_pool)
        prepare(forward)
        sampled_before = list(itertools.accumulate(self.sampled, initial=0))  # each request's row among the sampled
        masks = None if self.masks is None else self.masks.part([sampled_before[i] for i in indices if self.sampled[i]])
        return ScheduledBatch(self.mode, [self.requests[i] for i in indices], lens, sampled, forward,
                              self.input_ids[tokens], to_device(torch.tensor(rows, dtype=torch.int64), device),
                              [self.ends[i] for i in indices], [],
                              None if self.next_ids is None else self.next_ids[tokens], masks,
                              sum(not self.prefills(i) for i in indices) if self.mixed else 0)
