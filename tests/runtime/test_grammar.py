"""Structured output in the engine: outputs match their grammar under the overlap scheduler and without it."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, ConfigDict, Field

from plugserve.core.names import PRESETS
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


def test_grammars_hold_the_tokenizers_tokens_not_the_models_padding_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose vocabulary pads the tokenizer's (as V2-Lite's 102,400 rows pad its tokenizer): the padding rows
    are never sampled, and as xgrammar special tokens they made its every accept_token scan them all."""
    monkeypatch.setitem(PRESETS, "tiny-padded", PRESETS["tiny"] | {"vocab_size": 4096 + 1000})
    engine = Engine(ServerArgs(model_preset="tiny-padded", disable_overlap_schedule=True))
    try:
        assert engine.ready.wait(60)
        assert engine.runner.config.vocab_size == 5096 and engine.runner.sample_vocab == len(engine.tokenizer)
        compiled = engine.compile_grammar(SamplingParams(json_schema=json.dumps(SCHEMA)))
        assert compiled.tokenizer_info.vocab_size == len(engine.tokenizer)
        assert not [t for t in compiled.tokenizer_info.special_token_ids if t >= len(engine.tokenizer)]
        params = SamplingParams(max_new_tokens=60, temperature=1.0, n=4, seed=2, json_schema=json.dumps(SCHEMA))
        for result in engine.generate("The weather:", params):
            Weather.model_validate_json(result.text)
    finally:
        engine.shutdown()
