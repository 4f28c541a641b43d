"""The scheduler's bookkeeping of the requests it holds, without running a forward."""

from __future__ import annotations

import gc
import time

import pytest

from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.runtime.metrics import Metrics
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import FinishReason, Request, RequestOutput
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.scheduler import Scheduler
from plugserve.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(ServerArgs(model_preset="tiny"))


def _scheduler(runner: ModelRunner) -> Scheduler:
    return Scheduler(runner, RadixCache(runner.allocator, runner.page_size), load_tokenizer(EMBEDDED_MODEL_DIR))


def _requests(count: int, outputs: list[RequestOutput], rid: str = "r") -> list[Request]:
    return [Request(f"{rid}{i}", [1, 2, 3], SamplingParams(max_new_tokens=4), outputs.append) for i in range(count)]


def test_aborting_thousands_of_queued_requests_is_fast(runner):
    """A client that left a request of 12,800 sequences used to hold up every other request for seconds: each abort
    scanned the queue and rebuilt it (O(n^2); 5,000 took about 4 s). Four times the aborts take about four times as
    long, not sixteen: a ratio of the best of three runs with the garbage collector off, so that neither a loaded
    machine nor a collection pause decides."""
    elapsed: dict[int, float] = {}
    for count in (2000, 8000):
        for _ in range(3):
            scheduler, outputs = _scheduler(runner), []
            requests = _requests(count, outputs)
            for request in requests:
                scheduler.add(request)
            gc.disable()
            try:
                start = time.perf_counter()
                for request in reversed(requests):
                    scheduler.abort(request.rid)
                took = time.perf_counter() - start
            finally:
                gc.enable()
            elapsed[count] = min(elapsed.get(count, took), took)
            assert [o.finish_reason for o in outputs] == [FinishReason.ABORT] * count
            assert scheduler.num_waiting == 0 and len(scheduler.by_rid) == 0 and not scheduler.has_work
    assert elapsed[8000] < 8 * elapsed[2000] + 0.05, elapsed


def test_an_abort_ends_every_request_of_its_id_and_only_those(runner):
    scheduler, outputs = _scheduler(runner), []
    first, second, other = _requests(1, outputs, "same") + _requests(1, outputs, "same") + _requests(1, outputs)
    for request in (first, second, other):
        scheduler.add(request)
    scheduler.abort("nobody")
    scheduler.abort("same0")
    assert first.finish_reason is second.finish_reason is FinishReason.ABORT and not other.finished
    assert list(scheduler.waiting) == [other] and len(scheduler.by_rid) == 1


def test_a_final_output_comes_after_its_tokens_are_counted(runner):
    """A client that reads /metrics when its request ends finds its tokens counted: each batch's tokens reach the
    metrics before any of its outputs go out (the last batch's were counted after its outputs, a race that a
    speculative test lost now and then)."""
    metrics = Metrics()
    scheduler = Scheduler(runner, RadixCache(runner.allocator, runner.page_size), load_tokenizer(EMBEDDED_MODEL_DIR),
                          metrics)
    counted_at_output: list[tuple[int, float]] = []

    def on_output(output: RequestOutput) -> None:
        counted_at_output.append((output.completion_tokens, metrics.registry.get_sample_value(
            "plugserve_generation_tokens_total")))

    for i in range(2):
        scheduler.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True), on_output))
    while scheduler.has_work:
        scheduler.step()
    finals = [counted for completion, counted in counted_at_output if completion == 5]
    assert finals == [10.0, 10.0], counted_at_output
