"""Checks on an Engine that several test modules share."""

from __future__ import annotations

import time

from plugserve.runtime.engine import Engine


def assert_every_page_is_back(engine: Engine) -> None:
    """Idle: each KV page is free or held only by an evictable prefix-cache node, and each has one owner."""
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.check_pool_accounting()
    allocator = engine.runner.allocator
    assert engine.radix.protected_pages == 0
    assert allocator.num_free + engine.radix.evictable_pages == allocator.num_pages
