"""Online serving benchmark for any OpenAI-compatible HTTP server, in the spirit of ``python -m sglang.bench_serving``.

It sends streaming ``/v1/completions`` (``--backend openai-completions``) or ``/v1/chat/completions``
(``--backend openai-chat``) requests built from random token ids, at a Poisson request rate (or all at once) and
optionally under a concurrency cap, and prints SGLang's ``Serving Benchmark Result`` table: throughputs,
end-to-end latency, time to first token (TTFT), time per output token (TPOT) and inter-token latency (ITL). Because it
only speaks the OpenAI protocol it measures plugserve and its peers (SGLang, vLLM) alike.

Usage::

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 --num-prompts 200 \\
        --request-rate 8 --max-concurrency 64 --output-file results.jsonl

Notes on what is measured:

- Input lengths count the prompt text's tokens without special tokens (no bos, no chat template), as SGLang does;
  the prompt is built so that re-encoding it gives the drawn length where the tokenizer allows (the reported
  lengths are always the re-encoded counts).
- Output lengths come from the server's ``usage`` (``stream_options.include_usage``); when a server sends none they
  are counted by encoding the generated text with ``--tokenizer``.
- Any server configuration is measured alike (tensor, expert parallelism...: the server's own flags); from a plugserve
  server the JSON record keeps its launch flags (``server_args``, from ``GET /server_info``) beside the results.
- TTFT runs from sending the request to the first chunk with non-empty text; ITLs are the gaps between successive
  non-empty chunks (a chunk holding several tokens is one gap, as in SGLang's default); E2E latency runs to the end of
  the stream. TPOT = (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

BACKENDS: dict[str, str] = {
    "openai-completions": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
"""Backend name -> the endpoint path it posts to."""

DATASETS: tuple[str, ...] = ("random",)
"""The datasets --dataset-name accepts."""

DEFAULT_BASE_URL = "http://127.0.0.1:30000"

_ERROR_CHARS = 300
"""Error messages are cut to this many characters."""


@dataclass
class BenchRequest:
    """One request to send: the prompt, its token count and the number of tokens to generate (``max_tokens``)."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What one request measured. Times are in seconds; ``start_time`` is relative to the benchmark's start."""

    prompt_len: int = 0
    max_tokens: int = 0
    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    output_len: int = 0
    """Output tokens: the server's ``usage.completion_tokens`` when it sent one, else the tokenizer's count."""
    usage_output_len: int | None = None
    """``usage.completion_tokens`` as the server reported it, None when it sent no usage."""
    usage_prompt_len: int | None = None
    """``usage.prompt_tokens`` as the server reported it (it includes bos and any chat template), or None."""
    retokenized_output_len: int | None = None
    """The tokenizer's count of ``generated_text`` (filled in by `count_output_tokens`)."""


# --------------------------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------------------------


