"""Shared test helpers: installed-looking plugin packages made on the fly."""

from __future__ import annotations

import os

import torch

# Triton fixes, when first imported, whether its kernels are interpreted: the CPU suite runs them interpreted.
# pytest also loads this file for kit runs from the repo root (`--pyargs plugserve.conformance`): on a GPU
# machine the kernels must compile, so the default applies only where no GPU is visible.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from plugserve.runtime.server_args import ServerArgs
from tests.live_server import API_KEY, SERVED_MODEL, RunningServer, start_server

MakePlugin = Callable[[str, str, str], Path]


@pytest.fixture
def make_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakePlugin:
    """make_plugin(package, module, source) writes module `module` with `source` and a dist-info for
    `package` whose `plugserve` entry point names it, puts the folder on sys.path (the same way an
    installed package is found), and returns the folder (for PYTHONPATH in subprocesses)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(package: str, module: str, source: str) -> Path:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        dist_info = tmp_path / f"{package.replace('-', '_')}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[plugserve]\n{module} = {module}\n")
        return tmp_path

    return make


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """A live server on the tiny preset (see tests/runtime/test_engine.py for why the scheduling tests use it)."""
    yield from start_server(ServerArgs(model_preset="tiny", api_key=API_KEY, max_running_requests=64,
                                       served_model_name=SERVED_MODEL))
