"""Who owns each KV page: the allocator's free list, one prefix-cache node, or one request. The audit that tests
and `Engine.check_pool_accounting` run between two scheduler steps."""

from __future__ import annotations

from collections.abc import Sequence

from plugserve.core.block_table import DeviceBlockTable
from plugserve.core.kv_cache import PoolAccountingError
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import Request


def check_pool_accounting(requests: Sequence[Request], radix: RadixCache, block_table: DeviceBlockTable) -> None:
    """Check that every page of `radix`'s allocator has exactly one owner: the free list, one prefix-cache node,
    or one of `requests` (its pages past its cached prefix, whose pages must lead its list), that the cache's
    locks are the requests' own, and that each taken block-table row is one request's. Raises
    PoolAccountingError naming the pages that leaked or are owned twice."""
    allocator = radix.allocator
    owners = dict.fromkeys(radix.check_accounting([r.prefix_node for r in requests if r.prefix_node]),
                           "the prefix cache")
    problems = []
    for request in requests:
        shared = radix.path_pages(request.prefix_node) if request.prefix_node else []  # type: ignore[arg-type]
        if request.pages[: len(shared)] != shared:
            problems.append(f"request {request.rid} does not lead with its cached prefix's pages")
        for page in request.pages[len(shared) :]:
            if page in owners:
                problems.append(f"page {page} is held by request {request.rid} and by {owners[page]}")
            owners[page] = f"request {request.rid}"
    free = allocator.check()
    if owned_free := free & owners.keys():
        problems.append(f"free pages are also owned: {sorted(owned_free)[:16]}")
    if leaked := set(range(allocator.num_pages)) - free - owners.keys():
        problems.append(f"{len(leaked)} pages leaked (allocated, owned by no request nor the cache): "
                        f"{sorted(leaked)[:16]}")
    rows = [r.table_row for r in requests if r.table_row >= 0]
    if len(set(rows)) != len(rows):
        problems.append("two requests share a block-table row")
    if stray := block_table.taken_rows - set(rows):
        problems.append(f"block-table rows taken by no request: {sorted(stray)[:16]}")
    if problems:
        raise PoolAccountingError("KV pool accounting: " + "; ".join(problems))
