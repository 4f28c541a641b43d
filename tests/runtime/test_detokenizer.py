"""IncrementalText: while a request runs its text is the whole decode's, less a trailing incomplete character; its
final text is the whole decode; and it decodes each token once, not the whole output at every step."""

from __future__ import annotations

import random

import pytest

from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.runtime.detokenizer import IncrementalText


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


class CountingTokenizer:
    """The tokenizer, counting the ids its whole `decode` is given."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.decoded = tokenizer, 0
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_running_text_is_the_whole_decode_less_an_incomplete_character(tokenizer, skip_special_tokens: bool):
    rng = random.Random(0)
    text = "Le café, 東京 and naïve ünïcödé 🙂 — " * 3
    for trial in range(60):
        # Random ids (special ones and split multi-byte characters among them), or real text's.
        ids = ([rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))] if trial % 2 else
               tokenizer.encode(text, add_special_tokens=False)[: rng.randint(1, 60)])
        incremental = IncrementalText(tokenizer, skip_special_tokens)
        pending = [*ids, -1, -1]  # as a request's output holds them: tokens a batch in flight samples, never read
        for k in range(1, len(ids) + 1):
            whole = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
            running = incremental.of(pending, k, final=False)
            assert whole.startswith(running) and set(whole[len(running):]) <= {"\ufffd"}, (ids[:k], running, whole)
        final = incremental.of(pending, len(ids), final=True)
        assert final == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_token_is_decoded_once_not_the_whole_output_every_step(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    incremental = IncrementalText(counting, skip_special_tokens=True)
    for k in range(1, len(ids)):
        incremental.of(ids, k, final=False)
    incremental.of(ids, len(ids), final=True)
    assert counting.decoded == len(ids)  # the final whole decode only (every step's whole decode: n^2 / 2)
