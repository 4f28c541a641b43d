"""DP attention's scheduling on rank 0: a `Scheduler` per DP group, one forward per step for all of them.

Each DP group (--tp-size / --dp-size ranks, each holding the group's whole pool) caches its own requests' KV in its
own pool, so each has its own scheduler here: its page allocator, prefix cache and block table (group 0's are the
runner's; the others' pages live on their ranks' devices, rank 0 only accounts for them). A new request goes to the
group with the fewest requests, running and waiting, and stays there: its KV is on that group's ranks.

A step plans every group's batch, then runs them in one `ModelRunner.forward_groups` (each rank its group's,
an idle group an IDLE batch, since the MLP layers' collectives need every rank), samples each group's rows on
rank 0 and lets each group's scheduler process its tokens, through the same `OverlapLoop` as one `Scheduler`.
With speculative decoding the groups share one `SpeculativeWorker` (rank 0's, holding group 0's draft state; every
other rank's holds its group's), and a step runs the groups' prefill batches in one speculative prefill step,
then their TARGET_VERIFY batches in one round (`extend_groups`, `verify_groups`), every rank joining both (a group
with no batch of that kind idles through it). If the step raises, each group's batch runs alone (the others idle),
and a failing one in parts (`runtime/isolation.py`): only requests whose own forward raises fail.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from concurrent.futures import Future

from plugserve.core.block_table import DeviceBlockTable
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.kv_cache import PageAllocator
from plugserve.runtime import isolation
from plugserve.runtime.metrics import Metrics
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.overlap import BatchResult, OverlapLoop
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.rank_protocol import Part
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SampleOutput
from plugserve.runtime.scheduled_batch import ScheduledBatch
from plugserve.runtime.scheduler import Scheduler
from plugserve.runtime.speculative import Prefill, Round, SpeculativeWorker

logger = logging.getLogger(__name__)

Batches = list[ScheduledBatch | None]  # one step's batch of each group (None: it idles)
Results = list[Future[BatchResult] | None]  # their sampled tokens


class DPScheduler:
    """The Engine's scheduler under DP attention: the same interface as `Scheduler`, over `runner.dp_size`
    groups."""

    def __init__(self, runner: ModelRunner, tokenizer, metrics: Metrics | None, radix_cache: bool,
                 fault_hook: isolation.FaultHook | None = None) -> None:
        self.runner = runner
        config = runner.args.speculative
        self.spec = SpeculativeWorker(runner, config) if config is not None else None
        self.groups: list[Scheduler] = []
        for group in range(runner.dp_size):
            allocator = runner.allocator if group == 0 else PageAllocator(runner.allocator.num_pages)
            table = runner.block_table
            if group:
                table = DeviceBlockTable(table.num_rows, table.max_pages, runner.device)
            scheduler = Scheduler(runner, RadixCache(allocator, runner.page_size, enabled=radix_cache), tokenizer,
                                  metrics, table, fault_hook, self.spec)
            scheduler.gauges = self
            self.groups.append(scheduler)
        self.loop: OverlapLoop[Batches, Results] = OverlapLoop(self.groups[0].overlap)

    # -- requests ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        min(self.groups, key=lambda g: g.num_running + g.num_waiting).add(request)

    def abort(self, rid: str) -> None:
        for group in self.groups:
            group.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.loop.in_flight is not None or any(g.has_work for g in self.groups)

    @property
    def num_running(self) -> int:
        return sum(g.num_running for g in self.groups)

    @property
    def num_waiting(self) -> int:
        return sum(g.num_waiting for g in self.groups)

    @property
    def kv_usage(self) -> float:
        """The groups' pools together (they are the same size)."""
        return sum(g.kv_usage for g in self.groups) / len(self.groups)

    @property
    def cache_hit_rate(self) -> float:
        queried = sum(g.radix.queried_tokens for g in self.groups)
        return sum(g.radix.hit_tokens for g in self.groups) / queried if queried else 0.0

    @property
    def overlap(self) -> bool:
        """Whether the next steps overlap the forward with processing (settable between steps)."""
        return self.loop.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.loop.overlap = on

    @property
    def overlap_status(self) -> str:
        return self.groups[0].overlap_status

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> None:
        """Plan every group's batch, run them in one forward and process what came out (with overlap: launch
        this step's, process the previous one's)."""
        self.loop.step(self._schedule, self._launch, self._finish)

    def _schedule(self) -> Batches | None:
        batches: Batches = [g.schedule() for g in self.groups]
        return batches if any(b is not None for b in batches) else None

    def _launch(self, batches: Batches, prior: Results | None) -> Results:
        """Run the step's forward (on the worker thread with overlap): each group's future gets its sampled
        tokens, or the exception that failed every one of its requests."""
        futures: Results = [None if b is None else Future() for b in batches]
        priors = prior if prior is not None else [None] * len(self.groups)

        def run() -> None:
            try:
                results = self._run(batches, priors)
            except Exception as exc:  # before any forward (the inputs): no request to pin it on
                results = [exc] * len(batches)
            for future, result in zip(futures, results, strict=True):
                if future is None:
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)  # type: ignore[arg-type]

        self.loop.submit(run)
        return futures

    def _run(self, batches: Batches, priors: Results) -> list[BatchResult | Exception | None]:
        full = [None if b is None else b.with_inputs(g.inputs(b, prior))
                for g, b, prior in zip(self.groups, batches, priors, strict=True)]
        try:
            for group, batch in zip(self.groups, full, strict=True):
                if batch is not None:
                    group.check_faults(batch)
            return [None if out is None else BatchResult.of(out) for out in self._forward(full)]
        except Exception as exc:
            logger.warning("a DP step failed (%s: %s): each group's batch runs alone", type(exc).__name__, exc)
        results: list[BatchResult | Exception | None] = []
        for index, batch in enumerate(full):
            try:
                results.append(None if batch is None else isolation.run_alone(
                    batch, lambda part, index=index: self._alone(index, part), self.runner.prepare))
            except Exception as exc:
                results.append(exc)
        return results

    def _forward(self, full: Batches) -> list[SampleOutput | None]:
        """Every group's batch (inputs complete; None: the group idles) in one step -> each group's tokens: one
        forward, or with speculative decoding a prefill step for the groups' EXTEND batches, then a round for their
        TARGET_VERIFY ones, each joined by every group."""
        if self.spec is None:
            logits = self.runner.forward_groups([None if b is None else Part(b.input_ids, b.forward_batch,
                                                                             b.sample_rows) for b in full])
            return [None if b is None else g.sample(rows, b.sampled_requests, b.masks)
                    for g, b, rows in zip(self.groups, full, logits, strict=True)]
        none: list[SampleOutput | None] = [None] * len(full)
        prefills = [None if b is None or b.mode is not ForwardMode.EXTEND else
                    Prefill(b.forward_batch, b.input_ids, b.next_ids, b.sample_rows,
                            [r.table_row for r in b.sampled_requests],
                            functools.partial(g.sample, requests=b.sampled_requests))
                    for g, b in zip(self.groups, full, strict=True)]
        prefilled = self.spec.extend_groups(prefills) if any(p is not None for p in prefills) else none
        rounds = [None if b is None or b.mode is not ForwardMode.TARGET_VERIFY else
                  Round(b.forward_batch, b.input_ids, b.sampled_requests) for b in full]
        verified = (self.spec.verify_groups(rounds, self.runner.sampling_generator)
                    if any(r is not None for r in rounds) else none)
        return [p if p is not None else v for p, v in zip(prefilled, verified, strict=True)]

    def _alone(self, index: int, batch: ScheduledBatch) -> SampleOutput:
        """Group `index`'s batch (or part of it) in a step of its own, the other groups idle."""
        self.groups[index].check_faults(batch)
        out = self._forward([batch if i == index else None for i in range(len(self.groups))])[index]
        assert out is not None
        return out

    def _finish(self, batches: Batches, futures: Results) -> None:
        for group, batch, future in zip(self.groups, batches, futures, strict=True):
            if batch is not None:
                group.process(batch, future)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.loop.shutdown(self._finish)
        for group in self.groups:
            group.shutdown()

    def fail_all(self, error: str) -> None:
        """End every request of every group with `error`."""
        if (taken := self.loop.take_in_flight()) is not None:  # its forward ends first: it writes pages to be freed
            batches, futures = taken
            for group, batch, future in zip(self.groups, batches, futures, strict=True):
                if batch is not None:
                    with contextlib.suppress(Exception):
                        future.result()  # type: ignore[union-attr]
                    group.fail_batch(batch.requests, error)
        for group in self.groups:
            group.fail_all(error)

    def check_pool_accounting(self) -> None:
        """`Scheduler.check_pool_accounting` of every group (each owns its pages and block-table rows)."""
        for group in self.groups:
            group.check_pool_accounting()
