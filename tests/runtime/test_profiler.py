"""StepProfiler: a profile over a number of steps or until stopped, its files, and what it refuses."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from plugserve.runtime.profiler import ProfileError, StepProfiler


def test_a_profile_of_n_steps_ends_by_itself_and_writes_a_trace_and_a_table(tmp_path):
    profiler = StepProfiler()
    profiler.start(str(tmp_path), num_steps=2, activities=("CPU",))
    for _ in range(2):
        assert profiler.running
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        profiler.after_step()
    assert not profiler.running
    files = profiler.last
    assert files is not None and files.steps == 2
    trace = json.loads(gzip.decompress(files.trace.read_bytes()))
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    table = files.table.read_text()
    assert table.startswith("2 scheduler steps in") and "aten::mm" in table
    with pytest.raises(ProfileError, match=r"no profile is running.*ended after its 2 steps"):
        profiler.stop()


def test_a_profile_without_steps_runs_until_stopped(tmp_path):
    profiler = StepProfiler()
    profiler.start(str(tmp_path / "new" / "folder"))
    for _ in range(5):
        profiler.after_step()
    assert profiler.running
    files = profiler.stop()
    assert files.steps == 5 and files.trace.parent == tmp_path / "new" / "folder" and not profiler.running


def test_refusals_name_what_is_wrong(tmp_path):
    profiler = StepProfiler()
    with pytest.raises(ProfileError, match=r"activities \['DISK'\]"):
        profiler.start(str(tmp_path), activities=("CPU", "DISK"))
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match="activity GPU"):
            profiler.start(str(tmp_path), activities=("GPU",))
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ProfileError, match="output_dir"):
        profiler.start(str(blocked / "sub"))
    assert not profiler.running
    profiler.start(str(tmp_path))
    with pytest.raises(ProfileError, match="already running"):
        profiler.start(str(tmp_path))
    profiler.stop()
