"""A running request's output text, decoded a token at a time: re-decoding the whole output at every step costs
time quadratic in its length, on the scheduler thread."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


class IncrementalText:
    """The text of a growing list of token ids. While the request runs, each new id goes through the tokenizer's
    `DecodeStream` (a fast tokenizer's own incremental decoder: a character split over tokens appears once whole);
    the final text is one whole decode, so it is exactly `tokenizer.decode`'s. Tokenizers without a fast backend,
    or that clean up spaces (which looks at neighbouring words), decode whole every time."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        incremental = self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens) if incremental else None
        self.text, self.fed = "", 0

    def of(self, ids: Sequence[int], count: int, final: bool) -> str:
        """The text of ids[:count], which extend the ids of the previous call (only the new ones are read: no copy
        of a long output per token); `final`: the last call (the whole decode, a trailing incomplete character
        included as the tokenizer renders it)."""
        if final or self.stream is None:
            return self.tokenizer.decode(list(ids[:count]), skip_special_tokens=self.skip_special_tokens)
        for token in ids[self.fed : count]:
            piece = self.stream.step(self.backend, token)
            if piece is not None:
                self.text += piece
        self.fed = count
        return self.text
