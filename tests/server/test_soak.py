"""Soak: two hundred mixed requests, 64 at once, against a KV pool far too small for them (retraction all
along): streamed and not, n > 1, stop strings, logprobs, /generate, clients that leave mid-stream or before a
non-streamed answer, hostile ones (a 10 MB body, a 200 x 64 fan-out, a lone surrogate), refused with their 4xx,
and requests whose forward fails (the engine's fault hook), answered with a JSON 500. Afterwards every other
request finished, was ended by its client or refused; none hung or failed; the greedy ones equal their solo runs
(batch-mates of the failing ones included); /health answered within 100 ms (99th percentile) all along; and every
KV page is back (free, or held only by evictable prefix-cache nodes), each with one owner."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import pytest

from plugserve.core.forward_batch import ForwardMode
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.live_server import API_KEY, SERVED_MODEL, RunningServer, start_server

REQUESTS = 200
CONCURRENCY = 64
POOL_TOKENS = 256  # ~6 of the longest requests at once; 64 are in flight
HANG_S = 120  # the whole soak; one request never waits this long unless something hangs
WORDS = ["red", "fox", "jumps", "over", "the", "lazy", "dog", "7", "and", "then", "sleeps"]
KINDS = ["greedy", "greedy stream", "sampled n", "stop and logprobs", "chat", "generate", "leave stream",
         "leave waiting"]
# Hostile requests and the status each must get: a body over --max-request-body-bytes, more sequences than
# --max-sequences-per-request, a string UTF-8 cannot encode, and prompts whose forward fails.
HOSTILE = {"huge body": 413, "fan-out": 400, "lone surrogate": 400, "failing prefill": 500, "failing decode": 500}
BODY_LIMIT = 1 << 20
FAILING = {"failing prefill": "the fox fails at once", "failing decode": "the dog fails later"}


class Faults:
    """The server's fault hook: a forward fails if it holds a request with a FAILING prompt (in its prefill, or
    once it has a few tokens), whose ids the test sets once the server runs."""

    def __init__(self) -> None:
        self.prefill: list[int] | None = None
        self.decode: list[int] | None = None

    def __call__(self, mode: ForwardMode, requests: Sequence[Request]) -> None:
        for request in requests:
            if ((request.prompt_ids == self.prefill and mode is ForwardMode.EXTEND)
                    or (request.prompt_ids == self.decode and len(request.output_ids) > 3)):
                raise RuntimeError("injected fault")


FAULTS = Faults()


@dataclass
class Outcome:
    kind: str
    ended_by_client: bool = False
    texts: tuple[str, ...] = ()  # per choice
    finish_reasons: tuple[str | None, ...] = ()
    key: tuple[str, int] | None = None  # the greedy request's (prompt, max_tokens), to compare with its solo run
    status: int | None = None  # a hostile request's answer


@pytest.fixture(scope="module")
def soak_server():
    yield from start_server(ServerArgs(model_preset="tiny", api_key=API_KEY, served_model_name=SERVED_MODEL,
                                       max_total_tokens=POOL_TOKENS, max_request_body_bytes=BODY_LIMIT,
                                       max_running_requests=CONCURRENCY, chunked_prefill_size=64), FAULTS)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))


async def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) async for line in response.aiter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def _hostile(client: httpx.AsyncClient, kind: str) -> Outcome:
    if kind == "huge body":
        body = json.dumps({"model": SERVED_MODEL, "prompt": "a" * (10 << 20)}).encode()
        response = await client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    elif kind == "fan-out":
        response = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": ["hi"] * 200, "n": 64})
    elif kind in FAILING:
        response = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": FAILING[kind],
                                                              "max_tokens": 12, "ignore_eos": True})
        assert "injected fault" in response.json()["error"]["message"]
    else:
        response = await client.post("/v1/completions", content=b'{"prompt": "\\ud800 the fox", "max_tokens": 2}',
                                     headers={"Content-Type": "application/json"})
    assert response.json()["error"]["message"], response.text
    return Outcome(kind, status=response.status_code)


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, greedy: list[tuple[str, int]]) -> Outcome:
    if kind in HOSTILE:
        return await _hostile(client, kind)
    if kind in ("greedy", "greedy stream"):
        prompt, max_tokens = rng.choice(greedy)
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        if kind == "greedy":
            choice = (await client.post("/v1/completions", json=body)).raise_for_status().json()["choices"][0]
            return Outcome(kind, texts=(choice["text"],), finish_reasons=(choice["finish_reason"],),
                           key=(prompt, max_tokens))
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            chunks = [c["choices"][0] for c in await _events(response.raise_for_status())]
        return Outcome(kind, texts=("".join(c["text"] for c in chunks),), finish_reasons=(chunks[-1]["finish_reason"],),
                       key=(prompt, max_tokens))
    if kind in ("sampled n", "stop and logprobs"):
        body = {"model": SERVED_MODEL, "prompt": _prompt(rng), "max_tokens": rng.randint(4, 24), "n": rng.randint(2, 3),
                "temperature": 0.9, "seed": rng.randrange(1000), "stream": rng.random() < 0.5}
        if kind == "stop and logprobs":
            body |= {"n": 1, "stop": [rng.choice(WORDS), "."], "logprobs": 3}
        if not body["stream"]:
            choices = (await client.post("/v1/completions", json=body)).raise_for_status().json()["choices"]
            if kind == "stop and logprobs":
                logprobs = choices[0]["logprobs"]
                assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
            return Outcome(kind, texts=tuple(c["text"] for c in choices),
                           finish_reasons=tuple(c["finish_reason"] for c in choices))
        async with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = [c["choices"][0] for c in await _events(response.raise_for_status())]
        reasons = {c["index"]: c["finish_reason"] for c in chunks if c["finish_reason"]}
        return Outcome(kind, texts=("",) * body["n"], finish_reasons=tuple(reasons.get(i) for i in range(body["n"])))
    if kind == "chat":
        body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": _prompt(rng)}],
                "max_tokens": rng.randint(2, 16), "n": rng.randint(1, 2), "logprobs": True, "top_logprobs": 2}
        choices = (await client.post("/v1/chat/completions", json=body)).raise_for_status().json()["choices"]
        return Outcome(kind, texts=tuple(c["message"]["content"] for c in choices),
                       finish_reasons=tuple(c["finish_reason"] for c in choices))
    if kind == "generate":
        body = {"text": _prompt(rng), "sampling_params": {"max_new_tokens": rng.randint(2, 20), "temperature": 0.7,
                                                           "stop": rng.choice(WORDS)}}
        meta = (await client.post("/generate", json=body)).raise_for_status().json()["meta_info"]
        return Outcome(kind, texts=("",), finish_reasons=(meta["finish_reason"],))
    # Clients that leave: a stream closed after a few events, a non-streamed request given up on.
    body = {"model": SERVED_MODEL, "prompt": _prompt(rng), "max_tokens": 150, "ignore_eos": True}
    if kind == "leave stream":
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            lines = response.aiter_lines()
            for _ in range(rng.randint(1, 6)):
                await anext(lines)
        return Outcome(kind, ended_by_client=True)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(client.post("/v1/completions", json=body), rng.uniform(0.05, 1.0))
    return Outcome(kind, ended_by_client=True)


def test_soak_with_a_far_too_small_kv_pool(soak_server: RunningServer, capsys):
    engine = soak_server.engine
    FAULTS.prefill, FAULTS.decode = (engine.tokenize(FAILING[k]) for k in ("failing prefill", "failing decode"))
    rng = random.Random(0)
    greedy = [(_prompt(rng), rng.randint(4, 24)) for _ in range(12)]
    plan = [rng.choice(KINDS) for _ in range(REQUESTS)]
    for i, kind in enumerate(HOSTILE):  # each once, early, while the pool is busiest
        plan.insert(10 + 20 * i, kind)
    health: list[float] = []

    async def probe_health(client: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            sent = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            health.append(time.monotonic() - sent)
            await asyncio.sleep(0.05)

    async def run() -> list[Outcome]:
        gate = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        async with httpx.AsyncClient(base_url=soak_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=HANG_S, limits=limits) as client:
            async def guarded(i: int, kind: str) -> Outcome:
                async with gate:
                    return await _one(client, kind, random.Random(i), greedy)

            done = asyncio.Event()
            prober = asyncio.create_task(probe_health(client, done))
            try:
                return await asyncio.wait_for(asyncio.gather(*(guarded(i, k) for i, k in enumerate(plan))), HANG_S)
            finally:
                done.set()
                await prober

    errors_before = soak_server.metric("plugserve_requests_total", finish_reason="error")
    started = time.monotonic()
    outcomes = asyncio.run(run())
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 10
    while engine.num_outstanding and time.monotonic() < deadline:  # the last aborts reach the scheduler
        time.sleep(0.05)
    aborted = soak_server.metric("plugserve_requests_total", finish_reason="abort")
    kinds = Counter(o.kind for o in outcomes)
    left = sum(o.ended_by_client for o in outcomes)
    allocator = engine.runner.allocator
    p99 = sorted(health)[int(0.99 * len(health))] if health else float("inf")
    # Idle, every page is free or in the prefix cache: the rest leaked.
    leaked = allocator.num_pages - allocator.num_free - engine.radix.cached_pages
    with capsys.disabled():
        print(f"\nsoak: {len(outcomes)} requests in {elapsed:.0f} s ({dict(kinds)}); {left} clients left early, "
              f"{aborted:.0f} requests aborted; {engine.metrics.retractions._value.get():.0f} retractions; "
              f"{leaked} pages leaked; /health p99 {p99 * 1e3:.0f} ms over {len(health)} probes")

    assert engine.num_outstanding == 0, "requests still running after their clients were done"
    assert soak_server.metric("plugserve_requests_total", finish_reason="error") == errors_before + len(FAILING)
    assert 0 < aborted <= left  # a client that left after its last token aborted nothing
    assert engine.metrics.retractions._value.get() > 0, "the pool was not too small: nothing was retracted"
    assert {o.kind: o.status for o in outcomes if o.kind in HOSTILE} == HOSTILE
    assert len(health) > 20 and p99 < 0.1, sorted(health)[-10:]
    for outcome in outcomes:
        if outcome.kind in HOSTILE:
            continue
        if not outcome.ended_by_client:
            assert outcome.finish_reasons and all(r in ("stop", "length") for r in outcome.finish_reasons), outcome
    solo = {key: engine.generate(key[0], SamplingParams(max_new_tokens=key[1], temperature=0, ignore_eos=True))[0].text
            for key in greedy}
    compared = [o for o in outcomes if o.key is not None]
    assert len(compared) > 30 and all(o.texts == (solo[o.key],) for o in compared)
    # Every page is back: free or in an evictable cache node, and each has exactly one owner.
    assert leaked == 0
    engine.check_pool_accounting()
    assert engine.radix.protected_pages == 0
    assert allocator.num_free + engine.radix.evictable_pages == allocator.num_pages
