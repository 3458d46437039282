"""One exception type for every failed Kafka call, whatever the client library."""

from __future__ import annotations

import time
from contextlib import contextmanager

from ..backoff import Backoff


class KafkaError(Exception):
    """A Kafka call failed (broker away, rebalance under way, refused request ...)."""

    def __init__(self, message: str, *, retriable: bool = False, code: str | None = None):
        super().__init__(message)
        self.retriable = retriable
        self.code = code


class TransportUnavailable(Exception):
    """The broker cannot be reached now; the producer keeps the records and retries later."""


# Errors that pass by themselves: what a topic created a moment ago, a broker that just
# started or a coordinator moving answer for a few seconds (librdkafka does not flag all
# of them retriable, as they are fatal to a request but not to the caller).
_TRANSIENT = {"NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE", "UNKNOWN_TOPIC_OR_PART",
              "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE", "NOT_COORDINATOR",
              "REQUEST_TIMED_OUT", "_TIMED_OUT", "_TRANSPORT", "_ALL_BROKERS_DOWN",
              "_WAIT_COORD", "_UNKNOWN_PARTITION", "_UNKNOWN_TOPIC"}


def retried(call, what: str, timeout_s: float = 10.0):
    """``call()``, again after a short pause while it fails with a retriable error (a
    partition whose leader is being elected, a coordinator loading its offsets: the
    normal state of a topic created a moment ago) and ``timeout_s`` has not passed."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=0.05, max_s=1.0)
    while True:
        try:
            with translated(what):
                return call()
        except KafkaError as exc:
            pause = backoff.next()
            if not exc.retriable or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)


@contextmanager
def translated(what: str):
    """Re-raise confluent-kafka's exceptions as :class:`KafkaError`, saying what failed."""
    from confluent_kafka import KafkaException

    try:
        yield
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if hasattr(error, "code"):
            raise KafkaError(f"{what}: {error.str()}", code=error.name(),
                             retriable=error.retriable() or error.name() in _TRANSIENT) from exc
        raise KafkaError(f"{what}: {exc}") from exc
