"""A consumer group over record topics: decoded records, dead letters, explicit commits.

Every consumer (ClickHouse, alerts, W&B, Aim, TensorBoard) reads through this class, driven
by the consumer runtime (:mod:`.runtime`):
it unpacks each Kafka message into its records (one or more, see ``schemas.pack``),
decodes each into its pydantic model, sends anything undecodable to the dead-letter
topic with the error and the original bytes, and commits only the offsets the caller
says it has durably handled. A message's records share its offset and are always
handed out together, so "everything before offset N" stays a whole-message notion.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Iterable

from .. import topics
from ..kafka_client import Consumer, KafkaError, Producer, TopicPartition
from ..schemas import (MAX_RECORDS_PER_MESSAGE, RECORD_TYPES, SCHEMA_HEADER, DecodeError, Record, decode,
                       schema_fingerprint, unpack)
from . import membership
from .topic_setup import ensure_topics

log = logging.getLogger("trainmon.consumers")
_REPORTED_PREFIXES: set[str] = set()


@dataclass(slots=True)
class Message:
    """One record, with where it came from: ``index`` is its place in the Kafka message
    at ``offset``, ``value`` its own bytes. Or, handed out undecoded (see RecordStream),
    all ``count`` records of that Kafka message: ``value`` is then the message's, one
    record per line (``RecordStream.decode`` splits it)."""

    kind: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    record: Record | None = None
    index: int = 0
    count: int = 1


def _lines_if_packed(value: bytes) -> int:
    """How many lines a message value has when it starts a JSON object, as ``schemas.pack``
    writes them (one record per line); else 0. (Compact JSON never holds a raw newline, so
    each line is one record, and a line can be given its Kafka coordinates by what starts
    it: clickhouse.columns.json_body, which checks that every line starts an object.)"""
    return value.count(b"\n") + 1 if value[:1] == b"{" else 0


class RecordStream:
    MAX_RECORDS = 10_000  # per poll, unless the caller asks for fewer
    # A dead letter keeps this much of the record's bytes (base64: a third more), so that it
    # stays within Kafka's message size (1 MB by default) whatever the record's size.
    DEAD_LETTER_VALUE_BYTES = 256 * 1024
    # And this much of its error and key as text: an error may quote the record (a field
    # path names its dict keys), and a dead letter over Kafka's size is refused for good,
    # sent again at every commit, and nothing would be committed again.
    DEAD_LETTER_TEXT_CHARS = 4096
    DEAD_LETTERS_WAIT_S = 10.0  # for Kafka to acknowledge the dead letters sent (settle_dead_letters)

    def __init__(self, group_id: str, kinds: Iterable[str] | None = None, *,
                 topic_prefix: str | None = None, env: dict | None = None,
                 undecoded_kinds: Iterable[str] = (), **consumer_settings):
        self.group_id = group_id
        # Of these kinds, records a trainmon producer with our schemas sent (its header
        # says so, see schemas.SCHEMA_HEADER) are handed out as bytes (``record`` None),
        # for a sink that stores them as they are; the sink decodes them should it need to.
        self._undecoded = frozenset(undecoded_kinds)
        self._trusted_header = (SCHEMA_HEADER, schema_fingerprint()) if self._undecoded else None
        self.prefix = topics.prefix() if topic_prefix is None else topic_prefix
        self.kinds = list(kinds or RECORD_TYPES)
        self.dead_letters = 0
        self.dead_letters_by_kind: dict[str, int] = {}  # (for the runtime's metrics)
        self.polled_by_kind: dict[str, int] = {}  # the last poll's records handed out, per kind (same)
        self._env = env
        self._dlq: Producer | None = None
        # Dead letters sent since the last settle_dead_letters: (value, key, its delivery).
        self._unconfirmed: list[tuple[bytes, bytes | None, object]] = []
        # Start from the most a message can pack: a first poll too small, never too big.
        self._records_per_message = float(MAX_RECORDS_PER_MESSAGE)
        self.topic_names = [topics.topic_for(k, self.prefix) for k in self.kinds]
        self.consumer = self._join(consumer_settings)

    # The two places the stream meets Kafka (a MemoryRecordStream overrides them):
    # joining the group, and the producer of dead letters.

    def _join(self, consumer_settings: dict) -> Consumer:
        """Claim an instance id, create the consumer, make the topics exist, subscribe."""
        group_id, env = self.group_id, self._env
        # Static membership by default (see .membership): a restarted service gets its
        # partitions back at once. An explicit group_instance_id (None: dynamic) wins.
        if "group_instance_id" in consumer_settings:
            self._instance = membership.InstanceId(consumer_settings.pop("group_instance_id"))
        else:
            self._instance = membership.claim(group_id, env)
        self.instance_id = self._instance.value
        try:
            self.consumer = Consumer(group_id, env=env, instance_id=self.instance_id, **consumer_settings)
        except BaseException:
            self._instance.release()
            raise
        # The topics there, asked once on the consumer's own connection: those missing are
        # created (an admin client of its own costs ~60 ms at every start, measured) and
        # trainmon-looking ones no consumer reads are named.
        existing = self._existing_topics()
        wanted = [*self.topic_names, topics.topic_for(topics.DEADLETTER, self.prefix)]
        if existing is None or not existing.issuperset(wanted):
            ensure_topics(wanted, env)
        # Rebalance callbacks: set by the consumer runtime (Consumer.listen) before its first poll.
        self.consumer.subscribe(self.topic_names)
        log.info("trainmon: %s joins as %s", group_id,
                 f"static member {self.instance_id}" if self.instance_id else "a dynamic member")
        if existing is not None:
            self._report_uncovered_topics(existing)
        return self.consumer

    def _dead_letter_producer(self) -> Producer:
        return Producer(env=self._env)

    def _existing_topics(self) -> set[str] | None:
        try:
            return self.consumer.topics()
        except Exception as exc:  # a start-up nicety: never a reason not to start
            log.debug("trainmon: could not list topics: %s", exc)
            return None

    def _report_uncovered_topics(self, existing: set[str]) -> None:
        """Say at start which trainmon-looking topics no consumer reads (once per process
        and prefix): records on a misspelt topic are otherwise never seen."""
        if self.prefix in _REPORTED_PREFIXES:
            return
        _REPORTED_PREFIXES.add(self.prefix)
        stray = topics.uncovered(existing, self.prefix)
        if stray:
            shown = ", ".join(stray[:20]) + (f" (+{len(stray) - 20} more)" if len(stray) > 20 else "")
            log.warning("trainmon: %d topic(s) look like trainmon's but no trainmon consumer reads "
                        "them (misspelt kind or prefix? this consumer reads %s<kind>): %s",
                        len(stray), self.prefix, shown)

    def poll(self, timeout_ms: int = 500, max_records: int | None = None) -> list[Message]:
        """Records polled within ``timeout_ms``: about ``max_records`` at most (whole Kafka
        messages: a message packs up to ``schemas.MAX_RECORDS_PER_MESSAGE`` records)."""
        # Kafka counts messages, which pack records: ask for as many messages as the last
        # poll's records per message suggest.
        wanted = max(1, int(min(max_records or self.MAX_RECORDS, self.MAX_RECORDS)
                            / self._records_per_message))
        raw = self.consumer.poll(timeout_ms / 1000, max_messages=wanted)
        messages: list[Message] = []
        append = messages.append
        records = 0
        by_kind: dict[str, int] = {}  # counted per Kafka message, not per record
        for m in raw:
            topic, partition, offset, key, value = m.topic, m.partition, m.offset, m.key, m.value or b""
            kind = topics.kind_of(topic, self.prefix)
            if kind in self._undecoded and m.headers and self._trusted_header in m.headers:
                count = _lines_if_packed(value)
                if count:
                    # Handed out whole: no Python work per record for a sink that stores
                    # the JSON as it came.
                    append(Message(kind, topic, partition, offset, key, value, None, 0, count))
                    records += count
                    by_kind[kind] = by_kind.get(kind, 0) + count
                    continue
            decoded = self._decode_into(messages, kind, topic, partition, offset, key, value)
            records += decoded
            if decoded:
                by_kind[kind] = by_kind.get(kind, 0) + decoded
        self.polled_by_kind = by_kind
        if raw:
            self._records_per_message = max(1.0, records / len(raw))
        return messages

    def decode(self, messages: list[Message]) -> list[Message]:
        """Decode the records handed out undecoded (one Message each); dead-letter those
        that do not decode. Returns the messages that have their record."""
        decoded: list[Message] = []
        for m in messages:
            if m.record is not None:
                decoded.append(m)
            else:
                self._decode_into(decoded, m.kind, m.topic, m.partition, m.offset, m.key, m.value)
        return decoded

    def _decode_into(self, out: list[Message], kind: str, topic: str, partition: int, offset: int,
                     key: bytes | None, value: bytes) -> int:
        """Append the records of one Kafka message value to ``out``, each one positional
        Message, decoded (this runs for every record a consumer decodes); dead-letter those
        that do not decode. Returns how many were appended."""
        appended = 0
        for index, line in enumerate(unpack(value)):
            message = Message(kind, topic, partition, offset, key, line, None, index)
            if self._decoded(message):
                out.append(message)
                appended += 1
        return appended

    def _decoded(self, message: Message) -> bool:
        """Give ``message`` its record, or dead-letter it (False). Whatever decoding raises
        costs that record only, never the consumer."""
        try:
            message.record = decode(message.kind, message.value)
        except Exception as exc:  # noqa: BLE001 -- one record's problem, never the consumer's
            self.dead_letter(message, exc.reason if isinstance(exc, DecodeError) else
                             f"cannot decode: {type(exc).__name__}: {exc}"[:500])
            return False
        return True

    def dead_letter(self, message: Message, error: str) -> None:
        """Publish a record we cannot use, with why, and keep going."""
        if len(error) > self.DEAD_LETTER_TEXT_CHARS:
            error = error[:self.DEAD_LETTER_TEXT_CHARS] + f"... ({len(error):,} characters)"
        self.dead_letters += 1
        self.dead_letters_by_kind[message.kind] = self.dead_letters_by_kind.get(message.kind, 0) + 1
        if self.dead_letters <= 5:
            log.warning("trainmon: dead-lettering %s[%d]@%d#%d: %s", message.topic,
                        message.partition, message.offset, message.index, error)
        if self._dlq is None:
            self._dlq = self._dead_letter_producer()
        body = {
            "consumer": self.group_id,
            "topic": message.topic,
            "partition": message.partition,
            "offset": message.offset,
            "index": message.index,
            "error": error,
            "key": message.key.decode("utf-8", "replace")[:self.DEAD_LETTER_TEXT_CHARS] if message.key else None,
            "value_base64": base64.b64encode((message.value or b"")[:self.DEAD_LETTER_VALUE_BYTES]).decode(),
        }
        if len(message.value or b"") > self.DEAD_LETTER_VALUE_BYTES:
            body["value_bytes"] = len(message.value)  # the rest stays in Kafka, at its offset
            body["value_truncated"] = True
        self._send_dead_letter(json.dumps(body).encode(), message.key)

    def _send_dead_letter(self, value: bytes, key: bytes | None) -> None:
        delivery = self._dlq.send(topics.topic_for(topics.DEADLETTER, self.prefix), value, key=key)
        self._unconfirmed.append((value, key, delivery))

    def positions(self) -> dict[TopicPartition, int]:
        """Where each assigned partition has been read up to (its next offset)."""
        return self.consumer.consumed()

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit these next-offsets; the dead letters sent so far are durable first."""
        self.settle_dead_letters()
        self.consumer.commit(offsets)

    def commit_polled(self) -> None:
        """Commit the positions of everything polled so far (dead letters included)."""
        self.commit(self.positions())

    def settle_dead_letters(self) -> None:
        """Return once every dead letter sent so far is in Kafka (KafkaError, retriable,
        after DEAD_LETTERS_WAIT_S): before their offsets are committed, or before anything a sink resumes
        from (the loader's rows) moves past them."""
        if self._dlq is None:
            return
        if not self._dlq.flush(self.DEAD_LETTERS_WAIT_S):
            raise KafkaError(f"dead letters not acknowledged by Kafka within {self.DEAD_LETTERS_WAIT_S:g} s",
                             retriable=True)
        # Answered is not stored: one Kafka refused (a login not allowed to write the topic)
        # is sent again, and nothing moves past it until it lands.
        refused = [(value, key, delivery.error) for value, key, delivery in self._unconfirmed if delivery.failed]
        self._unconfirmed = []
        if refused:
            for value, key, _ in refused:
                self._send_dead_letter(value, key)
            raise KafkaError(f"{len(refused)} dead letter(s) refused by Kafka ({refused[0][2]}); sent again",
                             retriable=True)

    def close(self) -> None:
        try:
            if self._dlq is not None:
                self._dlq.close(5)
            self.consumer.close()
        finally:
            self._instance.release()  # only now may another process take this instance id

