"""The OpenAI-compatible API over real HTTP, driven by the `openai` client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.live_server import API_KEY, SERVED_MODEL, RunningServer, start_server

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


SMALL_POOL, SMALL_FAN_OUT = 512, 8


@pytest.fixture(scope="module")
def small_server() -> Iterator[RunningServer]:
    """A server whose KV pool is smaller than the context, and which takes few sequences per request."""
    yield from start_server(ServerArgs(model_preset="tiny", api_key=API_KEY, served_model_name=SERVED_MODEL,
                                       max_total_tokens=SMALL_POOL, max_sequences_per_request=SMALL_FAN_OUT))


def _post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)


def _engine_text(server: RunningServer, prompt, max_tokens: int) -> str:
    return server.engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0))[0].text


def test_models_lists_the_served_model(client, server):
    [model] = client.models.list().data
    assert model.id == server.engine.model_name == SERVED_MODEL


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_404_model_not_found(server, path):
    """It used to be served, echoing the name back."""
    body = {"model": "gpt-9", "prompt": PROMPT, "messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
    # The listed name, and no name at all, are served.
    for model in (SERVED_MODEL, None):
        body["model"] = model
        response = httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=60)
        assert response.status_code == 200 and response.json()["model"] == SERVED_MODEL


def test_logit_bias_moves_the_greedy_output(client, server):
    """It used to be ignored: a -100 bias on the greedy token left the output as it was."""
    first = server.engine.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0))[0].token_ids[0]
    banned = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"skip_special_tokens": False})
    assert banned.choices[0].text != server.engine.tokenizer.decode([first])
    forced = server.engine.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, temperature=1,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == server.engine.tokenizer.decode([forced] * 3)


def test_completions_streamed_or_not_match_engine_generate(client, server):
    expected = _engine_text(server, PROMPT, 16)
    response = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected
    assert response.usage.completion_tokens == 16 or response.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == response.usage.total_tokens


def test_chat_streamed_or_not_match_engine_generate(client, server):
    ids = server.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    expected = _engine_text(server, list(ids), 16)
    response = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_n_and_logprobs(client):
    response = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=1.0, n=3, seed=11,
                                         logprobs=2)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) > 0
        for top, chosen in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True):
            values = list(top.values())  # distinct token texts: 2 entries unless two ids decode alike
            assert 1 <= len(values) <= 2 and values == sorted(values, reverse=True)
            assert chosen <= values[0] + 1e-6
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    for token in chat.choices[0].logprobs.content:
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert token.logprob == values[0]  # greedy picks the most likely


def test_the_largest_seed_serves_every_sample(client):
    """n samples take seeds seed, seed + 1, ...: at the top of the range each still gets its tokens (a seed past
    what a generator takes used to give a 200 with an empty second choice and no finish reason)."""
    response = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, n=2, seed=2**63 - 1,
                                         extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in response.choices] == ["length", "length"]
    assert all(c.text for c in response.choices) and response.usage.completion_tokens == 6


def test_64_concurrent_streams_each_equal_its_solo_run(server):
    rng = random.Random(0)
    words = ["red", "fox", "jumps", "over", "lazy", "dog", "7"]
    jobs = [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))), rng.randint(1, 24)) for _ in range(64)]
    solo = [_engine_text(server, prompt, max_tokens) for prompt, max_tokens in jobs]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)

    async def one(prompt: str, max_tokens: int) -> str:
        stream = await aclient.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        return await asyncio.gather(*(one(p, m) for p, m in jobs))

    assert asyncio.run(run_all()) == solo


def test_shared_prefix_hits_the_radix_cache_and_matches_a_cold_run(client, server):
    prefix = "In a hole in the ground there lived a hobbit. " * 12
    before = server.metric("plugserve_cached_prompt_tokens_total")
    client.completions.create(model="m", prompt=prefix + "Not a nasty, dirty, wet hole.", max_tokens=1,
                              temperature=0)
    warm = client.completions.create(model="m", prompt=prefix + "It had a perfectly round door.", max_tokens=6,
                                     temperature=0, logprobs=5)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(server.engine.tokenize(prefix)) - 1
    assert server.metric("plugserve_cached_prompt_tokens_total") - before >= cached
    assert server.metric("plugserve_cache_hit_rate") > 0
    # The cold run: the same request on an engine without a prefix cache.
    from plugserve.runtime.engine import Engine
    from plugserve.runtime.server_args import ServerArgs

    cold_engine = Engine(ServerArgs(model_preset="tiny", disable_radix_cache=True))
    try:
        cold = cold_engine.generate(prefix + "It had a perfectly round door.",
                                    SamplingParams(max_new_tokens=6, temperature=0, logprobs=True, top_logprobs=5))[0]
    finally:
        cold_engine.shutdown()
    assert warm.choices[0].text == cold.text
    for warm_lp, cold_lp in zip(warm.choices[0].logprobs.token_logprobs, cold.logprobs, strict=True):
        assert warm_lp == pytest.approx(cold_lp.logprob, abs=1e-4)


# (endpoint, body, the field the 400 names)
BAD_REQUESTS = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "token " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    # Used to reach the scheduler untyped: a TypeError there killed its thread, or a 500 in plain text.
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": "ab"}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [5]}}, "sampling_params.stop.0"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [-3]}}, "sampling_params.stop_token_ids.0"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [999999]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 100000}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**63}}, "sampling_params.seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),  # OpenAI: needs logprobs
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [999999]}, "stop_token_ids"),
    # The OpenAI endpoints share /generate's typed sampling fields: JSON types are strict there too.
    ("/v1/completions", {"prompt": PROMPT, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2.0}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [5]}, "stop.0"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ""}, "stop.0"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty"),
    # A lone surrogate (JSON's "\\ud800") UTF-8 cannot encode: it used to be a plain-text 500 (the tokenizer or the
    # response failed on it) that left the client a dead keep-alive connection, or a 400 with the tokenizer's
    # internal TypeError; now a 400 names where it is, in every kind of field. (Pydantic refused it already in
    # strings with constraints, as `stop`'s, and in keys.)
    ("/v1/completions", '{"prompt": "hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["hi", "\\udc00 there"]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}, '
     '{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "messages.1.content.0.text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', "model"),
    ("/generate", '{"text": "\\ud800"}', "text"),
    ("/generate", '{"text": "hi", "rid": "\\ud800"}', "rid"),
    # /generate has no `prompt`: its errors about the prompt name the field it came in (they named `prompt`).
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [999999]}, "input_ids"),
    ("/generate", {"input_ids": [1] * 9000}, "input_ids"),
    ("/generate", {"text": "token " * 9000}, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "token " * 9000}]}, "messages"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"999999": 1}}}, "sampling_params.logit_bias"),
    # Fields that used to be ignored with a 200: honoured, or refused by name.
    ("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"prompt": PROMPT, "regex": "(unclosed"}, "regex"),
    ("/v1/completions", {"prompt": PROMPT, "json_schema": "[1]"}, "json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= "}}, "sampling_params.ebnf"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}, "regex": "a"},
     "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL]}, "tool_choice"),  # auto needs a parser
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, path, body, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, str) else None
    response = httpx.post(f"{server.base_url}{path}", content=content, json=None if content else body,
                          headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, error
    assert param is None or param in error["message"], error  # the message says where, too
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_wrong_or_missing_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_the_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER"):
        response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200


def test_server_info_never_shows_the_api_key(server):
    response = httpx.get(f"{server.base_url}/server_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200 and API_KEY not in response.text and "api_key" not in response.json()["args"]


def test_bad_requests_during_a_stream_do_not_disturb_it(server, client):
    stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = []
    for i, chunk in enumerate(stream):
        if i == 2:
            for path, body, _ in BAD_REQUESTS[:4]:
                httpx.post(f"{server.base_url}{path}", content=body if isinstance(body, str) else None,
                           json=None if isinstance(body, str) else body,
                           headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        pieces.append(chunk.choices[0].text if chunk.choices else "")
    expected = server.engine.generate(PROMPT, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0]
    assert "".join(pieces) == expected.text


def test_a_client_leaving_mid_stream_aborts_its_request(server):
    before = server.metric("plugserve_requests_total", finish_reason="abort")
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 4000, "stream": True, "ignore_eos": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for _ in zip(range(3), response.iter_lines(), strict=False):
            pass
    for _ in range(100):
        if server.metric("plugserve_requests_total", finish_reason="abort") > before:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert server.metric("plugserve_requests_total", finish_reason="abort") == before + 1


def test_native_generate_and_server_info(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = httpx.post(f"{server.base_url}/generate", headers=headers,
                      json={"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert body["text"] == _engine_text(server, PROMPT, 5) and len(body["output_ids"]) == 5
    info = httpx.get(f"{server.base_url}/server_info", headers=headers).json()
    assert {(b["kind"], b["phase"]) for b in info["backends"]} >= {("attention", "decode"), ("attention", "prefill")}
    assert all(b["reason"] for b in info["backends"]) and info["page_size"] >= 1


def test_generate_takes_one_stop_string_as_one_stop(server):
    """`"stop": "ab"` used to be the stops `a` and `b`: the text ended at the first of either."""
    def generate(**sampling) -> dict:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        body["sampling_params"] |= sampling
        return httpx.post(f"{server.base_url}/generate", headers={"Authorization": f"Bearer {API_KEY}"}, json=body,
                          timeout=60).raise_for_status().json()

    full = generate()["text"]
    # A pair of characters one of which comes earlier in the text than the pair does.
    stop = next(full[i : i + 2] for i in range(len(full) - 1)
                if min(full.find(c) for c in full[i : i + 2]) < full.find(full[i : i + 2]))
    stopped = generate(stop=stop)
    assert stopped["text"] == full[: full.find(stop)]
    assert stopped["meta_info"]["finish_reason"] == "stop" and stopped["meta_info"]["matched_stop"] == stop


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_usage_counts_the_prompt_once_whatever_n(client, n):
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=3)
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=3, n=n, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == 3 * n
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=3, n=n).usage.prompt_tokens == \
        plain.usage.prompt_tokens
    chat = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, n=n, stream=True,
                                               stream_options={"include_usage": True}))
    single = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert chat[-1].usage.prompt_tokens == single.usage.prompt_tokens


def test_a_non_streaming_client_that_leaves_has_its_request_aborted_and_its_pages_freed(server):
    engine = server.engine
    runner = engine.runner

    def settled() -> bool:
        return (engine.scheduler.num_running == 0 and not engine.scheduler.waiting
                and runner.allocator.num_free + engine.radix.evictable_pages == runner.allocator.num_pages)

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # thousands of tokens on the CPU: far longer than the client waits
        httpx.post(f"{server.base_url}/v1/completions", headers=headers, json=body, timeout=1.0)
    deadline = time.time() + 5
    while not settled() and time.time() < deadline:
        time.sleep(0.05)
    assert settled(), "the request ran on after its client left"


@pytest.mark.parametrize("stream", [False, True])
def test_a_job_that_fails_to_run_is_an_error_not_a_partial_answer(server, monkeypatch, stream):
    """`_merged` used to swallow a failing job (gather with return_exceptions): a 200 with what the others made."""
    real = server.engine.stream_async
    calls = []

    async def stream_async(ids, params, rid=None):
        calls.append(1)
        if len(calls) == 2:  # the second of n = 2 samples, as the engine's own would fail (in its first step)
            raise RuntimeError("job bug")
        async for output in real(ids, params, rid):
            yield output

    monkeypatch.setattr(server.engine, "stream_async", stream_async)
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2, "stream": stream}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "RuntimeError: job bug" in json.loads(events[-2])["error"]["message"]
    else:
        assert response.status_code == 500 and "RuntimeError: job bug" in response.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413_naming_the_flag(server):
    limit = server.engine.args.max_request_body_bytes
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    declared = httpx.post(f"{server.base_url}/v1/completions", headers=headers, content=b" " * (limit + 1))

    def chunks():  # no Content-Length: the size shows only while the body is read
        yield b'{"prompt": "'
        for _ in range(limit // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    streamed = httpx.post(f"{server.base_url}/v1/completions", headers=headers, content=chunks(), timeout=60)
    for response in (declared, streamed):
        assert response.status_code == 413
        assert "--max-request-body-bytes" in response.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_health_answers_at_once_while_a_long_prompt_is_tokenized(server):
    """Tokenizing a 1.5 MB prompt takes seconds: it ran on the event loop, which answered nothing meanwhile."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "To reset a user password in Django, " * 42_000, "max_tokens": 1}
    latencies: list[float] = []

    async def probe() -> float:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            long = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
            start = time.monotonic()
            await asyncio.sleep(0.2)  # the body is parsed and its tokenizing begun
            while not long.done():
                sent = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.monotonic() - sent)
                await asyncio.sleep(0.02)
            assert (await long).status_code == 400  # far past the tiny model's context
            return time.monotonic() - start

    duration = asyncio.run(probe())
    assert duration > 0.5 and len(latencies) >= 5
    assert sorted(latencies)[int(0.9 * len(latencies))] < 0.1, latencies


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_bug_is_a_json_500_that_closes_its_connection_and_the_client_goes_on(server, monkeypatch, path):
    """An unexpected exception used to be Starlette's plain-text 500 on a connection uvicorn then dropped without
    `Connection: close`: the client's next request on it failed with a reset."""
    real = server.engine.tokenize

    def tokenize(prompt):
        if prompt == "boom":
            raise RuntimeError("tokenizer bug")
        return real(prompt)

    monkeypatch.setattr(server.engine, "tokenize", tokenize)

    def body(prompt: str) -> dict:
        if path == "/generate":
            return {"text": prompt, "sampling_params": {"max_new_tokens": 2}}
        return {"prompt": prompt, "max_tokens": 2}

    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        response = client.post(path, json=body("boom"))
        assert response.status_code == 500 and response.headers["connection"] == "close", response.text
        error = response.json()["error"]
        assert error["type"] == "internal_error" and "RuntimeError: tokenizer bug" in error["message"], error
        for _ in range(2):  # the same client (its connection pool): each request is served
            assert client.post(path, json=body(PROMPT)).status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [PROMPT] * 3, "n": 3}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6]] * 9}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "n": 9}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 9}, "n"),
])
def test_more_sequences_than_the_flag_allows_are_refused(small_server, path, body, param):
    """`n` was capped but the prompt array was not: 200 prompts x n = 64 made 12,800 sequences in one request."""
    response = _post(small_server, path, body | {"max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "--max-sequences-per-request" in error["message"] and f"at most {SMALL_FAN_OUT}" in error["message"]
    allowed = _post(small_server, "/v1/completions", {"prompt": [PROMPT] * 2, "n": 4, "max_tokens": 2})
    assert allowed.status_code == 200 and len(allowed.json()["choices"]) == SMALL_FAN_OUT


def test_the_default_fan_out_bound_refuses_the_probe_s_request(server):
    response = _post(server, "/v1/completions", {"prompt": [PROMPT] * 200, "n": 64, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "12800 sequences" in response.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [5] * 450, "max_tokens": 200, "ignore_eos": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 450, "max_tokens": SMALL_POOL - 450 + 1}, "max_tokens"),
    ("/generate", {"input_ids": [5] * 450, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
     "sampling_params.max_new_tokens"),
])
def test_a_request_the_kv_pool_can_never_hold_is_refused(small_server, path, body, param):
    """It fit the context but not the pool: a 200 with 62 tokens and finish_reason "length", cut short silently."""
    response = _post(small_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert f"holds {SMALL_POOL} tokens" in error["message"] and "--max-total-tokens" in error["message"]


def test_a_request_that_just_fits_the_kv_pool_runs_to_its_max_tokens(small_server):
    body = {"prompt": [5] * 450, "max_tokens": SMALL_POOL - 450, "ignore_eos": True, "temperature": 0}
    response = _post(small_server, "/v1/completions", body).json()
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == SMALL_POOL - 450
    # Without max_tokens, chat's budget is what the pool leaves the prompt (the context's would be refused).
    chat = _post(small_server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["total_tokens"] == SMALL_POOL


def _streamed_completion(client, **kwargs) -> tuple[str, list, int]:
    """Text, logprobs entries (token, logprob, top, offset) and completion tokens of a streamed completion."""
    text, entries, used = "", [], 0
    for chunk in client.completions.create(model="m", stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                lp = choice.logprobs
                entries += zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True)
    return text, entries, used


@pytest.mark.parametrize("stop", [None, ["ovTest"]])  # "ov" is held back (it may start the stop), then matched
def test_streamed_logprobs_have_one_entry_per_token_equal_to_the_non_streamed(client, stop):
    """A token that added no text in its step used to lose its entry; text_offset indexes the returned text."""
    kwargs = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 2, "stop": stop}
    whole = client.completions.create(model="m", **kwargs)
    choice = whole.choices[0]
    lp = choice.logprobs
    expected = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True))
    assert len(expected) == whole.usage.completion_tokens
    text, entries, used = _streamed_completion(client, **kwargs)
    assert (text, used) == (choice.text, whole.usage.completion_tokens)
    assert [(e[0], list(e[2]), e[3]) for e in entries] == [(e[0], list(e[2]), e[3]) for e in expected]
    for got, want in zip(entries, expected, strict=True):  # a prefix-cache hit may move a logprob by float noise
        assert got[1] == pytest.approx(want[1], abs=1e-4) and list(got[2].values()) == pytest.approx(
            list(want[2].values()), abs=1e-4)
    in_text = [(token, offset) for token, _, _, offset in entries if offset + len(token) <= len(text)]
    assert in_text[0][1] == 0 and all(text[offset:].startswith(token) for token, offset in in_text)
    chat = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2, "stop": stop}
    whole_chat = client.chat.completions.create(model="m", **chat)
    streamed = [(t.token, t.logprob) for c in client.chat.completions.create(model="m", stream=True, **chat)
                for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    expected_chat = [(t.token, t.logprob) for t in whole_chat.choices[0].logprobs.content]
    assert len(streamed) == len(expected_chat) == whole_chat.usage.completion_tokens
    assert [t for t, _ in streamed] == [t for t, _ in expected_chat]
    assert [v for _, v in streamed] == pytest.approx([v for _, v in expected_chat], abs=1e-4)


def test_streamed_text_offsets_stay_in_the_text_when_a_held_stop_string_is_cut(client):
    """A stop string of three tokens: the first two are held back (they may start it) and their entries go out
    before the third cuts them off. The second's offset used to point past the returned text."""
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    k = next(k for k in range(1, len(lp.tokens) - 3)
             if all(t.strip() and "\ufffd" not in t for t in lp.tokens[k : k + 3])
             and text.find("".join(lp.tokens[k : k + 3])) == lp.text_offset[k]
             and lp.text_offset[k] < lp.text_offset[k + 1] < lp.text_offset[k + 2])
    stop = "".join(lp.tokens[k : k + 3])
    streamed, entries, _ = _streamed_completion(client, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0,
                                                stop=[stop])
    cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0, stop=[stop])
    assert streamed == cut.choices[0].text == text[: lp.text_offset[k]]
    offsets = [e[3] for e in entries]
    assert max(offsets) <= len(streamed), (offsets, len(streamed))
    assert offsets == cut.choices[0].logprobs.text_offset


