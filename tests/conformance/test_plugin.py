"""The kit's pytest plugin loads in every pytest run where plugserve is installed: it must not import torch."""

from __future__ import annotations

from tests.imports import imported_after


def test_loading_the_plugin_imports_no_torch():
    code = ("import plugserve.conformance.plugin as plugin\n"
            "assert plugin.PROFILES and plugin.DTYPE_NAMES")
    assert imported_after(code, ("torch", "transformers", "triton")) == []
