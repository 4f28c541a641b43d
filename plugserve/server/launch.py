"""`plugserve serve`: flags -> ServerArgs -> Engine -> uvicorn. Flags are generated from ServerArgs, so
the two never drift; a bad value is a usage error naming the flag and the valid choices."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
import threading
import time
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING

import uvicorn
from pydantic import ValidationError

from plugserve.runtime import precompile
from plugserve.runtime.server_args import CHOICES, ServerArgs, describe_validation_error, flag

if TYPE_CHECKING:
    from plugserve.runtime.engine import Engine

logger = logging.getLogger(__name__)

HELP = {
    "model_path": "Hugging Face model directory (config.json, safetensors, tokenizer; a Hub id must be downloaded "
                  "first: huggingface-cli download ID --local-dir DIR); default: the embedded model",
    "model_preset": "build a preset's shapes with random weights instead of reading a checkpoint",
    "tokenizer_path": "tokenizer directory (default: the model directory, or the embedded tokenizer)",
    "load_format": "auto / safetensors read --model-path; dummy draws random weights",
    "quantization": "fp8: quantize a bf16 checkpoint to DeepSeek's 128x128 block-FP8 on load (a block-FP8 "
                    "checkpoint's weights are used as stored, with a warning)",
    "num_layers": "keep only the first N decoder layers (to fit a big model on one GPU for benchmarks)",
    "dtype": "activation and weight dtype (auto: bfloat16 on a GPU, float32 on the CPU)",
    "device": "auto, cpu, cuda or cuda:N",
    "context_length": "cap the context below the model's max_position_embeddings (more is refused)",
    "host": "address to listen on (0.0.0.0: every IPv4 interface); checked before the model loads",
    "port": "port to listen on (0: a free one, named in the ready line); checked before the model loads",
    "api_key": "require 'Authorization: Bearer KEY' on every endpoint but /health (default: the PLUGSERVE_API_KEY "
               "environment variable; a key given here shows in `ps`: prefer --api-key-file or the variable)",
    "api_key_file": "read the API key from the first line of this file",
    "max_request_body_bytes": "largest request body taken (a larger one is a 413 before it is parsed)",
    "served_model_name": "the model id /v1/models reports",
    "allowed_origins": "CORS: comma-separated origins a browser may call from ('*': any); default: no CORS headers",
    "chat_template": "a Jinja chat template, as a file or inline, replacing the tokenizer's",
    "stream_interval": "stream a chunk every N tokens (and the first and last at once)",
    "enable_cache_report": "accepted from SGLang: usage.prompt_tokens_details.cached_tokens is always reported",
    "enable_metrics": "accepted from SGLang: Prometheus metrics are always served at /metrics",
    "trust_remote_code": "accepted from SGLang and ignored: plugserve runs its own DeepSeek code, never remote code",
    "graceful_shutdown_timeout": "seconds from SIGTERM (or Ctrl-C) to exit: new requests get 503 at once, running "
                                 "ones may finish until 2 s before it, then end with an error; a second signal "
                                 "exits at once",
    "max_sequences_per_request": "most sequences one request may ask for (its prompts times n); more is a 400",
    "tp_size": "tensor-parallel size: one process and device per rank, attention heads, MLP and expert widths and "
               "the vocabulary split over them",
    "ep_size": "expert-parallel size, 1 or --tp-size: each rank holds 1/ep_size of the routed experts whole "
               "(instead of each expert's 1/tp_size) and runs them for every token; one all-reduce combines",
    "enable_dp_attention": "DP attention: each of --dp-size groups of ranks runs attention for its own requests "
                           "with its own KV pool, its heads split over the group's ranks; the MLP / MoE layers "
                           "stay split over every rank (each group's tokens all-gathered before them, its rows "
                           "kept after)",
    "dp_size": "DP attention groups (with --enable-dp-attention), dividing --tp-size: A ranks "
               "each, A = --tp-size / --dp-size: group g the ranks g*A .. g*A+A-1, splitting its heads",
    "nnodes": "nodes the --tp-size ranks are spread over (as many on each)",
    "node_rank": "this node's number; node 0 serves HTTP, the others run their ranks only",
    "dist_init_addr": "host:port of node 0 where the ranks meet (needed with --nnodes > 1; default: a free local "
                      "port)",
    "disable_custom_all_reduce": "sum every tensor-parallel all-reduce with the group's own collective, NCCL "
                                 "(--all-reduce-backend torch_ref)",
    "all_reduce_backend": "comm backend of the tensor-parallel all-reduces (auto: the ranked chain, e.g. "
                          "symmetric_memory for small sums over NVLink and torch_ref above; or a name from "
                          "`plugserve backends --kind comm`)",
    "attention_backend": "attention backend for both phases (auto, or a name from `plugserve backends`)",
    "prefill_attention_backend": "attention backend for prefill (default: --attention-backend)",
    "decode_attention_backend": "attention backend for decode / verify (default: --attention-backend)",
    "fp8_gemm_backend": "block-FP8 GEMM backend (other than auto: a model with block-FP8 weights only)",
    "moe_runner_backend": "MoE backend (other than auto: a model with routed experts only)",
    "page_size": "tokens per KV page (default: what the decode backend needs, else 1)",
    "kv_cache_dtype": "KV cache dtype (auto: the model dtype)",
    "chunked_prefill_size": "most prompt tokens in one prefill batch; -1 disables chunking",
    "chunked_prefix_cache_threshold": "cached-prefix tokens from which prefill de-compresses the prefix (MHA)",
    "max_prefill_tokens": "most tokens in one prefill batch (with --chunked-prefill-size, the smaller caps it)",
    "schedule_policy": "order of the waiting queue: fcfs (arrival) or lpm (longest cached prefix first; not with "
                       "--disable-radix-cache)",
    "max_running_requests": "most requests decoding at once",
    "max_total_tokens": "KV pool size in tokens (overrides --mem-fraction-static, with a warning when both are given)",
    "mem_fraction_static": "fraction of the device's memory for the weights, CUDA graphs and KV pool (default 0.85 on "
                           "a GPU); on the CPU, of the machine's memory (without it the CPU's pool is 512 MiB)",
    "disable_radix_cache": "do not reuse cached prompt prefixes",
    "disable_overlap_schedule": "schedule only while the device is idle (no CPU/GPU overlap)",
    "enable_mixed_chunk": "the running requests decode a token each inside every prefill batch (one forward, within "
                          "--chunked-prefill-size), so decoding goes on while a long prompt is prefilled chunk by "
                          "chunk; not with speculative decoding",
    "enable_deterministic_inference": "the same greedy request gives the same tokens whatever the batch around it, a "
                                      "cached prefix, prefill chunking, streaming or overlap: batch-invariant "
                                      "backends only (auto picks among them, another is refused), row-invariant "
                                      "matmuls and reductions, keys summed in fixed tiles, every prefill as absorbed "
                                      "MLA; costs speed (about 2x a decode step on the CPU); not with speculative "
                                      "decoding nor --tp-size > 1",
    "disable_cuda_graph": "do not capture decode (nor speculative rounds) in CUDA graphs (GPU only: refused on the "
                          "CPU, which has none)",
    "cuda_graph_max_bs": "largest decode batch (or speculative round) captured in CUDA graphs (default: "
                         "--max-running-requests, 256 on a GPU; above it, capped to it with a warning); graphs are "
                         "captured at SGLang's sizes up to it (GPU only)",
    "enable_torch_compile": "torch.compile the element-wise ops between kernels that have no Triton kernel of "
                            "plugserve's (rope's cos / sin, the MHA path's rope; norms and SiLU-and-mul always run "
                            "fused on CUDA), fused by Inductor, inside the CUDA graphs",
    "torch_compile_max_bs": "largest batch (in tokens) that runs the compiled ops, larger ones eagerly (default 32; "
                            "needs --enable-torch-compile)",
    "disable_shared_experts_overlap": "run the shared experts on the main CUDA stream instead of a second one (GPU "
                                      "only; not with --enable-shared-experts-fusion, which has no second stream)",
    "enable_shared_experts_fusion": "run the shared experts as extra experts inside the MoE backend's GEMMs (one that "
                                    "can: triton) instead of their own MLP; off by default: on the H100, "
                                    "DeepSeek-V2-Lite decodes 2-3 %% faster with it at batch 1 but 2 %% slower at "
                                    "batch 64",
    "speculative_algorithm": "NEXTN (or EAGLE, its alias here): speculative decoding with the model's NextN (MTP) "
                             "layer as the draft; runs the non-overlap scheduler",
    "speculative_draft_model_path": "a checkpoint whose NextN layer drafts instead of the target's own (a NextN-only "
                                    "export such as SGLang's DeepSeek-V3-NextN, or a whole checkpoint with one); it "
                                    "must have the target's shapes",
    "speculative_num_steps": "draft tokens per round, one NextN forward each (default 3)",
    "speculative_eagle_topk": "draft branches per step (1: a chain; more: EAGLE-2 trees, on a decode attention "
                              "backend that verifies trees)",
    "speculative_num_draft_tokens": "tokens one verify forward scores (with topk 1: num-steps + 1)",
    "grammar_backend": "structured output (response_format, regex, ebnf, tool_choice required or named): "
                       "xgrammar, or none to refuse such requests with a 400",
    "tool_call_parser": "parse the model's tool-call tokens into tool_calls (deepseekv3: DeepSeek-V3's "
                        "<｜tool▁calls▁begin｜> format); without it, tools work only with tool_choice required "
                        "or named",
    "reasoning_parser": "split <think>...</think> from the output into reasoning_content (deepseek-r1)",
    "skip_server_warmup": "serve without first running every prefill and decode shape (each compiles on its "
                          "first request instead); CUDA graphs are still captured",
    "watchdog_timeout": "seconds a scheduler step may run before the server ends with an error (a hung forward)",
    "log_requests": "log one line per finished request (id, tokens, latency), at info (so not with --log-level "
                    "warning or error)",
    "log_requests_level": "with --log-requests, 0: ids, tokens, latency; 1: and the sampling parameters; 2: and the "
                          "prompt and output text",
    "decode_log_interval": "log the batch statistics every N decode steps",
    "log_level": "logging level",
    "seed": "random seed of unseeded sampling and of dummy weights (alias --random-seed)",
}


# SGLang's other spellings of a flag (explicit: argparse would find `--model` ambiguous, a prefix of two flags).
ALIASES = {"seed": ("--random-seed",), "model_path": ("--model",), "tp_size": ("--tp",), "dp_size": ("--dp",),
           "ep_size": ("--ep",), "speculative_algorithm": ("--speculative-algo",),
           "speculative_draft_model_path": ("--speculative-draft",)}
# SGLang's older switches, as the flags they became: (help, field, value; None: the --tp-size).
OLD_SWITCHES = {
    "enable_flashinfer_mla": ("SGLang's older spelling of --attention-backend flashinfer_mla", "attention_backend",
                              "flashinfer_mla"),
    "enable_ep_moe": ("SGLang's older spelling of --ep-size equal to --tp-size (with --tp-size > 1)", "ep_size",
                      None),
}
# SGLang flags for what plugserve does not have: refused naming why (argparse would only say "unrecognized").
_NO_DEEPEP = "no DeepEP all-to-all here: expert parallelism runs within the tensor-parallel ranks (--ep-size)"
_LOCAL_ONLY = "checkpoints are read from a local directory only: download it first, then give --model-path"
REFUSED = {
    "--enable-deepep-moe": _NO_DEEPEP,
    "--moe-a2a-backend": _NO_DEEPEP,
    "--enable-two-batch-overlap": "no two-batch overlap here",
    "--disaggregation-mode": "no prefill / decode disaggregation here",
    "--revision": _LOCAL_ONLY,
    "--download-dir": _LOCAL_ONLY,
    "--load-balance-method": "one engine serves; under DP attention each request goes to the least-loaded group",
    "--enable-dp-lm-head": "the LM head is split over every tensor-parallel rank",
    "--moe-dense-tp-size": "the dense MLPs are split over every tensor-parallel rank",
    "--cuda-graph-bs": "graphs are captured at SGLang's default sizes up to --cuda-graph-max-bs",
    "--is-embedding": "plugserve serves generation only",
}
# Where the API key comes from when no flag gives it.
API_KEY_VARIABLE = "PLUGSERVE_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerArgs field as a flag, its default and choices in its help."""
    for name, field in ServerArgs.model_fields.items():
        kind = _base_type(field.annotation)
        help_text = HELP.get(name, "")
        if kind is bool:
            parser.add_argument(flag(name), action="store_true", help=help_text)
            continue
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else CHOICES.get(name)
        if field.default is not None and name != "api_key":
            help_text += " (default: %(default)s)"
        parser.add_argument(flag(name), *ALIASES.get(name, ()), type=_parser_for(kind), choices=choices,
                            default=field.default, metavar=None if choices else name.upper(), help=help_text)
    for name, (help_text, _, _) in OLD_SWITCHES.items():
        parser.add_argument(flag(name), action="store_true", help=help_text)
    for name, why in REFUSED.items():
        parser.add_argument(name, nargs="*", action=RefusedFlag, why=why, help=argparse.SUPPRESS)


