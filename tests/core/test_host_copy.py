"""The pinned ring's bookkeeping: where each staged tensor goes, and which earlier copies it waits for."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.host_copy import RingSpans, to_device


def test_spans_are_aligned_and_wrap_to_the_start_when_the_end_is_passed():
    spans = RingSpans(capacity=1024, alignment=256)
    placed = []
    for size in (100, 300, 256, 200):
        start, waits = spans.reserve(size)
        spans.record(start, size, f"copy of {size}")
        placed.append((start, [span.done for span in waits]))
    # 200 more bytes from 1024 pass the end: back to 0, over the first copy's bytes.
    assert placed == [(0, []), (256, []), (768, []), (0, ["copy of 100"])]


def test_a_span_waits_for_the_copies_it_overwrites_and_only_those():
    spans = RingSpans(capacity=1024, alignment=256)
    for size in (256, 256, 256, 256):
        start, _ = spans.reserve(size)
        spans.record(start, size, f"at {start}")
    start, waits = spans.reserve(300)  # wraps: overwrites [0, 300), the first two copies' bytes
    assert start == 0 and [span.done for span in waits] == ["at 0", "at 256"]
    spans.record(start, 300, "again at 0")
    start, waits = spans.reserve(100)  # [512, 612): the third copy's
    assert start == 512 and [span.done for span in waits] == ["at 512"]
    assert [span.done for span in spans.pending] == ["at 768", "again at 0"]


def test_a_span_larger_than_the_ring_or_empty_is_refused():
    spans = RingSpans(capacity=1024)
    with pytest.raises(ValueError, match="2048 bytes"):
        spans.reserve(2048)
    with pytest.raises(ValueError, match="0 bytes"):
        spans.reserve(0)


def test_to_device_off_a_gpu_is_a_plain_copy():
    host = torch.arange(6).reshape(2, 3).t()
    out = to_device(host, torch.device("cpu"))
    assert torch.equal(out, host)
