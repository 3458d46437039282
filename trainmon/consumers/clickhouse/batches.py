"""Polled messages buffered per Kafka partition until a batch is due."""

from __future__ import annotations

import time
from collections import defaultdict

from ...kafka_client import TopicPartition

from ..stream import Message


class PartitionBuffers:
    """Messages grouped by (topic, partition), in offset order, with the age of the
    oldest so a trickle is flushed on time and a burst by size."""

    def __init__(self, max_rows: int, max_wait_s: float):
        self.max_rows = max_rows
        self.max_wait_s = max_wait_s
        self.rows = 0
        self._by_partition: dict[TopicPartition, list[Message]] = defaultdict(list)
        self._oldest: float | None = None

    def add(self, messages: list[Message]) -> None:
        if not messages:
            return
        if self._oldest is None:
            self._oldest = time.monotonic()
        last, bucket = None, None
        for m in messages:  # polled messages come in runs of one partition
            if (m.topic, m.partition) != last:
                last = (m.topic, m.partition)
                bucket = self._by_partition[TopicPartition(*last)]
            bucket.append(m)
        self.rows += sum(m.count for m in messages)

    def due(self) -> bool:
        return self.rows >= self.max_rows or (
            self._oldest is not None and time.monotonic() - self._oldest >= self.max_wait_s)

    def seconds_until_due(self) -> float:
        if self._oldest is None:
            return self.max_wait_s
        return max(0.0, self.max_wait_s - (time.monotonic() - self._oldest))

    def first_offsets(self) -> dict[TopicPartition, int]:
        """The offset of each partition's oldest buffered message."""
        return {tp: messages[0].offset for tp, messages in self._by_partition.items() if messages}

    def take(self, only: set[TopicPartition] | None = None) -> dict[TopicPartition, list[Message]]:
        """Remove and return the buffered batches (all, or those of ``only``)."""
        if only is None:
            taken, self._by_partition = dict(self._by_partition), defaultdict(list)
            self.rows = 0
        else:
            taken = {tp: self._by_partition.pop(tp) for tp in list(self._by_partition) if tp in only}
            self.rows = sum(m.count for v in self._by_partition.values() for m in v)
        if not self.rows:
            self._oldest = None
        return taken
