"""--reasoning-parser deepseek-r1: a DeepSeek-R1 style output, `reasoning</think>answer`, split into the chat
message's reasoning_content and content, whole or as stream deltas.

R1's chat template opens `<think>` in the prompt, so the output starts inside the reasoning: everything before
`</think>` is reasoning (a leading `<think>` the model writes itself is dropped), and an output without `</think>` is
all reasoning (cut short while thinking), as SGLang's deepseek-r1 parser has it.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (to hold back while streaming)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(reasoning, content): content None while `</think>` has not come."""
    reasoning, end, content = text.partition(THINK_END)
    reasoning = reasoning.removeprefix(THINK_START)
    return reasoning, content if end else None


class ReasoningStream:
    """One choice's stream: each piece of text in, its (reasoning, content) deltas out."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_reasoning = self.sent_content = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """The deltas of reasoning and content that `text` (the output's next piece) makes certain; a piece of
        `</think>` (or of a leading `<think>`) still arriving is held back until the choice finishes."""
        self.text += text
        reasoning, content = split_reasoning(self.text)
        if content is None:
            visible = len(reasoning)
            if not finished:
                visible -= max(held_back(reasoning, THINK_END), held_back(self.text, THINK_START)
                               if len(self.text) < len(THINK_START) else 0)
            delta, self.sent_reasoning = reasoning[self.sent_reasoning : visible], max(self.sent_reasoning, visible)
            return delta, ""
        rest, self.sent_reasoning = reasoning[self.sent_reasoning :], len(reasoning)
        delta, self.sent_content = content[self.sent_content :], len(content)
        return rest, delta
