"""A service's own Prometheus metrics, and the endpoint that serves them.

Every consumer run by :func:`.serving.serve` has a :class:`ServiceMetrics`, kept by its
runtime whether or not it is served: the runtime counts what it reads, writes and
dead-letters per record kind, the consumer lag per partition, its flush and commit
latency and batch sizes; a sink adds its own (``context.metrics``: the ClickHouse
loader's insert latency, the alerts fired per rule, notify's failed deliveries). Each
service has a registry of its own, not prometheus-client's global one, so several
services in one process (tests, the alerts engine beside its Grafana forwarder) never
mix their counts.

``--metrics-port PORT`` (``$TRAINMON_METRICS_PORT``; 0: a free port, logged) serves them
at ``http://ADDR:PORT/metrics``, ADDR from ``--metrics-listen`` / ``$TRAINMON_METRICS_LISTEN``
(default 127.0.0.1). The metric names and what to alert on: docs/metrics.md.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("trainmon.consumers")

DEFAULT_LISTEN = "127.0.0.1"
# Seconds: an insert or a commit takes milliseconds when well, seconds when the server
# or the broker struggles, and tens of seconds in an outage.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf)
# Records per flush: one record (a quiet live stream) to a catch-up batch of 150,000.
BATCH_BUCKETS = (1, 10, 100, 1_000, 5_000, 10_000, 25_000, 50_000, 100_000, 150_000, math.inf)


class ServiceMetrics:
    """The metrics every consumer has; ``registry`` takes a sink's own."""

    def __init__(self, service: str, group: str = ""):
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        # The process's memory, open files and CPU: what a soak watches for leaks.
        ProcessCollector(registry=r)
        self.read = Counter("trainmon_records_read", "Records read from the record topics and handed "
                            "to the sink, per record kind", ["kind"], registry=r)
        self.written = Counter("trainmon_records_written", "Records the sink has made durable (inserted, "
                               "forwarded, judged), per record kind", ["kind"], registry=r)
        self.dead_lettered = Counter("trainmon_records_dead_lettered", "Records sent to the dead-letter "
                                     "topic (undecodable, or refused by the sink), per record kind",
                                     ["kind"], registry=r)
        self.lag = Gauge("trainmon_consumer_lag", "Kafka messages (offsets) in an assigned partition "
                         "not read yet: its end as of the last fetch minus this consumer's position",
                         ["topic", "partition"], registry=r)
        self.flush_seconds = Histogram("trainmon_flush_seconds", "Time a sink's flush took (the "
                                       "ClickHouse loader hands batches to its inserts here)",
                                       registry=r, buckets=LATENCY_BUCKETS)
        self.commit_seconds = Histogram("trainmon_commit_seconds", "Time a Kafka offset commit took "
                                        "(dead letters made durable first)", registry=r,
                                        buckets=LATENCY_BUCKETS)
        self.batch_records = Histogram("trainmon_batch_records", "Records put between two flushes",
                                       registry=r, buckets=BATCH_BUCKETS)
        self.commit_failures = Counter("trainmon_commit_failures", "Kafka commits refused (a "
                                       "rebalance, the broker away); tried again later", registry=r)
        Gauge("trainmon_service_info", "The service and its consumer group (always 1)",
              ["service", "group"], registry=r).labels(service, group).set(1)
        self._lag_labels: set[tuple[str, str]] = set()
        self._server = None

    # -- what the runtime reports --------------------------------------------------------

    def count_read(self, per_kind: Mapping[str, int]) -> None:
        for kind, n in per_kind.items():
            self.read.labels(kind).inc(n)

    def count_written(self, per_kind: Mapping[str, int]) -> None:
        for kind, n in per_kind.items():
            self.written.labels(kind).inc(n)

    def set_lag(self, lags: Mapping[tuple[str, int], int]) -> None:
        """The lag of every partition assigned now; partitions gone are dropped."""
        now = {(topic, str(partition)): lag for (topic, partition), lag in lags.items()}
        for labels in self._lag_labels - now.keys():
            self.lag.remove(*labels)
        for labels, lag in now.items():
            self.lag.labels(*labels).set(lag)
        self._lag_labels = set(now)

    def counters_from(self, stats: Mapping[str, int], names: Mapping[str, tuple[str, str]]) -> None:
        """Export counts a sink keeps in a dict of its own (``stats[key]``) as counters,
        read when scraped: ``names`` maps a key to (metric name without _total, help)."""
        self.registry.register(_StatsCollector(stats, names))

    # -- the endpoint --------------------------------------------------------------------

    def serve(self, port: int, addr: str = DEFAULT_LISTEN) -> int | None:
        """Serve /metrics on ``port`` (0: a free one); returns the port, or None when it
        cannot be had -- a metrics port is never a reason for a consumer not to run."""
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except (OSError, OverflowError) as exc:  # (OverflowError: a port over 65535)
            log.error("trainmon: %s: cannot serve metrics on %s:%d (%s); running without them",
                      self.service, addr, port, exc)
            return None
        bound = self._server.server_address[1]
        log.info("trainmon: %s metrics on http://%s:%d/metrics", self.service, addr, bound)
        return bound

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            # shutdown() waits for serve_forever's loop; from its own thread it would hang.
            threading.Thread(target=lambda: (server.shutdown(), server.server_close()), daemon=True).start()


class _StatsCollector:
    def __init__(self, stats: Mapping[str, int], names: Mapping[str, tuple[str, str]]):
        self._stats, self._names = stats, names

    def collect(self) -> Iterable[CounterMetricFamily]:
        for key, (name, help_text) in self._names.items():
            yield CounterMetricFamily(name, help_text, value=self._stats.get(key, 0))


def per_kind(messages: Iterable) -> dict[str, int]:
    """Records per kind in these messages (a message handed out undecoded carries several).
    Per record: the stream counts a poll's per Kafka message instead (``polled_by_kind``);
    this is for the polls the runtime filtered."""
    counts: dict[str, int] = {}
    for m in messages:
        counts[m.kind] = counts.get(m.kind, 0) + m.count
    return counts
