"""SGLang's and vLLM's service endpoints beside the OpenAI API: liveness through a real generation, model and
server information, the prefix cache's flush, tokenize / detokenize and the version. An APIRouter the app includes;
each endpoint finds the engine on `request.app.state.engine`."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ConfigDict, PositiveInt, StrictBool, StrictStr

from plugserve import __version__
from plugserve.registry import get_registry
from plugserve.runtime.engine import Engine, EngineStopped
from plugserve.runtime.profiler import ProfileError
from plugserve.runtime.request import FinishReason
from plugserve.runtime.sampling import SamplingParams
from plugserve.server.protocol import RequestBody, TokenId, error_body
from plugserve.server.responses import GATE, errors, text

router = APIRouter()
# The prompt of /health_generate: one token generated from it proves a forward runs end to end.
HEALTH_PROMPT = "Hello"
FLUSH_REFUSED = ("Cache not flushed: requests are queued or running (the prefix cache is flushed only when the server "
                 "is idle).")
FLUSH_RESPONSES = {200: text("text/plain", "Cache flushed."), 400: text("text/plain", FLUSH_REFUSED),
                   **errors(401, 413, 503)}


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@router.get("/health_generate", responses=errors(*GATE))
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation ran; 503 with why otherwise."""
    engine = _engine(request)
    try:
        async for output in engine.stream_async(HEALTH_PROMPT, SamplingParams(max_new_tokens=1, temperature=0)):
            if output.finished and output.finish_reason is FinishReason.ERROR:
                return JSONResponse(error_body(f"generation failed: {output.error}", "internal_error", code=503), 503)
    except EngineStopped as exc:
        return JSONResponse(error_body(str(exc), "internal_error", code=503), 503)
    return JSONResponse({"status": "ok"})


@router.get("/get_model_info", responses=errors(*GATE))
async def get_model_info(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    return {"model_path": engine.args.model_dir or engine.args.model_preset, "tokenizer_path":
            engine.args.tokenizer_path or engine.args.model_dir, "served_model_name": engine.model_name,
            "is_generation": True, "max_model_len": engine.runner.context_length}


@router.get("/server_info", responses=errors(*GATE))
@router.get("/get_server_info", responses=errors(*GATE))
async def server_info(request: Request) -> dict[str, Any]:
    """The launch flags and what they resolved to: model, hardware, backends, graphs, scheduling."""
    engine = _engine(request)
    runner = engine.runner
    return {
        "version": __version__,
        "args": engine.args.model_dump(),
        "model": dataclasses.asdict(runner.config),
        "hardware": dataclasses.asdict(runner.hardware),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "page_size": runner.page_size,
        "max_total_tokens": runner.max_total_tokens,
        "max_total_num_tokens": runner.max_total_tokens,  # SGLang's name
        "context_length": runner.context_length,
        "backends": [dataclasses.asdict(c) for c in runner.backends.chosen],
        "kernels": {f"{c.kind}:{c.name}": get_registry().kernels(c.kind, c.name, runner.hardware)
                    for c in runner.backends.chosen},
        "by_rows": runner.backends.by_rows,
        "cuda_graph": runner.graphs.status,
        "all_reduce": runner.all_reduce_status,
        "overlap_schedule": engine.scheduler.overlap_status,
        "speculative": speculative_info(engine),
        "shared_experts": runner.backends.shared_experts_mode,
        "torch_compile": (f"small ops compiled up to {engine.args.compile_max_bs} rows"
                          if engine.args.enable_torch_compile else "off"),
        "ready": engine.ready.is_set(),
        "broken_plugins": [dataclasses.asdict(b) for b in get_registry().broken],
    }


def speculative_info(engine: Engine) -> dict[str, Any] | None:
    """The speculative-decoding settings and the mean accept length so far (None: speculation is off)."""
    spec, worker = engine.args.speculative, engine.scheduler.spec
    if spec is None or worker is None:
        return None
    return dataclasses.asdict(spec) | {"accept_length": worker.accept_length}


@router.post("/flush_cache", response_class=PlainTextResponse, responses=FLUSH_RESPONSES)
@router.get("/flush_cache", response_class=PlainTextResponse, responses=FLUSH_RESPONSES)
async def flush_cache(request: Request) -> Response:
    """SGLang's answer: 200 "Cache flushed." when idle, else 400 and the cache is left as it is."""
    if await asyncio.to_thread(_engine(request).flush_cache):  # waits for the scheduler thread: off the event loop
        return PlainTextResponse("Cache flushed.")
    return PlainTextResponse(FLUSH_REFUSED, 400)


class ProfileRequest(RequestBody):
    """SGLang's /start_profile body. activities: "CPU" (host ops), "GPU" (kernels), "MEM" (allocations)."""

    model_config = ConfigDict(extra="forbid")

    output_dir: StrictStr | None = None
    num_steps: PositiveInt | None = None
    activities: list[Literal["CPU", "GPU", "MEM"]] | None = None
    record_shapes: StrictBool = False
    with_stack: StrictBool = False


PROFILE_RESPONSES = {200: text("text/plain", "Profiling started, or stopped with the files it wrote."),
                     **errors(400, 401, 413, 503)}


@router.post("/start_profile", response_class=PlainTextResponse, responses=PROFILE_RESPONSES)
async def start_profile(request: Request, body: ProfileRequest | None = None) -> Response:
    """Torch's profiler over the next `num_steps` scheduler steps, or until /stop_profile (runtime/profiler.py);
    the trace and a table of ops by self time go to `output_dir` (default $SGLANG_TORCH_PROFILER_DIR, else /tmp)."""
    body = body or ProfileRequest()
    activities = tuple(dict.fromkeys(body.activities)) if body.activities else None
    try:
        await asyncio.to_thread(_engine(request).start_profile, body.output_dir, body.num_steps, activities,
                                body.record_shapes, body.with_stack)
    except ProfileError as exc:
        return JSONResponse(error_body(str(exc), code=400), 400)
    return PlainTextResponse("Start profiling.")


@router.post("/stop_profile", response_class=PlainTextResponse, responses=PROFILE_RESPONSES)
async def stop_profile(request: Request) -> Response:
    try:
        files = await asyncio.to_thread(_engine(request).stop_profile)
    except ProfileError as exc:
        return JSONResponse(error_body(str(exc), code=400), 400)
    return PlainTextResponse(f"Stop profiling. {files.steps} steps: trace {files.trace}, table {files.table}")


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[TokenId]
    skip_special_tokens: StrictBool = False


@router.post("/v1/tokenize", responses=errors(400, *GATE))
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """SGLang's and vLLM's shape: the ids, their count and the context length."""
    engine = _engine(request)
    # Off the event loop: a long prompt takes seconds to tokenize.
    ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.runner.context_length}


@router.post("/v1/detokenize", responses=errors(400, *GATE))
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    engine = _engine(request)
    vocab = len(engine.tokenizer)
    bad = [i for i, t in enumerate(body.tokens) if t >= vocab]
    if bad:
        return JSONResponse(error_body(f"tokens.{bad[0]}: {body.tokens[bad[0]]} is not a token id (0 to {vocab - 1})",
                                       param=f"tokens.{bad[0]}", code=400), 400)
    text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens, skip_special_tokens=body.skip_special_tokens)
    return JSONResponse({"text": text})


@router.get("/version", responses=errors(*GATE))
async def version() -> dict[str, str]:
    return {"version": __version__}
