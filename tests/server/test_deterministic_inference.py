"""`serve --enable-deterministic-inference` on the embedded model, over HTTP with the `openai` client: the issue's
greedy completion is the same cold and twice from the prefix cache, streamed or whole, alone or inside a batch of
other prompts (each fails without the flag: see tests/runtime/test_deterministic_inference.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from plugserve.runtime.server_args import ServerArgs
from tests.live_server import API_KEY, SERVED_MODEL, RunningServer, start_server

PROMPT = "To reset a user password in Django,"
# A fixed pool: on a GPU, sizing by --mem-fraction-static sees the memory an earlier engine of this process still
# holds in torch's cache, and finds none left.
KV_TOKENS = 16384
BODY = {"model": SERVED_MODEL, "temperature": 0, "max_tokens": 24, "logprobs": 0}
Answer = tuple[str, list[float]]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    yield from start_server(ServerArgs(enable_deterministic_inference=True, api_key=API_KEY,
                                       served_model_name=SERVED_MODEL, max_total_tokens=KV_TOKENS))


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


def _flush(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200


def _answers(client: openai.OpenAI, prompt: str | list[str], max_tokens: int = 24) -> list[Answer]:
    choices = client.completions.create(prompt=prompt, **{**BODY, "max_tokens": max_tokens}).choices
    return [(c.text, c.logprobs.token_logprobs) for c in sorted(choices, key=lambda c: c.index)]


def test_cold_cached_and_streamed_completions_are_identical(server, client):
    _flush(server)
    cold = _answers(client, PROMPT)[0]
    assert [_answers(client, PROMPT)[0] for _ in range(2)] == [cold, cold]
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **BODY))
    streamed = ("".join(c.choices[0].text for c in chunks),
                [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs])
    assert streamed == cold


def test_a_prompt_inside_a_batch_completes_as_it_does_alone(server, client):
    _flush(server)
    alone = _answers(client, PROMPT, max_tokens=6)[0]
    _flush(server)
    batch = ["Hi", "The history of the Roman empire, from its founding to the fall of Constantinople, shows", PROMPT]
    assert _answers(client, batch, max_tokens=6)[2] == alone
