"""Tool calls of the chat API: what a request's `tools` and `tool_choice` ask of the output, and the output read back
into OpenAI's `tool_calls`, whole or as stream deltas.

- tool_choice "required": the output is constrained (a JSON schema, as SGLang and vLLM build it) to a JSON array of
  `{"name": ..., "parameters": ...}` calls of the given tools (one when parallel_tool_calls is false), so that any
  model, however small, makes valid calls;
- a named function: the output is constrained to that function's parameters, and is its call's arguments;
- "auto" (the default with tools): the model decides, and `--tool-call-parser deepseekv3` reads DeepSeek-V3's
  tool-call tokens out of its text:
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...`;
- "none": no call; the output is text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from plugserve.server.reasoning import held_back

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)"
                           r"\n```json\n(?P<arguments>.*?)\n```<｜tool▁call▁end｜>", re.DOTALL)


class ToolChoiceError(ValueError):
    """A tools request that cannot be served; `field`: the request field to name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes tool calls. mode: "required" (a JSON array of calls), "named" (one call's
    arguments), "parse" (the parser reads calls out of free text) or "none"."""

    mode: Literal["none", "parse", "required", "named"]
    name: str | None = None  # the named function
    json_schema: str | None = None  # the output's constraint (required, named)


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any, parallel: bool, parser: str | None) -> ToolPlan:
    """The plan of a chat request's `tools` (protocol.Tool), `tool_choice` ("none" / "auto" / "required" /
    protocol.NamedToolChoice / None) and `parallel_tool_calls`, under --tool-call-parser `parser`."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolChoiceError("tool_choice", "tool_choice requires tools")
        return ToolPlan("none")
    if tool_choice == "none":
        return ToolPlan("none")
    functions = {t.function.name: t.function for t in tools}
    if tool_choice is None or tool_choice == "auto":
        if parser is None:
            raise ToolChoiceError("tool_choice", "tool_choice auto (the default with tools) needs a tool-call parser "
                                  "(--tool-call-parser deepseekv3); tool_choice required or a named function works "
                                  "without one")
        return ToolPlan("parse")
    if tool_choice == "required":
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f.parameters},
                 "required": ["name", "parameters"], "additionalProperties": False} for name, f in functions.items()]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", json_schema=json.dumps(schema))
    name = tool_choice.function.name
    if name not in functions:
        raise ToolChoiceError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
    return ToolPlan("named", name, json.dumps(functions[name].parameters))


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output. An output cut short (max_tokens) that does not parse stays text."""
    if plan.mode == "named":
        return None, [_call(plan.name or "", text)]
    if plan.mode == "required":
        try:  # the grammar's shape, unless a stop string or max_tokens cut it
            return None, [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
    if plan.mode == "parse" and CALLS_BEGIN in text:
        content, _, rest = text.partition(CALLS_BEGIN)
        calls = [_call(m["name"].strip(), m["arguments"]) for m in DEEPSEEK_CALL.finditer(rest)]
        if calls:
            return content or None, calls
    return text, []


@dataclass
class ToolStream:
    """One choice's stream: each piece of text in, its content delta and tool_calls deltas out."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)  # the calls sent so far

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls deltas with their `index`) that `text`, the output's next piece, makes
        certain. Named: the call goes out first, then its arguments piece by piece; required: the calls once the
        output has finished; parse: text up to the calls' begin token streams as content (a piece of that token
        is held back), then each call as its end token arrives."""
        self.text += text
        if self.plan.mode == "named":
            deltas = []
            if not self.calls:
                self.calls.append(_call(self.plan.name or "", ""))
                deltas.append({"index": 0, **self.calls[0]})
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if self.plan.mode == "required":
            if not finished:
                return "", []
            content, calls = parse_calls(self.plan, self.text)
            return self._new_calls(content or "", calls)
        if self.plan.mode == "none":
            return text, []
        content, begun, rest = self.text.partition(CALLS_BEGIN)
        visible = len(content) if begun or finished else len(content) - held_back(content, CALLS_BEGIN)
        delta, self.sent_content = content[self.sent_content : visible], max(self.sent_content, visible)
        calls = [_call(m["name"].strip(), m["arguments"]) for m in DEEPSEEK_CALL.finditer(rest)]
        if finished and begun and not calls:  # a begin token and no call: it was text after all
            delta += self.text[self.sent_content :]
        return self._new_calls(delta, calls)

    def _new_calls(self, content: str, calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        new = calls[len(self.calls) :]
        deltas = [{"index": len(self.calls) + i, **call} for i, call in enumerate(new)]
        self.calls += new
        return content, deltas
