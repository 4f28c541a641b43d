"""The attention kernels' old module, split into one file per kernel family, still hands out every public name
it had, with a DeprecationWarning naming the new home."""

import importlib

import pytest

from plugserve.core.moved import MOVED_NAMES

OLD = "plugserve.plugins.attention.triton_kernels"


@pytest.mark.parametrize("name", sorted(MOVED_NAMES[OLD]))
def test_old_kernel_names_resolve_with_a_warning(name: str) -> None:
    new = MOVED_NAMES[OLD][name]
    with pytest.warns(DeprecationWarning, match=f"{new}.{name}"):
        moved = getattr(importlib.import_module(OLD), name)
    assert moved is getattr(importlib.import_module(new), name)
