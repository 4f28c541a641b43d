"""Progress of the long start-up steps (loading weights, warm-up, CUDA-graph capture): a tqdm bar on a terminal,
else log lines (at most one per tenth, and the end), so that piped output (docker, systemd) shows it too."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger("plugserve.progress")
T = TypeVar("T")


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        self._bar = tqdm(total=total, desc=desc, unit=unit) if sys.stderr.isatty() else None
        self._logged_tenth = 0
        self._start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        tenth = self.done * 10 // max(self.total, 1)
        if tenth > self._logged_tenth and self.done < self.total:
            self._logged_tenth = tenth
            logger.info("%s: %d/%d %s (%.1f s)", self.desc, self.done, self.total, self.unit,
                        time.perf_counter() - self._start)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.total:
            logger.info("%s: %d/%d %s in %.1f s", self.desc, self.done, self.total, self.unit,
                        time.perf_counter() - self._start)


def track(items: Iterable[T], total: int, desc: str, unit: str = "it") -> Iterator[T]:
    """`items`, reporting progress as they are taken."""
    progress = Progress(total, desc, unit)
    try:
        for item in items:
            yield item
            progress.update()
    finally:
        progress.close()
