"""Checks on an Engine that several test modules share."""

from __future__ import annotations

import time

import pytest

from plugserve.runtime.engine import Engine, EngineStopped
from plugserve.runtime.sampling import SamplingParams


def assert_every_page_is_back(engine: Engine) -> None:
    """Idle: each KV page is free or held only by an evictable prefix-cache node, and each has one owner."""
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.check_pool_accounting()
    allocator = engine.runner.allocator
    assert engine.radix.protected_pages == 0
    assert allocator.num_free + engine.radix.evictable_pages == allocator.num_pages


def assert_killing_rank_1_ends_the_engine(engine: Engine, prompt: list[int], timeout_s: float = 60.0) -> None:
    """A serving engine of several ranks: killing rank 1's process ends it with an error naming that rank, and
    refuses new requests with it."""
    assert engine.ranks is not None
    engine.ranks.workers[1].kill()
    deadline = time.monotonic() + timeout_s
    while engine.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.error is not None and "tensor-parallel rank 1 exited" in engine.error
    assert not engine.alive
    with pytest.raises(EngineStopped, match="tensor-parallel rank 1 exited"):
        engine.generate([prompt], SamplingParams(max_new_tokens=2))
