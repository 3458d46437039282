"""A partition as the rest of trainmon sees it: a hashable (topic, partition) tuple."""

from __future__ import annotations

from typing import NamedTuple


class TopicPartition(NamedTuple):
    topic: str
    partition: int
