"""Prometheus metrics of one engine (its own registry, so that several engines in one process, as in
the tests, do not collide): request counts, token throughput, TTFT / ITL / TPOT / queue / end-to-end latency, queue
sizes, KV usage, the prefix-cache hit rate, speculative decoding's accept length, and the Triton kernels compiled
after the warm-up.

`/metrics` (`render`) exports each one twice, every sample labelled `model_name`: under plugserve's name and, where
SGLang has the same measure, under SGLang's (`SGLANG_NAMES`), so that dashboards built for SGLang find it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

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


# plugserve's metric -> SGLang's name for the same measure (SGLang's Prometheus names: colons are legal there).
SGLANG_NAMES = {
    "plugserve_num_running_requests": "sglang:num_running_reqs",
    "plugserve_num_waiting_requests": "sglang:num_queue_reqs",
    "plugserve_num_used_tokens": "sglang:num_used_tokens",
    "plugserve_kv_cache_usage": "sglang:token_usage",
    "plugserve_gen_throughput": "sglang:gen_throughput",
    "plugserve_cache_hit_rate": "sglang:cache_hit_rate",
    "plugserve_max_total_num_tokens": "sglang:max_total_num_tokens",
    "plugserve_spec_accept_length": "sglang:spec_accept_length",
    "plugserve_prompt_tokens": "sglang:prompt_tokens",
    "plugserve_generation_tokens": "sglang:generation_tokens",
    "plugserve_cached_prompt_tokens": "sglang:cached_tokens",
    "plugserve_requests": "sglang:num_requests",
    "plugserve_aborted_requests": "sglang:num_aborted_requests",
    "plugserve_time_to_first_token_seconds": "sglang:time_to_first_token_seconds",
    "plugserve_inter_token_latency_seconds": "sglang:inter_token_latency_seconds",
    "plugserve_time_per_output_token_seconds": "sglang:time_per_output_token_seconds",
    "plugserve_e2e_request_latency_seconds": "sglang:e2e_request_latency_seconds",
    "plugserve_queue_time_seconds": "sglang:queue_time_seconds",
}


class Metrics:
    def __init__(self, model_name: str = "plugserve", max_total_tokens: int = 0,
                 on_decode_step: Callable[[SchedulerGauges, float], None] | None = None) -> None:
        """`on_decode_step(gauges, throughput)`: called after each decode (or verify) step, e.g. the batch log."""
        self.model_name, self.on_decode_step = model_name, on_decode_step
        self.registry = CollectorRegistry()  # unlabelled; `render` adds the model_name label and SGLang's names
        r = self.registry
        self.requests = Counter("plugserve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("plugserve_prompt_tokens",
                                     "Prompt tokens of the requests prefilled (cached ones included)", registry=r)
        self.generation_tokens = Counter("plugserve_generation_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter("plugserve_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.retractions = Counter("plugserve_retractions", "Requests retracted when the KV pool ran out", registry=r)
        self.aborted = Counter("plugserve_aborted_requests", "Requests aborted (client gone, or an abort)",
                               registry=r)
        self.used_tokens = Gauge("plugserve_num_used_tokens", "KV slots in use or cached", registry=r)
        self.max_total_tokens = Gauge("plugserve_max_total_num_tokens", "KV pool size in tokens", registry=r)
        self.max_total_tokens.set(max_total_tokens)
        self._capacity = max_total_tokens
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
        self.tpot = Histogram("plugserve_time_per_output_token_seconds",
                              "Per request: time from its first token to its last, over its later tokens",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("plugserve_queue_time_seconds", "Time from arrival to first being scheduled",
                                    buckets=LATENCY_BUCKETS, registry=r)
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
        self._throughput = 0.0
        self._spec_requests = self._spec_tokens = 0

    def observe_batch(self, generated: int, decode: bool = False, gauges: SchedulerGauges | None = None) -> None:
        """A batch's tokens appended to its requests (prefill's first tokens and every accepted draft included),
        so that the counter adds up to the requests' completion tokens. After a decode step, `on_decode_step`."""
        self.generation_tokens.inc(generated)
        self._window_tokens += generated
        now = time.perf_counter()
        if now - self._window_start >= 1.0:
            self._throughput = self._window_tokens / (now - self._window_start)
            self.throughput.set(self._throughput)
            self._window_start, self._window_tokens = now, 0
        if decode and gauges is not None and self.on_decode_step is not None:
            self.on_decode_step(gauges, self._throughput)

    def observe_scheduled(self, request: Request) -> None:
        """A request leaves the waiting queue; its queue time counts the first time only (not after a retraction)."""
        if not request.output_ids:
            self.queue_time.observe(time.perf_counter() - request.arrival_time)

    def observe_first_token(self, request: Request, now: float) -> None:
        """A request's first token: its prompt is through prefill (counted once, whatever a retraction re-runs)."""
        self.ttft.observe(now - request.arrival_time)
        self.prompt_tokens.inc(len(request.prompt_ids))

    def refresh_gauges(self, scheduler: SchedulerGauges) -> None:
        """Read the scheduler's state into the gauges: called whenever requests come and go, not only per batch."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_usage)
        self.used_tokens.set(round(scheduler.kv_usage * self._capacity))
        self.cache_hit_rate.set(scheduler.cache_hit_rate)

    def observe_idle(self, scheduler: SchedulerGauges) -> None:
        """Nothing to run: the gauges read an idle server (no throughput) rather than the last busy batch."""
        self.refresh_gauges(scheduler)
        self.throughput.set(0)
        self._throughput = 0.0
        self._window_start, self._window_tokens = time.perf_counter(), 0

    def observe_verify(self, tokens_per_request: list[int]) -> None:
        """One speculative verify: the tokens each of its requests got from it (drafts accepted + 1)."""
        self.spec_verified.inc(len(tokens_per_request))
        self.spec_accepted.inc(sum(tokens_per_request))
        self._spec_requests += len(tokens_per_request)
        self._spec_tokens += sum(tokens_per_request)
        self.spec_accept_length.set(self._spec_tokens / self._spec_requests)

    def observe_finish(self, request: Request) -> None:
        now = time.perf_counter()
        self.requests.labels(str(request.finish_reason)).inc()
        if request.finish_reason == "abort":
            self.aborted.inc()
        self.cached_prompt_tokens.inc(request.cached_tokens)
        self.e2e.observe(now - request.arrival_time)
        later_tokens = len(request.output_ids) - 1
        if request.first_token_time is not None and later_tokens > 0:
            self.tpot.observe((now - request.first_token_time) / later_tokens)

    def render(self) -> bytes:
        """The Prometheus text of /metrics: each metric labelled model_name, and again under SGLang's name."""
        exported = CollectorRegistry(auto_describe=False)
        exported.register(_Exported(self.registry, self.model_name))
        return generate_latest(exported)


class _Exported:
    """A collector over an engine's registry: its families with a model_name label, then SGLang's copies."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source, self.model_name = source, model_name

    def collect(self) -> list[Metric]:
        families = list(self.source.collect())
        copies = [(SGLANG_NAMES[f.name], f) for f in families if f.name in SGLANG_NAMES]
        return [self._labelled(f.name, f) for f in families] + [self._labelled(name, f) for name, f in copies]

    def _labelled(self, name: str, family: Metric) -> Metric:
        metric = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            metric.add_sample(name + sample.name.removeprefix(family.name), {"model_name": self.model_name,
                                                                           **sample.labels},
                              sample.value, sample.timestamp, sample.exemplar)
        return metric


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
