"""One generation request as the scheduler tracks it, and what it reports back.

The prompt and the generated ids form one token sequence; `cached_len` of its leading tokens have KV
in `pages` (or will have, once the batches planned for them have run); `computed_len` of them are known
to have it (their batches ran without error). A running request always has every token but its last
cached: the last one is the input of its next decode step.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plugserve.runtime.sampling import SamplingParams

# An output id whose token is still being sampled (overlap scheduling plans with it before it arrives).
PENDING = -1


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # the client went away or called abort
    ERROR = "error"  # the forward raised: reported, the server goes on


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """What a request produced since its last report (`text`, `token_ids`, `logprobs` are increments)."""

    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    table_row: int = -1  # its row of the runner's DeviceBlockTable while it holds KV (-1: none)
    pending_row: int = -1  # row of this request's newest PENDING token in its batch's sampled tokens
    cached_len: int = 0
    computed_len: int = 0  # <= cached_len: the prefix cache takes only these (a failed batch writes no KV)
    prefix_node: object | None = None  # the radix-cache node this request holds locked
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (the first time it was scheduled)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    text: str = ""  # decoded output so far (stop string cut off)
    sent_text_len: int = 0
    sent_tokens: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """The newest token (PENDING while the batch in flight samples it)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_resolved(self) -> int:
        """Generated tokens that have arrived (the rest are PENDING)."""
        return self.output_ids.index(PENDING) if PENDING in self.output_ids else len(self.output_ids)

    @property
    def known_len(self) -> int:
        return len(self.prompt_ids) + self.num_resolved

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
