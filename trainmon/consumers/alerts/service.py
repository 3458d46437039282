"""``trainmon consume alerts``: the rules engine as a Kafka consumer, plus the Grafana forwarder.

Per poll: records -> engine -> alerts published and flushed -> input offsets committed.
Every ``checkpoint_interval_s`` the engine state is written with the offsets it matches.
On start the state comes back from that checkpoint; incidents published after it are
read back from the alert topic, and records between the checkpoint and the committed
offsets are replayed as warm-up (windows update, nothing fires twice). Without a
checkpoint, incidents come from the whole alert topic and the last ``rebuild_records``
records per partition warm the windows up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import yaml

from ... import topics
from ...kafka_client import TopicPartition
from ..stream import RecordStream, stop_on_signals
from . import checkpoint
from .alert_topic import AlertLog, AlertPublisher
from .config import AlertsConfig, ConfigError, load_config
from .engine import INPUT_KINDS, AlertEngine

log = logging.getLogger("trainmon.alerts")


class AlertService:
    def __init__(self, config: AlertsConfig, *, topic_prefix: str | None = None, env: dict | None = None):
        self.config = config
        self.prefix = topics.prefix() if topic_prefix is None else topic_prefix
        self.env = env
        self.alert_topic = topics.topic_for("alert", self.prefix)
        self.path = checkpoint.checkpoint_path(config.state_dir, config.group_id, self.prefix)
        self.engine = AlertEngine(config)
        self.stop = threading.Event()
        self.stats = {"records": 0, "alerts": 0, "warmup": 0, "errors": 0}
        self.ticks = 0
        self._start_offsets: dict[str, int] = {}
        self._warm_until: dict[tuple[str, int], int] = {}
        self._had_checkpoint = False

    # -- start-up ----------------------------------------------------------------------

    def _restore(self, alert_log: AlertLog, publisher: AlertPublisher) -> None:
        saved = checkpoint.load(self.path)
        start = None
        if saved is not None:
            try:
                self.engine.load(saved.engine)
                self._start_offsets = saved.offsets
                self._had_checkpoint = True
                start = saved.alert_offsets
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("trainmon alerts: checkpoint %s does not fit this version (%s); "
                            "rebuilding from the topics", self.path, exc)
                self.engine = AlertEngine(self.config)
        for alert in alert_log.read(start):
            self.engine.book.apply(alert)
            publisher.published.add(alert.event_id)
        log.info("trainmon alerts: %s; %d open incident(s)",
                 f"restored {self.path}" if self._had_checkpoint else "no checkpoint, rebuilt from the alert topic",
                 len(self.engine.book.open_incidents()))

    def _on_assign(self, stream: RecordStream, partitions: list[TopicPartition]) -> None:
        """Start assigned partitions at the checkpoint (or rewind them to rebuild the
        windows) and mark the already-judged records up to the commit as warm-up. Runs
        inside poll, so the committed offsets can be asked for here."""
        consumer = stream.consumer
        committed = consumer.committed(partitions)
        for tp in partitions:
            done = committed.get(tp)
            start = self._start_offsets.get(f"{tp.topic}:{tp.partition}")
            if start is None and not self._had_checkpoint and done and self.config.rebuild_records:
                start = max(0, done - self.config.rebuild_records)
            if start is not None:
                consumer.seek(tp, start)
                if done and start < done:
                    self._warm_until[(tp.topic, tp.partition)] = done

    # -- the loop ------------------------------------------------------------------------

    def run(self, exit_when_idle_s: float | None = None) -> None:
        publisher = AlertPublisher(self.alert_topic, self.env)
        alert_log = AlertLog(self.alert_topic, self.env)
        stream = None
        try:
            self._restore(alert_log, publisher)
            stream = RecordStream(self.config.group_id, INPUT_KINDS, topic_prefix=self.prefix,
                                  env=self.env, on_assign=lambda parts: self._on_assign(stream, parts))
            self._loop(stream, publisher, alert_log, exit_when_idle_s)
        finally:
            if stream is not None:
                stream.close()
            publisher.close()
            alert_log.close()

    def _loop(self, stream: RecordStream, publisher: AlertPublisher, alert_log: AlertLog,
              exit_when_idle_s: float | None) -> None:
        engine = self.engine
        last_checkpoint = time.monotonic()
        last_record = time.monotonic()
        while not self.stop.is_set():
            messages = stream.poll(timeout_ms=200)
            alerts = []
            received = time.time()
            for m in messages:
                warm = m.offset < self._warm_until.get((m.topic, m.partition), -1)
                engine.warming_up = warm
                try:
                    alerts.extend(engine.process(m.record, received))
                except Exception as exc:  # a record the rules trip over must not stop the service
                    self.stats["errors"] += 1
                    log.exception("trainmon alerts: engine failed on %s[%d]@%d", m.topic, m.partition, m.offset)
                    stream.dead_letter(m, f"alert engine failed on this record: {exc!r}")
                self.stats["warmup" if warm else "records"] += 1
            engine.warming_up = False
            caught_up = self._caught_up(stream)
            if caught_up:
                self.ticks += 1
                alerts.extend(engine.tick(time.time()))
            if alerts and not publisher.publish(alerts, self.stop):
                return  # stopping with alerts undelivered: their records stay uncommitted
            self.stats["alerts"] += len(alerts)
            if messages:
                stream.commit_polled()
                last_record = time.monotonic()
            if time.monotonic() - last_checkpoint >= self.config.checkpoint_interval_s:
                self._checkpoint(stream, alert_log)
                last_checkpoint = time.monotonic()
            if exit_when_idle_s is not None and caught_up and not messages \
                    and time.monotonic() - last_record >= exit_when_idle_s:
                break
        self._checkpoint(stream, alert_log)

    def _caught_up(self, stream: RecordStream) -> bool:
        """Every assigned partition read to its end: only then can a rank's silence be
        told apart from a partition we have simply not read yet."""
        consumer = stream.consumer
        assigned = consumer.assignment()
        if not assigned:
            return False
        for topic in stream.topic_names:
            for p in consumer.partitions_for(topic):
                if TopicPartition(topic, p) not in assigned:
                    return False  # a topic whose partitions the group has not handed out yet
        highs = {tp: consumer.watermarks(tp, cached=True)[1] for tp in assigned}  # as of the last fetch
        if any(high < 0 for high in highs.values()):
            return False
        positions = consumer.positions(assigned)
        return all(positions[tp] >= high for tp, high in highs.items())

    def _checkpoint(self, stream: RecordStream, alert_log: AlertLog) -> None:
        consumer = stream.consumer
        offsets = dict(self._start_offsets)
        for tp in consumer.assignment():
            offsets[f"{tp.topic}:{tp.partition}"] = consumer.position(tp)
        checkpoint.save(self.path, checkpoint.Checkpoint(
            engine=self.engine.dump(), offsets=offsets, alert_offsets=alert_log.end_offsets()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmon consume alerts",
                                description="Anomaly rules over the record topics; alerts to the "
                                            "alert topic and to Grafana annotations.")
    p.add_argument("--config", help="YAML rules file (default: $TRAINMON_ALERT_CONFIG)")
    p.add_argument("--only", choices=["engine", "grafana"],
                   help="run just the rules engine or just the Grafana forwarder (default: both; "
                        "the forwarder only when GRAFANA_URL is set)")
    p.add_argument("--exit-when-idle", type=float, metavar="SECONDS",
                   help="stop once caught up and idle this long (batch replay, tests)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as YAML and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trainmon consume alerts: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    stop = stop_on_signals()
    forwarder = None
    if args.only != "engine" and (args.only == "grafana" or os.environ.get("GRAFANA_URL")):
        from .grafana import GrafanaForwarder

        forwarder = GrafanaForwarder.from_env(config, stop=stop)
        if args.only == "grafana":
            forwarder.run(exit_when_idle_s=args.exit_when_idle)
            return 0
    thread = None
    if forwarder is not None:
        # It runs until stopped: with --exit-when-idle it must outlive the engine, whose
        # last alerts may come after the forwarder has been idle for that long.
        thread = threading.Thread(target=forwarder.run, name="trainmon-grafana", daemon=True)
        thread.start()
    service = AlertService(config)
    service.stop = stop
    service.run(exit_when_idle_s=args.exit_when_idle)
    log.info("trainmon alerts: stopped after %d records (%d replayed as warm-up), %d alerts, "
             "%d engine errors", service.stats["records"], service.stats["warmup"],
             service.stats["alerts"], service.stats["errors"])
    if thread is not None:
        if args.exit_when_idle is not None:
            # Forward the engine's last alerts: stop once the forwarder has been idle as long.
            deadline = time.monotonic() + max(30.0, 3 * args.exit_when_idle)
            while thread.is_alive() and time.monotonic() < deadline and \
                    time.monotonic() - forwarder.idle_since < args.exit_when_idle:
                time.sleep(0.2)
        stop.set()
        thread.join(timeout=15)
    return 0
