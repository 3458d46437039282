"""Reading and writing the alert topic: the incidents' event log.

Alerts are keyed by incident id, so the firing and the resolved event of one incident
land on one partition, in order, for every reader (ClickHouse, the Grafana forwarder).
"""

from __future__ import annotations

import logging
import time

from ...kafka_client import Consumer, Producer, TopicPartition
from ...schemas import AlertRecord, DecodeError, decode, encode, unpack
from ..runtime import RetriableError

log = logging.getLogger("trainmon.alerts")


class RecentIds:
    """A set of the last ``size`` ids added (oldest dropped first). The engine makes an
    alert again only while it replays the records since its last checkpoint (a minute or
    so), so the ids of recent alerts are all that stop a second send; a set of every id
    ever published grew for as long as the service ran."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self._ids: dict[str, None] = {}  # (a dict keeps the order ids came in)

    def add(self, event_id: str) -> None:
        self._ids.pop(event_id, None)
        self._ids[event_id] = None
        if len(self._ids) > self.size:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class AlertPublisher:
    """Publishes alerts durably, once: an event id already on the topic is not sent again."""

    def __init__(self, topic: str, env: dict | None = None):
        self.topic = topic
        self.published = RecentIds()
        self.sent = 0
        self._inflight: dict[str, tuple[AlertRecord, object]] = {}  # event id -> (alert, delivery)
        self._producer = Producer(env=env, durable=True)

    def publish(self, alerts: list[AlertRecord]) -> None:
        """Send the alerts not on the topic yet and wait (up to 5 s) until Kafka has them.
        Raises RetriableError when it has not confirmed them all: the same call later sends
        again those Kafka refused and waits again for those still in flight, never sending
        one twice. (The caller retries with the consumer runtime's policy.)"""
        self.send(alerts)
        if not self._inflight:
            return
        self._producer.flush(5)
        refused = 0
        for event_id, (alert, delivery) in list(self._inflight.items()):
            if delivery.failed:
                refused += 1
                del self._inflight[event_id]  # sent again by the next call
            elif delivery.done:
                del self._inflight[event_id]
                self.published.add(event_id)
                self.sent += 1
        if refused or self._inflight:
            raise RetriableError(f"{refused} alert(s) refused by {self.topic}, {len(self._inflight)} "
                                 f"not acknowledged yet")

    def send(self, alerts: list[AlertRecord]) -> None:
        """Send the alerts not on the topic yet, without waiting: ``publish`` waits for them
        later. The service sends each alert as soon as a rule finds it, so a page does not
        wait for the rest of the batch (10,000 records, 1-2 s at 16,384 ranks) to be judged."""
        for alert in alerts:
            if alert.event_id not in self.published and alert.event_id not in self._inflight:
                self._inflight[alert.event_id] = (alert, self._send(alert))

    def _send(self, alert: AlertRecord):
        return self._producer.send(self.topic, encode(alert), key=alert.incident_id.encode())

    def close(self) -> None:
        self._producer.close(10)


class AlertLog:
    """The alert topic read back: what incidents were published, and where its end is."""

    def __init__(self, topic: str, env: dict | None = None):
        self.topic = topic
        self._consumer = Consumer(None, env=env)

    def partitions(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in self._consumer.partitions_for(self.topic)]

    def read(self, start: dict[int, int] | None = None,
             timeout_s: float = 60.0) -> tuple[list[AlertRecord], dict[int, int]]:
        """Every alert from ``start`` (partition -> offset; default: the beginning) to the
        end, in time order, and that end (where the next read starts)."""
        end = self._consumer.end_offsets(self.partitions())
        reached = {tp.partition: o for tp, o in end.items()}
        begin = {tp: min((start or {}).get(tp.partition, 0), end[tp]) for tp in end}
        todo = {tp: offset for tp, offset in begin.items() if end[tp] > offset}
        if not todo:
            return [], reached
        self._consumer.assign(todo)
        alerts: list[AlertRecord] = []
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in todo):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {self.topic} back took over {timeout_s:.0f} s")
            for m in self._consumer.poll(0.5):
                for value in unpack(m.value or b""):
                    try:
                        alerts.append(decode("alert", value))
                    except DecodeError as exc:
                        log.warning("trainmon alerts: skipping an undecodable alert at %s[%d]@%d: %s",
                                    m.topic, m.partition, m.offset, exc.reason)
        alerts.sort(key=lambda a: a.time)
        return alerts, reached

    def close(self) -> None:
        self._consumer.close()
