"""Structured output and tool calls through the official openai client, against a live server on the embedded
model: every constrained output parses and validates against its schema (checked by pydantic and jsonschema_rs,
not by the grammar library that constrained it)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.live_server import API_KEY, SERVED_MODEL, RunningServer, start_server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    """Short and closed: every value ends within a few tokens (xgrammar's maxLength strings admit control
    characters, so free strings are left out)."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: int = Field(ge=-40, le=50)
    sunny: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"])
           for t in (WEATHER_TOOL, TIME_TOOL)}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    yield from start_server(ServerArgs(api_key=API_KEY, served_model_name=SERVED_MODEL, max_running_requests=64,
                                       tool_call_parser="deepseekv3", reasoning_parser="deepseek-r1"))


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    completion = client.beta.chat.completions.parse(model=SERVED_MODEL, messages=MESSAGES, response_format=Weather,
                                                    max_tokens=60, temperature=1.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)


def test_a_streamed_json_schema_output_parses(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
    chunks = list(client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=60, stream=True,
                                                 temperature=1.0, response_format=response_format))
    assert chunks[-1].choices[0].finish_reason == "stop"
    Weather.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))


def test_50_sampled_json_schema_outputs_all_validate(client):
    """Temperature 1, n = 50 in one request: each choice parses and validates against the schema."""
    schema = Weather.model_json_schema()
    started = time.perf_counter()
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, n=50, max_tokens=60, temperature=1.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
    assert len(response.choices) == 50
    validator = jsonschema_rs.validator_for(schema)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        validator.validate(json.loads(choice.message.content))
    assert time.perf_counter() - started < 120


def test_json_object_and_regex(client):
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                              response_format={"type": "json_object"})
    text = response.choices[0].message.content
    assert response.choices[0].finish_reason != "stop" or isinstance(json.loads(text), dict)
    completion = client.completions.create(model=SERVED_MODEL, prompt="The answer is", max_tokens=10,
                                           extra_body={"regex": "(yes|no)-[0-9]{2}"})
    assert completion.choices[0].text[:3] in ("yes", "no-") and completion.choices[0].finish_reason == "stop"


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        SCHEMAS[call.function.name].validate(json.loads(call.function.arguments))


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_calls_valid_tools(client, parallel):
    kwargs = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL], "max_tokens": 120,
              "tool_choice": "required", "parallel_tool_calls": parallel, "temperature": 1.0, "seed": 0}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert parallel or len(choice.message.tool_calls) == 1
    streamed = _stream_calls(client, kwargs)
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_named_tool_choice_calls_that_tool_streamed_or_not(client):
    kwargs = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL], "max_tokens": 60,
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "temperature": 0}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_time"})
    streamed = _stream_calls(client, kwargs)
    assert streamed[0].function.arguments == choice.message.tool_calls[0].function.arguments


class _Call:
    def __init__(self, id: str, name: str) -> None:
        self.id, self.type, self.function = id, "function", type("F", (), {"name": name, "arguments": ""})()


def _stream_calls(client: openai.OpenAI, kwargs: dict) -> list[_Call]:
    """The tool calls a streamed request's deltas assemble (by index, as clients do)."""
    calls: dict[int, _Call] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    calls[delta.index] = _Call(delta.id, delta.function.name)
                calls[delta.index].function.arguments += delta.function.arguments or ""
    assert finish == "tool_calls"
    result = [calls[i] for i in sorted(calls)]
    _check_calls(result, {"get_weather", "get_time"})
    return result


def test_reasoning_content_is_split_off_streamed_or_not(client, server):
    """The embedded model never writes </think>: under deepseek-r1 (whose template opens <think> in the prompt)
    its whole output is reasoning, cut short; a constrained output (above) is never split."""
    kwargs = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    message = client.chat.completions.create(**kwargs).choices[0].message
    ids = server.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    expected = server.engine.generate(list(ids), SamplingParams(max_new_tokens=12, temperature=0))[0].text
    assert message.reasoning_content == expected and message.content is None
    streamed = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        streamed += getattr(delta, "reasoning_content", None) or ""
    assert streamed == expected
