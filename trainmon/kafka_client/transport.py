"""The producer's way to Kafka: send packed messages, report what could not be delivered.

Two implementations of one small contract (:class:`Transport`): :class:`ConfluentTransport`
on librdkafka (the default), and kafka-python's in :mod:`.fallback` for machines where
confluent-kafka cannot be installed. Anything Kafka finally gives up on is handed to
``on_undelivered`` so the producer's worker can spill it: a transport never drops a
record silently.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

from . import settings
from .errors import TransportUnavailable

log = logging.getLogger("trainmon.producer")

Entry = tuple[str, bytes, bytes]  # topic, key, value (a packed message)
Undelivered = Callable[[list[Entry]], None]

CONFLUENT, KAFKA_PYTHON = "confluent-kafka", "kafka-python"


@dataclass(frozen=True)
class TransportSettings:
    """What the producer asks of its transport, in no client's spelling."""

    bootstrap: str
    security: dict  # TRAINMON_KAFKA_* security env vars and their values
    linger_ms: int = 5
    batch_bytes: int = 256 * 1024
    max_message_bytes: int = 1_000_000
    compression: str | None = "lz4"
    # Kafka that acknowledges nothing for this long counts as away: the messages come
    # back through on_undelivered and the worker spills them (a rank killed during an
    # outage keeps what it logged).
    delivery_timeout_ms: int = 5000
    max_in_flight_messages: int = 50_000


class Transport(Protocol):
    dropped: int  # records over the message limit even one per message
    # Called at every acknowledged message (instrumentation). Set it before the first send:
    # the confluent transport asks Kafka to report successes only when a hook is set then.
    on_ack: Callable[[], None] | None

    @property
    def in_flight(self) -> int: ...  # messages sent and not yet answered
    # raises TransportUnavailable; a failure goes to on_undelivered where given (a resend
    # of records the producer still holds), else to the transport's own
    def send(self, entry: Entry, on_undelivered: Undelivered | None = None) -> None: ...
    def serve(self, timeout: float = 0.0) -> None: ...  # hand answers to their callbacks, waiting up to timeout for one
    def flush(self, timeout: float) -> bool: ...
    def close(self, timeout: float) -> None: ...


def choose_client(env: dict | None = None) -> str:
    """confluent-kafka unless ``TRAINMON_KAFKA_CLIENT=kafka-python`` or it is not installed."""
    env = os.environ if env is None else env
    wanted = (env.get("TRAINMON_KAFKA_CLIENT") or CONFLUENT).strip().lower()
    if wanted == KAFKA_PYTHON:
        return KAFKA_PYTHON
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        log.info("trainmon: confluent-kafka is not installed; sending with kafka-python")
        return KAFKA_PYTHON
    return CONFLUENT


def make_transport(client: str, config: TransportSettings, on_undelivered: Undelivered) -> Transport:
    if client == KAFKA_PYTHON:
        from .fallback import KafkaPythonTransport

        return KafkaPythonTransport(config, on_undelivered)
    return ConfluentTransport(config, on_undelivered)


def split_or_drop(entry: Entry, on_undelivered: Undelivered, reason: object) -> int:
    """A message over the size limit, refused before it was sent: packed records go back
    one per message; a single record that big (the worker rejects those before they get
    here) is dropped, so it cannot hold back the records behind it. Returns records dropped."""
    from ..schemas import unpack

    topic, key, value = entry
    records = unpack(value)
    if len(records) > 1:
        on_undelivered([(topic, key, record) for record in records])
        return 0
    log.error("trainmon: Kafka refused a %s-byte record on %s as too large; dropped it (%s)",
              f"{len(value):,}", topic, reason)
    return 1


def say_topic_limit(topic: str, batch_bytes: int) -> None:
    # The broker judges whole batches, not single records: only a bigger topic limit helps.
    log.error("trainmon: Kafka refused a batch for %s as too large: the topic's max.message.bytes "
              "is below the producer's batch size (%s bytes); raise it (Kafka's default is 1 MB). "
              "The records are kept in the spill file.", topic, f"{batch_bytes:,}")


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
