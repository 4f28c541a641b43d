"""tools/device/run_fast_path_on_device.sh's step arguments, through its env: step (the one step that needs no GPU)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_commas_are_spaces_and_doubled_commas_are_commas(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", "tools/device/run_fast_path_on_device.sh", "env:FLAGS:--plugserve-dtypes,float16,,float32,-q"],
        capture_output=True, text=True, cwd=REPO, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "env FLAGS=--plugserve-dtypes float16,float32 -q" in result.stdout
    assert (tmp_path / "results.tgz").is_file()  # the results archive is written on exit
