"""Every old import path that `plugserve/core/moved.py` keeps gives the object of the new path and warns, naming
it; the tables are read, so entries added later are checked too."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugserve.core.moved import MOVED_MODULES, MOVED_NAMES

ROOT = Path(__file__).resolve().parents[2]
MOVED_NAME_ENTRIES = [pytest.param(old, name, new, id=f"{old}.{name}")
                      for old, names in MOVED_NAMES.items() for name, new in names.items()]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MODULES.items()))
def test_a_moved_module_is_the_new_one_and_warns(old, new, monkeypatch):
    target = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)  # so that the import runs again (restored after)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        found = importlib.import_module(old)
    assert found is target, f"{old} gave {found!r}, not {new}"


@pytest.mark.parametrize(("old", "name", "new"), MOVED_NAME_ENTRIES)
def test_a_moved_name_is_the_new_one_and_warns(old, name, new, monkeypatch):
    target = getattr(importlib.import_module(new), name)
    module = sys.modules.get(old)
    if module is not None and getattr(module, "__file__", None) is None:
        monkeypatch.delitem(sys.modules, old)  # a module made of moved names alone: import it again
    with pytest.warns(DeprecationWarning, match=re.escape(f"{new}.{name}")):
        found = getattr(importlib.import_module(old), name)  # what `from old import name` does
    assert found is target, f"{old}.{name} is not {new}.{name}"


def test_the_old_kit_name_still_collects_with_pyargs(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "plugserve.testing", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = re.search(r"(\d+) tests? collected", run.stdout)
    assert collected and int(collected.group(1)) > 0, run.stdout[-3000:]