class RefusedFlag(argparse.Action):
    """An SGLang flag plugserve has no counterpart for: a usage error saying why."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs: typing.Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: typing.Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported: {self.why}")


def _base_type(annotation):
    """int | None -> int; Literal[...] | None -> Literal[...]."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _parser_for(kind):
    if typing.get_origin(kind) is typing.Literal:
        return str
    return kind if kind in (int, float) else str


def server_args_from(namespace: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerArgs:
    values = {name: getattr(namespace, name) for name in ServerArgs.model_fields}
    for name, (_, field, value) in OLD_SWITCHES.items():
        if getattr(namespace, name):
            if value is None and values["tp_size"] == 1:
                parser.error(f"{flag(name)} is for several ranks: give {flag('tp_size')} > 1")
            values[field] = values["tp_size"] if value is None else value
    if values["api_key"] is None and values["api_key_file"] is None:
        values["api_key"] = os.environ.get(API_KEY_VARIABLE) or None
    try:
        return ServerArgs(**values)
    except ValidationError as exc:
        parser.error(describe_validation_error(exc))


def serve(args: ServerArgs) -> None:
    """Serve until SIGTERM / SIGINT (exit 0 after the graceful shutdown) or until the scheduler loop dies
    (exit 1, so that a supervisor restarts the server). Ends the process."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for notice in args.notices():
        logger.warning(notice)
    if args.node_rank:
        from plugserve.runtime.ranks import run_node

        error = run_node(args)
        if error is not None:
            print(f"plugserve serve: {error}", file=sys.stderr)
        _exit(0 if error is None else 1)
    sock = listen_socket(args.host, args.port)  # before the minutes of loading: a busy port fails at once
    started = time.perf_counter()
    precompile.start(args)  # before this process's imports: the compiling processes import torch meanwhile
    from plugserve.registry import SelectionError
    from plugserve.runtime.engine import Engine, served_model_names
    from plugserve.server.app import create_app

    logger.info("loading model %s from %s", served_model_names(args)[0],
                args.model_dir or f"--model-preset {args.model_preset} (random weights)")
    try:
        engine = Engine(args)
    except (SelectionError, ValueError) as exc:
        raise SystemExit(f"plugserve serve: {exc}") from None
    logger.info("model loaded in %.1f s (KV cache: %d tokens); warming up", time.perf_counter() - started,
                engine.runner.max_total_tokens)
    grace = args.graceful_shutdown_timeout
    config = uvicorn.Config(create_app(engine), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=min(grace, SHUTDOWN_MARGIN_S))  # type: ignore[arg-type]
    logging.getLogger("uvicorn.access").addFilter(_not_health)
    server = GracefulServer(config, engine, grace)
    engine.on_death = lambda error: setattr(server, "should_exit", True)  # its callers already have the error
    threading.Thread(target=_announce_ready, args=(server, engine, sock), name="plugserve-ready", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if engine.error is not None:
        print(f"plugserve serve: {engine.error}", file=sys.stderr)
    # Not through the interpreter's teardown of torch and the model, which can outlast the grace period, where
    # the watchdog (a daemon thread) could no longer end the process.
    _exit(0 if engine.error is None else 1)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn serves on it), or a usage error naming the flag that is wrong."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise SystemExit(f"plugserve serve: --host {host!r} is not an address or a known host name ({exc.strerror})"
                         ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"plugserve serve: --port {port} is in use on --host {host} (another server?): "
                             "choose another --port") from None
        raise SystemExit(f"plugserve serve: cannot listen on --host {host} --port {port}: {exc.strerror}") from None
    return sock


def _not_health(record: logging.LogRecord) -> bool:
    """uvicorn's access log without /health: a load balancer polls it every few seconds."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) > 2 and args[2] == "/health")


def _announce_ready(server: uvicorn.Server, engine: Engine, sock: socket.socket) -> None:
    """Once uvicorn listens and the warm-up is done (/health 200): say so and where, the last start-up line."""
    while not (server.started and engine.ready.is_set()):
        if not engine.alive:  # the warm-up failed, or the server is already going: /health says why
            return
        time.sleep(0.05)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("ready at http://%s:%d, model %s (warm-up %.1f s)", shown, port, engine.model_name,
                engine.warm_up_seconds or 0.0)


def _exit(status: int) -> None:
    """End the process now, its logs and output flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


SHUTDOWN_MARGIN_S = 2.0  # of the grace period, kept for the last responses and the engine's shutdown


class GracefulServer(uvicorn.Server):
    """uvicorn with plugserve's shutdown. The first SIGTERM / SIGINT closes the engine (new requests get 503,
    /health says why) and lets the running requests finish; those still running when the grace period is all
    but over end with an error; then uvicorn stops. A watchdog exits the process (status 1) should any of that
    outlast the grace period. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self._draining = False

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        # Not uvicorn's: it would re-raise the signal after shutting down, killing the process by SIGTERM.
        if self._draining:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        threading.Thread(target=self._drain, name="plugserve-drain", daemon=True).start()
        watchdog = threading.Timer(self.grace, self._overdue)
        watchdog.daemon = True
        watchdog.start()

    def _drain(self) -> None:
        logger.info("shutting down: refusing new requests, %d running get %.0f s", self.engine.num_outstanding,
                    self.grace)
        self.engine.close("the server is shutting down")
        deadline = time.monotonic() + max(0.0, self.grace - SHUTDOWN_MARGIN_S)
        while self.engine.num_outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine.num_outstanding:
            logger.warning("ending %d requests still running at the end of the grace period",
                           self.engine.num_outstanding)
            self.engine.abort_all(f"the server shut down before the request finished "
                                  f"(--graceful-shutdown-timeout {self.grace:g} s)")
        self.should_exit = True

    def _overdue(self) -> None:
        logger.error("the shutdown outlasted --graceful-shutdown-timeout (%g s): exiting now", self.grace)
        _exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="plugserve serve", description="Serve a DeepSeek-V2/V3 model over an "
                                     "OpenAI-compatible HTTP API.")
    add_server_args(parser)
    namespace = parser.parse_args(argv)
    serve(server_args_from(namespace, parser))
