"""One generation request as the scheduler tracks it, and what it reports back.

The prompt and the generated ids form one token sequence; `cached_len` of its leading tokens have KV
in `pages` (or will have, once the batches planned for them have run); `computed_len` of them are known
to have it (their batches ran without error). A running request always has every token but its last
cached: the last one is the input of its next decode step.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from plugserve.runtime.detokenizer import IncrementalText
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
    grammar: object | None = None  # its xgrammar GrammarMatcher (structured output), advanced by each token
    output_ids: list[int] = field(default_factory=list)
    num_pending: int = 0  # PENDING tokens, always output_ids' last ones (a batch in flight samples them in order)
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
    detokenizer: IncrementalText | None = None  # made at its first token
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
        return len(self.output_ids) - self.num_pending

    def add_pending(self) -> None:
        """A token the planned batch will sample: PENDING until it arrives."""
        self.output_ids.append(PENDING)
        self.num_pending += 1

    def resolve(self, token: int) -> int:
        """Put an arrived `token` in place of the first PENDING one, or after the last (the rest of a verified run
        of drafts); its index among the generated tokens."""
        index = self.num_resolved
        if self.num_pending:
            self.output_ids[index] = token
            self.num_pending -= 1
        else:
            self.output_ids.append(token)
        return index

    def drop_pending(self) -> None:
        """Forget the PENDING tokens (a finished request's, that a later batch in flight is sampling)."""
        del self.output_ids[self.num_resolved :]
        self.num_pending = 0

    @property
    def penalty_ids(self) -> list[int]:
        """The generated tokens a penalty counts: the arrived ones, or none (no copy) when it asks for no penalty."""
        return self.output_ids[: self.num_resolved] if self.params.penalized else []

    @property
    def known_len(self) -> int:
        return len(self.prompt_ids) + self.num_resolved

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sendable_len(self) -> int:
        """How much of `text` may be reported: while it runs, less a trailing partial character and what may
        become a stop string."""
        text, safe = self.text, len(self.text)
        if self.finished:
            return safe
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self.params.stop:
            for keep in range(min(len(stop) - 1, safe), 0, -1):
                if stop.startswith(text[safe - keep : safe]):
                    safe -= keep
                    break
        return safe

    def output(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob], error: str | None = None
               ) -> RequestOutput:
        """An increment to report: new text, ids and logprobs, with the request's state now."""
        return RequestOutput(
            rid=self.rid, text=text, token_ids=token_ids, logprobs=logprobs, finished=self.finished,
            finish_reason=self.finish_reason, matched_stop=self.matched_stop, prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.num_resolved, cached_tokens=self.cached_tokens, error=error,
        )


class RequestQueue:
    """Requests in order, any of them removed in O(1): an abort among thousands of waiting ones used to scan them."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._order: OrderedDict[Request, None] = OrderedDict.fromkeys(requests)

    def append(self, request: Request) -> None:
        self._order[request] = None

    def appendleft(self, request: Request) -> None:
        self._order[request] = None
        self._order.move_to_end(request, last=False)

    def remove(self, request: Request) -> None:
        del self._order[request]

    def __contains__(self, request: object) -> bool:
        return request in self._order

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class RequestIndex:
    """Requests by rid (several may share one), so that an abort finds its own without a scan."""

    def __init__(self) -> None:
        self._by_rid: dict[str, list[Request]] = {}

    def add(self, request: Request) -> None:
        self._by_rid.setdefault(request.rid, []).append(request)

    def pop(self, rid: str) -> list[Request]:
        return self._by_rid.pop(rid, [])

    def discard(self, request: Request) -> None:
        held = self._by_rid.get(request.rid, [])
        if request in held:
            held.remove(request)
            if not held:
                del self._by_rid[request.rid]

    def __len__(self) -> int:
        return len(self._by_rid)
