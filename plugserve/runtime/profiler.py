"""SGLang's live profiling: `/start_profile` starts torch's profiler on the scheduler thread, for a number of
scheduler steps or until `/stop_profile`; then a Chrome trace (Perfetto opens it) and a table of the ops and kernels by
self time (totals over the steps, headed by the time a step) are written to the output folder. It covers this
process: rank 0's GPU and its scheduler (the other tensor-parallel ranks run the same kernels on their GPUs, and are
not profiled)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)

# SGLang's variable for where traces go when a request names no folder.
OUTPUT_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"
ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names: host ops, device kernels, memory allocations
TABLE_ROWS = 60


class ProfileError(ValueError):
    """A profile that cannot start or stop as asked (already running, not running, no GPU, folder not writable)."""


@dataclass(frozen=True)
class ProfileFiles:
    """What a finished profile wrote: the Chrome trace (.json.gz) and the table of ops by self time (.txt)."""

    trace: Path
    table: Path
    steps: int


def default_activities() -> tuple[str, ...]:
    return ("CPU", "GPU") if torch.cuda.is_available() else ("CPU",)


class StepProfiler:
    """One torch profiler at a time over the scheduler's steps. Every method runs on the scheduler thread."""

    def __init__(self) -> None:
        self.session: profile | None = None
        self.output_dir = Path()
        self.num_steps: int | None = None
        self.steps = 0
        self.started = 0.0
        self.gpu = False
        self.last: ProfileFiles | None = None  # the latest profile's files, also when it stopped by itself

    @property
    def running(self) -> bool:
        return self.session is not None

    def start(self, output_dir: str | None = None, num_steps: int | None = None,
              activities: tuple[str, ...] | None = None, record_shapes: bool = False, with_stack: bool = False) -> None:
        """Profile from the next step on, for `num_steps` steps (None: until `stop`). Raises ProfileError."""
        if self.session is not None:
            raise ProfileError("a profile is already running: POST /stop_profile first")
        activities = activities or default_activities()
        unknown = sorted(set(activities) - set(ACTIVITIES))
        if unknown:
            raise ProfileError(f"activities {unknown} are not among {list(ACTIVITIES)}")
        if "GPU" in activities and not torch.cuda.is_available():
            raise ProfileError("activity GPU: this server runs on the CPU; ask for CPU (and MEM)")
        if num_steps is not None and num_steps < 1:
            raise ProfileError(f"num_steps must be at least 1, got {num_steps}")
        folder = Path(output_dir or os.environ.get(OUTPUT_DIR_ENV, "/tmp")).expanduser().resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ProfileError(f"output_dir {str(folder)!r}: {exc.strerror}") from exc
        if not os.access(folder, os.W_OK):
            raise ProfileError(f"output_dir {str(folder)!r} is not writable")
        kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if "GPU" in activities else [])
        session = profile(activities=kinds, record_shapes=record_shapes, with_stack=with_stack,
                          profile_memory="MEM" in activities)
        session.start()
        self.session, self.output_dir, self.num_steps = session, folder, num_steps
        self.steps, self.started, self.gpu = 0, time.perf_counter(), "GPU" in activities
        logger.info("profiling %s into %s", f"{num_steps} steps" if num_steps else "until /stop_profile", folder)

    def after_step(self) -> None:
        """Count a scheduler step; the profile ends by itself after its `num_steps`."""
        if self.session is None:
            return
        self.steps += 1
        if self.num_steps is not None and self.steps >= self.num_steps:
            try:
                self.stop()
            except Exception:  # e.g. the disk is full: serving goes on without the files
                logger.exception("the profile of %d steps could not be written", self.steps)

    def stop(self) -> ProfileFiles:
        """End the profile and write its files. Raises ProfileError when none is running."""
        session = self.session
        if session is None:
            last = (f"; the last one ended after its {self.last.steps} steps and wrote {self.last.trace} and "
                    f"{self.last.table}" if self.last else "")
            raise ProfileError(f"no profile is running: POST /start_profile first{last}")
        if self.gpu:
            torch.cuda.synchronize()  # the kernels of the last step land in the trace
        wall = time.perf_counter() - self.started
        session.stop()
        self.session = None
        stem = f"{time.strftime('%Y%m%d-%H%M%S')}-rank0"
        trace, table = self.output_dir / f"{stem}.trace.json.gz", self.output_dir / f"{stem}.txt"
        session.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if self.gpu else "self_cpu_time_total"
        steps = max(self.steps, 1)
        table.write_text(f"{self.steps} scheduler steps in {wall:.3f} s ({1000 * wall / steps:.3f} ms a step); "
                         f"totals over all steps, sorted by {sort}\n\n"
                         + session.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS, max_name_column_width=90))
        self.last = ProfileFiles(trace, table, self.steps)
        logger.info("profile of %d steps written: %s, %s", self.steps, trace, table)
        return self.last
