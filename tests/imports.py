"""What a fresh interpreter has imported after running some code: the checks that light entry points (`--help`, the
kit's pytest plugin) stay free of torch and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence


def imported_after(code: str, modules: Sequence[str]) -> list[str]:
    """Which of `modules` a fresh `python -c code` (run from the repo root) has in sys.modules at its end."""
    check = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {list(modules)!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    return json.loads(out.strip().splitlines()[-1])
