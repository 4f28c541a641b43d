import pytest
import torch

from plugserve.core.block_table import DeviceBlockTable


def test_rows_hold_what_was_last_written():
    table = DeviceBlockTable(num_rows=3, max_pages=6, device=torch.device("cpu"))
    a, b = table.acquire(), table.acquire()
    table.update(a, [4, 5])
    table.update(b, [7])
    assert table.gather([b, a], 2)[:, :1].tolist() == [[7], [4]]
    assert table.gather([a], 2).tolist() == [[4, 5]]
    table.update(a, [4, 5, 9])  # decode appends a page: only the tail is queued
    assert table._pending == [(a, 2, [9])]
    table.update(a, [1, 5, 9])  # a prefix-cache hit replaced a leading page: the row is rewritten
    assert table._pending[-1] == (a, 0, [1, 5, 9])
    assert table.gather([a, b], 3)[0].tolist() == [1, 5, 9]
    table.update(a, [1, 5, 9])
    assert table._pending == []


def test_released_rows_are_reused_and_forget_queued_writes():
    table = DeviceBlockTable(num_rows=1, max_pages=4, device=torch.device("cpu"))
    row = table.acquire()
    table.update(row, [3])
    with pytest.raises(RuntimeError, match="rows are taken"):
        table.acquire()
    table.release(row)
    assert table.acquire() == row
    table.update(row, [2, 0])  # a new owner starts from nothing written
    assert table.gather([row], 2).tolist() == [[2, 0]]
    with pytest.raises(ValueError, match="do not fit"):
        table.update(row, [0] * 5)
    table.release(row)
    with pytest.raises(ValueError, match="not taken"):
        table.release(row)
