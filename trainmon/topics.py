"""Topic names: one topic per record kind, under a configurable prefix; and the event
log's disk budget: how the broker stores each topic and how long it keeps it."""

from __future__ import annotations

import math
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


# -- the disk budget (docs/deploy.md, "Retention and compression") ---------------------------
#
# The topics are a bounded window of the event log, ClickHouse keeps the history: a week
# covers a consumer down over a long weekend, a forwarder catching up, and a `trainmon
# replay` of the last week into a fresh database; `trainmon replay` says where the
# retained window starts and refuses to pass a partial rebuild off as a full one. A size
# cap is off by default: it would trim by traffic, not by age, so the replay window would
# shrink under load without anyone choosing it; set one where the disk is smaller than a
# week of the topics (bytes per record x records/s x 604,800 s).
DEFAULT_RETENTION_HOURS = 168.0
# zstd measured best (benchmarks/disk_budget.py). The broker compresses each batch it
# receives; the producer in a training loop keeps sending uncompressed, so the training
# process pays nothing for it.
DEFAULT_COMPRESSION = "zstd"
COMPRESSIONS = ("zstd", "lz4", "gzip", "snappy", "uncompressed", "producer")
# Retention deletes whole segments, never the one being written: a segment is closed
# after a day at most, so a topic holds at most a day beyond its window.
MAX_SEGMENT_MS = 24 * 3600 * 1000
# The incidents' event log: the alerts engine rebuilds its book from it and notify its
# delivered state; a few records per incident, kept whole.
KEPT_WHOLE = ("alert",)


def _number(env: dict, name: str, default: float) -> float:
    text = (env.get(name) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number (-1 keeps everything)") from None
    if not math.isfinite(value):  # (float() takes "inf" and "nan")
        raise ValueError(f"{name}={text!r} is not a finite number (-1 keeps everything)")
    if value != -1 and value <= 0:
        raise ValueError(f"{name}={text!r}: give a positive number, or -1 to keep everything")
    return value


def topic_config(kind: str | None = None, env: dict | None = None) -> dict[str, str]:
    """The topic-level settings of a record kind's topic (or of any, ``kind`` None), from
    TRAINMON_TOPIC_RETENTION_HOURS, TRAINMON_TOPIC_RETENTION_BYTES (per partition) and
    TRAINMON_TOPIC_COMPRESSION; a bad value is a ValueError naming the variable."""
    env = os.environ if env is None else env
    hours = _number(env, "TRAINMON_TOPIC_RETENTION_HOURS", DEFAULT_RETENTION_HOURS)
    size = _number(env, "TRAINMON_TOPIC_RETENTION_BYTES", -1)
    compression = (env.get("TRAINMON_TOPIC_COMPRESSION") or DEFAULT_COMPRESSION).strip()
    if compression not in COMPRESSIONS:
        raise ValueError(f"TRAINMON_TOPIC_COMPRESSION={compression!r}: choose one of {', '.join(COMPRESSIONS)}")
    if hours != -1 and int(hours * 3600 * 1000) < 1:  # (Kafka's segment.ms is at least 1)
        raise ValueError(f"TRAINMON_TOPIC_RETENTION_HOURS={hours:g} is under a millisecond")
    if size != -1 and int(size) < 1:
        raise ValueError(f"TRAINMON_TOPIC_RETENTION_BYTES={size:g} is under a byte")
    if kind in KEPT_WHOLE:
        hours = size = -1
    config = {"compression.type": compression,
              "retention.ms": str(-1 if hours == -1 else int(hours * 3600 * 1000)),
              "retention.bytes": str(int(size))}
    if hours != -1:
        config["segment.ms"] = str(min(MAX_SEGMENT_MS, int(hours * 3600 * 1000)))
    return config


BROKER_NAMES = {"compression.type": "compression.type", "retention.ms": "log.retention.ms",
                "retention.bytes": "log.retention.bytes", "segment.ms": "log.roll.ms"}


def broker_defaults(config: dict[str, str]) -> dict[str, str]:
    """A topic config as the broker's defaults (server.properties names): what a topic
    created on first use, by a producer, gets."""
    return {BROKER_NAMES[name]: value for name, value in config.items()}


def config_for_topic(topic: str, env: dict | None = None) -> dict[str, str]:
    """``topic_config`` of the kind a topic name ends with (whatever its prefix)."""
    kinds = [k for k in [*RECORD_TYPES, DEADLETTER] if topic.endswith(k)]
    return topic_config(max(kinds, key=len) if kinds else None, env)
