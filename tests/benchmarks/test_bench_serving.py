"""Tests of benchmarks/bench_serving.py against a small fake OpenAI-compatible server run in-process (CPU, fast)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import random
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAIL_MARKER = "@@FAIL@@"
"""A prompt holding this makes the fake server answer HTTP 400."""
FAKE_MODEL = "fake-model"
PIECE = " tok"
"""The text of each streamed chunk."""


def _load_bench() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    return module


bs = _load_bench()


# --------------------------------------------------------------------------------------------------------------------
# The fake server
# --------------------------------------------------------------------------------------------------------------------


class FakeState:
    """What the fake server saw, and how it behaves."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.headers: list[dict[str, str]] = []
        self.send_usage = True
        self.chunk_sleep = 0.002
        self.first_sleep = 0.005

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def make_app(state: FakeState) -> FastAPI:
    """A fake OpenAI-compatible server: /v1/models, streaming /v1/completions and /v1/chat/completions."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}, {"id": "other", "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        n = int(body.get("max_tokens") or 16)
        rid = f"req-{len(state.bodies)}"
        counted = True
        try:
            await asyncio.sleep(state.first_sleep)
            if chat:  # a role-only first chunk, as real servers send: no content, so no TTFT
                first = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"role": "assistant"}}],
                }
                yield f"data: {json.dumps(first)}\n\n".encode()
            for i in range(n):
                if i:
                    await asyncio.sleep(state.chunk_sleep)
                if chat:
                    choice = {"index": 0, "delta": {"content": PIECE}, "finish_reason": None}
                    chunk = {"id": rid, "object": "chat.completion.chunk", "choices": [choice]}
                else:
                    chunk = {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": PIECE}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt = body["messages"][0]["content"] if chat else body["prompt"]
                usage = {"prompt_tokens": len(prompt.split()) + 1, "completion_tokens": n, "total_tokens": 0}
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode()
            # done before [DONE] goes out: a client that stops at [DONE] cannot start its next request before this
            state.in_flight -= 1
            counted = False
            yield b"data: [DONE]\n\n"
        finally:
            if counted:
                state.in_flight -= 1

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        state.arrivals.append(time.perf_counter())
        state.headers.append(dict(request.headers))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if FAIL_MARKER in prompt:
            return JSONResponse({"error": {"message": "bad prompt marker", "type": "invalid_request"}}, 400)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


class FakeServer:
    """The fake app served by uvicorn on a free loopback port in a background thread."""

    def __init__(self) -> None:
        self.state = FakeState()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def _server() -> Iterator[FakeServer]:
    server = FakeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(_server: FakeServer) -> FakeServer:
    _server.state.reset()
    return _server


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok, _ = bs.load_tokenizer(None)
    return tok


def _args(server: FakeServer, *extra: str) -> list[str]:
    return [
        "--base-url", server.base_url, "--dataset-name", "random", "--random-input-len", "32",
        "--random-output-len", "8", "--num-prompts", "6", "--disable-tqdm", "--seed", "3", *extra,
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# Metrics on hand-made results
# --------------------------------------------------------------------------------------------------------------------


def _result(**kw: Any) -> Any:
    return bs.RequestResult(success=True, **kw)


def test_compute_metrics_exact() -> None:
    results = [
        _result(prompt_len=100, output_len=11, ttft=0.1, itl=[0.02, 0.03], latency=1.1),
        _result(prompt_len=200, output_len=21, ttft=0.3, itl=[0.04], latency=2.3),
        _result(prompt_len=50, output_len=1, ttft=0.2, itl=[], latency=0.2),
        bs.RequestResult(prompt_len=999, max_tokens=5, success=False, error="HTTP 400: boom"),
        bs.RequestResult(prompt_len=999, max_tokens=5, success=False, error="HTTP 400: boom"),
    ]
    m = bs.compute_metrics(results, duration_s=4.0)
    assert m["completed"] == 3 and m["failed"] == 2
    assert m["error_summary"] == {"HTTP 400: boom": 2}
    assert m["total_input_tokens"] == 350  # failed requests do not count
    assert m["total_output_tokens"] == 33
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["input_throughput"] == pytest.approx(350 / 4)
    assert m["output_throughput"] == pytest.approx(33 / 4)
    assert m["total_throughput"] == pytest.approx(383 / 4)
    assert m["concurrency"] == pytest.approx((1.1 + 2.3 + 0.2) / 4)
    # E2E: 1100, 2300, 200 ms
    assert m["mean_e2e_latency_ms"] == pytest.approx(1200.0)
    assert m["median_e2e_latency_ms"] == pytest.approx(1100.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(1100 + 0.98 * 1200)  # linear interpolation between 1100, 2300
    # TTFT: 100, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 100)
    # TPOT = (e2e - ttft) / (out - 1): 1.0/10 = 100 ms, 2.0/20 = 100 ms; the 1-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["median_tpot_ms"] == pytest.approx(100.0)
    assert m["p99_tpot_ms"] == pytest.approx(100.0)
    # ITL: 20, 30, 40 ms
    assert m["mean_itl_ms"] == pytest.approx(30.0)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p99_itl_ms"] == pytest.approx(30 + 0.98 * 10)
    assert m["max_itl_ms"] == pytest.approx(40.0)
    assert m["total_output_tokens_retokenized"] is None


def test_compute_metrics_tpot_differs_per_request() -> None:
    results = [
        _result(prompt_len=1, output_len=5, ttft=0.5, itl=[0.1] * 4, latency=0.9),  # 400 ms / 4 = 100 ms
        _result(prompt_len=1, output_len=3, ttft=0.1, itl=[0.3] * 2, latency=0.7),  # 600 ms / 2 = 300 ms
    ]
    m = bs.compute_metrics(results, duration_s=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)
    assert m["median_tpot_ms"] == pytest.approx(200.0)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 200)
    assert m["concurrency"] == pytest.approx(1.6)


def test_compute_metrics_all_failed_is_zeroes() -> None:
    m = bs.compute_metrics([bs.RequestResult(error="x")], duration_s=2.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    report = bs.format_report(m, "openai-completions", math.inf, None)
    assert "Successful requests:                     0" in report


def test_format_report_layout() -> None:
    results = [_result(prompt_len=256, output_len=32, ttft=0.19057, itl=[0.0179] * 31, latency=0.74672)]
    for r in results:
        r.retokenized_output_len = 32
    m = bs.compute_metrics(results, duration_s=0.74672)
    lines = bs.format_report(m, "openai-completions", math.inf, None).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert lines[1] == f"{'Backend:':<40} {'openai-completions':<10}"
    assert lines[2] == f"{'Traffic request rate:':<40} {'inf':<10}"
    assert lines[3] == f"{'Max request concurrency:':<40} {'not set':<10}"
    assert f"{'Request throughput (req/s):':<40} {1 / 0.74672:<10.2f}" in lines
    assert f"{'Mean TTFT (ms):':<40} {190.57:<10.2f}" in lines
    assert "----------------End-to-End Latency----------------" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert f"{'Total generated tokens (retokenized):':<40} {32:<10}" in lines
    rate = bs.format_report(m, "openai-chat", 4.0, 8).splitlines()
    assert rate[2].split() == ["Traffic", "request", "rate:", "4"]
    assert rate[3].split() == ["Max", "request", "concurrency:", "8"]


# --------------------------------------------------------------------------------------------------------------------
# Dataset and arrivals
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("full", "ratio"), [(100, 0.5), (7, 0.0), (64, 0.9), (1, 0.3)])
def test_random_lengths_in_range(full: int, ratio: float) -> None:
    lens = bs.random_lengths(full, ratio, 500, random.Random(0))
    low = max(int(full * ratio), 1)
    assert all(low <= n <= full for n in lens)
    if full - low >= 2:
        assert len(set(lens)) > 2  # spread over the range, not a constant
        assert min(lens) == low and max(lens) == full


def test_random_lengths_exact_when_ratio_one() -> None:
    assert bs.random_lengths(123, 1.0, 50, random.Random(0)) == [123] * 50
    with pytest.raises(ValueError):
        bs.random_lengths(10, 1.5, 1, random.Random(0))


def test_sample_random_requests(tokenizer: Any) -> None:
    reqs = bs.sample_random_requests(tokenizer, 20, input_len=64, output_len=16, range_ratio=0.25, seed=7)
    assert len(reqs) == 20
    for r in reqs:
        assert 16 <= r.prompt_len <= 64 and 4 <= r.output_len <= 16
        # the reported length is the prompt's actual token count
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    again = bs.sample_random_requests(tokenizer, 20, input_len=64, output_len=16, range_ratio=0.25, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    exact = bs.sample_random_requests(tokenizer, 10, input_len=50, output_len=9, range_ratio=1.0, seed=1)
    assert [(r.prompt_len, r.output_len) for r in exact] == [(50, 9)] * 10
    assert len({r.prompt for r in exact}) == 10


def test_arrival_times() -> None:
    assert bs.arrival_times(5, math.inf, 0) == [0.0] * 5
    times = bs.arrival_times(2000, 50.0, 1)
    assert times == bs.arrival_times(2000, 50.0, 1)  # seeded
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert times[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)  # mean gap 1 / rate
    with pytest.raises(ValueError):
        bs.arrival_times(3, 0.0, 0)


# --------------------------------------------------------------------------------------------------------------------
# Against the fake server
# --------------------------------------------------------------------------------------------------------------------

TABLE_LABELS = [
    "============ Serving Benchmark Result ============",
    "Backend:",
    "Traffic request rate:",
    "Max request concurrency:",
    "Successful requests:",
    "Failed requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Input token throughput (tok/s):",
    "Output token throughput (tok/s):",
    "Total token throughput (tok/s):",
    "Concurrency:",
    "End-to-End Latency",
    "Mean E2E Latency (ms):",
    "Median E2E Latency (ms):",
    "P99 E2E Latency (ms):",
    "Time to First Token",
    "Mean TTFT (ms):",
    "Median TTFT (ms):",
    "P99 TTFT (ms):",
    "Time per Output Token (excl. 1st token)",
    "Mean TPOT (ms):",
    "Median TPOT (ms):",
    "P99 TPOT (ms):",
    "Inter-token Latency",
    "Mean ITL (ms):",
    "Median ITL (ms):",
    "P99 ITL (ms):",
]

JSON_KEYS = {
    "backend", "base_url", "model", "dataset_name", "num_prompts", "random_input_len", "random_output_len",
    "random_range_ratio", "request_rate", "max_concurrency", "seed", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "error_summary", "input_lens", "output_lens", "ttfts", "itls",
    "latencies", "errors",
}  # fmt: skip


def _table_value(out: str, label: str) -> str:
    for line in out.splitlines():
        if line.startswith(label):
            return line[len(label) :].strip()
    raise AssertionError(f"no line {label!r} in:\n{out}")


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_main_prints_table_and_writes_json(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    out_file = tmp_path / "res" / "bench.jsonl"
    argv = _args(server, "--backend", backend, "--output-file", str(out_file), "--random-range-ratio", "1")
    assert bs.main(argv) == 0
    out = capsys.readouterr().out
    for label in TABLE_LABELS:
        assert label in out, label
    assert _table_value(out, "Backend:") == backend
    assert _table_value(out, "Traffic request rate:") == "inf"
    assert _table_value(out, "Max request concurrency:") == "not set"
    assert _table_value(out, "Successful requests:") == "6"
    assert _table_value(out, "Failed requests:") == "0"
    assert _table_value(out, "Total input tokens:") == str(6 * 32)
    assert _table_value(out, "Total generated tokens:") == str(6 * 8)
    assert float(_table_value(out, "Mean TTFT (ms):")) > 0
    assert float(_table_value(out, "Mean ITL (ms):")) > 0

    # the requests: model from /v1/models, and the benchmark's sampling settings (plus one warmup request)
    bodies = server.state.bodies
    assert len(bodies) == 7
    for body in bodies:
        assert body["model"] == FAKE_MODEL
        assert body["temperature"] == 0 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert ("messages" in body) == (backend == "openai-chat")
    assert [b["max_tokens"] for b in bodies[1:]] == [8] * 6

    lines = out_file.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert set(record) >= JSON_KEYS
    assert record["server_args"] is None  # a server without plugserve's /server_info
    assert record["backend"] == backend and record["model"] == FAKE_MODEL and record["request_rate"] == "inf"
    assert record["completed"] == 6 and record["total_output_tokens"] == 48
    assert record["input_lens"] == [32] * 6 and record["output_lens"] == [8] * 6
    assert all(len(itl) == 7 for itl in record["itls"])
    assert all(0 < t < lat for t, lat in zip(record["ttfts"], record["latencies"], strict=True))
    assert record["errors"] == [""] * 6
    # a second run appends a line
    assert bs.main([*argv, "--warmup-requests", "0"]) == 0
    assert len(out_file.read_text().splitlines()) == 2


def test_max_concurrency_respected(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.state.chunk_sleep = 0.005
    assert bs.main(_args(server, "--max-concurrency", "2", "--num-prompts", "8", "--warmup-requests", "0")) == 0
    assert server.state.max_in_flight == 2
    assert _table_value(capsys.readouterr().out, "Max request concurrency:") == "2"
    server.state.reset()
    assert bs.main(_args(server, "--num-prompts", "8", "--warmup-requests", "0")) == 0
    assert server.state.max_in_flight > 2  # without the cap they overlap


def test_request_rate_respected(server: FakeServer, tokenizer: Any) -> None:
    reqs = bs.sample_random_requests(tokenizer, 10, 16, 4, 1.0, seed=0)
    rate, seed = 40.0, 5
    schedule = bs.arrival_times(len(reqs), rate, seed)
    results, duration = asyncio.run(
        bs.run_requests(
            reqs, api_url=server.base_url + "/v1/completions", backend="openai-completions", model="m",
            request_rate=rate, seed=seed,
        )
    )  # fmt: skip
    assert all(r.success for r in results)
    for r, at in zip(results, schedule, strict=True):
        assert r.start_time >= at - 0.002
        assert r.start_time < at + 0.25
    assert duration >= schedule[-1]
    arrivals = server.state.arrivals
    assert arrivals[-1] - arrivals[0] >= schedule[-1] - 0.01


def test_failures_are_counted_not_fatal(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = bs.build_requests

    def with_failures(args: Any, tok: Any) -> list[Any]:
        reqs = real(args, tok)
        for r in reqs[1::3]:
            r.prompt = FAIL_MARKER + r.prompt
        return reqs

    monkeypatch.setattr(bs, "build_requests", with_failures)
    out_file = tmp_path / "b.jsonl"
    assert bs.main(_args(server, "--output-file", str(out_file))) == 0
    out = capsys.readouterr().out
    assert _table_value(out, "Successful requests:") == "4"
    assert _table_value(out, "Failed requests:") == "2"
    assert "2 request(s) failed:" in out and "2 x HTTP 400" in out and "bad prompt marker" in out
    record = json.loads(out_file.read_text())
    assert record["failed"] == 2 and record["completed"] == 4
    assert [bool(e) for e in record["errors"]] == [False, True, False, False, True, False]
    assert list(record["error_summary"].values()) == [2]


def test_connection_error_is_a_failed_result(tokenizer: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    reqs = bs.sample_random_requests(tokenizer, 3, 8, 4, 1.0, seed=0)
    results, _ = asyncio.run(
        bs.run_requests(
            reqs, api_url=f"http://127.0.0.1:{port}/v1/completions", backend="openai-completions", model="m"
        )
    )
    assert [r.success for r in results] == [False] * 3
    assert all("ConnectError" in r.error for r in results)
    m = bs.compute_metrics(results, 1.0)
    assert m["failed"] == 3 and m["completed"] == 0


def test_output_tokens_counted_by_tokenizer_without_usage(server: FakeServer, tokenizer: Any) -> None:
    server.state.send_usage = False
    reqs = bs.sample_random_requests(tokenizer, 2, 8, 5, 1.0, seed=0)
    for backend, path in bs.BACKENDS.items():
        results, _ = asyncio.run(
            bs.run_requests(reqs, api_url=server.base_url + path, backend=backend, model="m", api_key="sekret")
        )
        assert all(r.success and r.usage_output_len is None for r in results)
        bs.count_output_tokens(results, tokenizer)
        expected = len(tokenizer.encode(PIECE * 5, add_special_tokens=False))
        assert [r.output_len for r in results] == [expected] * 2
        assert all(r.generated_text == PIECE * 5 and len(r.itl) == 4 for r in results)
    assert all(h.get("authorization") == "Bearer sekret" for h in server.state.headers)


def test_main_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bs.main(["--dataset-name", "sharegpt"])
    assert exc.value.code == 2
    assert "random" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.main(["--backend", "tgi"])
    assert "openai-completions" in capsys.readouterr().err


def test_main_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bs.main(["--host", "127.0.0.1", "--port", str(port), "--num-prompts", "1", "--disable-tqdm"]) == 1
    assert "/v1/models" in capsys.readouterr().err


def test_base_url_resolution() -> None:
    parser = bs.build_parser()
    assert bs.resolve_base_url(parser.parse_args([])) == "http://127.0.0.1:30000"
    assert bs.resolve_base_url(parser.parse_args(["--host", "h", "--port", "8000"])) == "http://h:8000"
    assert bs.resolve_base_url(parser.parse_args(["--base-url", "http://x:1/v1/"])) == "http://x:1"


def test_json_schema_flag_builds_each_backends_field(tmp_path) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    chat = bs.json_schema_body("openai-chat", json.dumps(schema))
    assert chat == {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert json.loads(bs.json_schema_body("openai-completions", f"@{path}")["json_schema"]) == schema
    with pytest.raises(ValueError):
        bs.json_schema_body("openai-chat", "[1]")
