"""ShmChannel: one writer's messages reach every reader in order through a ring smaller than the stream; a message
too big for a slot is reported to both sides; a reader whose writer exited fails instead of waiting forever."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from plugserve.core import shm_broadcast
from plugserve.core.shm_broadcast import PeerGone, ShmChannel

MESSAGES = [f"step {i}".encode() * (i % 5) for i in range(40)] + [b"x" * 65]


def _read_all(name: str, reader: int, count: int, results: mp.Queue) -> None:
    channel = ShmChannel.attach(name, reader)
    results.put([channel.receive() for _ in range(count)])
    channel.close()


def test_every_reader_gets_every_message_in_order_through_a_smaller_ring() -> None:
    channel = ShmChannel.create(readers=2, slots=3, slot_bytes=64)
    context = mp.get_context("spawn")
    results = context.Queue()
    readers = [context.Process(target=_read_all, args=(channel.name, r, len(MESSAGES), results)) for r in range(2)]
    for process in readers:
        process.start()
    try:
        sent = [channel.send(m) for m in MESSAGES]  # 41 messages through 3 slots: the writer waits for the readers
        expected = [m if len(m) <= 64 else None for m in MESSAGES]
        assert sent == [m is not None for m in expected]  # the last is too big for a slot: both sides are told
        assert results.get(timeout=60) == expected and results.get(timeout=60) == expected
    finally:
        for process in readers:
            process.join(10)
        channel.close()


def _create_and_exit(names: mp.Queue, attached: mp.Queue) -> None:
    channel = ShmChannel.create(readers=1)
    names.put(channel.name)
    attached.get(timeout=60)
    os._exit(0)  # without closing: the memory stays until the reader's test removes it


def test_a_reader_whose_writer_exited_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_broadcast, "LIVENESS_S", 0.1)
    context = mp.get_context("spawn")
    names, attached = context.Queue(), context.Queue()
    writer = context.Process(target=_create_and_exit, args=(names, attached))
    writer.start()
    name = names.get(timeout=60)
    channel = ShmChannel.attach(name, 0)
    attached.put(True)
    writer.join(30)
    try:
        with pytest.raises(PeerGone, match=f"process {writer.pid} of the shared-memory channel"):
            channel.receive()
    finally:
        channel.close()
        channel.memory.unlink()
