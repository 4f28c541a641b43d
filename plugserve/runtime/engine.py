"""Engine: plugserve in-process. The server, the benchmarks and the tests drive it.

    engine = Engine(ServerArgs(model_path=...))
    engine.generate("The capital of France is", SamplingParams(max_new_tokens=16, temperature=0))

A background thread owns the scheduler; callers submit requests and receive `RequestOutput`
increments through a callback (`stream`, `stream_async` and `generate` are built on it). The thread
first warms the model up (`warmup.warm_up`: JIT compiles, CUDA-graph capture); `ready` is set
after it, and requests submitted before wait in the queue.

The engine never leaves a caller waiting: a failing step ends its requests with an error and the loop goes
on; if the loop itself dies, every outstanding request gets an error at once, later submissions raise
`EngineStopped`, and `on_death` tells the owner (the server exits non-zero). `close` refuses new requests
while the running ones finish (a graceful shutdown); `abort_all` ends those left.

With --tp-size N the engine is rank 0 (runtime/ranks.py): it starts this node's other ranks, and one that
exits kills the engine as a dying loop does (while it starts up, the process: it waits in a collective
that only the timeout would end). With --enable-dp-attention its scheduler is a `DPScheduler`, one
`Scheduler` per DP group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from plugserve.core.distributed import SINGLE
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.runtime import precompile
from plugserve.runtime.dp_scheduler import DPScheduler
from plugserve.runtime.grammar import GrammarCompiler, GrammarError, grammar_of
from plugserve.runtime.isolation import FaultHook
from plugserve.runtime.metrics import Metrics
from plugserve.runtime.profiler import ProfileFiles, StepProfiler
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.ranks import Ranks
from plugserve.runtime.request import FinishReason, Request, RequestOutput, TokenLogprob
from plugserve.runtime.sampling import SamplingParams, make_generator
from plugserve.runtime.scheduler import Scheduler
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative import build_runner
from plugserve.runtime.stats_log import StatsLog
from plugserve.runtime.warmup import warm_up
from plugserve.runtime.watchdog import Watchdog

logger = logging.getLogger(__name__)
HUNG_LOOP_JOIN_S = 5.0  # how long a shutdown waits for a loop that died or hung before leaving it

Prompt = str | Sequence[int]
T = TypeVar("T")


@dataclass
class GenerateResult:
    """A finished request, accumulated from its increments."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        self.finish_reason, self.matched_stop = output.finish_reason, output.matched_stop
        self.prompt_tokens, self.completion_tokens = output.prompt_tokens, output.completion_tokens
        self.cached_tokens, self.error = output.cached_tokens, output.error


