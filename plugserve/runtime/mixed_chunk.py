"""--enable-mixed-chunk (SGLang's mixed chunked prefill): the running requests' decode tokens ride in a prefill
batch's EXTEND forward, one token each, so that decoding goes on while a long prompt is prefilled chunk by chunk,
and the device runs one forward where it would run a prefill and a decode step.

A rider's token is an extend of one over its cached prefix: `core/dispatch.py`'s prefix rules pick the batch's
attention (absorbed MLA under `--chunked-prefix-cache-threshold`, MHA over the de-compressed prefixes above it),
each correct for any mix of prefix and new-token lengths. Under overlap a rider's input is the batch in flight's
token (PENDING, filled on the device), as in a decode batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plugserve.runtime.request import Request


@dataclass
class Riders:
    """The running requests that decode a token in the next prefill batch, and the prefill's share of the budget."""

    requests: list[Request]
    prefill_budget: int

    @classmethod
    def of(cls, running: list[Request], budget: int, planned: Callable[[Request], bool]) -> Riders:
        """The running requests with a token left to plan (`planned`: their last one is planned already), one token
        of `budget` each, when that leaves the prefill at least one token; else none, and the prefill the whole
        budget (a decode batch follows it)."""
        decoding = [r for r in running if not planned(r)]
        if len(decoding) >= budget:
            return cls([], budget)
        return cls(decoding, budget - len(decoding))

    def merge(self, requests: list[Request], lens: list[int], sampled: list[bool], ids: list[int]) -> None:
        """Append the riders to a prefill batch's `requests`, their extend `lens`, whether each is `sampled`, and
        its input `ids`: one new token each, its newest (PENDING while the batch in flight samples it)."""
        requests += self.requests
        lens += [1] * len(self.requests)
        sampled += [True] * len(self.requests)
        ids += [r.last_id for r in self.requests]
