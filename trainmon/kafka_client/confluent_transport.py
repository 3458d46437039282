"""The producer's transport on librdkafka (confluent-kafka): the default."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Callable

from . import settings
from .errors import TransportUnavailable
from .transport import Entry, TransportSettings, Undelivered, say_topic_limit, split_or_drop

log = logging.getLogger("trainmon.producer")


_LEFT_IN_PARENT: list = []  # a forked child must never destroy its parent's client


class ConfluentTransport:
    # librdkafka's produce only queues the message (or raises BufferError when its queue
    # is full): the producer lets a log call send its own record (producer/worker.py).
    sends_without_blocking = True

    def __init__(self, config: TransportSettings, on_undelivered: Undelivered):
        self._config = config
        self._on_undelivered = on_undelivered
        self._producer = None
        self.dropped = 0
        self._on_ack: Callable[[], None] | None = None
        self._reports_successes = False
        self._told_topic_limit = False
        self_ref = weakref.ref(self)  # the hook must not keep every transport alive
        os.register_at_fork(after_in_child=lambda: (t := self_ref()) is not None and t._forget())

    @property
    def on_ack(self) -> Callable[[], None] | None:
        return self._on_ack

    @on_ack.setter
    def on_ack(self, hook: Callable[[], None] | None) -> None:
        if hook is not None and self._producer is not None and not self._reports_successes:
            log.warning("trainmon: on_ack set after the Kafka client was created, which reports "
                        "failed deliveries only; it is called from the next client on")
        self._on_ack = hook

    def _forget(self) -> None:
        if self._producer is not None:
            _LEFT_IN_PARENT.append(self._producer)
            self._producer = None

    def _connect(self):
        if self._producer is None:
            from confluent_kafka import Producer

            c = self._config
            conf = settings.librdkafka(c.security, c.bootstrap)
            conf.update({
                "acks": "all",
                "linger.ms": c.linger_ms,
                "batch.size": c.batch_bytes,
                "message.max.bytes": c.max_message_bytes,
                "compression.type": c.compression or "none",
                "message.timeout.ms": c.delivery_timeout_ms,
                "request.timeout.ms": min(4000, c.delivery_timeout_ms),
                # Not idempotent, one request in flight per connection: each rank's records
                # stay in order, and a resend after an outage can duplicate a record in
                # Kafka, which every consumer keeps once (by event id).
                "enable.idempotence": False,
                "max.in.flight.requests.per.connection": 1,
                "queue.buffering.max.messages": c.max_in_flight_messages,
                "partitioner": settings.PARTITIONER,  # as kafka-python's: a run, one partition
                # Only failures matter to the worker (it spills them): a report per success
                # would be a callback per message on the worker's thread, and messages owed
                # a report keep it waking to collect them.
                "delivery.report.only.error": self._on_ack is None,
                "on_delivery": self._report,
            })
            self._reports_successes = self._on_ack is not None
            from ..schemas import SCHEMA_HEADER, schema_fingerprint

            # Says the records are this trainmon's validated encoding (see schemas.SCHEMA_HEADER).
            self._headers = [(SCHEMA_HEADER, schema_fingerprint())]
            try:
                self._producer = Producer(conf)
            except Exception as exc:  # a bad setting: say so, keep the records
                raise TransportUnavailable(f"cannot create the Kafka producer: {exc}") from exc
        return self._producer

    @property
    def in_flight(self) -> int:
        return len(self._producer) if self._producer is not None else 0

    def send(self, entry: Entry, on_undelivered: Undelivered | None = None) -> None:
        topic, key, value = entry
        producer = self._producer if self._producer is not None else self._connect()
        try:
            if on_undelivered is None:
                producer.produce(topic, value=value, key=key, headers=self._headers)
            else:
                producer.produce(topic, value=value, key=key, headers=self._headers,
                                 on_delivery=lambda error, message: self._report(error, message, on_undelivered))
        except BufferError as exc:  # max_in_flight_messages unanswered: Kafka is away or slow
            raise TransportUnavailable(f"{len(producer)} messages unacknowledged by Kafka") from exc
        except Exception as exc:
            from confluent_kafka import KafkaException

            if not isinstance(exc, KafkaException):
                raise
            if exc.args and exc.args[0].name() == "MSG_SIZE_TOO_LARGE":
                self.dropped += split_or_drop(entry, on_undelivered or self._on_undelivered, exc)
                return
            raise TransportUnavailable(str(exc)) from exc

    def _report(self, error, message, on_undelivered: Undelivered | None = None) -> None:
        """A delivery report (on the worker's thread, inside serve/flush)."""
        if error is None:
            if self._on_ack is not None:
                self._on_ack()
            return
        entry = (message.topic(), message.key(), message.value())
        if error.name() == "MSG_SIZE_TOO_LARGE" and not self._told_topic_limit:
            self._told_topic_limit = True
            say_topic_limit(entry[0], self._config.batch_bytes)
        log.debug("trainmon: Kafka gave up on a message (%s)", error.str())
        (on_undelivered or self._on_undelivered)([entry])

    def serve(self, timeout: float = 0.0) -> None:
        if self._producer is not None:
            self._producer.poll(timeout)

    def flush(self, timeout: float) -> bool:
        return self._producer is None or self._producer.flush(timeout) == 0

    def close(self, timeout: float) -> None:
        producer = self._producer
        if producer is None:
            return
        if producer.flush(timeout):
            # Not delivered in time: take the messages back (their reports spill them).
            producer.purge()
            producer.flush(0)
        self._producer = None
