"""OpenAI's text_offset for completions logprobs, counted in characters of the returned text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from plugserve.runtime.request import TokenLogprob
from plugserve.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from plugserve.runtime.engine import Engine


class TextOffsets:
    """OpenAI's text_offset, token by token: where each token's text starts in the returned text.

    Why: a skipped special token or a byte of a partial character adds no text of its own, so summing the
    tokens' own texts overcounts; a token starts where the decoded output before and after it part ways.

    Incremental (each add decodes a window of the last few tokens, not the whole output): the text is settled up to
    the last token that completed its characters; the window starts one settled stretch earlier, so that a
    tokenizer's rules for a leading token (a stripped leading space) apply to that context, not to the new text."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.tokenizer, self.skip_special_tokens = engine.tokenizer, params.skip_special_tokens
        self.ids: list[int] = []
        self.settled_len = 0  # characters of the decoded output of ids[: self.read]
        self.start = self.read = 0  # the window: ids[start:]; ids[start:read] decode to `context`
        self.context = ""
        self.tail = ""  # the decoded output past the settled text (a partial character)

    def add(self, logprobs: Sequence[TokenLogprob], limit: int) -> list[int]:
        """The offsets of these next tokens, at most `limit` (the text's length: a stop string is cut off)."""
        offsets = []
        for lp in logprobs:
            self.ids.append(lp.token_id)
            tail = self._decode(self.ids[self.start :])[len(self.context) :]
            offsets.append(min(self.settled_len + common_prefix_len(self.tail, tail), limit))
            self.tail = tail
            if not tail.endswith("\ufffd"):  # whole characters: settle them
                self.settled_len += len(tail)
                self.start, self.read, self.tail = self.read, len(self.ids), ""
                self.context = self._decode(self.ids[self.start : self.read])
        return offsets

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def common_prefix_len(a: str, b: str) -> int:
    """How many leading characters a and b share (where a token's text starts: the texts before and after it)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
