"""--schedule-policy: the order in which waiting requests are considered for the next prefill batch.

fcfs keeps arrival order. lpm (longest prefix match) puts the requests with the most cached prompt tokens first,
so that requests sharing a prefix run together while it is in the cache; as SGLang does, a long queue falls back
to arrival order, where matching every request each step would cost more host time than it saves.
"""

from __future__ import annotations

from collections.abc import Iterable

from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import Request

LPM_MAX_QUEUE = 128  # waiting requests above which lpm orders by arrival


def order_waiting(policy: str, waiting: Iterable[Request], radix: RadixCache) -> list[Request]:
    """The waiting requests in the order the policy considers them (a stable sort: ties keep arrival order)."""
    requests = list(waiting)
    if policy == "fcfs" or len(requests) > LPM_MAX_QUEUE or not radix.enabled:
        return requests
    return sorted(requests, key=lambda r: -radix.cached_prefix_len(r.all_ids))