def random_lengths(full_len: int, range_ratio: float, num: int, rng: random.Random) -> list[int]:
    """Draw `num` lengths uniformly from the integers in [max(int(full_len * range_ratio), 1), full_len], as SGLang.

    Raises ValueError when `full_len` < 1 or `range_ratio` is outside [0, 1].
    """
    if full_len < 1:
        raise ValueError(f"length must be at least 1, got {full_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full_len * range_ratio), 1)
    return [rng.randint(low, full_len) for _ in range(num)]


def prompt_token_pool(tokenizer: Any) -> list[int]:
    """Token ids suitable for random prompts: ordinary vocabulary tokens that decode alone to clean text.

    Special and added tokens (bos, chat-template markers) and byte fragments that decode to U+FFFD are left out, so
    decoded prompts re-encode predictably.
    """
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    candidates = sorted(i for i in set(tokenizer.get_vocab().values()) if i not in excluded)
    texts = tokenizer.batch_decode([[i] for i in candidates], clean_up_tokenization_spaces=False)
    pool = [i for i, text in zip(candidates, texts, strict=True) if text and "\ufffd" not in text]
    if not pool:
        raise ValueError("the tokenizer has no ordinary tokens to build random prompts from")
    return pool


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


def make_random_prompt(
    tokenizer: Any, target_len: int, pool: Sequence[int], rng: random.Random, max_rounds: int = 16
) -> tuple[str, int]:
    """Decode `target_len` random token ids to text and adjust it until it re-encodes to `target_len` tokens.

    Decoding and re-encoding merges or splits tokens at the seams, so the ids are cut back (too many) or topped up
    with more random ids (too few) and decoded again, for at most `max_rounds` rounds. Returns the prompt and its
    actual token count (without special tokens), which is `target_len` unless the rounds ran out.
    """
    ids = [rng.choice(pool) for _ in range(target_len)]
    text = _decode(tokenizer, ids)
    for _ in range(max_rounds):
        ids = _encode(tokenizer, text)
        if len(ids) == target_len:
            return text, target_len
        ids = (
            ids[:target_len]
            if len(ids) > target_len
            else ids + [rng.choice(pool) for _ in range(target_len - len(ids))]
        )
        text = _decode(tokenizer, ids)
    return text, len(_encode(tokenizer, text))


def sample_random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """Build the ``random`` dataset: `num_prompts` prompts of random tokens.

    Input and output lengths are drawn uniformly in [range_ratio * len, len] (see `random_lengths`); each prompt is
    random token ids decoded to text and adjusted to re-encode to its drawn length; ``prompt_len`` is the actual
    re-encoded count. The same seed gives the same requests.
    """
    rng = random.Random(seed)
    input_lens = random_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = random_lengths(output_len, range_ratio, num_prompts, rng)
    pool = prompt_token_pool(tokenizer)
    requests: list[BenchRequest] = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        prompt, actual = make_random_prompt(tokenizer, in_len, pool, rng)
        requests.append(BenchRequest(prompt=prompt, prompt_len=actual, output_len=out_len))
    return requests


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    """The request list for the dataset `args.dataset_name` names (only ``random`` exists)."""
    if args.dataset_name != "random":
        raise ValueError(f"unknown dataset {args.dataset_name!r}; choices: {', '.join(DATASETS)}")
    return sample_random_requests(
        tokenizer,
        num_prompts=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
    )


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `num` requests at `request_rate` req/s.

    With an infinite rate every request is sent at 0; otherwise gaps are exponential with mean 1 / rate (a Poisson
    process, as SGLang's ``--request-rate``), drawn from a generator seeded by `seed`. The first request goes at 0.
    """
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(request_rate)
        times.append(now)
    return times


# --------------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------------


def request_payload(backend: str, model: str, request: BenchRequest, extra_body: dict[str, Any]) -> dict[str, Any]:
    """The JSON body of one streaming request: greedy, ``max_tokens`` = the drawn output length, ``ignore_eos``."""
    payload: dict[str, Any] = {"model": model}
    if backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update(
        {
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    payload.update(extra_body)
    return payload


def _chunk_text(backend: str, data: dict[str, Any]) -> str:
    """The generated text one streamed chunk carries ('' for a usage-only chunk)."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if backend == "openai-chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _ERROR_CHARS else message[: _ERROR_CHARS - 3] + "..."


async def send_request(
    client: httpx.AsyncClient,
    api_url: str,
    backend: str,
    model: str,
    request: BenchRequest,
    headers: dict[str, str],
    extra_body: dict[str, Any],
    t0: float,
) -> RequestResult:
    """Send one streaming request and time it; never raises (a failure is a result with ``success`` False)."""
    result = RequestResult(prompt_len=request.prompt_len, max_tokens=request.output_len)
    payload = request_payload(backend, model, request, extra_body)
    st = time.perf_counter()
    result.start_time = st - t0
    last = st
    text_parts: list[str] = []
    try:
        async with client.stream("POST", api_url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = _short(f"HTTP {response.status_code}: {body}")
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                chunk = line[len("data:") :].strip()
                if chunk == "[DONE]":
                    break
                data = json.loads(chunk)
                if data.get("error"):
                    raise RuntimeError(f"error in stream: {data['error']}")
                text = _chunk_text(backend, data)
                if text:
                    now = time.perf_counter()
                    if not text_parts:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    text_parts.append(text)
                usage = data.get("usage")
                if usage:
                    if usage.get("completion_tokens") is not None:
                        result.usage_output_len = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        result.usage_prompt_len = int(usage["prompt_tokens"])
        result.latency = time.perf_counter() - st
        if not text_parts:
            result.ttft = result.latency
        result.generated_text = "".join(text_parts)
        if result.usage_output_len is not None:
            result.output_len = result.usage_output_len
        result.success = True
    except Exception as exc:  # a failed request is a result, never the end of the run
        result.error = _short(f"{type(exc).__name__}: {exc}")
    return result


async def run_requests(
    requests: Sequence[BenchRequest],
    *,
    api_url: str,
    backend: str,
    model: str,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    extra_body: dict[str, Any] | None = None,
    warmup_requests: int = 0,
    disable_tqdm: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send `requests` at `request_rate` (Poisson, seeded; inf = all at once) under a `max_concurrency` semaphore.

    `warmup_requests` copies of the first request (at most 32 output tokens) go first and are not measured. Returns
    the results in the order of `requests` and the benchmark's duration in seconds (first send to last completion).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choices: {', '.join(BACKENDS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    extra = dict(extra_body or {})
    schedule = arrival_times(len(requests), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False) as client:
        if warmup_requests > 0 and requests:
            first = requests[0]
            warm = BenchRequest(first.prompt, first.prompt_len, min(first.output_len, 32))
            warm_results = await asyncio.gather(
                *(
                    send_request(client, api_url, backend, model, warm, headers, extra, time.perf_counter())
                    for _ in range(warmup_requests)
                )
            )
            if not any(r.success for r in warm_results):
                print(f"warning: every warmup request failed: {warm_results[0].error}", file=sys.stderr)

        pbar = _progress_bar(len(requests), disable_tqdm)
        t0 = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                result = await send_request(client, api_url, backend, model, request, headers, extra, t0)
            else:
                async with semaphore:
                    result = await send_request(client, api_url, backend, model, request, headers, extra, t0)
            pbar.update(1)
            return result

        try:
            results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, schedule, strict=True)))
        finally:
            pbar.close()
        duration = time.perf_counter() - t0
    return list(results), duration


def _progress_bar(total: int, disable: bool) -> Any:
    """A tqdm bar over completed requests (a do-nothing stand-in when tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers

        class _NoBar:
            def update(self, n: int = 1) -> None:
                pass

            def close(self) -> None:
                pass

        return _NoBar()
    return tqdm(total=total, disable=disable, desc="requests", unit="req")


def count_output_tokens(results: Sequence[RequestResult], tokenizer: Any | None) -> None:
    """Fill in ``retokenized_output_len`` and, where the server sent no usage, ``output_len`` from the tokenizer."""
    for r in results:
        if not r.success:
            continue
        if tokenizer is not None:
            r.retokenized_output_len = len(_encode(tokenizer, r.generated_text)) if r.generated_text else 0
        if r.usage_output_len is None:
            r.output_len = r.retokenized_output_len if r.retokenized_output_len is not None else len(r.itl) + 1


# --------------------------------------------------------------------------------------------------------------------
# Metrics and report
# --------------------------------------------------------------------------------------------------------------------


def _stats(values: Sequence[float], prefix: str, out: dict[str, float], p95: bool = False) -> None:
    """mean/median/std/p99 (and p95, max) of `values` in ms into `out` under ``{stat}_{prefix}_ms``; 0 when empty."""
    arr = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    out[f"mean_{prefix}_ms"] = float(np.mean(arr))
    out[f"median_{prefix}_ms"] = float(np.median(arr))
    out[f"std_{prefix}_ms"] = float(np.std(arr))
    if p95:
        out[f"p95_{prefix}_ms"] = float(np.percentile(arr, 95))
    out[f"p99_{prefix}_ms"] = float(np.percentile(arr, 99))
    if p95:
        out[f"max_{prefix}_ms"] = float(np.max(arr))


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The benchmark's metrics from per-request results and the run's duration (a pure function).

    Only successful requests count toward tokens and latencies (as SGLang). Throughputs divide by `duration_s`;
    concurrency = sum of E2E latencies / duration; TPOT = (E2E - TTFT) / (output tokens - 1) per request with more
    than one output token; percentiles interpolate linearly (numpy's default). Latencies are in ms.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    retok = [r.retokenized_output_len for r in ok]
    total_retok = sum(x for x in retok if x is not None) if ok and all(x is not None for x in retok) else None
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2e = [r.latency for r in ok]
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_output_tokens_retokenized": total_retok,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": total_input / duration_s,
        "output_throughput": total_output / duration_s,
        "total_throughput": (total_input + total_output) / duration_s,
        "concurrency": sum(e2e) / duration_s,
    }
    _stats(e2e, "e2e_latency", metrics)
    _stats([r.ttft for r in ok], "ttft", metrics)
    _stats(tpots, "tpot", metrics)
    _stats(itls, "itl", metrics, p95=True)
    metrics["error_summary"] = dict(Counter(r.error for r in failed).most_common())
    return metrics


def format_rate(request_rate: float) -> str:
    """A request rate as the table and the JSON show it ('inf' for all at once)."""
    return "inf" if math.isinf(request_rate) else f"{request_rate:g}"


def format_report(metrics: dict[str, Any], backend: str, request_rate: float, max_concurrency: int | None) -> str:
    """SGLang's ``Serving Benchmark Result`` table for `metrics` (what `compute_metrics` returns)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, spec: str = "<10.2f") -> None:
        lines.append(f"{label:<40} {value:{spec}}")

    row("Backend:", backend, "<10")
    row("Traffic request rate:", format_rate(request_rate), "<10")
    row("Max request concurrency:", max_concurrency if max_concurrency else "not set", "<10")
    row("Successful requests:", metrics["completed"], "<10")
    row("Failed requests:", metrics["failed"], "<10")
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"], "<10")
    row("Total generated tokens:", metrics["total_output_tokens"], "<10")
    if metrics.get("total_output_tokens_retokenized") is not None:
        row("Total generated tokens (retokenized):", metrics["total_output_tokens_retokenized"], "<10")
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Input token throughput (tok/s):", metrics["input_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_throughput"])
    row("Concurrency:", metrics["concurrency"])
    sections = [
        ("End-to-End Latency", "E2E Latency", "e2e_latency"),
        ("Time to First Token", "TTFT", "ttft"),
        ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
        ("Inter-token Latency", "ITL", "itl"),
    ]
    for title, name, key in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name} (ms):", metrics[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", metrics[f"median_{key}_ms"])
        row(f"P99 {name} (ms):", metrics[f"p99_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(metrics: dict[str, Any], limit: int = 10) -> str:
    """A summary of the failed requests' error messages, most frequent first ('' when none failed)."""
    summary: dict[str, int] = metrics.get("error_summary") or {}
    if not summary:
        return ""
    lines = [f"{metrics['failed']} request(s) failed:"]
    for message, count in list(summary.items())[:limit]:
        lines.append(f"  {count} x {message}")
    if len(summary) > limit:
        lines.append(f"  ... and {len(summary) - limit} other error message(s)")
    return "\n".join(lines)


def result_record(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    metrics: dict[str, Any],
    results: Sequence[RequestResult],
    server_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON object written to ``--output-file``: config (with the server's launch flags where it says them),
    metrics and per-request lists."""
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        # configuration
        "backend": args.backend,
        "base_url": base_url,
        "model": model,
        "tokenizer": str(args.tokenizer) if args.tokenizer else None,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "warmup_requests": args.warmup_requests,
        "extra_request_body": args.extra_request_body_dict,
        "server_args": server_args,
        # results
        **metrics,
        # per request, in send order
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "max_tokens": [r.max_tokens for r in results],
        "server_input_lens": [r.usage_prompt_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "successes": [r.success for r in results],
        "errors": [r.error for r in results],
    }


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def json_schema_body(backend: str, schema: str) -> dict[str, Any]:
    """The request fields that constrain the output to `schema` (a JSON object as text, or @FILE holding one)."""
    if schema.startswith("@"):
        with open(schema[1:]) as f:
            schema = f.read()
    parsed = json.loads(schema)
    if not isinstance(parsed, dict):
        raise ValueError("a JSON schema is a JSON object")
    if backend == "openai-chat":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": parsed}}}
    return {"json_schema": json.dumps(parsed)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="bench_serving",
        description="Benchmark the online serving throughput and latency of an OpenAI-compatible server.",
    )
    p.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default="openai-completions",
        help="openai-completions: POST /v1/completions; openai-chat: POST /v1/chat/completions",
    )
    p.add_argument("--base-url", default=None, help=f"server URL (default: http://HOST:PORT, i.e. {DEFAULT_BASE_URL})")
    p.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    p.add_argument("--port", type=int, default=30000, help="server port, when --base-url is not given")
    p.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument(
        "--tokenizer", default=None, help="local tokenizer directory (default: plugserve's embedded model's tokenizer)"
    )
    p.add_argument("--dataset-name", choices=DATASETS, default="random", help="dataset (only 'random')")
    p.add_argument("--random-input-len", type=int, default=1024, help="input tokens per request (the maximum)")
    p.add_argument("--random-output-len", type=int, default=1024, help="output tokens per request (the maximum)")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are drawn uniformly in [ratio * len, len]; 1 gives exact lengths",
    )
    p.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=1, help="seed of the dataset and the arrival times")
    p.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument(
        "--extra-request-body",
        default=None,
        metavar="'{\"key\": value}'",
        help="JSON object merged into every request body",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="'{...}' | @FILE",
        help="constrain every output to this JSON schema (structured output): response_format json_schema with "
        "openai-chat, SGLang's json_schema field with openai-completions; a request ends when its JSON does",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    p.add_argument("--output-file", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def resolve_base_url(args: argparse.Namespace) -> str:
    """The server's root URL: --base-url (without a trailing / or /v1), else http://HOST:PORT."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        return url.removesuffix("/v1")
    return f"http://{args.host}:{args.port}"


def fetch_model_id(base_url: str, api_key: str | None) -> str:
    """The first model id of ``GET {base_url}/v1/models``. Raises RuntimeError when there is none or it fails."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"cannot list the models at {base_url}/v1/models: {exc}") from exc
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def fetch_server_args(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The launch flags of a plugserve server (``GET {base_url}/server_info``'s ``args``: --tp-size, --ep-size...),
    None from a server without that endpoint."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/server_info", headers=headers, timeout=30.0, trust_env=False)
        response.raise_for_status()
        args = response.json().get("args")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return args if isinstance(args, dict) else None


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """Load the tokenizer in directory `path` (default: plugserve's embedded one) offline; returns it and its path."""
    if path is None:
        try:
            from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
        except ImportError as exc:
            raise RuntimeError(
                "plugserve is not importable here, so there is no default tokenizer; pass --tokenizer"
            ) from exc
        path = str(EMBEDDED_MODEL_DIR)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot load the tokenizer {path!r}: {exc}") from exc
    return tokenizer, path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 when no request succeeded (2 for bad arguments, via argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.random_input_len < 1 or args.random_output_len < 1:
        parser.error("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("--random-range-ratio must be in [0, 1]")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    try:
        extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    except json.JSONDecodeError as exc:
        parser.error(f"--extra-request-body is not JSON: {exc}")
    if not isinstance(extra, dict):
        parser.error("--extra-request-body must be a JSON object")
    if args.json_schema:
        try:
            extra.update(json_schema_body(args.backend, args.json_schema))
        except (OSError, ValueError) as exc:
            parser.error(f"--json-schema: {exc}")
    args.extra_request_body_dict = extra

    try:
        tokenizer, args.tokenizer = load_tokenizer(args.tokenizer)
    except RuntimeError as exc:
        parser.error(str(exc))
    base_url = resolve_base_url(args)
    api_url = base_url + BACKENDS[args.backend]
    try:
        model = args.model or fetch_model_id(base_url, args.api_key)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    print(f"benchmark: backend={args.backend} url={api_url} model={model} tokenizer={args.tokenizer}")
    requests = build_requests(args, tokenizer)
    print(f"#Input tokens: {sum(r.prompt_len for r in requests)}")
    print(f"#Output tokens: {sum(r.output_len for r in requests)}")

    results, duration = asyncio.run(
        run_requests(
            requests,
            api_url=api_url,
            backend=args.backend,
            model=model,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            api_key=args.api_key,
            extra_body=extra,
            warmup_requests=args.warmup_requests,
            disable_tqdm=args.disable_tqdm,
        )
    )
    count_output_tokens(results, tokenizer)
    metrics = compute_metrics(results, duration)

    errors = format_errors(metrics)
    if errors:
        print(errors)
    print()
    print(format_report(metrics, args.backend, args.request_rate, args.max_concurrency))

    if args.output_file:
        record = result_record(args, base_url, model, metrics, results, fetch_server_args(base_url, args.api_key))
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
