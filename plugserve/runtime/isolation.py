"""A failed forward fails only the requests whose own forward raises: the batch is re-run in halves, and halves of
the failing halves, until each failure is pinned on single requests; the rest get their tokens as if nothing had
happened.

A part re-runs its requests' rows of the batch: the same inputs into the same KV slots (rewriting them is
idempotent), so a request that succeeds in a part samples what it would have sampled in the whole batch (each
request's forward is independent of its batch-mates', as batched-equals-solo checks). Parts run on the thread
that ran the batch, before the batch's result is known, so the batch planned meanwhile (overlap) takes its inputs
from the merged result: a failed request's rows hold placeholders, and that request ends with its error before
any later token of it is processed.

`FaultHook` is how a test (or a fault drill) makes a forward fail: the scheduler calls it with every batch it is
about to run, parts included, and what it raises fails that forward as a failing kernel would."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.host_copy import to_device
from plugserve.runtime.overlap import BatchResult
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SampleOutput
from plugserve.runtime.scheduled_batch import ScheduledBatch

logger = logging.getLogger(__name__)

FaultHook = Callable[[ForwardMode, Sequence[Request]], None]


def run_alone(batch: ScheduledBatch, run: Callable[[ScheduledBatch], SampleOutput],
              prepare: Callable[[ForwardBatch], ForwardBatch]) -> BatchResult:
    """`run(batch)`'s tokens (`batch`: inputs complete), and if it raises, `isolate`'s."""
    try:
        return BatchResult.of(run(batch))
    except Exception as exc:
        return isolate(batch, run, prepare, exc)


def isolate(batch: ScheduledBatch, run: Callable[[ScheduledBatch], SampleOutput],
            prepare: Callable[[ForwardBatch], ForwardBatch], error: Exception) -> BatchResult:
    """The tokens of a batch whose forward raised `error`, from its requests re-run in halves (`run` of a part):
    `BatchResult.failed` names the requests whose forward raised on its own. Raises `error` when none succeeds
    (a batch of one, or a failure of every request: the caller fails them all)."""
    if len(batch.requests) == 1:
        raise error
    logger.warning("a %s batch of %d requests failed (%s: %s): re-running it in parts", batch.mode.name,
                   len(batch.requests), type(error).__name__, error)
    parts: list[tuple[list[int], SampleOutput]] = []
    failed: dict[int, Exception] = {}

    def attempt(indices: list[int]) -> None:
        try:
            parts.append((indices, run(batch.part(indices, prepare))))
        except Exception as exc:
            if len(indices) == 1:
                failed[indices[0]] = exc
            else:
                attempt(indices[: len(indices) // 2])
                attempt(indices[len(indices) // 2 :])

    everyone = list(range(len(batch.requests)))
    attempt(everyone[: len(everyone) // 2])
    attempt(everyone[len(everyone) // 2 :])
    if not parts:
        raise error
    sample_row = list(itertools.accumulate(batch.sampled, initial=0))  # request i's row, if sampled
    rows = [([sample_row[i] for i in indices if batch.sampled[i]], out) for indices, out in parts]
    return BatchResult.of(merge(rows, sample_row[-1]), failed)


def merge(parts: Sequence[tuple[list[int], SampleOutput]], num_rows: int) -> SampleOutput:
    """The SampleOutput of `num_rows` rows whose rows `rows` are each part's (rows, output) output; rows no part
    has hold zeros. A tensor some parts lack (no request of theirs asked for logprobs) is zeros in their rows, and
    top logprobs narrower than the widest part's are zero-padded: no request reads past its own ask."""
    merged = {}
    for name in (f.name for f in fields(SampleOutput)):
        present = [(rows, t) for rows, out in parts if (t := getattr(out, name)) is not None]
        if not present:
            merged[name] = None
            continue
        first = present[0][1]
        shape = [num_rows, *(max(t.shape[d] for _, t in present) for d in range(1, first.dim()))]
        whole = first.new_zeros(shape)
        for rows, tensor in present:
            if rows:
                index = to_device(torch.tensor(rows, dtype=torch.int64), whole.device)
                whole[(index, *(slice(0, n) for n in tensor.shape[1:]))] = tensor
        merged[name] = whole
    return SampleOutput(**merged)
