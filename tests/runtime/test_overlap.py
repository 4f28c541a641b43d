"""OverlapLoop: with overlap a step launches its work and finishes the previous step's; without, it finishes its
own at once; the mode may change between steps (bench_one_batch times prefill without it, decode with it)."""

from __future__ import annotations

from concurrent.futures import Future

from plugserve.runtime.overlap import OverlapLoop
from plugserve.runtime.scheduler import Scheduler


def _steps(loop: OverlapLoop, work: list[int], events: list[str]) -> None:
    queue = list(work)

    def plan() -> int | None:
        return queue.pop(0) if queue else None

    def launch(item: int, prior: Future | None) -> Future:
        events.append(f"launch {item} after {prior.result() if prior is not None else None}")
        return loop.submit(lambda: item)

    def finish(item: int, future: Future) -> None:
        events.append(f"finish {future.result()}")

    while queue or loop.in_flight is not None:
        loop.step(plan, launch, finish)


def test_overlap_finishes_each_step_one_step_later_and_hands_launch_the_step_in_flight():
    loop: OverlapLoop = OverlapLoop(overlap=True)
    events: list[str] = []
    _steps(loop, [1, 2, 3], events)
    loop.shutdown(lambda item, future: None)
    assert events == ["launch 1 after None", "launch 2 after 1", "finish 1", "launch 3 after 2", "finish 2",
                      "finish 3"]


def test_without_overlap_each_step_finishes_its_own_work_and_the_mode_can_change_between_steps():
    loop: OverlapLoop = OverlapLoop(overlap=True)
    loop.overlap = False
    events: list[str] = []
    _steps(loop, [1, 2], events)
    assert events == ["launch 1 after None", "finish 1", "launch 2 after None", "finish 2"]
    assert loop.in_flight is None
    loop.overlap = True
    _steps(loop, [3, 4], events)
    loop.shutdown(lambda item, future: None)
    assert events[4:] == ["launch 3 after None", "launch 4 after 3", "finish 3", "finish 4"]


def test_a_launch_that_raises_without_overlap_gives_its_exception_to_finish():
    loop: OverlapLoop = OverlapLoop(overlap=False)

    def boom() -> int:
        raise RuntimeError("forward failed")

    failures: list[str] = []
    loop.step(lambda: 1, lambda item, prior: loop.submit(boom),
              lambda item, future: failures.append(str(future.exception())))
    assert failures == ["forward failed"]


def test_a_schedulers_overlap_flag_is_its_loops():
    """bench_one_batch sets `scheduler.overlap` between steps: the loop must follow."""
    scheduler = Scheduler.__new__(Scheduler)  # only the loop matters here
    scheduler.loop = OverlapLoop(overlap=True)
    scheduler.overlap = False
    assert scheduler.loop.overlap is False and scheduler.overlap is False
