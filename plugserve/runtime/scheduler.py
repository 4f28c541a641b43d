"""Continuous batching: prefill (EXTEND) batches with chunked prefill and prefix reuse, DECODE batches
of every running request, retraction when the KV pool runs dry, and overlap of the CPU's scheduling
with the device's forward.

One thread owns a Scheduler. `step()` plans a batch (`schedule`), runs it (`run`) and processes what came out
(`process`), through `OverlapLoop`: with overlap, batch i+1's decode inputs are batch i's sampled tokens still
on the device, and requests batch i finishes ride along in batch i+1 once more (that token is dropped).

With speculative decoding (`runtime/speculative.py`) a decode step is a TARGET_VERIFY batch that drafts, verifies
and accepts one to k + 1 tokens per request; it runs the non-overlap loop, as the next step's layout depends
on how many each request accepted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from plugserve.core.block_table import DeviceBlockTable
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.host_copy import to_device
from plugserve.core.kv_cache import pages_needed
from plugserve.core.moved import moved_names
from plugserve.runtime import grammar, isolation, overlap
from plugserve.runtime.detokenizer import IncrementalText
from plugserve.runtime.metrics import Metrics
from plugserve.runtime.mixed_chunk import Riders
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.page_owners import check_pool_accounting
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import PENDING, FinishReason, Request, RequestIndex, RequestQueue, TokenLogprob
from plugserve.runtime.sampling import SampleOutput, sample
from plugserve.runtime.schedule_policy import order_waiting
from plugserve.runtime.scheduled_batch import ScheduledBatch
from plugserve.runtime.speculative import SpeculativeWorker

if TYPE_CHECKING:
    from plugserve.runtime.metrics import SchedulerGauges
    from plugserve.runtime.overlap import BatchResult

logger = logging.getLogger(__name__)


class Scheduler:
    """One KV space's requests: its pages (`radix.allocator`, the prefix cache `radix`) and `block_table` (the
    runner's, when None). Under DP attention each DP group has one (`runtime/dp_scheduler.py`). `fault_hook`: called
    with each batch about to run (`isolation.FaultHook`). `spec`: the speculative worker when speculating (the DP
    groups share the DP scheduler's), else one of its own."""

    def __init__(self, runner: ModelRunner, radix: RadixCache, tokenizer, metrics: Metrics | None = None,
                 block_table: DeviceBlockTable | None = None, fault_hook: isolation.FaultHook | None = None,
                 spec: SpeculativeWorker | None = None) -> None:
        args = runner.args
        self.runner, self.radix, self.tokenizer, self.metrics = runner, radix, tokenizer, metrics
        self.fault_hook = fault_hook
        self.allocator, self.block_table = radix.allocator, block_table or runner.block_table
        # Whose totals the metrics' gauges report: this scheduler's, or the DP scheduler's over every group.
        self.gauges: SchedulerGauges = self
        self.page_size, self.max_running = runner.page_size, runner.max_running_requests
        self.chunk_size = args.prefill_token_budget
        self.schedule_policy, self.stream_interval = args.schedule_policy, args.stream_interval
        self.mixed_chunk = args.enable_mixed_chunk  # refused with speculative decoding (ServerArgs)
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.chunked: Request | None = None  # mid chunked prefill: first in the next prefill batch
        self.by_rid = RequestIndex()  # every request in waiting, running or chunked: what an abort looks in
        config = args.speculative
        self.spec = spec or (SpeculativeWorker(runner, config) if config is not None else None)
        # Tokens a request's speculative decode step verifies (its last and its drafts), and the positions past its
        # length that step writes KV at (the drafts, and a tree's draft steps).
        self.verify_width = config.num_draft_tokens if config is not None else 1
        self.lookahead = config.lookahead if config is not None else 0
        self.loop: overlap.OverlapLoop[ScheduledBatch, Future[BatchResult]] = overlap.OverlapLoop(
            not args.disable_overlap_schedule and self.spec is None)
        self.unfilled: list[grammar.BatchGrammar] = []  # masks that wait for the batch in flight's tokens

    # -- requests ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.by_rid.add(request)

    def abort(self, rid: str) -> None:
        """End the requests with this id, found without a scan of the queue (a client may leave thousands)."""
        for request in self.by_rid.pop(rid):
            if request in self.waiting:
                self.waiting.remove(request)
            if not request.finished:
                self._finish(request, FinishReason.ABORT)
        self._drop_finished(scan_waiting=False)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.loop.in_flight)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Share of the KV pages that are not free (held by requests or the prefix cache)."""
        return 1 - self.allocator.num_free / self.allocator.num_pages

    @property
    def cache_hit_rate(self) -> float:
        return self.radix.hit_rate

    @property
    def overlap(self) -> bool:
        """Whether the next steps overlap the forward with processing (settable between steps)."""
        return self.loop.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.loop.overlap = on

    @property
    def overlap_status(self) -> str:
        """Whether scheduling overlaps the forward, and why not (for /server_info)."""
        if self.overlap:
            return "on"
        if self.spec is not None:
            return "off: speculative decoding runs the non-overlap loop"
        return "off: --disable-overlap-schedule"

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> None:
        """Plan, run and process one batch (with overlap: launch one, process the previous one)."""
        self.loop.step(self.schedule, lambda batch, prior: self.loop.submit(self.run, batch, prior), self.process)

    def process(self, batch: ScheduledBatch, future: Future[BatchResult]) -> None:
        """A batch's outcome to its requests: its tokens, or the error its forward raised (to those whose own
        forward raised: `runtime/isolation.py`)."""
        try:
            result = future.result()
        except Exception as exc:
            logger.exception("a %s batch of %d requests failed", batch.mode.name, len(batch.requests))
            self.fail_batch(batch.requests, f"{type(exc).__name__}: {exc}")
        else:
            for i, exc in result.failed.items():
                logger.error("the forward of request %s failed", batch.requests[i].rid, exc_info=exc)
                if not batch.requests[i].finished:
                    self._end_with_error(batch.requests[i], f"{type(exc).__name__}: {exc}")
            self._take_tokens(batch, result)
        grammar.fill_all(self.unfilled)  # the batch in flight's masks waited for these tokens

    def shutdown(self) -> None:
        self.loop.shutdown(self.process)

    # -- planning ------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """The next batch to run, its requests' pages allocated (None: nothing to run)."""
        self._drop_finished()
        return self._schedule_extend() or self._schedule_decode()

    def _pages_available(self) -> int:
        return self.allocator.num_free + self.radix.evictable_pages

    def _schedule_extend(self) -> ScheduledBatch | None:
        budget = self.chunk_size if self.chunk_size is not None else 1 << 62
        riders = Riders.of(self.running if self.mixed_chunk else [], budget, self._last_token_planned)
        budget = riders.prefill_budget
        candidates = ([self.chunked] if self.chunked else []) + order_waiting(self.schedule_policy, self.waiting,
                                                                             self.radix)
        requests: list[Request] = []
        lens: list[int] = []
        for request in candidates:
            if request is not self.chunked and len(self.running) + len(requests) >= self.max_running:
                break
            try:
                n = self._take_pages(request, budget, len(requests))
            except Exception as exc:
                self._fail(request, "being scheduled", exc)
                continue
            if n <= 0:
                break
            requests.append(request)
            lens.append(n)
            budget -= n
            if budget <= 0:
                break
        if not requests:
            self._drop_finished()
            return None
        self.chunked = None
        sampled = []
        for request, n in zip(requests, lens, strict=True):
            if request in self.waiting:
                self.waiting.remove(request)
                if self.metrics:
                    self.metrics.observe_scheduled(request)
            sampled.append(request.cached_len + n == request.seq_len)
            if sampled[-1]:
                self.running.append(request)
            else:
                self.chunked = request
        ids = [t for r, n in zip(requests, lens, strict=True) for t in r.all_ids[r.cached_len : r.cached_len + n]]
        next_ids = None
        if self.spec is not None:  # the next prompt token, or 0 where the token after the prompt is sampled
            next_ids = torch.tensor([t for r, n in zip(requests, lens, strict=True)
                                     for t in [*r.all_ids[r.cached_len + 1 : r.cached_len + n + 1], 0][:n]])
        riders.requests = self._grow(riders.requests)  # their pages were set aside by `_take_pages`
        riders.merge(requests, lens, sampled, ids)
        return self._build(ForwardMode.EXTEND, requests, lens, sampled, torch.tensor(ids, dtype=torch.int64),
                           next_ids, len(riders.requests))

    def _take_pages(self, request: Request, budget: int, batched: int) -> int:
        """How many of a waiting (or chunked) request's uncached tokens this prefill computes, at most `budget`,
        beside `batched` requests already in it; their pages are allocated. <= 0: it does not fit (a request that
        holds no KV yet is left holding none)."""
        fresh = request.cached_len == 0 and not request.pages
        if fresh:
            self._reuse_prefix(request)
        # Pages it may take: free and evictable ones, less what each running request's next step may need.
        spare = self._pages_available() - (len(self.running) + batched) * pages_needed(self.lookahead + 1,
                                                                                       self.page_size)
        room = (len(request.pages) + spare) * self.page_size - request.cached_len
        n = min(request.seq_len - request.cached_len, budget, room)
        if n <= 0:
            if fresh:  # a waiting request holds no KV: give the matched prefix back
                self._release(request)
                request.cached_len = 0
            return n
        request.pages += self.radix.alloc(pages_needed(request.cached_len + n, self.page_size) - len(request.pages))
        return n

    def _reuse_prefix(self, request: Request) -> None:
        # At least one token is left to compute: its logits give the next token.
        match = self.radix.match_prefix(request.all_ids[: request.seq_len - 1])
        if match.num_tokens:
            self.radix.lock(match.node)
            request.prefix_node = match.node
            request.pages = list(match.pages)
            request.cached_len = request.computed_len = match.num_tokens
        if not request.output_ids:
            request.cached_tokens = match.num_tokens

    def _schedule_decode(self) -> ScheduledBatch | None:
        # With overlap, a request whose last token the batch in flight samples needs no further step.
        active = [r for r in self.running if not self._last_token_planned(r)]
        if not active:
            return None
        # Every running request needs a slot for its last token (and drafts): retract the newest until all fit.
        while True:
            need = sum(self._missing_pages(r) for r in active)
            if need <= self._pages_available() or len(self.running) == 1:
                break
            newest = max(self.running, key=lambda r: r.arrival_time)
            self._retract(newest)
            if newest in active:
                active.remove(newest)
        requests = self._grow(active)
        if not requests:
            return None
        last, sampled = torch.tensor([r.last_id for r in requests], dtype=torch.int64), [True] * len(requests)
        if self.spec is None:
            return self._build(ForwardMode.DECODE, requests, [1] * len(requests), sampled, last)
        n = self.verify_width
        ids = torch.zeros(len(requests), n, dtype=torch.int64)
        ids[:, 0] = last
        return self._build(ForwardMode.TARGET_VERIFY, requests, [n] * len(requests), sampled, ids.view(-1))

    def _grow(self, requests: list[Request]) -> list[Request]:
        """Allocate the pages running requests lack for their next step -> those still running (one that the whole
        pool cannot hold stops)."""
        for request in requests:
            try:
                missing = self._missing_pages(request)
                if missing > self._pages_available():  # alone and still too long for the whole pool
                    logger.warning("request %s needs more KV than the pool holds: stopping it", request.rid)
                    self._finish(request, FinishReason.LENGTH)
                    continue
                request.pages += self.radix.alloc(missing)
            except Exception as exc:
                self._fail(request, "being scheduled", exc)
        self._drop_finished()
        return [r for r in requests if not r.finished]

    def _missing_pages(self, request: Request) -> int:
        """Pages a running request lacks for its next decode step (its last token and its drafts)."""
        return pages_needed(request.seq_len + self.lookahead, self.page_size) - len(request.pages)

    def _last_token_planned(self, request: Request) -> bool:
        """Its planned tokens (PENDING included) reach max_new_tokens or the context length."""
        return (len(request.output_ids) >= request.params.max_new_tokens
                or request.seq_len >= self.runner.context_length)

    def _retract(self, request: Request) -> None:
        """Give a running request's KV back (its full pages stay in the prefix cache) and queue it first:
        it resumes later by prefilling prompt + output so far."""
        logger.info("KV pool full: retracting request %s (%d tokens)", request.rid, request.seq_len)
        self.running.remove(request)
        self._release(request)
        request.cached_len = 0
        self.waiting.appendleft(request)
        if self.metrics:
            self.metrics.retractions.inc()

    def _build(self, mode: ForwardMode, requests: list[Request], lens: list[int], sampled: list[bool],
               input_ids: torch.Tensor, next_ids: torch.Tensor | None = None, mixed: int = 0) -> ScheduledBatch | None:
        """The batch of `requests`, `lens` new tokens each (`input_ids`, `next_ids` [sum(lens)] int64 on the host),
        the last `mixed` of them decoding in a prefill; None if it could not be built: its requests end with the
        error, and no other request does."""
        try:
            return self._assemble(mode, requests, lens, sampled, input_ids, next_ids, mixed)
        except Exception as exc:
            logger.exception("a %s batch of %d requests could not be built", mode.name, len(requests))
            self.fail_batch(requests, f"{type(exc).__name__}: {exc}")
            return None

    def _assemble(self, mode: ForwardMode, requests: list[Request], lens: list[int], sampled: list[bool],
                  input_ids: torch.Tensor, next_ids: torch.Tensor | None, mixed: int) -> ScheduledBatch:
        device, table = self.runner.device, self.block_table
        for request in requests:
            if request.table_row < 0:
                request.table_row = table.acquire()
            table.update(request.table_row, request.pages)
        block_table = table.gather([r.table_row for r in requests], max(len(r.pages) for r in requests))
        seq_lens = [r.cached_len + n for r, n in zip(requests, lens, strict=True)]
        batch = ForwardBatch.build(mode, seq_lens, lens, block_table, self.runner.pool)
        self.runner.prepare(batch)
        ends, end = [], -1
        for n in lens:
            end += n
            ends.append(end)
        rows = [row for row, is_sampled in zip(ends, sampled, strict=True) if is_sampled]
        # Inputs still being sampled by the batch in flight: the last token of a decoding request.
        resolve = [(ends[i], r.pending_row) for i, r in enumerate(requests) if r.last_id == PENDING]
        masks = grammar.BatchGrammar.plan([r for r, s in zip(requests, sampled, strict=True) if s],
                                          self.runner.sample_vocab, self.unfilled if resolve else None)
        sample_row = 0
        for request, n, is_sampled in zip(requests, lens, sampled, strict=True):
            request.cached_len += n  # the KV of these tokens exists once the forward has run
            if is_sampled:
                request.add_pending()
                request.pending_row = sample_row
                sample_row += 1
        return ScheduledBatch(mode, requests, lens, sampled, batch, to_device(input_ids, device),
                              to_device(torch.tensor(rows, dtype=torch.int64), device),
                              [r.cached_len for r in requests], resolve,
                              None if next_ids is None else to_device(next_ids, device), masks, mixed)

    # -- running -------------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch, prior: Future[BatchResult] | None) -> BatchResult:
        """Run a batch and sample its tokens; `prior`: the batch in flight, whose tokens may be its inputs. If
        the forward raises, its requests are re-run in parts, and only those failing alone fail."""
        return isolation.run_alone(batch.with_inputs(self.inputs(batch, prior)), self.forward, self.runner.prepare)

    def check_faults(self, batch: ScheduledBatch) -> None:
        """Call the fault hook (if any) with a batch about to run: what it raises fails that forward."""
        if self.fault_hook is not None:
            self.fault_hook(batch.mode, batch.requests)

    def forward(self, batch: ScheduledBatch) -> SampleOutput:
        """The sampled tokens of a batch whose inputs are complete (`ScheduledBatch.with_inputs`)."""
        self.check_faults(batch)
        input_ids, requests, forward = batch.input_ids, batch.sampled_requests, batch.forward_batch
        if self.spec is None:
            sampled = self.sample(self.runner.forward(input_ids, forward, batch.sample_rows), requests, batch.masks)
        elif batch.mode is ForwardMode.TARGET_VERIFY:
            sampled = self.spec.verify(forward, input_ids, requests, self.runner.sampling_generator)
        else:
            assert batch.next_ids is not None
            sampled = self.spec.extend(forward, input_ids, batch.next_ids, batch.sample_rows,
                                       [r.table_row for r in requests], lambda logits: self.sample(logits, requests))
        return sampled

    def inputs(self, batch: ScheduledBatch, prior: Future[BatchResult] | None) -> torch.Tensor:
        """The batch's input ids [T] int64 on the device, those the batch in flight (`prior`) samples filled in."""
        return overlap.fill_pending(batch.input_ids, batch.resolve, prior)

    def sample(self, logits: torch.Tensor, requests: list[Request], masks: grammar.BatchGrammar | None = None
               ) -> SampleOutput:
        """Tokens of the sampled `requests` from their logits [len(requests), vocab] float32, under
        their grammars' `masks` (filled by the scheduler thread: with overlap, once the batch before has run)."""
        if not requests:  # a prefill chunk in the middle of a prompt: nothing to sample
            return SampleOutput(torch.zeros(0, dtype=torch.int64, device=logits.device), None, None, None)
        # Penalties see the tokens known when the batch was planned (with overlap, not the one in flight).
        return sample(
            logits,
            [r.params for r in requests],
            [r.prompt_ids for r in requests],
            [r.penalty_ids for r in requests],
            [r.generator for r in requests],
            self.runner.sampling_generator,
            None if masks is None else masks.bitmask(logits.device),
        )

    # -- results -------------------------------------------------------------------------------------

    def _take_tokens(self, batch: ScheduledBatch, result: BatchResult) -> None:
        sample = result.wait()
        tokens, logprobs, tops, counts = sample.runs()
        verified = sample.accept_lens is not None
        row, appended, sampled = 0, 0, []  # sampled: their outputs go once the metrics count the batch's tokens
        for index, (request, was_sampled, end) in enumerate(zip(batch.requests, batch.sampled, batch.ends,
                                                                strict=True)):
            if not request.finished:  # its KV is written now (none if it was retracted since: pages given back)
                if verified:  # the KV past the accepted tokens is stale
                    request.cached_len -= self.verify_width - counts[row]
                request.computed_len = max(request.computed_len, min(end, request.cached_len))
            try:
                if was_sampled and not request.finished:  # finished by an earlier batch: the extra token is dropped
                    for i in range(counts[row]):  # the tokens after a stop are dropped
                        self._append(request, tokens[row][i], None if logprobs is None else logprobs[row][i],
                                     tops[row][i])
                        appended += 1
                        if request.finished:
                            break
                    sampled.append(request)
                    if verified and not request.finished:
                        self._trim_pages(request)
                # Prompt pages are shared at once (concurrent requests reuse them); decoded pages when the request
                # releases them: inserting a running path every step cost more host time than a batch-64 step.
                if not request.finished and batch.prefills(index):
                    self._cache_prefix(request)
            except Exception as exc:
                sampled = [r for r in sampled if r is not request]  # it ends with the error instead
                self._fail(request, "its output was processed", exc)
            row += was_sampled
        if self.metrics:
            self.metrics.observe_batch(appended, batch.mode is not ForwardMode.EXTEND, self.gauges)
            if verified:
                self.metrics.observe_verify(counts)
        for request in sampled:
            try:
                self._emit(request)
            except Exception as exc:
                self._fail(request, "its output was processed", exc)
        self._drop_finished()

    def _append(self, request: Request, token: int, logprob: float | None, top: tuple[tuple[int, float], ...]
                ) -> None:
        """Put a sampled token in place of the request's first PENDING one (after its last resolved one: the rest of
        a verified run) and check the stop rules. `top`: the top logprobs (id, logprob) of the batch's widest ask."""
        params = request.params
        index = request.resolve(token)
        if params.logprobs and logprob is not None:
            request.logprobs.append(TokenLogprob(token, logprob, top[: params.top_logprobs]))
        if grammar.accept(request, token) or token in params.stop_token_ids or (
                not params.ignore_eos and token in request.eos_token_ids):
            request.finish_reason, request.matched_stop = FinishReason.STOP, token
        elif index + 1 >= params.max_new_tokens or request.known_len >= self.runner.context_length:
            request.finish_reason = FinishReason.LENGTH
        self._decode(request)

    def _decode(self, request: Request) -> None:
        """Decode the output into `request.text`, cut before a stop string (which finishes the request)."""
        params = request.params
        stop_token = request.finish_reason is FinishReason.STOP and isinstance(request.matched_stop, int)
        if request.detokenizer is None:
            request.detokenizer = IncrementalText(self.tokenizer, params.skip_special_tokens)
        # The stop token itself is not text.
        text = request.detokenizer.of(request.output_ids, request.num_resolved - stop_token, final=request.finished)
        for stop in params.stop:
            at = text.find(stop, max(0, request.sent_text_len - len(stop)))
            if at != -1 and not request.finished:
                text, request.finish_reason, request.matched_stop = text[:at], FinishReason.STOP, stop
        request.text = text

    def _emit(self, request: Request) -> None:
        """Report new text: decoded output minus a trailing partial character or partial stop string."""
        text, safe = request.text, request.sendable_len
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
            if self.metrics:
                self.metrics.observe_first_token(request, now)
        elif self.metrics and request.last_token_time is not None:
            self.metrics.itl.observe(now - request.last_token_time)
        request.last_token_time = now
        if not request.finished and request.sent_tokens > 0 and request.num_resolved - request.sent_tokens < \
                self.stream_interval:
            return  # --stream-interval: the text waits for more tokens (the first and the last go at once)
        new_text = text[request.sent_text_len : safe]
        request.sent_text_len = max(request.sent_text_len, safe)
        new_tokens = request.output_ids[request.sent_tokens : request.num_resolved]
        new_logprobs = request.logprobs[request.sent_tokens :]
        request.sent_tokens = request.num_resolved
        if request.finished:
            request.drop_pending()
            self._release(request)
            if self.metrics:
                self.metrics.observe_finish(request)
        request.on_output(request.output(new_text, new_tokens, new_logprobs))

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request outside normal sampling (abort, error, no room) and tell its owner."""
        request.finish_reason = reason
        self._release(request)
        if self.metrics:
            self.metrics.observe_finish(request)
        request.on_output(request.output("", [], [], error))

    def _fail(self, request: Request, stage: str, exc: Exception) -> None:
        """End one request whose own handling raised (planning it, its stop rules, its callback): it alone gets
        the error, and the loop goes on."""
        logger.exception("request %s failed while %s", request.rid, stage)
        if not request.finished:
            self._end_with_error(request, f"{type(exc).__name__}: {exc}")

    def _end_with_error(self, request: Request, error: str) -> None:
        try:
            self._finish(request, FinishReason.ERROR, error)
        except Exception:  # its callback failed too: it is ended all the same
            logger.exception("could not report the failure of request %s", request.rid)
            request.finish_reason = FinishReason.ERROR

    def fail_batch(self, batch_requests: Sequence[Request], error: str) -> None:
        for request in batch_requests:
            if not request.finished:
                self._end_with_error(request, error)
        self._drop_finished()

    def fail_all(self, error: str) -> None:
        """End every request the scheduler holds with `error` (after a failure the loop cannot pin on one)."""
        in_flight: list[Request] = []
        if (taken := self.loop.take_in_flight()) is not None:  # its forward ends first: it writes pages to be freed
            batch, future = taken
            in_flight = batch.requests
            grammar.fill_all(self.unfilled)  # its sampling may wait for its masks
            with contextlib.suppress(Exception):
                future.result()
        self.fail_batch([*self.waiting, *self.running, *([self.chunked] if self.chunked else []), *in_flight], error)

    # -- KV ownership --------------------------------------------------------------------------------

    def check_pool_accounting(self) -> None:
        """`page_owners.check_pool_accounting` of this scheduler's requests, between two steps (as the engine's)."""
        check_pool_accounting([*self.waiting, *self.running, *filter(None, [self.chunked])], self.radix,
                              self.block_table)

    def _cache_prefix(self, request: Request) -> int:
        """Hand the request's computed full pages to the prefix cache (so concurrent requests share them)
        and hold the cached path locked while the request still runs. Returns the pages now cached."""
        if not self.radix.enabled:
            return 0
        # Only tokens known here (a PENDING one has no id to key the cache with yet) whose KV a batch has
        # written: with overlap, a batch in flight may still fail, and pages it was to fill must not be reused.
        full_pages = min(request.computed_len, request.known_len) // self.page_size
        if full_pages == 0:
            return 0
        match = self.radix.insert(request.all_ids[: full_pages * self.page_size], request.pages[:full_pages])
        request.pages[:full_pages] = match.pages
        self.radix.lock(match.node)
        if request.prefix_node is not None:
            self.radix.unlock(request.prefix_node)
        request.prefix_node = match.node
        return full_pages

    def _trim_pages(self, request: Request) -> None:
        """Free the pages past a running request's length (they held drafts it rejected)."""
        keep = pages_needed(request.seq_len, self.page_size)
        self.allocator.free(request.pages[keep:])
        del request.pages[keep:]

    def _release(self, request: Request) -> None:
        """Give back a request's KV: full pages to the prefix cache, the rest to the allocator."""
        if request.table_row >= 0:
            self.block_table.release(request.table_row)
            request.table_row = -1
        if not request.pages:
            return
        cached = self._cache_prefix(request)
        self.allocator.free(request.pages[cached:])
        if request.prefix_node is not None:
            self.radix.unlock(request.prefix_node)
            request.prefix_node = None
        request.pages = []
        request.computed_len = 0

    def _drop_finished(self, scan_waiting: bool = True) -> None:
        """Let go of finished requests; `scan_waiting` False spares the O(waiting) scan (an abort's are out)."""
        for request in [*self.running, *(self.waiting if scan_waiting else ()), self.chunked]:
            if request is not None and request.finished:
                self.by_rid.discard(request)
        self.running = [r for r in self.running if not r.finished]
        if scan_waiting:
            self.waiting = RequestQueue(r for r in self.waiting if not r.finished)
        if self.chunked is not None and self.chunked.finished:
            self.chunked = None
        if self.metrics:
            self.metrics.refresh_gauges(self.gauges)


__getattr__ = moved_names(__name__)