def test_text_offset_counts_characters_of_the_returned_text(client, server):
    """A skipped special token (EOS, ignore_eos) used to count its own text: offsets ran past the returned text."""
    special = set(server.engine.tokenizer.all_special_tokens)
    response = client.completions.create(model="m", prompt=PROMPT, max_tokens=200, temperature=50, seed=3, n=8,
                                         logprobs=0, extra_body={"ignore_eos": True})
    assert any(t in special for c in response.choices for t in c.logprobs.tokens)  # the case this is about
    for choice in response.choices:
        text, lp = choice.text, choice.logprobs
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
            assert offset <= len(text) and (token in special or "\ufffd" in token or text[offset:].startswith(token))


def test_chat_template_kwargs_and_continue_final_message_reach_the_template(client, server):
    """They used to be ignored: the prompt was the plain template's."""
    tokenizer = server.engine.tokenizer
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    # The template reads bos_token; a kwarg overrides it (here: no BOS token, one prompt token fewer).
    no_bos = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"bos_token": ""}})
    assert no_bos.usage.prompt_tokens == plain.usage.prompt_tokens - 1
    started = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    ids = tokenizer.apply_chat_template(started, continue_final_message=True, add_generation_prompt=False,
                                        tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).endswith("Once upon")
    continued = client.chat.completions.create(model="m", messages=started, max_tokens=8, temperature=0,
                                               extra_body={"continue_final_message": True})
    assert continued.usage.prompt_tokens == len(ids)
    assert continued.choices[0].message.content == _engine_text(server, list(ids), 8)
