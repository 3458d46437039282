"""Reading and writing the alert topic: the incidents' event log.

Alerts are keyed by incident id, so the firing and the resolved event of one incident
land on one partition, in order, for every reader (ClickHouse, the Grafana forwarder).
"""

from __future__ import annotations

import logging
import threading
import time

from ...kafka_client import Consumer, Producer, TopicPartition
from ...schemas import AlertRecord, DecodeError, decode, encode, unpack

log = logging.getLogger("trainmon.alerts")


class AlertPublisher:
    """Publishes alerts durably, once: an event id already on the topic is not sent again."""

    def __init__(self, topic: str, env: dict | None = None):
        self.topic = topic
        self.published: set[str] = set()
        self.sent = 0
        self._producer = Producer(env=env, durable=True)

    def publish(self, alerts: list[AlertRecord], stop: threading.Event | None = None) -> bool:
        """Send and wait until Kafka has them all. A send that failed is sent again after a
        backoff; one still in flight is waited for, never sent twice. False only if
        ``stop`` was set before everything was delivered."""
        stop = stop or threading.Event()
        inflight = [(a, self._send(a)) for a in alerts if a.event_id not in self.published]
        backoff = 0.5
        while inflight:
            self._producer.flush(5)
            waiting, failed = [], []
            for alert, delivery in inflight:
                if delivery.failed:
                    failed.append(alert)
                elif delivery.done:
                    self.published.add(alert.event_id)
                    self.sent += 1
                else:
                    waiting.append((alert, delivery))
            if failed:
                log.warning("trainmon alerts: %d alert(s) not accepted by %s; sending again in %.1f s",
                            len(failed), self.topic, backoff)
                if stop.wait(backoff):
                    return False
                backoff = min(backoff * 2, 10.0)
                waiting.extend((alert, self._send(alert)) for alert in failed)
            elif waiting and stop.is_set():
                return False
            inflight = waiting
        return True

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
