"""Topic names: one topic per record kind, under a configurable prefix."""

from __future__ import annotations

import os

from .schemas import RECORD_TYPES

DEFAULT_PREFIX = "trainmon."
DEADLETTER = "deadletter"


def prefix() -> str:
    return os.environ.get("TRAINMON_TOPIC_PREFIX", DEFAULT_PREFIX)


def topic_for(kind: str, topic_prefix: str | None = None) -> str:
    return f"{prefix() if topic_prefix is None else topic_prefix}{kind}"


def kind_of(topic: str, topic_prefix: str | None = None) -> str:
    p = prefix() if topic_prefix is None else topic_prefix
    return topic[len(p):] if topic.startswith(p) else topic


def all_topics(topic_prefix: str | None = None) -> list[str]:
    return [topic_for(k, topic_prefix) for k in [*RECORD_TYPES, DEADLETTER]]


def record_key(run_id: str) -> bytes:
    """One key per run. Kafka keeps a key's records in order on one partition, so each
    rank's records stay in order (a subset of the run's); and with every record topic of
    the same partition count and one hash for all producers (murmur2, see
    kafka_client.settings), every kind of a run lands on the same partition number, which
    the consumer group's range assignor gives to one member: each alerts engine sees
    whole runs, every rank of them (docs/alerts.md, "Scaling out")."""
    return run_id.encode()


def uncovered(existing, topic_prefix: str | None = None) -> list[str]:
    """Existing topics that look like trainmon's but that no trainmon consumer reads: a
    name starting with ``trainmon`` or with the prefix's first segment (``team`` of
    ``team.trainmon.``), other than a record kind's topic or the dead-letter topic under
    the prefix. E.g. ``trainmon.stpe`` written by a producer with a misspelt kind or
    prefix: its records would otherwise sit there unnoticed."""
    p = prefix() if topic_prefix is None else topic_prefix
    stems = {"trainmon", p.split(".")[0]} - {""}
    covered = set(all_topics(p))
    return sorted(t for t in existing
                  if t not in covered and not t.startswith("__")
                  and any(t.startswith(stem) for stem in stems))
