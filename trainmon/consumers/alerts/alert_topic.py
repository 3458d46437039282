"""Reading and writing the alert topic: the incidents' event log.

Alerts are keyed by incident id, so the firing and the resolved event of one incident
land on one partition, in order, for every reader (ClickHouse, the Grafana forwarder).
"""

from __future__ import annotations

import logging
import threading
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from ...schemas import AlertRecord, DecodeError, decode, encode

log = logging.getLogger("trainmon.alerts")


class AlertPublisher:
    """Publishes alerts durably, once: an event id already on the topic is not sent again."""

    def __init__(self, settings: dict, topic: str):
        self.topic = topic
        self.published: set[str] = set()
        self.sent = 0
        self._producer = KafkaProducer(**settings, acks="all", enable_idempotence=True, linger_ms=0,
                                       retries=2**31 - 1, max_block_ms=10_000)

    def publish(self, alerts: list[AlertRecord], stop: threading.Event | None = None) -> bool:
        """Send and wait until Kafka has them all; retried while Kafka is away. False only
        if ``stop`` was set before everything was delivered."""
        pending = [a for a in alerts if a.event_id not in self.published]
        backoff = 0.5
        while pending:
            futures = []
            for alert in pending:
                try:
                    futures.append((alert, self._producer.send(
                        self.topic, key=alert.incident_id.encode(), value=encode(alert))))
                except KafkaError as exc:
                    futures.append((alert, exc))
            try:
                self._producer.flush(timeout=30)
            except KafkaError:
                pass
            failed = []
            for alert, future in futures:
                if isinstance(future, Exception) or not future.is_done or future.failed():
                    failed.append(alert)
                else:
                    self.published.add(alert.event_id)
                    self.sent += 1
            if failed:
                log.warning("trainmon alerts: %d alert(s) not yet on %s; retrying in %.1f s",
                            len(failed), self.topic, backoff)
                if stop is not None and stop.wait(backoff):
                    return False
                if stop is None:
                    time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            pending = failed
        return True

    def close(self) -> None:
        self._producer.close(timeout=10)


class AlertLog:
    """The alert topic read back: what incidents were published, and where its end is."""

    def __init__(self, settings: dict, topic: str):
        self.topic = topic
        self._consumer = KafkaConsumer(**settings, group_id=None, enable_auto_commit=False,
                                       auto_offset_reset="earliest")

    def partitions(self) -> list[TopicPartition]:
        self._consumer.topics()  # refreshes metadata
        parts = self._consumer.partitions_for_topic(self.topic) or set()
        return [TopicPartition(self.topic, p) for p in sorted(parts)]

    def end_offsets(self) -> dict[int, int]:
        parts = self.partitions()
        return {tp.partition: o for tp, o in self._consumer.end_offsets(parts).items()} if parts else {}

    def read(self, start: dict[int, int] | None = None, timeout_s: float = 60.0) -> list[AlertRecord]:
        """Every alert from ``start`` (partition -> offset; default: the beginning) to the end."""
        parts = self.partitions()
        if not parts:
            return []
        end = self._consumer.end_offsets(parts)
        todo = [tp for tp in parts if end[tp] > (start or {}).get(tp.partition, 0)]
        if not todo:
            return []
        self._consumer.assign(todo)
        for tp in todo:
            self._consumer.seek(tp, min((start or {}).get(tp.partition, 0), end[tp]))
        alerts: list[AlertRecord] = []
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in todo):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {self.topic} back took over {timeout_s:.0f} s")
            for batch in self._consumer.poll(timeout_ms=500).values():
                for m in batch:
                    try:
                        alerts.append(decode("alert", m.value))
                    except DecodeError as exc:
                        log.warning("trainmon alerts: skipping an undecodable alert at %s[%d]@%d: %s",
                                    m.topic, m.partition, m.offset, exc.reason)
        alerts.sort(key=lambda a: a.time)
        return alerts

    def close(self) -> None:
        self._consumer.close(autocommit=False)
