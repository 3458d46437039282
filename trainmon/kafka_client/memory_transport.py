"""A transport with Kafka's delivery behaviour and no Kafka, for tests (as httpx ships
``MockTransport``): ``Producer(config, transport=memory_broker.transport)``.

A :class:`MemoryBroker` keeps each topic as a list of (key, value) messages and can be
taken away and brought back (``broker.up = False``). A :class:`MemoryTransport` behaves
as librdkafka does for the producer: ``send`` only queues (or raises
TransportUnavailable when ``max_in_flight`` messages wait), and while serving or
flushing, a message is appended to its topic at once while the broker is up; otherwise it waits,
and while serving or flushing it is appended once the broker is back, or given up on
(``on_undelivered``) once it is older than the delivery timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from .errors import TransportUnavailable
from .transport import Entry, Undelivered


class MemoryBroker:
    def __init__(self):
        self.up = True
        self.topics: dict[str, list[tuple[bytes, bytes]]] = {}
        self._lock = threading.Lock()

    def append(self, topic: str, key: bytes, value: bytes) -> None:
        with self._lock:
            self.topics.setdefault(topic, []).append((key, value))

    def values(self, topic: str) -> list[bytes]:
        with self._lock:
            return [value for _, value in self.topics.get(topic, [])]

    def transport(self, on_undelivered: Undelivered, **settings) -> "MemoryTransport":
        """A transport to this broker: the factory a Producer or Worker takes."""
        return MemoryTransport(self, on_undelivered, **settings)


class MemoryTransport:
    sends_without_blocking = True

    def __init__(self, broker: MemoryBroker, on_undelivered: Undelivered, *,
                 delivery_timeout_s: float = 0.5, max_in_flight: int = 50_000):
        self.broker = broker
        self._on_undelivered = on_undelivered
        self._delivery_timeout_s = delivery_timeout_s
        self._max_in_flight = max_in_flight
        # (entry, handed over at, its failure handler or None for the transport's own)
        self._queued: deque[tuple[Entry, float, Undelivered | None]] = deque()
        self._lock = threading.Lock()
        self.dropped = 0
        self.on_ack: Callable[[], None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._queued)

    def send(self, entry: Entry, on_undelivered: Undelivered | None = None) -> None:
        with self._lock:
            if len(self._queued) >= self._max_in_flight:
                raise TransportUnavailable(f"{len(self._queued)} messages unacknowledged")
            if self.broker.up and not self._queued:
                self.broker.append(*entry)  # (acknowledged at once: nothing to wait for)
                delivered = True
            else:
                self._queued.append((entry, time.monotonic(), on_undelivered))
                delivered = False
        if delivered and self.on_ack is not None:
            self.on_ack()

    def _answer(self) -> None:
        """Deliver what can be, give up on what is too old; reports run outside the lock."""
        delivered, failed = 0, []
        with self._lock:
            now = time.monotonic()
            while self._queued:
                entry, at, on_undelivered = self._queued[0]
                if self.broker.up:
                    self.broker.append(*entry)
                    delivered += 1
                elif now - at >= self._delivery_timeout_s:
                    failed.append((entry, on_undelivered))
                else:
                    break  # (in order, as one partition's messages are)
                self._queued.popleft()
        for _ in range(delivered if self.on_ack is not None else 0):
            self.on_ack()
        for entry, on_undelivered in failed:
            (on_undelivered or self._on_undelivered)([entry])

    def serve(self, timeout: float = 0.0) -> None:
        self._answer()
        if timeout > 0 and self._queued:
            self.flush(timeout)

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._answer()
            if not self._queued:
                return True
            if time.monotonic() >= deadline:
                return False
            oldest = self._queued[0][1] + self._delivery_timeout_s
            time.sleep(max(0.001, min(oldest, deadline) - time.monotonic()))

    def close(self, timeout: float) -> None:
        if not self.flush(timeout):
            with self._lock:
                purged, self._queued = list(self._queued), deque()
            for entry, _, on_undelivered in purged:
                (on_undelivered or self._on_undelivered)([entry])
