"""One exception type for every failed Kafka call, whatever the client library."""

from __future__ import annotations

from contextlib import contextmanager


class KafkaError(Exception):
    """A Kafka call failed (broker away, rebalance under way, refused request ...)."""

    def __init__(self, message: str, *, retriable: bool = False, code: str | None = None):
        super().__init__(message)
        self.retriable = retriable
        self.code = code


class TransportUnavailable(Exception):
    """The broker cannot be reached now; the producer keeps the records and retries later."""


@contextmanager
def translated(what: str):
    """Re-raise confluent-kafka's exceptions as :class:`KafkaError`, saying what failed."""
    from confluent_kafka import KafkaException

    try:
        yield
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if hasattr(error, "code"):
            raise KafkaError(f"{what}: {error.str()}", retriable=error.retriable(),
                             code=error.name()) from exc
        raise KafkaError(f"{what}: {exc}") from exc
