"""--watchdog-timeout: a step stuck past it ends the engine with an error; a step within it does not."""

from __future__ import annotations

import threading
import time

from plugserve.runtime.engine import Engine
from plugserve.runtime.request import FinishReason
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.watchdog import Watchdog


def test_the_watchdog_fires_once_for_a_step_past_the_timeout_only():
    verdicts: list[str] = []
    dog = Watchdog(0.2, verdicts.append)
    dog.start()
    dog.step_started()
    time.sleep(0.1)
    dog.step_ended()
    time.sleep(0.3)
    assert verdicts == []
    dog.step_started()
    time.sleep(0.6)
    dog.stop()
    assert len(verdicts) == 1 and "--watchdog-timeout" in verdicts[0]


def test_a_stuck_scheduler_step_ends_the_engine_and_its_requests_with_an_error():
    engine = Engine(ServerArgs(model_preset="tiny", watchdog_timeout=0.3))
    release = threading.Event()
    died: list[str] = []
    engine.on_death = died.append
    engine.ready.wait(60)
    engine.scheduler.step = lambda: release.wait(30)  # a forward that never returns
    try:
        outputs: list = []
        engine.submit("Hello", SamplingParams(max_new_tokens=4), outputs.append)
        deadline = time.monotonic() + 10
        while not died and time.monotonic() < deadline:
            time.sleep(0.05)
        assert died and "--watchdog-timeout" in died[0]
        assert outputs[-1].finish_reason is FinishReason.ERROR and "--watchdog-timeout" in outputs[-1].error
        assert not engine.alive
    finally:
        release.set()
        engine.shutdown()
