"""CPU tensors to a GPU without waiting for it: `to_device` stages them through pinned memory, a ring allocated once
per GPU (`PinnedRing`). From pageable memory the driver may wait for the stream before copying; and torch's
`pin_memory()` takes a block of its caching host allocator at every call, which now and then stalls for milliseconds,
several times a decode step.

A span of the ring is written again only after the copies out of it have completed: each copy records an event, and a
span that overlaps a recorded one waits for that event first (`RingSpans`, the bookkeeping alone, testable without a
GPU). A step uses a small part of the ring, so that event completed long before.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

RING_BYTES = 32 << 20  # per GPU: a few hundred decode steps' inputs, a batch of 256 rows' grammar masks many times over
ALIGNMENT = 256  # bytes: each staged tensor starts where any dtype's copy is aligned
LARGEST_STAGED = RING_BYTES // 4  # larger tensors take torch's pin_memory()


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of the ring and what tells that the copy out of them completed (a CUDA event)."""

    start: int
    end: int
    done: Any


class RingSpans:
    """Where the next `size` bytes go in a ring of `capacity` bytes, and which earlier spans must complete first. Not
    thread-safe: its owner holds a lock."""

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        self.capacity, self.alignment = capacity, alignment
        self.offset = 0
        self.pending: deque[Span] = deque()  # oldest first, in ring order

    def reserve(self, size: int) -> tuple[int, list[Span]]:
        """(start, spans to wait for) of `size` bytes (at most the capacity): the next aligned offset, or 0 where the
        bytes would pass the end. The spans returned are forgotten: wait for them before writing."""
        if not 0 < size <= self.capacity:
            raise ValueError(f"a span of {size} bytes does not fit a ring of {self.capacity}")
        start = -(-self.offset // self.alignment) * self.alignment
        if start + size > self.capacity:
            start = 0
        end = start + size
        overlapping = []
        while self.pending and self.pending[0].start < end and self.pending[0].end > start:
            overlapping.append(self.pending.popleft())
        self.offset = end
        return start, overlapping

    def record(self, start: int, size: int, done: Any) -> None:
        """The span [start, start + size) is being read until `done` (reserve's order)."""
        self.pending.append(Span(start, start + size, done))


class PinnedRing:
    """A pinned buffer of `capacity` bytes and the copies out of it to `device`; thread-safe."""

    def __init__(self, device: torch.device, capacity: int = RING_BYTES) -> None:
        self.device = device
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.spans = RingSpans(capacity)
        self.lock = threading.Lock()

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """host (a CPU tensor, any strides) -> the same values on the device, copied on the current stream."""
        host = host.contiguous()
        size = host.numel() * host.element_size()
        with self.lock:
            start, overlapping = self.spans.reserve(size)
            for span in overlapping:
                span.done.synchronize()
            staged = self.buffer[start : start + size].view(host.dtype).view(host.shape)
            staged.copy_(host)
            out = staged.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.spans.record(start, size, done)
        return out


_rings: dict[torch.device, PinnedRing] = {}
_rings_lock = threading.Lock()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the device: on a GPU staged through its `PinnedRing` (torch's
    pin_memory() for tensors above LARGEST_STAGED bytes, empty ones and during CUDA-graph capture); elsewhere `.to`."""
    if device.type != "cuda":
        return host.to(device)
    size = host.numel() * host.element_size()
    if not 0 < size <= LARGEST_STAGED or torch.cuda.is_current_stream_capturing():
        return host.pin_memory().to(device, non_blocking=True)
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    ring = _rings.get(device)
    if ring is None:
        with _rings_lock:
            ring = _rings.get(device) or _rings.setdefault(device, PinnedRing(device))
    return ring.copy(host)
