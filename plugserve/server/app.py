"""The FastAPI app: OpenAI-compatible completions and chat completions (streamed as server-sent events),
plugserve's native /generate, and /v1/models, /health, /metrics; SGLang's service endpoints come from native.py."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plugserve import __version__
from plugserve.runtime.engine import Engine, EngineStopped, GenerateResult
from plugserve.runtime.request import FinishReason, RequestOutput, TokenLogprob
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import flag
from plugserve.server import chat, native, prepare
from plugserve.server.offsets import TextOffsets
from plugserve.server.prepare import BadRequest, Job
from plugserve.server.protocol import (
    INVALID_UNICODE,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    new_id,
    now,
    usage,
)
from plugserve.server.responses import GATE, errors, json_or_events, text

# What answers before the engine is ready (the rest gets 503).
READY_FREE_PATHS = frozenset({"/health", "/metrics", "/server_info", "/get_server_info", "/get_model_info", "/version",
                              "/v1/models", "/docs", "/openapi.json"})


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="plugserve", version=__version__)
    app.state.engine = engine
    app.add_middleware(Gate, engine=engine)
    if engine.args.origins:  # added last, so outermost: a preflight is answered before the Gate asks for a key
        app.add_middleware(CORSMiddleware, allow_origins=engine.args.origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(native.router)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems, locs = [], []
        for e in exc.errors():
            if e["type"] == "json_invalid":
                problems.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
                continue
            loc = [str(p) for p in e["loc"] if p != "body"]
            if e["type"] == INVALID_UNICODE:  # the field's check names where inside it the string lies
                loc += [str(p) for p in e["ctx"]["at"]]
            locs.append(loc)
            problems.append(f"{'.'.join(loc)}: {e['msg']}" if loc else e["msg"])
        return JSONResponse(error_body("; ".join(problems), param=_field_of(locs), code=400), 400)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "internal_error"
        return JSONResponse(error_body(exc.message, kind, exc.param, exc.code or exc.status), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        """A bug: a JSON 500 like every other error, not Starlette's plain text. Starlette re-raises the exception
        after this response (uvicorn logs it) and uvicorn then drops the connection: `Connection: close` tells the
        client so, which would otherwise send its next request on a dead keep-alive connection."""
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, "internal_error", code=500), 500, headers={"Connection": "close"})

    @app.get("/health", responses=errors(413, 503))
    async def health() -> Response:
        if not _serving(engine):
            return _not_serving(engine)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses=errors(*GATE))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": now(),
                                             "owned_by": "plugserve", "max_model_len": engine.runner.context_length}]}

    @app.get("/metrics", response_class=Response,
             responses={200: text("text/plain", "Prometheus text"), **errors(*GATE)})
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses={200: json_or_events("The completion"), **errors(400, 404, *GATE)})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepare.check_model(engine, body.model)
        prepare.check_supported(body)
        if body.echo:
            raise BadRequest("echo is not supported", "echo")
        prompts = prepare.prompt_list(body.prompt)
        top = body.logprobs or 0
        # Off the event loop: a long prompt takes seconds to tokenize (the tokenizer releases the GIL).
        jobs = await asyncio.to_thread(prepare.make_jobs, engine, prompts, "prompt", body, body.max_tokens,
                                       body.logprobs is not None, top)
        rid, model = new_id("cmpl"), body.model or engine.model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_chunks(engine, jobs, rid, model, include_usage, body.n))
        results = await _run_all(engine, jobs, request)
        choices = [{"index": i, "text": r.text, "finish_reason": _reason(r), "logprobs": _completion_logprobs(
                    engine, r.logprobs, TextOffsets(engine, params).add(r.logprobs, len(r.text)))
                    if body.logprobs is not None else None}
                   for i, (r, (_, _, params)) in enumerate(zip(results, jobs, strict=True))]
        return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": model,
                             "choices": choices, "usage": _usage(results, len(prompts), body.n).model_dump()})

    @app.post("/v1/chat/completions",
              responses={200: json_or_events("The chat completion"), **errors(400, 404, *GATE)})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepare.check_model(engine, body.model)
        prepare.check_supported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        tools = prepare.tool_plan(engine, body)
        try:
            ids = await asyncio.to_thread(chat.prompt_ids, engine.tokenizer, body)
        except chat.ChatTemplateError as exc:
            raise BadRequest(str(exc), exc.field) from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # A tools plan's grammar, or the parser's tokens kept in the text (they are special tokens).
        overrides = ({"json_schema": tools.json_schema} if tools.json_schema else
                     {"skip_special_tokens": False} if tools.mode == "parse" else {})
        jobs = await asyncio.to_thread(prepare.make_jobs, engine, [ids], "messages", body, max_tokens, body.logprobs,
                                       body.top_logprobs or 0, overrides, "tools" if tools.json_schema else None)
        constrained = tools.json_schema is not None or body.grammar_json_schema() is not None
        output = chat.ChatOutput(engine.args.reasoning_parser is not None and not constrained, tools)
        rid, model = new_id("chatcmpl"), body.model or engine.model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_chunks(engine, jobs, rid, model, include_usage, body.n, output))
        results = await _run_all(engine, jobs, request)
        choices = []
        for i, r in enumerate(results):
            message, finish = output.message(r.text, _reason(r))
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": _chat_logprobs(engine, r.logprobs) if body.logprobs else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now(), "model": model,
                             "choices": choices, "usage": _usage(results, 1, body.n).model_dump()})

    @app.post("/generate", responses={200: json_or_events("The generation"), **errors(400, *GATE)})
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        params = body.sampling_params.to_params()
        field = "text" if body.text is not None else "input_ids"
        ids = await asyncio.to_thread(prepare.tokenize, engine, getattr(body, field), field)
        prepare.validate(params, len(ids), engine, prepare.generate_name)
        await asyncio.to_thread(prepare.compile_grammar, engine, params, prepare.generate_name)
        if params.n != 1:
            raise BadRequest("/generate takes n = 1; send several requests", "sampling_params.n")
        rid = body.rid or new_id("gen")
        if body.stream:
            return _sse(_generate_chunks(engine, ids, params, rid))
        result = (await _run_all(engine, [(0, ids, params)], request))[0]
        return JSONResponse(_generate_body(rid, result))

    return app


# -- request preparation -----------------------------------------------------------------------------


class Gate:
    """What every HTTP request passes first: the API key (but for /health), the body's size (a 413 past
    --max-request-body-bytes), then only the read-only endpoints until the engine has warmed up, and again once it
    is shutting down or dead. Plain ASGI, because Starlette's BaseHTTPMiddleware would keep a client's disconnect
    from the endpoints (which abort the client's requests on it)."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, key, headers = scope["path"], self.engine.args.api_key, dict(scope["headers"])
            if key and path != "/health" and not _authorized(headers.get(b"authorization", b""), key):
                body = error_body("invalid or missing API key", "authentication_error", code=401)
                await JSONResponse(body, 401)(scope, receive, send)
                return
            limit = self.engine.args.max_request_body_bytes
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > limit:
                await _too_large(limit)(scope, receive, send)
                return
            receive = _limited(receive, limit)
            if not _serving(self.engine) and path not in READY_FREE_PATHS:
                await _not_serving(self.engine)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive`, failing with a 413 once the body's bytes pass `limit` (a body sent without a Content-Length, or
    with a false one): FastAPI lets an HTTPException from the body's reading through, to `http_error`."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, _too_large_message(limit))
        return message

    return limited


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than {flag('max_request_body_bytes')} ({limit} bytes)"


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(_too_large_message(limit), code=413), 413)


def _authorized(authorization: bytes, key: str) -> bool:
    """Whether an Authorization header carries `key` as a bearer token (the scheme in any case, as RFC 7235 has
    it), compared in constant time."""
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


def _serving(engine: Engine) -> bool:
    return engine.ready.is_set() and engine.alive and engine.closing is None


def _not_serving(engine: Engine) -> JSONResponse:
    """503 with why: warming up (retry soon), warm-up failed, shutting down, or the scheduler has died."""
    retry = False
    if engine.warm_up_error is not None:
        message = f"warm-up failed: {engine.warm_up_error}"
    elif not engine.ready.is_set():
        message, retry = "the server is warming up (compiling kernels, capturing CUDA graphs)", engine.alive
    elif engine.error is not None:
        message = engine.error
    elif engine.closing is not None:
        message = engine.closing
    else:
        message = "the scheduler thread has stopped"
    headers = {"Retry-After": "5"} if retry else None
    return JSONResponse(error_body(message, "internal_error", code=503), 503, headers=headers)


def _field_of(locs: list[list[str]]) -> str | None:
    """The field of a validation error: where the first error is, less the member tags of a union (`prompt`, tried
    as each of its types, reports prompt.str, prompt.list[int].0, ...): the path its field's errors share."""
    same = [loc for loc in locs if loc[:1] == locs[0][:1]]
    shared = itertools.takewhile(lambda parts: len(set(parts)) == 1, zip(*same, strict=False))
    return ".".join(parts[0] for parts in shared) or None


# -- running -----------------------------------------------------------------------------------------


async def _merged(engine: Engine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come. Closing it (a client gone) aborts them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(index: int, ids: list[int], params: SamplingParams) -> None:
        stream = None
        try:
            stream = engine.stream_async(ids, params)
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:  # e.g. the engine shut down or died after the gate: an error, never silence
            error = str(exc) if isinstance(exc, EngineStopped) else f"{type(exc).__name__}: {exc}"
            await queue.put((index, RequestOutput("", "", [], [], True, FinishReason.ERROR, error=error)))
        finally:
            if stream is not None:
                await stream.aclose()
            await queue.put((index, None))  # always: _merged counts the jobs that ended

    tasks = [asyncio.create_task(pump(*job)) for job in jobs]
    try:
        remaining = len(tasks)
        while remaining:
            index, output = await queue.get()
            if output is None:
                remaining -= 1
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


async def _run_all(engine: Engine, jobs: list[Job], request: Request) -> list[GenerateResult]:
    """Every job to completion. A client that disconnects first has its jobs aborted (their KV freed)."""
    results = [GenerateResult() for _ in jobs]

    async def collect() -> None:
        async for index, output in _merged(engine, jobs):
            results[index].add(output)

    async def client_gone() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    run, watch = asyncio.create_task(collect()), asyncio.create_task(client_gone())
    try:
        await asyncio.wait([run, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (run, watch):
            task.cancel()  # closing _merged's generator aborts the jobs still running
        await asyncio.gather(run, watch, return_exceptions=True)
    if not run.done() or run.cancelled():
        raise BadRequest("the client disconnected", status=499)
    run.result()  # a job that failed to start (or a bug in collecting) is an error, not a partial answer
    failed = [r.error for r in results if r.finish_reason is FinishReason.ERROR]
    if failed:
        raise BadRequest(f"generation failed: {failed[0]}", status=500)
    if any(r.finish_reason is None for r in results):
        raise BadRequest("generation failed: a request ended without a finish reason", status=500)
    return results


def _reason(result: GenerateResult | RequestOutput) -> str | None:
    return None if result.finish_reason is None else str(result.finish_reason)


def _usage(results: Sequence[GenerateResult], num_prompts: int, n: int):
    # Each prompt is counted once, whatever n is.
    prompt = sum(r.prompt_tokens for r in results[::n])
    cached = sum(r.cached_tokens for r in results[::n])
    return usage(prompt, sum(r.completion_tokens for r in results), cached)


def _token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def _completion_logprobs(engine: Engine, logprobs: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    return {
        "tokens": [_token_text(engine, lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(engine, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(engine: Engine, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


# -- streaming ---------------------------------------------------------------------------------------


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _error_chunk(output: RequestOutput) -> dict[str, Any]:
    return error_body(f"generation failed: {output.error}", "internal_error", code=500)


async def _completion_chunks(engine: Engine, jobs: list[Job], rid: str, model: str, include_usage: bool, n: int
                             ) -> AsyncIterator[dict[str, Any]]:
    """Every token with logprobs gets its entry, in a chunk of its own step even when it adds no text yet (vLLM's
    way): a special token, or one held back by a partial character, used to lose it. A token that starts past
    the text sent so far (inside text held back as a possible stop string) waits for that text or the end: a
    stop string may cut it off, and its offset then is the returned text's end."""
    totals: dict[int, RequestOutput] = {}
    sent = [0] * len(jobs)
    offsets = [TextOffsets(engine, params) for _, _, params in jobs]
    held: list[list[tuple[TokenLogprob, int]]] = [[] for _ in jobs]  # entries whose offset passes `sent`
    async for index, output in _merged(engine, jobs):
        if output.finish_reason is FinishReason.ERROR:
            yield _error_chunk(output)
            return
        totals[index] = output
        sent[index] += len(output.text)
        entries = held[index] + list(zip(output.logprobs, offsets[index].add(output.logprobs, sys.maxsize),
                                         strict=True))
        ready = len(entries) if output.finished else next(
            (i for i, (_, offset) in enumerate(entries) if offset > sent[index]), len(entries))
        held[index] = entries[ready:]
        logprobs = None
        if jobs[index][2].logprobs:
            logprobs = _completion_logprobs(engine, [lp for lp, _ in entries[:ready]],
                                            [min(offset, sent[index]) for _, offset in entries[:ready]])
        if output.text or output.finished or (logprobs and ready):
            yield {"id": rid, "object": "text_completion", "created": now(), "model": model,
                   "choices": [{"index": index, "text": output.text, "logprobs": logprobs,
                                "finish_reason": _reason(output)}]}
    if include_usage:
        yield _usage_chunk(rid, "text_completion", model, n, totals)


async def _chat_chunks(engine: Engine, jobs: list[Job], rid: str, model: str, include_usage: bool, n: int,
                       output: chat.ChatOutput) -> AsyncIterator[dict[str, Any]]:
    """As `_completion_chunks`: a token's logprobs go out in its step's chunk, with or without text; the text goes
    out as content, reasoning_content and tool_calls deltas (`output`)."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs=None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for index, *_ in jobs:
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    totals: dict[int, RequestOutput] = {}
    streams = [output.stream() for _ in jobs]
    async for index, out in _merged(engine, jobs):
        if out.finish_reason is FinishReason.ERROR:
            yield _error_chunk(out)
            return
        totals[index] = out
        wants = jobs[index][2].logprobs
        logprobs = _chat_logprobs(engine, out.logprobs) if wants else None
        delta, finish = streams[index].feed(out.text, out.finished, _reason(out))
        if delta or out.finished or (wants and out.logprobs):
            yield chunk(index, delta, finish, logprobs)
    if include_usage:
        yield _usage_chunk(rid, "chat.completion.chunk", model, n, totals)


def _usage_chunk(rid: str, kind: str, model: str, n: int, totals: dict[int, RequestOutput]) -> dict[str, Any]:
    """Usage of the whole request: each prompt counted once, whatever n (its jobs are prompt-major)."""
    outputs = [totals[i] for i in sorted(totals)]
    info = usage(sum(o.prompt_tokens for o in outputs[::n]),
                 sum(o.completion_tokens for o in outputs), sum(o.cached_tokens for o in outputs[::n]))
    return {"id": rid, "object": kind, "created": now(), "model": model, "choices": [], "usage": info.model_dump()}


def _generate_body(rid: str, result: GenerateResult | RequestOutput, text: str | None = None,
                   ids: list[int] | None = None) -> dict[str, Any]:
    return {
        "text": result.text if text is None else text,
        "output_ids": result.token_ids if ids is None else ids,
        "meta_info": {"id": rid, "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                      "cached_tokens": result.cached_tokens, "finish_reason": _reason(result),
                      "matched_stop": result.matched_stop},
    }


async def _generate_chunks(engine: Engine, ids: list[int], params: SamplingParams, rid: str
                           ) -> AsyncIterator[dict[str, Any]]:
    """SGLang's /generate stream: every event carries the text and ids so far."""
    total = GenerateResult()
    async for _, output in _merged(engine, [(0, ids, params)]):
        if output.finish_reason is FinishReason.ERROR:
            yield _error_chunk(output)
            return
        total.add(output)
        yield _generate_body(rid, output, total.text, total.token_ids)
