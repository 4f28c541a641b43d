"""The kit's pytest plugin loads in every pytest run where plugserve is installed: it must not import torch."""

from __future__ import annotations

import os
import subprocess
import sys


def test_loading_the_plugin_imports_no_torch():
    code = ("import sys, plugserve.conformance.plugin as plugin\n"
            "assert plugin.PROFILES and plugin.DTYPE_NAMES\n"
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert out.strip() == "[]"
