"""--reasoning-parser deepseek-r1: reasoning_content split off, whole and streamed piece by piece."""

from __future__ import annotations

import pytest

from plugserve.server.reasoning import ReasoningStream, split_reasoning

OUTPUT = "Paris is in France.\nSo: Paris.</think>\n\nThe answer is Paris."


def test_split():
    assert split_reasoning(OUTPUT) == ("Paris is in France.\nSo: Paris.", "\n\nThe answer is Paris.")
    assert split_reasoning("<think>short</think>ok") == ("short", "ok")
    assert split_reasoning("still thinking") == ("still thinking", None)  # cut short: all reasoning


@pytest.mark.parametrize("text", [OUTPUT, "<think>short</think>ok", "still thinking </thi"])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_deltas_match_the_split(text, step):
    stream = ReasoningStream()
    reasoning = content = ""
    for at in range(0, len(text), step):
        finished = at + step >= len(text)
        r, c = stream.feed(text[at : at + step], finished)
        assert finished or ("</" not in r and "<think" not in r)  # a partial tag waits: it may be the tag
        reasoning, content = reasoning + r, content + c
    whole_reasoning, whole_content = split_reasoning(text)
    assert reasoning == whole_reasoning and content == (whole_content or "")
