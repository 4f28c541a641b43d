"""DeepSeek-V3 tool-call parsing and the tool_choice plans, whole and streamed piece by piece."""

from __future__ import annotations

import json

import pytest

from plugserve.server.protocol import NamedToolChoice, Tool
from plugserve.server.tool_calls import ToolChoiceError, ToolPlan, ToolStream, parse_calls, plan_tools

# DeepSeek-V3's format, as its chat template writes an assistant's calls.
CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>")
OUTPUT = ("Let me check." + "<｜tool▁calls▁begin｜>" + CALL.format(name="get_weather", args='{"city": "Paris"}') + "\n"
          + CALL.format(name="get_time", args='{"zone": "CET"}') + "<｜tool▁calls▁end｜>")
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time")]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_deepseek_calls_parse_out_of_the_text():
    content, calls = parse_calls(ToolPlan("parse"), OUTPUT)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls(ToolPlan("parse"), "no calls here") == ("no calls here", [])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_assemble_the_same_calls(step):
    """Fed a few characters at a time, as tokens come: content never shows a piece of the begin token."""
    stream = ToolStream(ToolPlan("parse"))
    content, calls = "", []
    for at in range(0, len(OUTPUT), step):
        delta, new = stream.feed(OUTPUT[at : at + step], at + step >= len(OUTPUT))
        assert "<" not in delta
        content += delta
        calls += new
    assert content == "Let me check."
    assert [c["index"] for c in calls] == [0, 1]
    assert _calls(calls) == _calls(parse_calls(ToolPlan("parse"), OUTPUT)[1])


def test_required_and_named_plans():
    required = plan_tools(TOOLS, "required", False, None)
    schema = json.loads(required.json_schema)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    content, calls = parse_calls(required, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert content is None and _calls(calls) == [("get_time", {"zone": "UTC"})]
    named = plan_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}),
                       True, None)
    assert named.mode == "named" and json.loads(named.json_schema) == {"type": "object"}
    assert plan_tools(TOOLS, "none", True, None).mode == "none"
    assert plan_tools(TOOLS, None, True, "deepseekv3").mode == "parse"


def test_plans_that_cannot_be_served_name_the_field():
    with pytest.raises(ToolChoiceError, match="--tool-call-parser") as error:
        plan_tools(TOOLS, "auto", True, None)
    assert error.value.field == "tool_choice"
    with pytest.raises(ToolChoiceError, match="not in tools"):
        plan_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}), True,
                   None)
    with pytest.raises(ToolChoiceError, match="requires tools"):
        plan_tools(None, "required", True, None)
