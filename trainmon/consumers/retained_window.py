"""How far back the topics reach: what a replay can rebuild, once retention trimmed them.

The topics keep a bounded window (topics.topic_config), ClickHouse the history. A
partition whose log start offset is past 0 has lost its oldest records; those after its
first kept record are all there (retention removes a log's oldest segments only). So the
replay of every partition rebuilds completely the records since the newest of the
trimmed partitions' first kept records (record time, the producer's). A partition
trimmed to nothing bounds it too: every record removed by time was older than its
topic's ``retention.ms`` at the time, so at most that far back from now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from ..kafka_client import Consumer, KafkaError, TopicPartition, settings


@dataclass(frozen=True)
class Trimmed:
    tp: TopicPartition
    removed: int  # records removed from its start (its log start offset)
    first_kept_ms: int | None  # the oldest record still there; None: nothing is left


@dataclass(frozen=True)
class RetainedWindow:
    trimmed: list[Trimmed]
    since_ms: int | None  # every record from then on is in the topics; None: every record ever sent

    @property
    def complete(self) -> bool:
        return not self.trimmed

    def since(self) -> str:
        return datetime.fromtimestamp(self.since_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    def describe(self) -> str:
        if self.complete:
            return "the topics hold every record ever sent to them"
        removed = sum(t.removed for t in self.trimmed)
        return (f"the topics hold every record sent since {self.since()}; retention removed the "
                f"{removed:,} oldest of {len(self.trimmed)} partition(s) "
                f"({', '.join(sorted({t.tp.topic for t in self.trimmed}))})")


def retained_window(topic_names: list[str], *, env: dict | None = None, bootstrap: str | None = None,
                    timeout_s: float = 10.0) -> RetainedWindow:
    """The window the topics (those of ``topic_names`` that exist) still hold."""
    reader = Consumer(None, env=env, bootstrap=bootstrap)
    try:
        partitions = [TopicPartition(t, p) for t in topic_names for p in reader.partitions_for(t)]
        marks = {tp: reader.watermarks(tp, timeout_s=timeout_s) for tp in partitions}
        starts = {tp: low for tp, (low, _) in marks.items() if low > 0}
        kept = {tp: low for tp, low in starts.items() if low < marks[tp][1]}
        first = _first_timestamps(reader, kept, timeout_s)
    finally:
        reader.close()
    trimmed = [Trimmed(tp, low, first.get(tp)) for tp, low in sorted(starts.items())]
    if not trimmed:
        return RetainedWindow([], None)
    emptied = sorted({t.tp.topic for t in trimmed if t.first_kept_ms is None})
    bounds = [t.first_kept_ms for t in trimmed if t.first_kept_ms is not None]
    now_ms = int(time.time() * 1000)
    bounds += [now_ms - max(0, retention) for retention in _retention_ms(emptied, env, bootstrap, timeout_s).values()]
    return RetainedWindow(trimmed, max(bounds))


def _first_timestamps(reader: Consumer, starts: dict[TopicPartition, int], timeout_s: float) -> dict[TopicPartition, int]:
    """The time of each partition's first kept record (the one at its log start)."""
    if not starts:
        return {}
    reader.assign(starts)
    found: dict[TopicPartition, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(starts) and time.monotonic() < deadline:
        for m in reader.poll(0.5):
            found.setdefault(TopicPartition(m.topic, m.partition), m.timestamp_ms)
    missing = sorted(set(starts) - set(found))
    if missing:
        raise KafkaError(f"could not read the first kept record of {missing} within {timeout_s:g} s")
    return found


def _retention_ms(names: list[str], env: dict | None, bootstrap: str | None, timeout_s: float) -> dict[str, int]:
    """Each topic's retention.ms (-1, forever, counts as 0: nothing is known to be kept)."""
    if not names:
        return {}
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient(settings.librdkafka(env, bootstrap))
    try:
        answers = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names])
        out = {res.name: int(future.result(timeout_s)["retention.ms"].value) for res, future in answers.items()}
    except KafkaException as exc:
        raise KafkaError(f"describe topic configs: {exc}") from exc
    return {name: max(0, ms) for name, ms in out.items()}
