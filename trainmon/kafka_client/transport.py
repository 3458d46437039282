"""The producer's way to Kafka, as a contract: send packed messages, report what could
not be delivered.

Implementations, one module each: :mod:`.confluent_transport` on librdkafka (the
default), :mod:`.kafka_python_transport` for machines where confluent-kafka cannot be
installed, and :mod:`.memory_transport` for tests (as httpx ships ``MockTransport``), and
:mod:`.relay_transport` to the node's relay (``trainmon relay``, ``TRAINMON_RELAY``);
:mod:`.transport_choice` picks one. Anything Kafka finally gives up on is handed to
``on_undelivered`` so the producer's worker can keep it: a transport never drops a
record silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

log = logging.getLogger("trainmon.producer")

Entry = tuple[str, bytes, bytes]  # topic, key, value (a packed message)
Undelivered = Callable[[list[Entry]], None]


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
