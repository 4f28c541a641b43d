"""Prometheus metrics of one engine (its own registry, so that several engines in one process, as in
the tests, do not collide): request counts, token throughput, TTFT / ITL / end-to-end latency, queue
sizes, KV usage, the prefix-cache hit rate, speculative decoding's accept length, and the Triton kernels compiled
after the warm-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from plugserve.runtime.request import Request


class SchedulerGauges(Protocol):
    """What the metrics' gauges read whenever requests come and go, and when the engine is idle."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def cache_hit_rate(self) -> float: ...


logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("plugserve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("plugserve_prompt_tokens",
                                     "Prompt tokens of the requests prefilled (cached ones included)", registry=r)
        self.generation_tokens = Counter("plugserve_generation_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter("plugserve_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.retractions = Counter("plugserve_retractions", "Requests retracted when the KV pool ran out", registry=r)
        self.running = Gauge("plugserve_num_running_requests", "Requests running", registry=r)
        self.waiting = Gauge("plugserve_num_waiting_requests", "Requests waiting", registry=r)
        self.kv_usage = Gauge("plugserve_kv_cache_usage", "Fraction of KV pages in use or cached", registry=r)
        self.cache_hit_rate = Gauge("plugserve_cache_hit_rate", "Prefix-cache hit rate over prompt tokens",
                                    registry=r)
        self.throughput = Gauge("plugserve_gen_throughput", "Generated tokens per second (last batches)", registry=r)
        self.ttft = Histogram("plugserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("plugserve_inter_token_latency_seconds", "Inter-token latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("plugserve_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.spec_verified = Counter("plugserve_spec_verified_requests",
                                     "Speculative verifies, one per request and round", registry=r)
        self.spec_accepted = Counter("plugserve_spec_accepted_tokens",
                                     "Tokens speculative verifies produced (accepted drafts and the target's own)",
                                     registry=r)
        self.spec_accept_length = Gauge("plugserve_spec_accept_length",
                                        "Mean tokens a request gets from one speculative verify", registry=r)
        self.late_triton_compiles = Counter(
            "plugserve_late_triton_compiles",
            "Triton kernels compiled after the warm-up, each a stall of the batch in flight (the log names them)",
            registry=r)
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._spec_requests = self._spec_tokens = 0

    def observe_batch(self, generated: int) -> None:
        """A batch's tokens appended to its requests (prefill's first tokens and every accepted draft included),
        so that the counter adds up to the requests' completion tokens."""
        self.generation_tokens.inc(generated)
        self._window_tokens += generated
        now = time.perf_counter()
        if now - self._window_start >= 1.0:
            self.throughput.set(self._window_tokens / (now - self._window_start))
            self._window_start, self._window_tokens = now, 0

    def observe_first_token(self, request: Request, now: float) -> None:
        """A request's first token: its prompt is through prefill (counted once, whatever a retraction re-runs)."""
        self.ttft.observe(now - request.arrival_time)
        self.prompt_tokens.inc(len(request.prompt_ids))

    def refresh_gauges(self, scheduler: SchedulerGauges) -> None:
        """Read the scheduler's state into the gauges: called whenever requests come and go, not only per batch."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_usage)
        self.cache_hit_rate.set(scheduler.cache_hit_rate)

    def observe_idle(self, scheduler: SchedulerGauges) -> None:
        """Nothing to run: the gauges read an idle server (no throughput) rather than the last busy batch."""
        self.refresh_gauges(scheduler)
        self.throughput.set(0)
        self._window_start, self._window_tokens = time.perf_counter(), 0

    def observe_verify(self, tokens_per_request: list[int]) -> None:
        """One speculative verify: the tokens each of its requests got from it (drafts accepted + 1)."""
        self.spec_verified.inc(len(tokens_per_request))
        self.spec_accepted.inc(sum(tokens_per_request))
        self._spec_requests += len(tokens_per_request)
        self._spec_tokens += sum(tokens_per_request)
        self.spec_accept_length.set(self._spec_tokens / self._spec_requests)

    def observe_finish(self, request: Request) -> None:
        self.requests.labels(str(request.finish_reason)).inc()
        self.cached_prompt_tokens.inc(request.cached_tokens)
        self.e2e.observe(time.perf_counter() - request.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def report_late_triton_compiles(on_compile: Callable[[], None] | None = None) -> None:
    """From now on (after the warm-up), log a warning for each Triton kernel compiled, naming it and its
    specialization (argument dtypes, 16-byte alignments, constexprs), and call `on_compile` (the engine's metrics
    counter): a compile inside a request stalls it for tens to hundreds of milliseconds, so each one names a shape
    or layout the warm-up should walk. Triton's hook is one per process: the last engine warmed up reports. A
    no-op without triton or on a release without `knobs.runtime.jit_post_compile_hook`."""
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return

    def warn(**details: Any) -> None:
        logger.warning("Triton compiled a kernel after the warm-up (the request waited for it): %s",
                       _describe_compile(details))
        if on_compile is not None:
            on_compile()

    runtime.jit_post_compile_hook = warn


def _describe_compile(details: dict[str, Any]) -> str:
    """`name(arg: type, ...) divisible by 16: [args] constexprs {...}` from the keywords triton's JIT passes its
    hooks (`compile`: signature, constants, configs; a pointer "divisible by 16" is 16-byte aligned), or its own
    `repr` where those differ."""
    try:
        compile_info = details["compile"]
        signature: dict[str, str] = compile_info["signature"]
        names = list(signature)
        divisible = sorted(names[index[0]] for attrs in compile_info["configs"] for index, values in attrs.items()
                           if any(value[0] == "tt.divisibility" for value in values))
        args = ", ".join(f"{name}: {kind}" for name, kind in signature.items() if kind != "constexpr")
        constants = {names[key[0]] if isinstance(key, tuple) else key: value
                     for key, value in compile_info["constants"].items()}
        return f"{details['fn'].name}({args}) divisible by 16: {divisible} constexprs {constants}"
    except (KeyError, TypeError, IndexError, AttributeError):
        return str(details.get("repr", details.get("key")))
