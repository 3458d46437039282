"""What Kafka has not acknowledged, in the order it was logged, waiting to be sent again.

On disk (the spill file, a write-ahead log: see spill.py) while the spill directory can be
written, so a rank killed during an outage keeps what it logged. Where it cannot (a
read-only or full disk, a file in the path), the records wait in memory instead, up to
``memory_bound`` records, and only records beyond that are dropped: an unusable spill
directory costs nothing while Kafka comes back before the bound is reached. The disk is
tried again at most once every ``DISK_RETRY_S`` while records wait in memory: once it
takes them (space freed, say), those not in flight move back to the file, behind what
it holds, and newer records follow them there.

The sender reads a batch (:meth:`peek`), hands it to Kafka and, once Kafka has
acknowledged all of it, lets it go (:meth:`acknowledge`). Order: once records wait in
memory, newer ones join them there until memory is empty again, and the file (older)
is always read first.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from typing import NamedTuple

from ..kafka_client.transport import Entry
from ..schemas import count
from .spill import SpillFile


DISK_RETRY_S = 1.0  # how often a disk that failed is tried again while records wait in memory


class Kept(NamedTuple):
    on_disk: bool  # in the spill file (else in memory, as far as the bound allowed)
    dropped: int  # records beyond the memory bound
    disk_error: OSError | None  # why the spill file could not take them
    moved_to_disk: int = 0  # records that waited in memory and are in the file now


class Backlog:
    def __init__(self, spill: SpillFile, memory_bound: int):
        self.spill = spill
        self.memory_bound = memory_bound
        # add() runs on the sender thread, on a log call's thread (a full queue) and on
        # kafka-python's own thread (its failed deliveries); peek / acknowledge on the
        # sender thread only.
        self._lock = threading.Lock()
        self._memory: deque[Entry] = deque()
        self.in_memory = 0  # records waiting in memory
        self._memory_bytes = 0  # their message values' bytes
        self._peeked_from_memory = 0  # entries the last peek took from memory (0: from disk)
        self._disk_retry_at = 0.0  # monotonic time before which a failed disk is not tried

    @property
    def on_disk(self) -> int:
        return self.spill.count

    @property
    def records(self) -> int:
        return self.spill.count + self.in_memory

    def add(self, entries: list[Entry]) -> Kept:
        with self._lock:
            error = None
            if not self._memory or time.monotonic() >= self._disk_retry_at:
                kept = self._to_disk(entries)
                if kept.on_disk:
                    return kept
                error = kept.disk_error
            dropped = 0
            for entry in entries:
                records = count(entry[2])
                if self.in_memory + records > self.memory_bound:
                    dropped += records
                    continue
                self._memory.append(entry)
                self.in_memory += records
                self._memory_bytes += len(entry[2])
            return Kept(False, dropped, error)

    def add_to_disk(self, entries: list[Entry]) -> Kept:
        """Into the file, or nowhere (never memory, nothing dropped): for records that are
        safe on disk elsewhere already (an earlier producer's spill file)."""
        with self._lock:
            return self._to_disk(entries)

    def retry_disk(self) -> Kept | None:
        """Records waiting in memory go back to the file if the disk takes them now (tried
        at most once every DISK_RETRY_S); None when nothing was tried."""
        with self._lock:
            if len(self._memory) <= self._peeked_from_memory or time.monotonic() < self._disk_retry_at:
                return None  # (nothing waits but what is in flight: nothing to try the disk with)
            return self._to_disk([])

    def _to_disk(self, entries: list[Entry]) -> Kept:  # (holding the lock)
        """Into the file: memory's records not in flight first (they are older), then these."""
        waiting = list(self._memory)[self._peeked_from_memory:] if self._memory else []
        try:
            if waiting and not self.spill.has_room(self._memory_bytes):
                # Still full: say so without encoding all of memory (up to the bound) first.
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.spill.directory))
            self.spill.append(waiting + entries)
        except OSError as exc:
            self._disk_retry_at = time.monotonic() + DISK_RETRY_S
            return Kept(False, 0, exc)
        moved = sum(count(entry[2]) for entry in waiting)
        for entry in waiting:
            self._memory.pop()
            self._memory_bytes -= len(entry[2])
        self.in_memory -= moved
        return Kept(True, 0, None, moved)

    def peek(self, max_bytes: int) -> list[Entry]:
        """The oldest entries, about max_bytes of them; they stay until acknowledged."""
        self._peeked_from_memory = 0
        if self.spill.count:
            return self.spill.read(max_bytes)
        with self._lock:
            batch, size = [], 0
            for entry in self._memory:
                if batch and size + len(entry[2]) > max_bytes:
                    break
                batch.append(entry)
                size += len(entry[2])
            self._peeked_from_memory = len(batch)
        return batch

    def acknowledge(self) -> None:
        """Kafka has everything the last peek returned."""
        if not self._peeked_from_memory:
            self.spill.acknowledge()
            return
        with self._lock:
            for _ in range(self._peeked_from_memory):
                value = self._memory.popleft()[2]
                self.in_memory -= count(value)
                self._memory_bytes -= len(value)
            self._peeked_from_memory = 0

    def discard_memory(self) -> int:
        """At exit: the records only memory held, which are lost now; their count."""
        with self._lock:
            lost, self.in_memory, self._memory_bytes = self.in_memory, 0, 0
            self._memory.clear()
            return lost
