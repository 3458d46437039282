"""The consumer side of a :class:`~.memory_transport.MemoryBroker`, for tests: a consumer
group with rebalances and committed offsets, and a producer for the consumers' own
output (dead letters), with no Kafka. ``MemoryConsumer`` answers what :class:`.Consumer`
answers, so a RecordStream and the consumer runtime run on it unchanged (see
``trainmon.consumers.memory_stream``).

Each topic of the broker is one partition, 0 (a message's offset is its place in the
topic's list): a group of several members then shares a subscription's topics. As with
Kafka's cooperative rebalancing, a partition moves to its new member only once the old
one gave it up (in its own ``poll``), and rebalance callbacks run inside ``poll`` on the
polling thread. While the broker is down (``broker.up = False``) polls find nothing and
commits fail with a retriable KafkaError.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable
from weakref import WeakKeyDictionary

from .consumer import Callback, RawMessage
from .errors import KafkaError
from .memory_transport import MemoryBroker
from .producer import Delivery
from .types import TopicPartition

PARTITION = 0
_POLL_PAUSE_S = 0.005  # how often an empty poll looks again within its timeout


class _Group:
    """One consumer group on one broker: its members in join order, who owns which
    partition, what it committed."""

    def __init__(self):
        self.members: list[MemoryConsumer] = []
        self.owners: dict[TopicPartition, MemoryConsumer] = {}
        self.committed: dict[TopicPartition, int] = {}

    def share(self, member: "MemoryConsumer") -> set[TopicPartition]:
        """The partitions ``member`` should own now: the members' subscriptions dealt out
        round-robin in join order (what a range or sticky assignor gives a stable group)."""
        wanted = sorted({tp for m in self.members for tp in m.subscribed_partitions()})
        share: set[TopicPartition] = set()
        for turn, tp in enumerate(wanted):
            takers = [m for m in self.members if tp in m.subscribed_partitions()]
            if takers[turn % len(takers)] is member:
                share.add(tp)
        return share


# Group state per broker, kept beside it rather than on it: the broker itself is only the
# producer's log (memory_transport), and stays that.
_groups: WeakKeyDictionary[MemoryBroker, dict[str, _Group]] = WeakKeyDictionary()
_groups_lock = threading.Lock()


def _group(broker: MemoryBroker, group_id: str) -> _Group:
    with _groups_lock:
        return _groups.setdefault(broker, {}).setdefault(group_id, _Group())


def committed_offsets(broker: MemoryBroker, group_id: str) -> dict[TopicPartition, int]:
    """What the group has committed on this broker (next offsets)."""
    with _groups_lock:
        group = _groups.get(broker, {}).get(group_id)
        return dict(group.committed) if group is not None else {}


def create_topics(broker: MemoryBroker, names: Iterable[str]) -> None:
    """Make the topics exist, empty (as ensure_topics does on Kafka)."""
    for name in names:
        broker.topics.setdefault(name, [])


class MemoryConsumer:
    def __init__(self, broker: MemoryBroker, group_id: str | None = None):
        """``group_id=None``: a reader that assigns partitions itself and never commits."""
        self.broker = broker
        self.group_id = group_id
        self._group = _group(broker, group_id) if group_id else None
        self._topics: list[str] = []
        self._assignment: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._on_assign: Callback | None = None
        self._on_revoke: Callback | None = None
        self._assigning: dict[TopicPartition, int] | None = None  # seeks asked in on_assign
        self.closed = False

    # -- group membership ------------------------------------------------------------

    def subscribe(self, topics: list[str], on_assign: Callback | None = None,
                  on_revoke: Callback | None = None) -> None:
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._topics = list(topics)
        create_topics(self.broker, self._topics)
        with _groups_lock:
            if self not in self._group.members:
                self._group.members.append(self)

    def listen(self, on_assign: Callback | None, on_revoke: Callback | None) -> None:
        """Replace the rebalance callbacks (before the first poll: none has run yet)."""
        self._on_assign, self._on_revoke = on_assign, on_revoke

    def subscribed_partitions(self) -> list[TopicPartition]:
        return [TopicPartition(topic, PARTITION) for topic in self._topics]

    def _rebalance(self) -> None:
        """Give up what the group now deals to others, then take what is ours and free."""
        group = self._group
        with _groups_lock:
            share = group.share(self)
        revoked = sorted(self._assignment - share)
        if revoked:
            try:
                if self._on_revoke:
                    self._on_revoke(revoked)
            finally:
                with _groups_lock:
                    for tp in revoked:
                        self._assignment.discard(tp)
                        self._positions.pop(tp, None)
                        self._paused.discard(tp)
                        group.owners.pop(tp, None)
        with _groups_lock:
            assigned = sorted(tp for tp in share - self._assignment if group.owners.get(tp) in (None, self))
            for tp in assigned:
                group.owners[tp] = self
        if not assigned:
            return
        self._assigning = {}
        try:
            if self._on_assign:
                self._on_assign(assigned)
            seeks = self._assigning
        finally:
            self._assigning = None
        self._assignment.update(assigned)
        with _groups_lock:
            committed = dict(group.committed)
        for tp in assigned:
            self._positions[tp] = seeks.get(tp, committed.get(tp, 0))

    def assign(self, partitions: dict[TopicPartition, int]) -> None:
        """Read these partitions from these offsets, outside any group (readers)."""
        self._assignment = set(partitions)
        self._positions = dict(partitions)

    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)

    # -- reading -----------------------------------------------------------------------

    def poll(self, timeout_s: float, max_messages: int = 10_000) -> list[RawMessage]:
        """Messages as soon as any are there (at most ``max_messages``), else [] after
        ``timeout_s``. Rebalance callbacks run in here."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._group is not None and self._topics:
                self._rebalance()
            out = self._read(max_messages) if self.broker.up else []
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(_POLL_PAUSE_S, max(0.0, deadline - time.monotonic())))

    def _read(self, max_messages: int) -> list[RawMessage]:
        out: list[RawMessage] = []
        for tp in sorted(self._assignment - self._paused):
            log = self.broker.topics.get(tp.topic, [])
            start = self._positions.get(tp, 0)
            taken = log[start:start + max_messages - len(out)]
            out += [RawMessage(tp.topic, tp.partition, start + i, key, value, 0)
                    for i, (key, value) in enumerate(taken)]
            self._positions[tp] = start + len(taken)
            if len(out) >= max_messages:
                break
        return out

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if self._assigning is not None:  # inside on_assign: where the partition starts
            self._assigning[tp] = offset
            return
        self._positions[tp] = offset

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused.update(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused.difference_update(partitions)

    # -- offsets -------------------------------------------------------------------------

    def position(self, tp: TopicPartition) -> int:
        return self.positions([tp])[tp]

    def positions(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        partitions = list(partitions)
        committed = self.committed([tp for tp in partitions if tp not in self._positions])
        for tp, offset in committed.items():
            self._positions[tp] = offset or 0
        return {tp: self._positions[tp] for tp in partitions}

    def committed(self, partitions: list[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int | None]:
        done = committed_offsets(self.broker, self.group_id) if self.group_id else {}
        return {tp: done.get(tp) for tp in partitions}

    def watermarks(self, tp: TopicPartition, cached: bool = False, timeout_s: float = 10.0) -> tuple[int, int]:
        return (0, len(self.broker.topics.get(tp.topic, [])))

    def end_offsets(self, partitions: Iterable[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        return {tp: self.watermarks(tp)[1] for tp in partitions}

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit these next-offsets; refused while the broker is down, or for a partition
        this member no longer owns (Kafka's rebalance-in-progress refusal)."""
        if not offsets:
            return
        if not self.broker.up:
            raise KafkaError("commit: broker down", retriable=True, code="_TRANSPORT")
        with _groups_lock:
            if any(self._group.owners.get(tp) is not self for tp in offsets):
                raise KafkaError("commit: partitions not owned", retriable=True,
                                 code="REBALANCE_IN_PROGRESS")
            self._group.committed.update(offsets)

    def consumed(self) -> dict[TopicPartition, int]:
        return {tp: o for tp, o in self._positions.items() if tp in self._assignment}

    def commit_consumed(self) -> None:
        self.commit(self.consumed())

    # -- metadata ------------------------------------------------------------------------

    def partitions_for(self, topic: str) -> list[int]:
        return [PARTITION] if topic in self.broker.topics else []

    def topics(self) -> set[str]:
        return set(self.broker.topics)

    def close(self) -> None:
        """Leave the group: its partitions go to the others at their next poll. As
        librdkafka's close does, the revoke callback runs first, for what it owns."""
        if self.closed:
            return
        self.closed = True
        if self._group is None:
            self._assignment.clear()
            return
        try:
            if self._assignment and self._on_revoke:
                self._on_revoke(sorted(self._assignment))
        finally:
            with _groups_lock:
                if self in self._group.members:
                    self._group.members.remove(self)
                for tp in self._assignment:
                    if self._group.owners.get(tp) is self:
                        del self._group.owners[tp]
            self._assignment.clear()


class MemoryProducer:
    """The consumers' small producer (:class:`.Producer`) on a MemoryBroker: a message is
    on its topic at once while the broker is up, else once it is back and the producer
    is flushed."""

    def __init__(self, broker: MemoryBroker):
        self.broker = broker
        self._waiting: list[tuple[str, bytes | None, bytes, Delivery]] = []

    def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> Delivery:
        delivery = Delivery()
        self._waiting.append((topic, key, value, delivery))
        self._deliver()
        return delivery

    def _deliver(self) -> None:
        while self._waiting and self.broker.up:
            topic, key, value, delivery = self._waiting.pop(0)
            self.broker.append(topic, key, value)
            delivery.done, delivery.offset = True, len(self.broker.topics[topic]) - 1

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._deliver()
            if not self._waiting or time.monotonic() >= deadline:
                return not self._waiting
            time.sleep(_POLL_PAUSE_S)

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
