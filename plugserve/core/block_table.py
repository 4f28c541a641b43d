"""The running requests' page lists, kept on the device: each request owns one row of a persistent
[rows, max_pages] int32 table (SGLang's req_to_token, at page granularity), written only where its page
list changed. A batch's block table is then one gather of its rows, instead of a [B, pages] table built
from Python lists and uploaded every step, which costs host time that grows with the batch.

Uploads are stream-ordered copies through pinned memory (`core/host_copy.py`): building a batch never waits for the
device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plugserve.core.host_copy import to_device


class DeviceBlockTable:
    """Rows of page ids on the device, one per request that holds KV.

    table [num_rows, max_pages] int32: row r, column c = the c-th page of the request owning r (stale
    past its page count: readers bound themselves by sequence length).
    """

    def __init__(self, num_rows: int, max_pages: int, device: torch.device) -> None:
        self.num_rows, self.max_pages, self.device = num_rows, max_pages, device
        self.table = torch.zeros(num_rows, max_pages, dtype=torch.int32, device=device)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._written: dict[int, list[int]] = {}  # row -> the page list the device holds for it
        self._pending: list[tuple[int, int, list[int]]] = []  # (row, first column, pages) to upload

    @property
    def taken_rows(self) -> set[int]:
        return set(self._written)

    def acquire(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"all {self.num_rows} block-table rows are taken: more requests hold KV than "
                               "the scheduler admits")
        row = self._free_rows.pop()
        self._written[row] = []
        return row

    def release(self, row: int) -> None:
        if row not in self._written:
            raise ValueError(f"block-table row {row} is not taken")
        del self._written[row]
        self._pending = [p for p in self._pending if p[0] != row]
        self._free_rows.append(row)

    def update(self, row: int, pages: list[int]) -> None:
        """Make row `row` hold `pages` (queued; `gather` uploads it). Only the changed tail is written: a
        decode step appends at most one page, a prefix-cache hit rewrites the leading ones."""
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages do not fit a block-table row of {self.max_pages}")
        written = self._written[row]
        if pages == written[: len(pages)]:  # unchanged, or a tail given back: readers stop at the request's length
            self._written[row] = list(pages)
            return
        start = len(written) if len(pages) > len(written) and pages[: len(written)] == written else 0
        self._pending.append((row, start, pages[start:]))
        self._written[row] = list(pages)

    def gather(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """The block table of a batch: rows `rows` (after the queued updates), columns [0, width) ->
        [len(rows), width] int32 on the device. One upload (the updates and the row ids) and two kernels."""
        where_rows: list[int] = []
        where_cols: list[int] = []
        pages: list[int] = []
        for row, start, tail in self._pending:
            where_rows += [row] * len(tail)
            where_cols += range(start, start + len(tail))
            pages += tail
        self._pending = []
        writes = len(pages)
        device = to_device(torch.tensor(where_rows + where_cols + pages + list(rows), dtype=torch.int64), self.device)
        if writes:
            self.table[device[:writes], device[writes : 2 * writes]] = device[2 * writes : 3 * writes].to(torch.int32)
        return self.table[device[3 * writes :], :width]
