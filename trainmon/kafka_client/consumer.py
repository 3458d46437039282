"""A Kafka consumer: subscribe with rebalance callbacks, poll raw messages, seek, commit.

Rebalance callbacks run on the thread that polls (librdkafka serves them inside
``poll``), so they may block and make Kafka calls (``committed``, ``seek``, ``pause``).
A ``seek`` inside ``on_assign`` sets where the partition starts.

Positions are tracked here per partition (the offset after the last message handed out,
or where a seek put it), so ``commit_consumed`` commits exactly what the caller received
and ``position`` answers without a broker call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from . import settings
from .errors import KafkaError, retried, translated
from .types import TopicPartition

log = logging.getLogger("trainmon.kafka")

Callback = Callable[[list[TopicPartition]], None]
_METADATA_TTL_S = 30.0  # partitions are added rarely (by hand); a new one is seen within this
_UNKNOWN_TOPIC_RETRY_S = 1.0
# ListOffsets "timestamps" that ask for a partition's end and start instead of a time.
_LATEST, _EARLIEST = -1, -2


@dataclass(slots=True)
class RawMessage:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int  # the producer's create time, or the broker's with LogAppendTime
    headers: list[tuple[str, bytes]] | None = None


class Consumer:
    def __init__(self, group_id: str | None = None, *, env: dict | None = None,
                 bootstrap: str | None = None, instance_id: str | None = None,
                 fetch_max_bytes: int = 8 * 1024 * 1024, **overrides):
        """``group_id=None``: a reader that assigns partitions itself and never commits."""
        from confluent_kafka import Consumer as _Consumer

        config = settings.librdkafka(env, bootstrap)
        config.update({
            # librdkafka wants a group id even for assign(); a reader never joins or commits.
            "group.id": group_id or "trainmon-reader",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": fetch_max_bytes,
            # A run's records are on one partition: let one partition fill a fetch (the
            # default, 1 MiB, took the broker ~50 % more CPU to serve a backlog of
            # uncompressed records, in many more fetches).
            "max.partition.fetch.bytes": fetch_max_bytes,
            # The default prefetch queue holds up to 64 MiB per consumer; 16 is plenty
            # ahead of one 8 MiB poll and keeps a service's memory modest.
            "queued.max.messages.kbytes": 16 * 1024,
            # Once that queue is full librdkafka waits this long before fetching again (its
            # default is a whole second): a consumer draining a backlog then read 60-74k
            # records/s, with 10 ms over 2M/s.
            "fetch.queue.backoff.ms": 10,
            # How long the broker holds a fetch that finds nothing new (default 500 ms). A
            # fetch sent right after assignment often asks only partitions that are empty,
            # and the partitions with a backlog waited for its answer: half a second of a
            # 2-second drain. Idle, it is 10 fetches a second instead of 2.
            "fetch.wait.max.ms": 100,
            # A subscribed topic created later (by another consumer's group, by hand) is
            # noticed within seconds, not at librdkafka's default 5-minute refresh.
            "topic.metadata.refresh.interval.ms": 10_000,
            "partition.assignment.strategy": settings.ASSIGNMENT_STRATEGY,
            **overrides,
        })
        if instance_id:
            config["group.instance.id"] = instance_id
        report = config.get("error_cb")

        def on_error(error) -> None:
            if error.fatal():
                self._fatal = error.str()
            if report is not None:
                report(error)
        config["error_cb"] = on_error
        self._config = config
        self._topics: list[str] = []
        self._fatal: str | None = None
        self._consumer = _Consumer(config)
        self._positions: dict[TopicPartition, int] = {}
        self._assignment: set[TopicPartition] = set()
        self._on_assign: Callback | None = None
        self._on_revoke: Callback | None = None
        self._assigning: dict[TopicPartition, int] | None = None  # seeks asked in on_assign
        self._paused_in_assign: list[TopicPartition] = []
        self._partitions_cache: dict[str, list[int]] = {}
        self._metadata_at = -1e9
        self.closed = False

    # -- group membership ------------------------------------------------------------

    def subscribe(self, topics: list[str], on_assign: Callback | None = None,
                  on_revoke: Callback | None = None) -> None:
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._topics = list(topics)
        self._consumer.subscribe(self._topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._revoked)

    def listen(self, on_assign: Callback | None, on_revoke: Callback | None) -> None:
        """Replace the rebalance callbacks (before the first poll: none has run yet)."""
        self._on_assign, self._on_revoke = on_assign, on_revoke

    def _recover(self) -> None:
        """A fatal error leaves librdkafka's consumer unusable for good (seen: a static
        member fenced by its own earlier session after a broker restart): a new client
        joins again, and the on_assign callback positions the partitions as at start."""
        from confluent_kafka import Consumer as _Consumer

        log.warning("Kafka consumer: fatal error (%s); joining again with a new client", self._fatal)
        self._fatal = None
        if self._assignment and self._on_revoke is not None:
            self._on_revoke(sorted(self._assignment))  # the owner writes what it holds first
        try:
            self._consumer.close()
        except Exception:  # noqa: BLE001 -- a fenced client may refuse a clean close
            pass
        self._assignment.clear()
        self._positions.clear()
        self._consumer = _Consumer(self._config)
        if self._topics:
            self._consumer.subscribe(self._topics, on_assign=self._assigned, on_revoke=self._revoked,
                                     on_lost=self._revoked)

    def _assigned(self, consumer, partitions) -> None:
        from confluent_kafka import OFFSET_INVALID, TopicPartition as _TP

        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._assigning, self._paused_in_assign = {}, []
        try:
            if self._on_assign:
                self._on_assign(tps)
            seeks = self._assigning
        finally:
            self._assigning = None
        starts = {**self._start_offsets([tp for tp in tps if tp not in seeks]), **seeks}
        consumer.assign([_TP(tp.topic, tp.partition, starts.get(tp, OFFSET_INVALID)) for tp in tps])
        self._assignment.update(tps)
        for tp, offset in seeks.items():
            self._positions[tp] = offset
        if self._paused_in_assign:
            consumer.pause([_TP(*tp) for tp in self._paused_in_assign])

    def _start_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Where partitions no seek placed start: the group's committed offset, else the
        log's start (``auto.offset.reset`` is earliest), in two batched requests. Left to
        librdkafka, a partition with nothing committed is looked up after a 100 ms backoff,
        and a fetch sent for the partitions found first then holds the others up to
        fetch.wait.max.ms: ~0.25 s before the first record, measured. On any error: {}
        (librdkafka looks them up itself, as before)."""
        if not partitions:
            return {}
        from confluent_kafka import KafkaException, TopicPartition as _TP

        try:
            committed = [p for p in self._consumer.committed([_TP(*tp) for tp in partitions], timeout=5)
                         if p.error is None]  # a partition not answered for: librdkafka's to place
            starts = {TopicPartition(p.topic, p.partition): p.offset for p in committed if p.offset >= 0}
            # Nothing committed: from the log's start.
            unknown = [_TP(p.topic, p.partition, _EARLIEST) for p in committed if p.offset < 0]
            if unknown:
                starts.update((TopicPartition(p.topic, p.partition), p.offset)
                              for p in self._consumer.offsets_for_times(unknown, timeout=5)
                              if p.error is None and p.offset >= 0)
            return starts
        except KafkaException as exc:
            log.debug("Kafka consumer: start offsets left to librdkafka (%s)", exc)
            return {}

    def _revoked(self, consumer, partitions) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        try:
            if self._on_revoke:
                self._on_revoke(tps)
        finally:
            consumer.unassign()
            for tp in tps:
                self._assignment.discard(tp)
                self._positions.pop(tp, None)

    def assign(self, partitions: dict[TopicPartition, int]) -> None:
        """Read these partitions from these offsets, outside any group (readers)."""
        from confluent_kafka import TopicPartition as _TP

        self._consumer.assign([_TP(tp.topic, tp.partition, offset) for tp, offset in partitions.items()])
        self._assignment = set(partitions)
        self._positions = dict(partitions)

    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)

    # -- reading -----------------------------------------------------------------------

    def poll(self, timeout_s: float, max_messages: int = 10_000) -> list[RawMessage]:
        """Messages as soon as any are there (at most ``max_messages``), else [] after
        ``timeout_s``. Rebalance callbacks run in here."""
        if self._fatal is not None and self._topics:
            self._recover()
        consumer = self._consumer
        first = consumer.poll(timeout_s)
        if first is None:
            return []
        batch = [first]
        if max_messages > 1:
            batch += consumer.consume(max_messages - 1, 0)
        out: list[RawMessage] = []
        positions, assignment = self._positions, self._assignment
        for m in batch:
            error = m.error()
            if error is not None:
                if settings.cause_of(error.str()) is not None:
                    # Refused (a user without the right): no retry fixes that, a setting does.
                    raise KafkaError(f"Kafka consumer: {settings.cause_of(error.str())}. Kafka said: "
                                     f"{error.str()}", code=error.name())
                # Partition-level errors (a topic not there yet ...): the client retries.
                log.debug("Kafka consumer: %s", error.str())
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            tp = TopicPartition(topic, partition)
            if tp not in assignment:
                # Its partition was revoked later in this poll (consume serves rebalances
                # too): dropped, and no position kept, which would outlive the revocation
                # and say, once the partition is back, that it was read past this message.
                continue
            positions[tp] = offset + 1
            out.append(RawMessage(topic, partition, offset, m.key(), m.value(), m.timestamp()[1], m.headers()))
        return out

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if self._assigning is not None:  # inside on_assign: where the partition starts
            self._assigning[tp] = offset
            return
        from confluent_kafka import TopicPartition as _TP

        with translated(f"seek {tp.topic}[{tp.partition}] to {offset}"):
            self._consumer.seek(_TP(tp.topic, tp.partition, offset))
        self._positions[tp] = offset

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        partitions = list(partitions)
        if self._assigning is not None:
            self._paused_in_assign.extend(partitions)
            return
        from confluent_kafka import TopicPartition as _TP

        self._consumer.pause([_TP(*tp) for tp in partitions])

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        from confluent_kafka import TopicPartition as _TP

        self._consumer.resume([_TP(*tp) for tp in partitions])

    # -- offsets -------------------------------------------------------------------------

    def position(self, tp: TopicPartition) -> int:
        """The next offset this consumer will hand out for ``tp``."""
        return self.positions([tp])[tp]

    def positions(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """``position`` of many partitions, with one committed-offsets request for those
        not read from yet. A broker call waits behind the consumer's own fetch (up to
        fetch.wait.max.ms on the same connection), so one per partition adds up."""
        partitions = list(partitions)
        unknown = [tp for tp in partitions if tp not in self._positions]
        if unknown:
            committed = self.committed(unknown)
            for tp in unknown:
                offset = committed.get(tp)
                if offset is None:  # nothing committed: reading starts at the log's start
                    low = self.watermarks(tp, cached=True)[0]
                    offset = low if low >= 0 else self.watermarks(tp)[0]
                self._positions[tp] = offset
        return {tp: self._positions[tp] for tp in partitions}

    def committed(self, partitions: list[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int | None]:
        from confluent_kafka import TopicPartition as _TP

        answer = retried(lambda: self._consumer.committed([_TP(*tp) for tp in partitions], timeout=timeout_s),
                         "committed offsets", timeout_s)
        return {TopicPartition(p.topic, p.partition): (p.offset if p.offset >= 0 else None)
                for p in answer}

    def watermarks(self, tp: TopicPartition, cached: bool = False, timeout_s: float = 10.0) -> tuple[int, int]:
        """(low, high) offsets of ``tp``; ``cached``: as of the last fetch, no broker call
        (-1 where nothing was fetched yet)."""
        from confluent_kafka import TopicPartition as _TP

        answer = retried(lambda: self._consumer.get_watermark_offsets(_TP(*tp), timeout=timeout_s, cached=cached),
                         f"offsets of {tp.topic}[{tp.partition}]", timeout_s)
        if answer is None:
            raise KafkaError(f"offsets of {tp.topic}[{tp.partition}]: timed out", retriable=True)
        low, high = answer
        return (max(low, -1), max(high, -1))

    def end_offsets(self, partitions: Iterable[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """Each partition's end (high watermark) as of now, in one batched ListOffsets
        request: a watermark query per partition waits behind the consumer's own fetch
        each time (fetch.wait.max.ms), ~0.1 s apiece."""
        return self._listed_offsets(partitions, _LATEST, timeout_s)

    def start_offsets(self, partitions: Iterable[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """Each partition's start (low watermark: past 0 once retention, or a delete,
        removed its first records), in one batched ListOffsets request."""
        return self._listed_offsets(partitions, _EARLIEST, timeout_s)

    def _listed_offsets(self, partitions: Iterable[TopicPartition], which: int,
                        timeout_s: float) -> dict[TopicPartition, int]:
        """``which``: _LATEST or _EARLIEST, Kafka's ListOffsets timestamps for either end."""
        from confluent_kafka import TopicPartition as _TP

        partitions = list(partitions)
        if not partitions:
            return {}
        what = "end offsets" if which == _LATEST else "start offsets"
        answer = retried(lambda: self._consumer.offsets_for_times([_TP(*tp, which) for tp in partitions],
                                                                  timeout=timeout_s),
                         what, timeout_s)
        listed = {TopicPartition(p.topic, p.partition): p.offset for p in answer
                  if p.error is None and p.offset >= 0}
        # A partition the batch did not answer for is asked alone.
        low_or_high = 1 if which == _LATEST else 0
        return {tp: listed[tp] if tp in listed else self.watermarks(tp, timeout_s=timeout_s)[low_or_high]
                for tp in partitions}

    def uncommitted(self, partitions: list[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """Per partition, the messages this consumer's group has yet to read: from its
        committed offset, or from the log's start where it committed nothing or retention
        has removed records past its commit (a week of records gone is no lag)."""
        committed = self.committed(partitions, timeout_s)
        starts = self.start_offsets(partitions, timeout_s)
        ends = self.end_offsets(partitions, timeout_s)
        return {tp: max(0, ends[tp] - max(committed.get(tp) or 0, starts[tp])) for tp in partitions}

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit these next-offsets, synchronously."""
        if not offsets:
            return
        from confluent_kafka import TopicPartition as _TP

        with translated("commit"):
            self._consumer.commit(offsets=[_TP(tp.topic, tp.partition, o) for tp, o in offsets.items()],
                                  asynchronous=False)

    def consumed(self) -> dict[TopicPartition, int]:
        """The position of every assigned partition something was read from (or sought)."""
        return {tp: o for tp, o in self._positions.items() if tp in self._assignment}

    def commit_consumed(self) -> None:
        """Commit the position of every assigned partition something was read from."""
        self.commit(self.consumed())

    # -- metadata ------------------------------------------------------------------------

    def partitions_for(self, topic: str) -> list[int]:
        """The topic's partitions ([] if unknown). One metadata request answers for every
        topic and is kept for _METADATA_TTL_S (a topic not there yet: asked again after
        _UNKNOWN_TOPIC_RETRY_S): a request waits behind the consumer's fetch on the same
        connection, so asking per topic, per check, costs seconds."""
        now = time.monotonic()
        stale = now - self._metadata_at >= _METADATA_TTL_S
        if stale or (topic not in self._partitions_cache and now - self._metadata_at >= _UNKNOWN_TOPIC_RETRY_S):
            with translated("metadata"):
                metadata = self._consumer.list_topics(timeout=10)
            self._partitions_cache = {name: sorted(t.partitions) for name, t in metadata.topics.items()
                                      if t.error is None and t.partitions}
            self._metadata_at = time.monotonic()
        return self._partitions_cache.get(topic, [])

    def topics(self) -> set[str]:
        with translated("list topics"):
            return set(self._consumer.list_topics(timeout=10).topics)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._consumer.close()
