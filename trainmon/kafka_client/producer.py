"""A small producer for the consumers' own output (dead letters, alerts).

The training side's producer is :mod:`trainmon.producer`; its transport to Kafka is
:mod:`.transport` here. This one sends a message and tells, through a :class:`Delivery`,
whether Kafka has it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings


@dataclass(slots=True)
class Delivery:
    done: bool = False
    error: str | None = None
    offset: int | None = None  # where Kafka stored it
    # Refused by the client before it was sent, as over its message.max.bytes: sending it
    # again cannot help (the broker's own refusal comes in a report, as other failures).
    too_large: bool = False

    @property
    def failed(self) -> bool:
        return self.done and self.error is not None

    def _report(self, error, message) -> None:
        self.error = None if error is None else error.str()
        self.offset = message.offset() if error is None else None
        self.done = True

    def _refused(self, exc: Exception) -> None:
        """The client refused the message at produce (a KafkaException holds its KafkaError)."""
        from confluent_kafka import KafkaException

        self.done, self.error = True, f"{type(exc).__name__}: {exc}"
        self.too_large = (isinstance(exc, KafkaException) and bool(exc.args)
                          and exc.args[0].name() == "MSG_SIZE_TOO_LARGE")


class Producer:
    def __init__(self, *, env: dict | None = None, bootstrap: str | None = None, durable: bool = False,
                 **overrides):
        """``durable``: acks from every in-sync replica, idempotent, retried without end
        (the alert topic); otherwise acks=all with librdkafka's defaults."""
        from confluent_kafka import Producer as _Producer

        config = settings.librdkafka(env, bootstrap)
        config.update({"acks": "all", "linger.ms": 5, "partitioner": settings.PARTITIONER})
        if durable:
            config.update({"enable.idempotence": True, "linger.ms": 0,
                           "message.timeout.ms": 0})  # 0: retried until delivered
        config.update(overrides)
        self._producer = _Producer(config)

    def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> Delivery:
        delivery = Delivery()
        where = {} if partition is None else {"partition": partition}
        if headers:
            where["headers"] = headers
        try:
            self._producer.produce(topic, value=value, key=key, on_delivery=delivery._report, **where)
        except BufferError:  # the local queue is full: make room, then try once more
            self._producer.poll(1.0)
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=delivery._report, **where)
            except (BufferError, Exception) as exc:  # noqa: BLE001 -- reported, not raised
                delivery._refused(exc)
        except Exception as exc:  # noqa: BLE001 -- e.g. a message over message.max.bytes
            delivery._refused(exc)
        self._producer.poll(0)
        return delivery

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect Kafka's answers so far (each send's Delivery), waiting up to ``timeout_s``."""
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every send to be answered; True if none is left."""
        return self._producer.flush(timeout_s) == 0

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)

