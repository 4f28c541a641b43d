"""Structured output in the engine: outputs match their grammar under the overlap scheduler and without it."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, ConfigDict, Field

from plugserve.runtime import grammar
from plugserve.runtime.engine import Engine
from plugserve.runtime.grammar import BatchGrammar, GrammarError
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs

# Short and closed: every value ends within a few tokens, so that a random model finishes well within max tokens.
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "age", "sunny"], "additionalProperties": False}


class Weather(BaseModel):
    """SCHEMA as a pydantic model: the independent check of each output."""

    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(pattern="^(Paris|Oslo|Lima)$")
    age: int = Field(ge=0, le=99)
    sunny: bool


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no-overlap"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    engine = Engine(ServerArgs(model_preset="tiny", disable_overlap_schedule=not request.param))
    assert engine.ready.wait(60)
    assert engine.scheduler.overlap is request.param
    yield engine
    engine.shutdown()


def test_sampled_json_outputs_match_the_schema(engine):
    """Random weights at temperature 1: unconstrained, such a model never writes JSON."""
    params = SamplingParams(max_new_tokens=60, temperature=1.0, n=16, seed=1, json_schema=json.dumps(SCHEMA))
    for result in engine.generate("The weather:", params):
        assert result.finish_reason == "stop", result.text  # the grammar's end ends the request
        Weather.model_validate_json(result.text)
    free = engine.generate("The weather:", SamplingParams(max_new_tokens=30, temperature=1.0, n=4, seed=1))
    assert not any(r.text.startswith('{"city": ') for r in free)


def test_regex_and_ebnf_outputs_match(engine):
    [result] = engine.generate("Answer:", SamplingParams(max_new_tokens=20, temperature=1.0, regex="(yes|no)-[0-9]{3}"))
    assert re.fullmatch("(yes|no)-[0-9]{3}", result.text) and result.finish_reason == "stop"
    ebnf = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    results = engine.generate("Sum:", SamplingParams(max_new_tokens=30, temperature=1.0, n=4, ebnf=ebnf))
    for result in results:
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", result.text) or result.finish_reason == "length", result.text


def test_a_grammar_that_cannot_compile_names_its_field(engine):
    for field, text in [("json_schema", "{not json"), ("regex", "(unclosed"), ("ebnf", "root ::= ")]:
        with pytest.raises(GrammarError, match=field) as error:
            engine.compile_grammar(SamplingParams(**{field: text}))
        assert error.value.field == field
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema="{}", regex="a").validate()


def test_grammar_backend_none_refuses_naming_the_flag():
    engine = Engine(ServerArgs(model_preset="tiny", grammar_backend="none"))
    try:
        with pytest.raises(GrammarError, match="--grammar-backend none"):
            engine.compile_grammar(SamplingParams(regex="a+"))
        assert engine.compile_grammar(SamplingParams()) is None
    finally:
        engine.shutdown()


def test_sampling_waits_for_a_mask_filled_later(engine):
    """Overlap: a batch's sampling waits for the scheduler thread to fill its mask."""
    compiled = engine.compile_grammar(SamplingParams(regex="ab"))
    request = Request("r", [1], SamplingParams(), lambda _: None, grammar=engine.grammars.matcher(compiled))
    unfilled: list[BatchGrammar] = []
    masks = BatchGrammar.plan([request], engine.runner.config.vocab_size, unfilled)
    assert unfilled == [masks] and not masks.filled
    got = []
    waiter = threading.Thread(target=lambda: got.append(masks.bitmask(engine.runner.device)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got
    masks.fill()
    waiter.join(5)
    allowed = [t for t in range(engine.runner.config.vocab_size) if got[0][0, t // 32] >> (t % 32) & 1]
    assert all(engine.tokenizer.decode([t]) in ("a", "ab") for t in allowed) and allowed


def test_a_batch_of_matchers_advances_on_several_threads_as_one_by_one(engine):
    """accept_all: each request's verdict (terminated, or the error of a token its grammar refuses) in order, the same
    as `accept` a request at a time, with the matchers advanced on the pool's threads."""
    compiled = engine.compile_grammar(SamplingParams(regex="ab|abc"))
    a, b, c = (engine.tokenizer.convert_tokens_to_ids(t) for t in "abc")

    def batch(n: int) -> list[Request]:
        return [Request(f"r{i}", [1], SamplingParams(), lambda _: None, grammar=engine.grammars.matcher(compiled))
                for i in range(n)]

    count = grammar.PARALLEL_ACCEPT_MIN * 2
    one_by_one, together = batch(count), batch(count)
    for requests in (one_by_one, together):
        for request in requests:
            assert not grammar.accept(request, a)
    # "ab" may end or go on; "ac" breaks the grammar; an accepted "b" leaves the matcher able to take "c".
    tokens = [c if i % 3 == 1 else b for i in range(count)]
    expected = []
    for request, token in zip(one_by_one, tokens, strict=True):
        try:
            expected.append(grammar.accept(request, token))
        except RuntimeError as exc:
            expected.append(str(exc))
    threads = set()
    original = grammar.accept

    def spying(request: Request, token: int) -> bool:
        threads.add(threading.current_thread().name)
        return original(request, token)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar, "accept", spying)
        verdicts = grammar.accept_all(list(zip(together, tokens, strict=True)))
    assert [str(v) if isinstance(v, Exception) else v for v in verdicts] == expected
    assert expected[0] is False and "broke the request's grammar" in expected[1]
    if grammar.ACCEPT_THREADS > 1:  # on the pool's threads, not the caller's
        assert threads and all(name.startswith("plugserve-grammar") for name in threads)
    assert [r.grammar.is_terminated() for r in together] == [r.grammar.is_terminated() for r in one_by_one]
