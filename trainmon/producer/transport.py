"""The seam between the worker and Kafka: send bytes, report what could not be delivered.

KafkaTransport wraps kafka-python's KafkaProducer (batching, compression, idempotent
retries). Anything Kafka finally gives up on is handed to ``on_undelivered`` so the
worker can spill it: the transport itself never drops a record silently.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from ..schemas import count, unpack
from .spill import Entry

log = logging.getLogger("trainmon.producer")


class TransportUnavailable(Exception):
    """The broker cannot be reached now; the caller keeps the records and retries later."""


class Transport(Protocol):
    def send(self, entry: Entry) -> None: ...
    def flush(self, timeout: float) -> bool: ...
    def close(self, timeout: float) -> None: ...


class KafkaTransport:
    def __init__(self, settings: dict, on_undelivered: Callable[[list[Entry]], None],
                 max_in_flight: int = 50_000, room_wait_s: float = 1.0):
        self._settings = settings
        self._on_undelivered = on_undelivered
        # kafka-python 3 has no buffer_memory bound: while the broker is away its
        # accumulator would grow without limit, so we cap unacknowledged records here.
        # At the cap a send waits (on the worker thread, never the caller's) for
        # acknowledgements; a broker that acknowledges nothing for room_wait_s counts as
        # unavailable and the worker spills to disk.
        self._max_in_flight = max_in_flight
        self._room_wait_s = room_wait_s
        self._in_flight = 0
        self._room = threading.Condition()
        self._producer = None
        self.dropped = 0  # records over max_request_size even one per message
        self._told_topic_limit = False

    def _connect(self):
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        if self._producer is None:
            try:
                self._producer = KafkaProducer(**self._settings)
            except (KafkaError, OSError) as exc:
                raise TransportUnavailable(str(exc)) from exc
            except Exception as exc:  # e.g. a bad setting: say so, keep the records
                raise TransportUnavailable(f"cannot create KafkaProducer: {exc!r}") from exc
        return self._producer

    def send(self, entry: Entry) -> None:
        from kafka.errors import KafkaError, MessageSizeTooLargeError

        topic, key, value = entry
        producer = self._connect()
        with self._room:
            if not self._room.wait_for(lambda: self._in_flight < self._max_in_flight,
                                       self._room_wait_s):
                raise TransportUnavailable(f"{self._in_flight} records unacknowledged by Kafka")
        try:
            future = producer.send(topic, key=key, value=value)
        except MessageSizeTooLargeError as exc:  # over max_request_size
            self._too_large(entry, exc)
            return
        except KafkaError as exc:  # metadata not available within max_block_ms
            raise TransportUnavailable(str(exc)) from exc
        records = count(value)
        with self._room:
            self._in_flight += records
        future.add_callback(self._delivered, records)
        future.add_errback(self._undelivered, entry, records)

    # kafka-python calls these on its sender thread, with the bound arguments first.
    def _delivered(self, records: int, _metadata) -> None:
        with self._room:
            self._in_flight -= records
            self._room.notify()

    def _undelivered(self, entry: Entry, records: int, exc: BaseException) -> None:
        from kafka.errors import MessageSizeTooLargeError

        with self._room:
            self._in_flight -= records
            self._room.notify()
        if isinstance(exc, MessageSizeTooLargeError) and not self._told_topic_limit:
            # The broker judges whole batches (batch_size, 256 KiB), not single records:
            # only a bigger topic limit helps. The records wait in the spill file till then
            # (kafka-python's idempotent sequence may stay stuck until the job restarts).
            self._told_topic_limit = True
            log.error("trainmon: Kafka refused a batch for %s as too large: the topic's "
                      "max.message.bytes is below the producer's batch_size (%s bytes); raise it "
                      "(Kafka's default is 1 MB). The records are kept in the spill file.",
                      entry[0], f"{self._settings.get('batch_size', 0):,}")
        log.debug("trainmon: Kafka gave up on a message of %d records (%s); spilling it", records, exc)
        self._on_undelivered([entry])

    def _too_large(self, entry: Entry, exc: BaseException) -> None:
        """A message over max_request_size, refused before it was sent. Packed records go
        back one per message; a single record that big (the worker rejects those before
        they get here) is dropped, so that it cannot hold back the records behind it."""
        topic, key, value = entry
        records = unpack(value)
        if len(records) > 1:
            self._on_undelivered([(topic, key, record) for record in records])
            return
        self.dropped += 1
        log.error("trainmon: Kafka refused a %s-byte record on %s as too large; dropped it (%s)",
                  f"{len(value):,}", topic, exc)

    def flush(self, timeout: float) -> bool:
        from kafka.errors import KafkaError

        if self._producer is None:
            return True
        try:
            self._producer.flush(timeout=timeout)
            return True
        except KafkaError:
            return False

    def close(self, timeout: float) -> None:
        from kafka.errors import KafkaError, KafkaTimeoutError

        if self._producer is None:
            return
        producer, self._producer = self._producer, None
        try:
            producer.close(timeout=timeout)
        except KafkaTimeoutError:
            # kafka-python 3.0.12's close() flushes first and raises when the flush times
            # out, before reaching its own force-close. Do what that would have done:
            # abort the unsent batches (their errbacks spill them) and let the sender end.
            producer._sender.force_close()
            producer._sender.join(5)
            try:
                producer.close(timeout=0)
            except KafkaError:
                pass

    def forget_after_fork(self) -> None:
        # The parent's producer, sockets and sender thread belong to the parent.
        self._producer = None
        self._in_flight = 0
        self._room = threading.Condition()


def kafka_settings(bootstrap: str, extra: dict, *, linger_ms: int, batch_size: int,
                   compression: str | None) -> dict:
    return {
        "bootstrap_servers": bootstrap.split(","),
        "linger_ms": linger_ms,
        "batch_size": batch_size,
        "compression_type": compression,
        "acks": "all",
        # Not idempotent: kafka-python's idempotent producer stops sending (and expiring)
        # while it has no producer id, which after a broker outage longer than the delivery
        # timeout it never gets back: records stayed in memory for good. A resend can now
        # duplicate a record in Kafka; every consumer keeps one row per event id. One
        # request in flight per connection keeps each rank's records in order.
        "enable_idempotence": False,
        "max_in_flight_requests_per_connection": 1,
        # Short blocking bounds: the worker decides what to do when Kafka is away,
        # rather than sitting inside kafka-python for a minute.
        "max_block_ms": 2000,
        "bootstrap_timeout_ms": 2000,
        # Kafka that acknowledges nothing for a few seconds is treated as away: the
        # batches expire and their errbacks put them in the spill file, so a rank killed
        # during an outage keeps what it logged (with the default 120 s they sat in
        # kafka-python's memory, and were lost with the process).
        "request_timeout_ms": 4000,
        "delivery_timeout_ms": 5000,
        "reconnect_backoff_max_ms": 1000,
        **extra,
    }
