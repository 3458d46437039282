"""The producer's pure-Python transport, on kafka-python: for machines where
confluent-kafka (librdkafka) cannot be installed, or ``TRAINMON_KAFKA_CLIENT=kafka-python``."""

from __future__ import annotations

import logging
import threading

from . import settings
from .errors import TransportUnavailable
from .transport import Entry, TransportSettings, Undelivered, say_topic_limit, split_or_drop

log = logging.getLogger("trainmon.producer")

# kafka-python logs every refused connection at ERROR; during a broker outage that would
# flood the training job's console. trainmon reports outages itself in one line.
logging.getLogger("kafka").setLevel(logging.CRITICAL)


class KafkaPythonTransport:
    def __init__(self, config: TransportSettings, on_undelivered: Undelivered, room_wait_s: float = 1.0):
        self._config = config
        self._on_undelivered = on_undelivered
        # kafka-python 3 has no buffer_memory bound: while the broker is away its
        # accumulator would grow without limit, so unacknowledged messages are capped here.
        # At the cap a send waits (on the worker thread, never the caller's) for
        # acknowledgements; a broker that acknowledges nothing for room_wait_s counts as
        # unavailable and the worker spills to disk.
        self._room_wait_s = room_wait_s
        self._in_flight = 0
        self._room = threading.Condition()
        self._producer = None
        self.dropped = 0
        self.on_ack = None
        self._told_topic_limit = False

    def _settings(self) -> dict:
        c = self._config
        return {
            **settings.kafka_python(c.security, c.bootstrap),
            "linger_ms": c.linger_ms,
            "batch_size": c.batch_bytes,
            "max_request_size": c.max_message_bytes,
            "compression_type": c.compression,
            "acks": "all",
            # Not idempotent: kafka-python's idempotent producer stops sending (and
            # expiring) while it has no producer id, which after an outage longer than the
            # delivery timeout it never gets back. One request in flight keeps order.
            "enable_idempotence": False,
            "max_in_flight_requests_per_connection": 1,
            # Short blocking bounds: the worker decides what to do when Kafka is away.
            "max_block_ms": 2000,
            "bootstrap_timeout_ms": 2000,
            "request_timeout_ms": min(4000, c.delivery_timeout_ms),
            "delivery_timeout_ms": c.delivery_timeout_ms,
            "reconnect_backoff_max_ms": 1000,
            # The partitioner is kafka-python's default, murmur2 of the key like the
            # confluent transport's (settings.PARTITIONER): a run, one partition, either way.
        }

    def _connect(self):
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        if self._producer is None:
            try:
                self._producer = KafkaProducer(**self._settings())
            except (KafkaError, OSError) as exc:
                raise TransportUnavailable(str(exc)) from exc
            except Exception as exc:  # e.g. a bad setting: say so, keep the records
                raise TransportUnavailable(f"cannot create KafkaProducer: {exc!r}") from exc
        return self._producer

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def send(self, entry: Entry, on_undelivered: Undelivered | None = None) -> None:
        from kafka.errors import KafkaError, MessageSizeTooLargeError

        topic, key, value = entry
        producer = self._connect()
        with self._room:
            if not self._room.wait_for(lambda: self._in_flight < self._config.max_in_flight_messages,
                                       self._room_wait_s):
                raise TransportUnavailable(f"{self._in_flight} messages unacknowledged by Kafka")
        try:
            future = producer.send(topic, key=key, value=value)
        except MessageSizeTooLargeError as exc:  # over max_request_size
            self.dropped += split_or_drop(entry, on_undelivered or self._on_undelivered, exc)
            return
        except KafkaError as exc:  # metadata not available within max_block_ms
            raise TransportUnavailable(str(exc)) from exc
        with self._room:
            self._in_flight += 1
        future.add_callback(self._delivered)
        future.add_errback(self._undelivered, entry, on_undelivered or self._on_undelivered)

    # kafka-python calls these on its sender thread, with the bound arguments first.
    def _delivered(self, _metadata) -> None:
        with self._room:
            self._in_flight -= 1
            self._room.notify()
        if self.on_ack is not None:
            self.on_ack()

    def _undelivered(self, entry: Entry, on_undelivered: Undelivered, exc: BaseException) -> None:
        from kafka.errors import MessageSizeTooLargeError

        with self._room:
            self._in_flight -= 1
            self._room.notify()
        if isinstance(exc, MessageSizeTooLargeError) and not self._told_topic_limit:
            self._told_topic_limit = True
            say_topic_limit(entry[0], self._config.batch_bytes)
        log.debug("trainmon: Kafka gave up on a message (%s)", exc)
        on_undelivered([entry])

    def serve(self, timeout: float = 0.0) -> None:
        # kafka-python runs the callbacks on its own thread: just wait for the answers.
        with self._room:
            self._room.wait_for(lambda: self._in_flight == 0, timeout)

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
