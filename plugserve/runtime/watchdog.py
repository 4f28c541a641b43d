"""--watchdog-timeout: a scheduler step that runs longer than this (a hung forward, a deadlocked collective) ends
the server with an error instead of leaving every client waiting forever."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """Times each step the loop brackets with `step_started` / `step_ended`; past `timeout` seconds in one, calls
    `on_hang(error)` once, from its own thread (the loop's is the one stuck)."""

    def __init__(self, timeout: float, on_hang: Callable[[str], None]) -> None:
        self.timeout, self.on_hang = timeout, on_hang
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="plugserve-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> None:
        self._started = None

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout:
                self.on_hang(f"a scheduler step has run for over {self.timeout:g} s (--watchdog-timeout): the "
                             "server stops")
                return
