"""--schedule-policy: fcfs keeps arrival order, lpm puts the longest cached prefix first (ties by arrival)."""

from __future__ import annotations

from plugserve.core.kv_cache import PageAllocator
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.schedule_policy import LPM_MAX_QUEUE, order_waiting


def _request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(), lambda output: None)


def test_lpm_orders_by_cached_prefix_and_fcfs_by_arrival():
    radix = RadixCache(PageAllocator(64), 1)
    radix.insert([1, 2, 3, 4, 5], radix.alloc(5))
    waiting = [_request("cold", [9, 9, 9]), _request("two", [1, 2, 7]), _request("five", [1, 2, 3, 4, 5, 6]),
               _request("cold2", [8]), _request("two2", [1, 2, 8])]
    assert [r.rid for r in order_waiting("lpm", waiting, radix)] == ["five", "two", "two2", "cold", "cold2"]
    assert [r.rid for r in order_waiting("fcfs", waiting, radix)] == [r.rid for r in waiting]


def test_lpm_falls_back_to_arrival_order_on_a_long_queue():
    radix = RadixCache(PageAllocator(64), 1)
    radix.insert([1, 2], radix.alloc(2))
    waiting = [_request(str(i), [5]) for i in range(LPM_MAX_QUEUE)] + [_request("hit", [1, 2, 3])]
    assert order_waiting("lpm", waiting, radix)[-1].rid == "hit"
    assert order_waiting("lpm", waiting[-LPM_MAX_QUEUE:], radix)[0].rid == "hit"
