"""The overlap of the host's scheduling with the device's forward: with overlap on, the forward of step i runs on a
worker thread while the scheduler's thread processes step i - 1's tokens and plans step i + 1, whose decode inputs
are step i's sampled tokens still on the device."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

import torch

from plugserve.core.host_copy import to_device
from plugserve.runtime.sampling import SampleOutput

Work = TypeVar("Work")  # what one step plans: a batch, or one batch per DP group
Handle = TypeVar("Handle")  # what launching it gives: the future(s) of its sampled tokens


@dataclass
class BatchResult:
    """A batch's sampled tokens: `token_ids` [sum(sampled)] int64 on the device (the next batch's inputs
    under overlap), and the whole SampleOutput copied to (pinned) host memory, valid once `ready` fired.
    `failed`: the requests (by position in the batch) whose own forward raised, with its exception; their rows
    hold placeholders (`runtime/isolation.py`)."""

    token_ids: torch.Tensor
    host: SampleOutput
    ready: torch.cuda.Event | None
    failed: dict[int, Exception] = field(default_factory=dict)

    @classmethod
    def of(cls, sampled: SampleOutput, failed: dict[int, Exception] | None = None) -> BatchResult:
        """Start the copy to the host without waiting for it."""
        failed = failed or {}
        if sampled.token_ids.device.type != "cuda":
            return cls(sampled.token_ids, sampled, None, failed)
        tensors = (getattr(sampled, f.name) for f in fields(SampleOutput))
        host = SampleOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in tensors))
        ready = torch.cuda.Event()
        ready.record()
        return cls(sampled.token_ids, host, ready, failed)

    def wait(self) -> SampleOutput:
        """The host copy, once the batch has run. Waiting on the event releases the GIL; Tensor.tolist on a
        GPU tensor waits holding it, which stalled the overlap thread's planning and the HTTP loop for
        the whole forward."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


def fill_pending(input_ids: torch.Tensor, resolve: list[tuple[int, int]], prior: Future[BatchResult] | None
                 ) -> torch.Tensor:
    """`input_ids` [T] int64 on the device with the rows `resolve` names ((input row, sampled row of `prior`)) taken
    from `prior`'s sampled tokens. If `prior`'s forward failed, those rows get a placeholder token and the batch
    runs all the same: they belong to `prior`'s requests, which end with its error before this batch's tokens are
    processed (theirs are dropped), while its other requests' inputs never depended on `prior`. The same holds
    for the placeholder rows of requests `prior.failed` names."""
    if not resolve:
        return input_ids
    assert prior is not None, "PENDING inputs without a batch in flight"
    # Launched on the one worker thread after `prior`, or not overlapped: `prior` is done, this does not wait.
    if prior.exception() is not None:
        return input_ids.clamp(min=0)
    rows, sources = zip(*resolve, strict=True)
    filled = input_ids.clone()
    # Stream-ordered index uploads: a blocking one would wait for the batch in flight.
    filled[to_device(torch.tensor(rows), filled.device)] = prior.result().token_ids[
        to_device(torch.tensor(sources), filled.device)]
    return filled


class OverlapLoop(Generic[Work, Handle]):
    """Steps of plan, launch and finish. With `overlap` a step launches its work on the worker thread and then
    finishes the previous step's; without, it finishes its own at once (`overlap` may change between steps).
    `in_flight`: the work launched and not finished yet, with its handle."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        # The worker thread, when the loop starts overlapped; otherwise launches run at once on the caller's.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="plugserve-forward") if overlap else None
        self.in_flight: tuple[Work, Handle] | None = None

    def step(self, plan: Callable[[], Work | None], launch: Callable[[Work, Handle | None], Handle],
             finish: Callable[[Work, Handle], None]) -> None:
        """`launch(work, prior)` gets the handle of the step in flight (None: none), whose tokens may be inputs."""
        previous = self.in_flight
        # Planned before the step in flight is finished: its tokens are PENDING inputs here.
        work = plan()
        launched = None if work is None else (work, launch(work, previous[1] if previous is not None else None))
        if not self.overlap:  # the step's own work is finished at once
            previous, launched = launched, None
        self.in_flight = launched
        if previous is not None:
            finish(*previous)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """fn(*args) on the worker thread with overlap, else now: its result, or the Exception it raised."""
        if self._executor is not None:
            return self._executor.submit(fn, *args)
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # one failing batch must not stop the server
            future.set_exception(exc)
        return future

    def take_in_flight(self) -> tuple[Work, Handle] | None:
        """The step in flight, which the caller now ends (it is no longer in flight)."""
        taken, self.in_flight = self.in_flight, None
        return taken

    def shutdown(self, finish: Callable[[Work, Handle], None]) -> None:
        """Finish the step in flight and stop the worker thread."""
        if (taken := self.take_in_flight()) is not None:
            finish(*taken)
        if self._executor is not None:
            self._executor.shutdown()