class _Outbox:
    """Outputs for asyncio consumers, handed to their event loops once per scheduler step.

    Waking a loop from another thread writes to its self-pipe, and the GIL changes hands around that
    write: one wake-up per token cost about 0.4 ms each at 64 streams (on the CPU), more than a GPU decode
    step of the model. Outputs posted on the scheduler thread wait for `flush` (after each step and each
    round of commands); from any other thread they go at once."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[RequestOutput], None], RequestOutput]]] = {}
        self.owner: threading.Thread | None = None  # the scheduler thread

    def post(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[RequestOutput], None],
             output: RequestOutput) -> None:
        if threading.current_thread() is self.owner:
            self._pending.setdefault(loop, []).append((deliver, output))
        else:
            loop.call_soon_threadsafe(deliver, output)

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these any more
                loop.call_soon_threadsafe(_deliver_all, items)


def _deliver_all(items: list[tuple[Callable[[RequestOutput], None], RequestOutput]]) -> None:
    for deliver, output in items:
        deliver(output)


def served_model_names(args: ServerArgs) -> tuple[str, frozenset[str]]:
    """The model id /v1/models lists, and every name a request's `model` may call it by: that id, or a name the
    server was launched with (--served-model-name, --model-path, --model-preset)."""
    listed = args.served_model_name or args.model_path or args.model_preset or "plugserve-embedded"
    return listed, frozenset(n for n in (listed, args.served_model_name, args.model_path, args.model_preset) if n)


class EngineStopped(RuntimeError):
    """A request was submitted to an engine that takes none any more: shutting down, or its loop died."""


class Engine:
    def __init__(self, args: ServerArgs | None = None, fault_hook: FaultHook | None = None) -> None:
        """`fault_hook`: called with each batch about to run, before its forward; what it raises fails that forward
        (tests inject failures through it, `runtime/isolation.py`)."""
        self.args = args = args or ServerArgs()
        self.ready = threading.Event()  # before the ranks' watch, which reads it
        if args.node_rank:
            raise ValueError(f"--node-rank {args.node_rank}: the engine is rank 0, on node 0 (`plugserve serve` "
                             "on the other nodes starts their ranks only)")
        self.ranks = Ranks(args) if args.tp_size > 1 else None
        if self.ranks is not None:
            self.ranks.watch(self._rank_exited)
        try:
            self.runner = build_runner(args, self.ranks.group if self.ranks is not None else SINGLE,
                                       before_sizing=precompile.wait)
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop(None)
            raise
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_dir or EMBEDDED_MODEL_DIR)
        if args.chat_template is not None:
            self.tokenizer.chat_template = args.chat_template_text
        config = self.runner.config
        self.runner.sample_vocab = min(config.vocab_size, len(self.tokenizer))
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = (GrammarCompiler(self.tokenizer, self.runner.sample_vocab, eos)
                         if args.grammar_backend == "xgrammar" else None)
        self.model_name, self.model_names = served_model_names(args)
        self.stats = StatsLog(args, self.runner.max_total_tokens, self.tokenizer.decode)
        self.metrics = Metrics(self.model_name, self.runner.max_total_tokens, self.stats.decode_step)
        self.scheduler: Scheduler | DPScheduler
        if self.runner.dp_size > 1:
            self.scheduler = DPScheduler(self.runner, self.tokenizer, self.metrics, not args.disable_radix_cache,
                                         fault_hook)
            self.radix = self.scheduler.groups[0].radix  # rank 0's own group's
        else:
            self.radix = RadixCache(self.runner.allocator, self.runner.page_size,
                                    enabled=not args.disable_radix_cache)
            self.scheduler = Scheduler(self.runner, self.radix, self.tokenizer, self.metrics, fault_hook=fault_hook)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.warm_up_error: str | None = None
        self.warm_up_seconds: float | None = None
        self.error: str | None = None  # why the scheduler loop died, once it has
        self.closing: str | None = None  # why new requests are refused (a graceful shutdown)
        self.on_death: Callable[[str], None] | None = None  # called as the loop dies (on its thread or the watchdog's)
        # Requests submitted and not yet finished: the ones to fail if the loop dies, or to wait for on close.
        self._outstanding: set[Request] = set()
        self._lock = threading.Lock()  # orders submissions against close / death: none slips in after
        self._stopped = False
        self._outbox = _Outbox()
        self.watchdog = Watchdog(args.watchdog_timeout, self._hang)
        self.profiler = StepProfiler()  # /start_profile, /stop_profile
        self._thread = threading.Thread(target=self._loop, name="plugserve-scheduler", daemon=True)
        self._outbox.owner = self._thread
        self._thread.start()

    # -- the scheduler thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        started = time.perf_counter()
        try:
            warm_up(self.runner, on_late_compile=self.metrics.late_triton_compiles.inc)
        except Exception as exc:  # the model cannot run: serving would fail every request
            logger.exception("warm-up failed")
            self.warm_up_error = f"{type(exc).__name__}: {exc}"
            return
        self.warm_up_seconds = time.perf_counter() - started
        logger.info("warm-up done in %.1f s", self.warm_up_seconds)
        self.ready.set()
        self.watchdog.start()
        try:
            self._serve()
        except BaseException as exc:  # a bug past every guard below: no request can be served any more
            logger.critical("the scheduler loop died", exc_info=True)
            self._die(f"the scheduler loop died: {type(exc).__name__}: {exc}")
            return
        self.scheduler.shutdown()
        self._outbox.flush()

    def _serve(self) -> None:
        while not self._stopped and self.error is None:  # error: a tensor-parallel rank is gone
            while not self._inbox.empty():
                command = self._inbox.get()
                try:
                    command()
                except Exception:  # e.g. an abort whose callback raised: the request is ended all the same
                    logger.exception("a scheduler command failed")
            self._outbox.flush()
            if self.scheduler.has_work:
                self.watchdog.step_started()
                try:
                    self.scheduler.step()
                except Exception as exc:  # a scheduling failure no single request explains: end them all, go on
                    logger.exception("a scheduler step failed")
                    self.scheduler.fail_all(f"the scheduler failed: {type(exc).__name__}: {exc}")
                finally:
                    self.watchdog.step_ended()
                    self._outbox.flush()
                self.profiler.after_step()
            else:
                self.metrics.observe_idle(self.scheduler)
                self._wake.wait(0.05)
                self._wake.clear()

    def _hang(self, error: str) -> None:
        """The watchdog's verdict: the loop is stuck in a step, so its scheduler is left as it is (a shutdown would
        wait for the stuck forward); the requests get their error and the owner is told."""
        logger.critical(error)
        self._die(error, stop_scheduler=False)

    def _die(self, error: str, stop_scheduler: bool = True) -> None:
        """Fail every outstanding request at once (no caller hangs), refuse new ones, tell the owner."""
        with self._lock:
            self.error = error
            stranded, self._outstanding = self._outstanding, set()
        for request in stranded:
            request.finish_reason = FinishReason.ERROR
            try:
                request.on_output(RequestOutput(request.rid, "", [], [], True, FinishReason.ERROR,
                                                prompt_tokens=len(request.prompt_ids), error=error))
            except BaseException:
                logger.exception("could not report the failure of request %s", request.rid)
        try:
            if stop_scheduler:
                self.scheduler.shutdown()  # let a forward in flight end before the process goes
        except BaseException:  # it may raise what killed the loop again: its requests have their error already
            logger.exception("the scheduler's shutdown failed too")
        finally:
            try:
                self._outbox.flush()
            finally:
                if self.on_death is not None:
                    self.on_death(error)

    def _rank_exited(self, error: str) -> None:
        if not self.ready.is_set():
            logger.critical("%s while starting up", error)
            logging.shutdown()
            os._exit(1)
        # On the loop's thread, between steps: a forward in flight fails at its next collective (gloo: at
        # once; NCCL: its watchdog ends the process at the timeout).
        self._call_in_loop(lambda: self._die(error))

    def _call_in_loop(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wake.set()

    # -- requests ------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text gets the tokenizer's special tokens, e.g. BOS). Raises ValueError
        for an empty prompt, ids outside the vocabulary, or a prompt the context or KV pool cannot hold."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.runner.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens, over this model's context length of "
                             f"{self.runner.context_length} (prompt and output together)")
        if len(ids) + 1 > self.runner.max_total_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                             f"({self.runner.max_total_tokens})")
        return ids

    def compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (xgrammar's CompiledGrammar, cached), or None when it has none. Raises
        GrammarError naming the field for a grammar that cannot be compiled or served here. Slow on a new grammar:
        the server calls it in a worker thread before submitting."""
        grammar = grammar_of(params)
        if grammar is None:
            return None
        field, text = grammar
        if self.grammars is None:
            raise GrammarError(field, f"{field}: structured output is off on this server (--grammar-backend none; "
                                      "xgrammar turns it on)")
        if self.args.speculative is not None:
            raise GrammarError(field, f"{field}: structured output does not run with speculative decoding "
                                      "(--speculative-algorithm): drafts are not checked against the grammar")
        return self.grammars.compile(field, text)

    def submit(self, prompt: Prompt, params: SamplingParams, on_output: Callable[[RequestOutput], None],
               rid: str | None = None) -> str:
        """Queue one request (n must be 1 here: `generate` and the server expand n). Returns its id."""
        request = self._request(prompt, params, on_output, rid)
        self._queue([request])
        return request.rid

    def _request(self, prompt: Prompt, params: SamplingParams, on_output: Callable[[RequestOutput], None],
                 rid: str | None = None) -> Request:
        """A checked request, not queued yet: raises ValueError for bad parameters or a bad prompt."""
        params.validate()
        ids = self.tokenize(prompt)

        def report(output: RequestOutput) -> None:
            if output.finished:
                with self._lock:
                    self._outstanding.discard(request)
                self.stats.request_finished(request)
            on_output(output)

        compiled = self.compile_grammar(params)
        request = Request(rid or uuid.uuid4().hex, ids, params, report, self.eos_token_ids,
                          make_generator(params.seed, self.runner.device),
                          None if compiled is None else self.grammars.matcher(compiled))
        return request

    def _queue(self, requests: list[Request]) -> None:
        """Hand requests to the scheduler in one command, so that they reach it between the same two steps (and
        batch together as far as the pool allows, whatever the threads' timing)."""
        def add_all() -> None:
            for request in requests:
                self.scheduler.add(request)

        with self._lock:
            if self.error is not None or self.closing is not None:
                raise EngineStopped(self.error or self.closing)
            self._outstanding.update(requests)
            self._inbox.put(add_all)
        self._wake.set()

    def abort(self, rid: str) -> None:
        self._call_in_loop(lambda: self.scheduler.abort(rid))

    @property
    def num_outstanding(self) -> int:
        """Requests submitted and not finished yet (queued, running, or on their way to the scheduler)."""
        return len(self._outstanding)

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (`submit` raises EngineStopped with `reason`); running ones go on."""
        with self._lock:
            self.closing = reason

    def abort_all(self, error: str) -> None:
        """End every request the engine holds with `error` (the end of a graceful shutdown's grace period)."""
        self._call_in_loop(lambda: self.scheduler.fail_all(error))

    def run_in_loop(self, command: Callable[[], T], timeout: float = 30.0) -> T:
        """`command()` run on the scheduler's thread, between two steps (where the pool's bookkeeping is whole);
        returns what it returns, raises what it raises (TimeoutError: the loop did not run it in time)."""
        done, results, failures = threading.Event(), [], []

        def run() -> None:
            try:
                results.append(command())
            except Exception as exc:
                failures.append(exc)
            finally:
                done.set()

        self._call_in_loop(run)
        if not done.wait(timeout):
            raise TimeoutError("the scheduler thread did not run the command")
        if failures:
            raise failures[0]
        return results[0]

    def check_pool_accounting(self, timeout: float = 30.0) -> None:
        """`Scheduler.check_pool_accounting` run on the scheduler's thread. Raises what it raises."""
        self.run_in_loop(self.scheduler.check_pool_accounting, timeout)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Empty the prefix cache, if no request is queued or running (False: left as it is)."""
        def flush() -> bool:
            if self.scheduler.has_work:
                return False
            groups = self.scheduler.groups if isinstance(self.scheduler, DPScheduler) else [self.scheduler]
            for group in groups:
                group.radix.reset()
            return True

        return self.run_in_loop(flush, timeout)

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities: tuple[str, ...] | None = None, record_shapes: bool = False,
                      with_stack: bool = False) -> None:
        """Torch's profiler over the next `num_steps` scheduler steps (None: until `stop_profile`); see
        runtime/profiler.py. Raises ProfileError (already running, no GPU, folder not writable)."""
        self.run_in_loop(lambda: self.profiler.start(output_dir, num_steps, activities, record_shapes, with_stack))

    def stop_profile(self, timeout: float = 300.0) -> ProfileFiles:
        """End the running profile and write its trace and table (a large trace takes a while). Raises
        ProfileError when none is running."""
        return self.run_in_loop(self.profiler.stop, timeout)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.submit(prompt, params or SamplingParams(), outputs.put)
        while True:
            output = outputs.get()
            yield output
            if output.finished:
                return

    async def stream_async(self, prompt: Prompt, params: SamplingParams, rid: str | None = None
                           ) -> AsyncIterator[RequestOutput]:
        """As `stream`, for asyncio callers. Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self.submit(prompt, params, lambda o: self._outbox.post(loop, outputs.put_nowait, o), rid)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        """Run prompts to completion, n samples each: len(prompts) * n results, prompt-major."""
        params = params or SamplingParams()
        params.validate()
        samples = self.expand(params)
        for sample in samples:  # seed + i too: nothing is queued unless every sample is valid
            sample.validate()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        results = [GenerateResult() for _ in range(len(batch) * params.n)]
        done = threading.Semaphore(0)

        def collect(result: GenerateResult) -> Callable[[RequestOutput], None]:
            def on_output(output: RequestOutput) -> None:
                result.add(output)
                if output.finished:
                    done.release()
            return on_output

        # Every request is built (its prompt checked) before any is queued, and all are queued at once.
        self._queue([self._request(prompt, sample_params, collect(result))
                     for result, (prompt, sample_params) in zip(results, itertools.product(batch, samples),
                                                                strict=True)])
        for _ in results:
            done.acquire()
        return results

    @staticmethod
    def expand(params: SamplingParams) -> list[SamplingParams]:
        """n samples as n requests with n = 1; seeded ones get seeds seed, seed + 1, ..."""
        return [replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped and self.error is None

    def shutdown(self) -> None:
        self._stopped = True
        self.watchdog.stop()
        self._wake.set()
        # A loop the watchdog found stuck may never return: the process exits without it.
        self._thread.join(None if self.error is None else HUNG_LOOP_JOIN_S)
        if self.ranks is not None:
            # Released only after a clean run: otherwise a rank may wait in a collective rank 0 never joins.
            self.ranks.stop(self.runner if self.ready.is_set() and self.error is None else None)
