"""The chat API's two ends beyond sampling: the prompt (the chat template, with the request's tools, its
chat_template_kwargs and continue_final_message) and the assistant message (content, reasoning_content split off by
--reasoning-parser, tool_calls), whole or as stream deltas."""

from __future__ import annotations

from typing import Any

from plugserve.server.protocol import ChatCompletionRequest, ChatMessage
from plugserve.server.reasoning import ReasoningStream, split_reasoning
from plugserve.server.tool_calls import ToolPlan, ToolStream, parse_calls

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
RESERVED_KWARGS = frozenset({"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                             "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                             "chat_template", "tokenizer_kwargs"})


class ChatTemplateError(ValueError):
    """A chat the template cannot render; `field`: the request field to name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _content(content: str | list | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (content as one string; tool calls and answers as sent)."""
    return message.model_dump(exclude_none=True) | {"content": _content(message.content)}


def prompt_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt ids (run in a worker thread: templating and tokenizing a long chat take a while)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if reserved := sorted(RESERVED_KWARGS & kwargs.keys()):
        raise ChatTemplateError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: "
                                "they are the request's own fields or the server's")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise ChatTemplateError("continue_final_message", "continue_final_message needs the last message to be "
                                "the assistant's (the one continued)")
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    try:
        return list(tokenizer.apply_chat_template(
            [_message(m) for m in body.messages], tools=tools, add_generation_prompt=not body.continue_final_message,
            continue_final_message=body.continue_final_message, tokenize=True, return_dict=False, **kwargs))
    except Exception as exc:  # the template's own checks (roles, ordering) speak to the client
        raise ChatTemplateError("messages", f"the chat template rejected the messages: {exc}") from None


def _finish(reason: str | None, calls: bool) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChatOutput:
    """How one request's choices read: `reasoning` splits reasoning_content off (--reasoning-parser, and the output
    free: a grammar-constrained one has no reasoning), `tools` makes tool calls of it."""

    def __init__(self, reasoning: bool, tools: ToolPlan) -> None:
        self.reasoning, self.tools = reasoning, tools

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the finish reason: tool_calls where the output made calls and stopped)."""
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning:
            message["reasoning_content"], content = split_reasoning(text)
        calls: list[dict[str, Any]] = []
        if content is not None:
            content, calls = parse_calls(self.tools, content)
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        return message, _finish(finish_reason, bool(calls))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's stream deltas."""

    def __init__(self, output: ChatOutput) -> None:
        self.reasoning = ReasoningStream() if output.reasoning else None
        self.tools = ToolStream(output.tools)

    def feed(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta of the output's next piece `text`, the finish reason to send with it)."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, finished)
            if reasoning:
                delta["reasoning_content"] = reasoning
        content, calls = self.tools.feed(text, finished)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, _finish(finish_reason, bool(self.tools.calls))
