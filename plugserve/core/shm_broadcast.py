"""One writer's byte messages to the other processes of its host, through a ring of slots in shared memory.

Rank 0 sends each step's batch headers to the ranks of its node this way: writing a slot and reading it are
a few memory copies, where a gloo broadcast is a pickle and a TCP exchange with every rank on rank 0's path to the
forward. Layout, in int64 words: [writer pid, readers, slots, slot bytes, reader pids...], then per slot
[sequence number, length, one acknowledgement per reader, payload]. The writer fills the payload and the length,
then the sequence number; a reader waits for the number it expects, copies the payload and acknowledges it; the
writer reuses a slot once every reader acknowledged its previous message. Each store is one aligned word, in
program order, which x86-64 and the other processors CUDA hosts run on keep in order for the other cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

WORD = 8
SLOTS = 4
SLOT_BYTES = 256 * 1024
SPIN_S = 0.05  # how long a waiting side yields between polls before it sleeps between them
SLEEP_S = 0.0005
LIVENESS_S = 1.0  # how often a sleeping side checks that its peers still run


class PeerGone(RuntimeError):
    """The process a channel waits on exited."""


class ShmChannel:
    """Messages of up to `slot_bytes` bytes from the process that `create`s the channel to the `readers` that
    `attach` to it by name, in order, each read by every reader."""

    def __init__(self, memory: shared_memory.SharedMemory, reader: int | None) -> None:
        self.memory, self.reader = memory, reader  # reader None: the writer
        self.words = memory.buf.cast("q")
        self.readers, self.slots, self.slot_bytes = self.words[1], self.words[2], self.words[3]
        self.slot_words = 2 + self.readers + self.slot_bytes // WORD
        self.next = 1  # the sequence number this side writes or reads next

    @classmethod
    def create(cls, readers: int, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> ShmChannel:
        header = 4 + readers
        memory = shared_memory.SharedMemory(create=True, size=WORD * (header + slots * (2 + readers)) + slots *
                                            slot_bytes)
        words = memory.buf.cast("q")
        words[0], words[1], words[2], words[3] = os.getpid(), readers, slots, slot_bytes  # the rest starts zeroed
        words.release()
        return cls(memory, None)

    @classmethod
    def attach(cls, name: str, reader: int) -> ShmChannel:
        """Reader `reader` (0..readers-1) of the channel `name`. The writer owns the memory. Before Python 3.13 an
        attach registers it with the resource tracker, which this process shares with the writer (a spawned
        child uses its parent's): the writer's unlink then unregisters it once for both."""
        try:
            memory = shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
        except TypeError:  # Python < 3.13
            memory = shared_memory.SharedMemory(name=name)
        channel = cls(memory, reader)
        channel.words[4 + reader] = os.getpid()
        return channel

    @property
    def name(self) -> str:
        return self.memory.name

    def _slot(self, sequence: int) -> int:
        """The first word of the slot of message `sequence`."""
        return 4 + self.readers + (sequence - 1) % self.slots * self.slot_words

    def send(self, data: bytes) -> bool:
        """Writer: `data` to every reader, once they all read the slot's previous message. False (nothing sent)
        when it does not fit a slot: the caller sends it another way, and each reader's `receive` returns None."""
        slot, fits = self._slot(self.next), len(data) <= self.slot_bytes
        if self.next > self.slots:
            previous = self.next - self.slots
            self._wait(lambda: all(self.words[slot + 2 + r] >= previous for r in range(self.readers)),
                       [self.words[4 + r] for r in range(self.readers)])
        start = WORD * (slot + 2 + self.readers)
        if fits:
            self.memory.buf[start : start + len(data)] = data
        self.words[slot + 1] = len(data) if fits else -1
        self.words[slot] = self.next
        self.next += 1
        return fits

    def receive(self) -> bytes | None:
        """Reader: the next message (None: it did not fit a slot and comes another way), waiting as long as the
        writer runs."""
        slot = self._slot(self.next)
        self._wait(lambda: self.words[slot] == self.next, [self.words[0]])
        length = self.words[slot + 1]
        start = WORD * (slot + 2 + self.readers)
        data = None if length < 0 else bytes(self.memory.buf[start : start + length])
        self.words[slot + 2 + self.reader] = self.next  # type: ignore[operator]
        self.next += 1
        return data

    def _wait(self, ready: Callable[[], bool], peers: list[int]) -> None:
        """Until `ready()`: polled back to back (yielding the core) for SPIN_S, then every SLEEP_S, checking every
        LIVENESS_S that the `peers` (pids) still run."""
        start = checked = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            if now - checked > LIVENESS_S:
                checked = now
                for pid in peers:
                    if pid and not _running(pid):
                        raise PeerGone(f"process {pid} of the shared-memory channel {self.name} exited")
            time.sleep(SLEEP_S)

    def close(self) -> None:
        """Detach; the writer also removes the memory."""
        self.words.release()
        self.memory.close()
        if self.reader is None:
            self.memory.unlink()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (an exited child its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
