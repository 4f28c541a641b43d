"""TextOffsets against the whole-output oracle (a token starts where the decoded output before and after it part
ways), on the embedded tokenizer: multi-byte characters split over tokens, invalid bytes, special tokens kept or
skipped; and its decoding stays linear in the output."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.runtime.request import TokenLogprob
from plugserve.runtime.sampling import SamplingParams
from plugserve.server.offsets import TextOffsets, common_prefix_len

TEXT = "Hello wörld, 日本語のテキスト 🙂🦊 naïve café — done.\n\tdef f(x): return x ** 2"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


class CountingTokenizer:
    """The tokenizer, counting the tokens each decode is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _oracle(tokenizer, ids: list[int], skip: bool) -> list[int]:
    texts = [tokenizer.decode(ids[:i], skip_special_tokens=skip) for i in range(len(ids) + 1)]
    return [common_prefix_len(texts[i], texts[i + 1]) for i in range(len(ids))]


def _offsets(tokenizer, ids: list[int], skip: bool, step: int = 1) -> list[int]:
    offsets = TextOffsets(SimpleNamespace(tokenizer=tokenizer), SamplingParams(skip_special_tokens=skip))
    entries = [TokenLogprob(t, 0.0, ()) for t in ids]
    return [o for i in range(0, len(ids), step) for o in offsets.add(entries[i : i + step], 1 << 62)]


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_offsets_equal_the_whole_output_oracle(tokenizer, skip):
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    sequences = [tokenizer.encode(TEXT, add_special_tokens=False)]
    for _ in range(20):  # random ids: bytes that form no character, characters cut anywhere, special tokens
        sequences.append([rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
                          for _ in range(rng.randint(1, 60))])
    for ids in sequences:
        want = _oracle(tokenizer, ids, skip)
        assert _offsets(tokenizer, ids, skip) == want
        assert _offsets(tokenizer, ids, skip, step=7) == want


def test_offsets_are_cut_at_the_limit(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    offsets = TextOffsets(SimpleNamespace(tokenizer=tokenizer), SamplingParams())
    assert offsets.add([TokenLogprob(t, 0.0, ()) for t in ids], 10) == [min(o, 10) for o in _oracle(tokenizer, ids,
                                                                                                        True)]


def test_decoding_is_linear_in_the_output(tokenizer):
    """Decoding the whole output at each token made a long answer quadratic: 4000 tokens decoded 8 million."""
    ids = tokenizer.encode(TEXT * 60, add_special_tokens=False)
    assert len(ids) > 2000
    counting = CountingTokenizer(tokenizer)
    assert _offsets(counting, ids, True) == _oracle(tokenizer, ids, True)
    assert counting.decoded < 8 * len(ids)
