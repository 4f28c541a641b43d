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
    tokens' own texts overcounts; a token starts where the decoded output before and after it part ways."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.tokenizer, self.skip_special_tokens = engine.tokenizer, params.skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def add(self, logprobs: Sequence[TokenLogprob], limit: int) -> list[int]:
        """The offsets of these next tokens, at most `limit` (the text's length: a stop string is cut off)."""
        offsets = []
        for lp in logprobs:
            self.ids.append(lp.token_id)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            offsets.append(min(common_prefix_len(self.text, text), limit))
            self.text = text
        return offsets


def common_prefix_len(a: str, b: str) -> int:
    """How many leading characters a and b share (where a token's text starts: the texts before and after it)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
