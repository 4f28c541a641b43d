"""tools/compile_sm90.py: a kernel of the package compiled for sm90 on this machine, which has no GPU, through the
command line, and what it reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def launch_merge() -> None:
    """The MLA merge kernel's launch for 4 tokens x 16 heads of latent 512 (CPU tensors: compiled, not run)."""
    from plugserve.plugins.attention.merge import merge_attn_states

    out, lse = torch.zeros(4, 16, 512, dtype=torch.bfloat16), torch.zeros(4, 16)
    merge_attn_states(out, lse, out, lse)


def test_a_kernel_compiles_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "tools/compile_sm90.py", "tests.tools.test_compile_sm90:launch_merge", "--sass-dir",
         str(tmp_path)], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert re.fullmatch(r"_merge_kernel: shared \d+ B, REG:\d+ STACK:\d+, \d+ SASS instructions, "
                        r"\d+ local stores / \d+ loads", line), line
    assert "MUFU.EX2" in (tmp_path / "_merge_kernel.sass").read_text()  # its exps, in sm90's SASS
