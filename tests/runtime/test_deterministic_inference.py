"""--enable-deterministic-inference on the embedded model (CPU, through the Engine): the same greedy request gives the
same tokens cold or after a cached prefix, alone or inside a batch of other lengths, streamed or not, with overlap on
or off and with its prompt prefilled in chunks.

Without the flag these differ on this model: a float32 matmul on the CPU rounds a row differently with the number of
rows beside it, and a cached prefix moves the prefill from MHA to absorbed MLA (see the README's "What may vary")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs

PROMPT = "To reset a user password in Django,"
# A fixed pool: on a GPU, sizing by --mem-fraction-static sees the memory an earlier engine of this process still
# holds in torch's cache, and finds none left.
KV_TOKENS = 16384
# The issue's request; the chosen tokens' logprobs are compared too, bit for bit, so that a batch that moves a logit
# fails even where the greedy tokens survive it.
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
SHORT = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
Answer = tuple[list[int], list[float]]
OTHERS = ["Hi", "The history of the Roman empire, from its founding to the fall of Constantinople, shows that",
          "import numpy as np\nimport torch\n"]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine(ServerArgs(enable_deterministic_inference=True, max_total_tokens=KV_TOKENS))
    yield engine
    engine.shutdown()


def _answers(engine: Engine, prompts: list[str], params: SamplingParams = GREEDY) -> list[Answer]:
    return [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def cold(engine: Engine) -> Answer:
    """The prompt alone on an empty prefix cache."""
    engine.flush_cache()
    return _answers(engine, [PROMPT])[0]


def test_cold_then_twice_from_the_prefix_cache_gives_the_same_tokens(engine, cold):
    for _ in range(2):  # each finds the cold run's prompt in the cache
        [result] = engine.generate(PROMPT, GREEDY)
        assert result.cached_tokens > 0
        assert (result.token_ids, [lp.logprob for lp in result.logprobs]) == cold


def test_streamed_gives_the_tokens_of_the_whole_answer(engine, cold):
    """As a client meets it: the same request streamed after it was answered whole (its prompt now cached)."""
    outputs = list(engine.stream(PROMPT, GREEDY))
    assert outputs[-1].cached_tokens > 0
    streamed = ([t for o in outputs for t in o.token_ids], [lp.logprob for o in outputs for lp in o.logprobs])
    assert streamed == cold


@pytest.fixture(scope="module")
def cold_short(engine: Engine) -> Answer:
    engine.flush_cache()
    return _answers(engine, [PROMPT], SHORT)[0]


@pytest.mark.parametrize("batch", [[OTHERS[1], PROMPT], [*OTHERS, PROMPT, PROMPT + " first"]], ids=["2", "5"])
def test_a_request_inside_a_batch_of_other_lengths_gives_its_tokens_alone(engine, cold_short, batch):
    engine.flush_cache()
    assert _answers(engine, batch, SHORT)[batch.index(PROMPT)] == cold_short


def test_without_overlap_and_with_chunked_prefill_the_tokens_stay(cold_short):
    engine = Engine(ServerArgs(enable_deterministic_inference=True, disable_overlap_schedule=True,
                               chunked_prefill_size=4, max_total_tokens=KV_TOKENS))
    try:
        assert _answers(engine, [OTHERS[1], PROMPT], SHORT)[1] == cold_short
    finally:
        engine.shutdown()
