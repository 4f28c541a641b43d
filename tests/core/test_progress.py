"""Start-up progress: log lines where stderr is not a terminal (docker, systemd), one per tenth and the end."""

from __future__ import annotations

import logging

from plugserve.core.progress import track


def test_progress_is_logged_when_stderr_is_not_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="plugserve.progress"):
        assert list(track(range(20), 20, "loading weights", "tensors")) == list(range(20))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("loading weights: 2/20 tensors")
    assert lines[-1].startswith("loading weights: 20/20 tensors in ")
    assert len(lines) == 10  # nine tenths and the end
