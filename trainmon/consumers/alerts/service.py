"""``trainmon consume alerts``: the rules engine as a sink on the consumer runtime, plus the
Grafana forwarder.

Per poll: records -> engine -> alerts published and flushed -> input offsets committed (by
the runtime). Every ``checkpoint_interval_s`` the engine state is written with the offsets
it matches, after the alerts it led to are on the alert topic.
On start the state comes back from that checkpoint; incidents published after it are
read back from the alert topic, and records between the checkpoint and the committed
offsets are replayed as warm-up (windows update, nothing fires twice). Without a
checkpoint, incidents come from the whole alert topic and the last ``rebuild_records``
records per partition warm the windows up.

Several engines in one group share the runs out (see .ownership): at every assignment an
engine reads the alerts the others published since it last looked, drops the runs it
lost and warms up the partitions it gained the same way, so an incident fires once
whichever engine sees it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

import yaml
from prometheus_client import Counter

from ... import topics
from ...schemas import AlertRecord
from ...kafka_client import TopicPartition
from .. import runtime
from ..serving import add_exit_when_idle_argument, add_metrics_arguments, metrics_options, serve
from ..stream import Message
from . import checkpoint
from .alert_topic import AlertLog, AlertPublisher
from .config import AlertsConfig, ConfigError, load_config
from .engine import INPUT_KINDS, AlertEngine
from .ownership import Ownership

log = logging.getLogger("trainmon.alerts")
CHECKPOINT_COST_FACTOR = 10  # checkpoints at least this many times their write apart
WRITER_BUSY_RECHECK_S = 0.2  # a due checkpoint waiting for the write before it: looked at again
# While behind, the rules that can judge then (engine.tick_behind) run this often: a pass
# over every rank of a 16,384-rank run costs some milliseconds.
BEHIND_TICK_S = 1.0


class AlertService(runtime.Sink):
    """The rules engine as a sink on the consumer runtime: ``put`` judges records, ``tick``
    judges silences once every partition is read to its end (while behind, only a rank
    behind the others' steps), ``flush`` publishes the alerts (the runtime commits the
    records behind them only then) and checkpoints."""

    name = "alerts engine"
    poll_s = 0.2  # how often silences are judged while nothing arrives
    kinds = tuple(INPUT_KINDS)

    def __init__(self, config: AlertsConfig, *, topic_prefix: str | None = None, env: dict | None = None):
        self.config = config
        self.prefix = topics.prefix() if topic_prefix is None else topic_prefix
        self.env = env
        self.alert_topic = topics.topic_for("alert", self.prefix)
        self.path: Path | None = None  # the checkpoint, per group member: known once it joined
        self.engine = AlertEngine(config)
        self.shutdown = threading.Event()  # set: finish the batch in hand, checkpoint, return
        self.stats = {"records": 0, "alerts": 0, "warmup": 0, "errors": 0}
        self.ticks = 0
        self.caught_up = False
        self.ownership = Ownership()
        self._alerts_read: dict[int, int] = {}  # alert topic partition -> how far the book has read
        self._said_uneven: tuple | None = None
        self._publisher: AlertPublisher | None = None
        self._alert_log: AlertLog | None = None
        self._unpublished: list[AlertRecord] = []
        self._put_since_flush = False
        self._behind_tick_at = 0.0
        self._checkpoint_at = 0.0
        self._writer = checkpoint.Writer()

    @property
    def group(self) -> str:
        return self.config.group_id

    @property
    def consumer_settings(self) -> dict:
        session_ms = int(self.config.session_timeout_s * 1000)
        return {"session.timeout.ms": session_ms, "heartbeat.interval.ms": min(3000, session_ms // 3)}

    # -- start-up ----------------------------------------------------------------------

    def start(self, context: runtime.SinkContext) -> None:
        """Joined (its static instance id claimed) but not assigned before the first poll:
        the checkpoint of this member is known now, and restored."""
        super().start(context)
        self._fired = Counter("trainmon_alerts", "Alert events published, per rule and state (firing, "
                              "resolved)", ["rule", "state"], registry=context.metrics.registry)
        context.metrics.counters_from(self.stats, {
            "errors": ("trainmon_alert_engine_errors", "Records a rule failed on (dead-lettered)")})
        self.path = checkpoint.checkpoint_path(self.config.state_dir, self.config.group_id,
                                               self.prefix, context.stream.instance_id)
        self._checkpoint_at = time.monotonic() + self.config.checkpoint_interval_s
        self._restore()

    def _restore(self) -> None:
        saved = checkpoint.load(self.path)
        restored = False
        if saved is not None:
            try:
                self.engine.load(saved.engine)
                self.ownership.restore(saved.offsets, saved.run_partitions)
                self._alerts_read = dict(saved.alert_offsets)
                restored = True
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("trainmon alerts: checkpoint %s does not fit this version (%s); "
                            "rebuilding from the topics", self.path, exc)
                self.engine = AlertEngine(self.config)
                self.ownership = Ownership()
        self._read_alerts()
        log.info("trainmon alerts: %s; %d open incident(s)",
                 f"restored {self.path}" if restored else "no checkpoint, rebuilt from the alert topic",
                 len(self.engine.book.open_incidents()))

    def _read_alerts(self) -> None:
        """Bring the incident book up to the alert topic's end: the alerts published since
        it last looked, by this engine (applying them again changes nothing) and by the
        others of its group."""
        alerts, self._alerts_read = self._alert_log.read(self._alerts_read)
        for alert in alerts:
            self.engine.book.apply(alert)
            self._publisher.published.add(alert.event_id)

    # -- the sink contract ---------------------------------------------------------------

    def open(self, partitions: list[TopicPartition]) -> None:
        """A new assignment. The runs of partitions this engine lost go; the incidents other
        engines published come in, so that one still open here is not fired again;
        partitions it gained are rewound by ``rebuild_records`` and, like the records
        between a checkpoint and the committed offsets, replayed as warm-up."""
        consumer = self.context.consumer
        self._say_uneven_partitions(consumer, self.context.stream.topic_names)
        self.engine.release_runs(self.ownership.assign(partitions))
        self._read_alerts()
        committed = consumer.committed(partitions) if partitions else {}
        for tp in partitions:
            start = self.ownership.start(tp, committed.get(tp), self.config.rebuild_records)
            if start is not None:
                self.context.seek(tp, start)
        log.info("trainmon alerts: assigned %d partition(s) (numbers %s), judging %d run(s)",
                 len(partitions), sorted({tp.partition for tp in partitions}), len(self.engine.runs))

    def close(self, partitions: list[TopicPartition]) -> None:
        self.ownership.revoke(partitions)

    def put(self, messages: list[Message]) -> None:
        engine, ownership = self.engine, self.ownership
        received = time.time()
        for m in messages:
            warm = ownership.saw(m.topic, m.partition, m.offset, m.record.run_id)
            engine.warming_up = warm
            try:
                found = engine.process(m.record, received)
            except Exception as exc:  # a record the rules trip over must not stop the service
                found = None
                self.stats["errors"] += 1
                log.exception("trainmon alerts: engine failed on %s[%d]@%d", m.topic, m.partition, m.offset)
                self.context.dead_letter(m, f"alert engine failed on this record: {exc!r}")
            if found:
                self._send_now(found)
            self.stats["warmup" if warm else "records"] += 1
        engine.warming_up = False
        self._put_since_flush = True

    def tick(self) -> None:
        self.caught_up = self._caught_up()
        if self.caught_up:
            self.ticks += 1
            self._unpublished.extend(self.engine.tick(time.time()))
        elif time.monotonic() >= self._behind_tick_at and not self.ownership.warming():
            # A service that stays behind (a saturated machine) never reads every partition
            # to its end: a silent rank, proven by the other ranks' steps on the same
            # partition, is still told now rather than once the backlog is gone.
            self._behind_tick_at = time.monotonic() + BEHIND_TICK_S
            found = self.engine.tick_behind(time.time())
            if found:
                self._send_now(found)

    def _send_now(self, alerts: list[AlertRecord]) -> None:
        """Alerts sent as they are found, acknowledged at the flush: what a rule finds early
        in a batch goes out before the rest of the batch is judged. A crash before the
        flush leaves them on the topic, as one after a flush's publish does."""
        if self._publisher is not None:
            self._publisher.send(alerts)
        self._unpublished.extend(alerts)

    def flush_in_s(self) -> float | None:
        # A checkpoint falling due counts as something to flush; a poll waits poll_s at most.
        if self._put_since_flush or self._unpublished:
            return 0.0
        if time.monotonic() >= self._checkpoint_at:
            # Due, but the last write still runs (one of 16,384 ranks' state can outlast the
            # interval): look again shortly, not at once in a loop that spins a core.
            return WRITER_BUSY_RECHECK_S if self._writer.busy() else 0.0
        return None

    def flush(self) -> None:
        """Alerts published (retried by the runtime until Kafka has them all), then, every
        checkpoint_interval_s, the engine state: never a state ahead of its alerts."""
        if self._unpublished:
            self._publisher.publish(self._unpublished)
            self.stats["alerts"] += len(self._unpublished)
            for alert in self._unpublished:
                self._fired.labels(alert.rule, alert.state).inc()
            self._unpublished = []
        self._put_since_flush = False
        # (busy() first: it also reaps a writer that has finished)
        if not self._writer.busy() and time.monotonic() >= self._checkpoint_at:
            self._checkpoint()

    def stop(self) -> None:
        if self._unpublished:  # stopped before Kafka had them: a state ahead of its alerts
            log.warning("trainmon alerts: stopping with %d alert(s) not published; no checkpoint, "
                        "the records behind them are judged again at the next start",
                        len(self._unpublished))
            self._writer.wait()
            return
        self._checkpoint(background=False)

    def _say_uneven_partitions(self, consumer, topic_names: list[str]) -> None:
        """Records of one run reach one engine only while every record topic has the same
        partition count: say so loudly when not (once per distinct layout)."""
        counts = {t: len(consumer.partitions_for(t)) for t in topic_names}
        if len(set(counts.values()) - {0}) > 1 and tuple(sorted(counts.items())) != self._said_uneven:
            self._said_uneven = tuple(sorted(counts.items()))
            log.error("trainmon alerts: the record topics have different partition counts (%s): a "
                      "run's kinds land on different partition numbers, so with more than one engine "
                      "in group %s an engine sees only part of a run. Give every record topic the "
                      "same count (kafka-topics --alter --partitions).",
                      ", ".join(f"{t} {n}" for t, n in sorted(counts.items())), self.config.group_id)

    # -- running -------------------------------------------------------------------------

    def run(self, exit_when_idle_s: float | None = None, **serve_options) -> None:
        """Judge until ``shutdown`` is set or, with ``exit_when_idle_s``, until caught up and
        idle that long. ``serve_options``: serving.serve's (its metrics endpoint)."""
        self._publisher = AlertPublisher(self.alert_topic, self.env)
        self._alert_log = AlertLog(self.alert_topic, self.env)
        try:
            serve(self, topic_prefix=self.prefix, env=self.env, stop=self.shutdown,
                  exit_when_idle_s=exit_when_idle_s, **serve_options)
        finally:
            self._publisher.close()
            self._alert_log.close()

    def quiet_for(self, sink_runtime: runtime.SinkRuntime, seconds: float) -> bool:
        # Not done while a partition is unread: silences there are not judged yet.
        return self.caught_up and super().quiet_for(sink_runtime, seconds)

    def _caught_up(self) -> bool:
        """Every assigned partition read to its end: only then can a rank's silence be
        told apart from a partition we have simply not read yet."""
        consumer = self.context.consumer
        for topic in self.context.stream.topic_names:
            if not self.ownership.holds_all_of(topic, consumer.partitions_for(topic)):
                return False  # a topic whose partitions the group has not handed out yet
        return self.context.read_to_end()

    def _checkpoint(self, background: bool = True) -> None:
        """The state as of now, written by a forked child (checkpoint.Writer) unless
        ``background`` is False (at stop: the last one is complete before it returns)."""
        # The book first catches up with the alert topic, so the alert offsets saved are
        # exactly what it holds: a restart reads on from there and misses nothing another
        # engine published meanwhile.
        self._read_alerts()
        engine = self.engine
        self.ownership.prune(set(engine.runs) | set(engine.book.by_run) | set(engine.ended_runs))
        offsets, alert_offsets = self.ownership.checkpoint_offsets(), dict(self._alerts_read)
        run_partitions = dict(self.ownership.run_partition)

        def make() -> checkpoint.Checkpoint:  # (in the child: the state as of the fork)
            return checkpoint.Checkpoint(engine=engine.dump(), offsets=offsets,
                                         alert_offsets=alert_offsets, run_partitions=run_partitions)

        if background:
            self._writer.write(self.path, make)
        else:
            self._writer.wait()
            checkpoint.save(self.path, make())
        # A write that takes seconds (16,384 ranks: some 100 MB of JSON) is not repeated
        # every interval: the writer's CPU stays under a tenth of a core. The price is a
        # longer replay after a crash, of records already judged (warm-up).
        self._checkpoint_at = time.monotonic() + max(self.config.checkpoint_interval_s,
                                                     CHECKPOINT_COST_FACTOR * self._writer.last_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmon consume alerts",
                                description="Anomaly rules over the record topics; alerts to the "
                                            "alert topic and to Grafana annotations.")
    p.add_argument("--config", help="YAML rules file (default: $TRAINMON_ALERT_CONFIG)")
    p.add_argument("--only", choices=["engine", "grafana"],
                   help="run just the rules engine or just the Grafana forwarder (default: both; "
                        "the forwarder only when GRAFANA_URL is set)")
    add_exit_when_idle_argument(p, help="stop once caught up and idle this long (batch replay, tests)")
    add_metrics_arguments(p)
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
    stop = runtime.stop_on_signals()
    forwarder = None
    if args.only != "engine" and (args.only == "grafana" or os.environ.get("GRAFANA_URL")):
        from .grafana import GrafanaForwarder

        forwarder = GrafanaForwarder.from_env(config, stop=stop)
        if args.only == "grafana":
            forwarder.run(exit_when_idle_s=args.exit_when_idle_s, **metrics_options(args))
            return 0
    thread = None
    if forwarder is not None:
        # It runs until stopped: with --exit-when-idle it must outlive the engine, whose
        # last alerts may come after the forwarder has been idle for that long.
        thread = threading.Thread(target=forwarder.run, name="trainmon-grafana", daemon=True)
        thread.start()
    service = AlertService(config)
    service.shutdown = stop
    service.run(exit_when_idle_s=args.exit_when_idle_s, **metrics_options(args))
    log.info("trainmon alerts: stopped after %d records (%d replayed as warm-up), %d alerts, "
             "%d engine errors", service.stats["records"], service.stats["warmup"],
             service.stats["alerts"], service.stats["errors"])
    if thread is not None:
        if args.exit_when_idle_s is not None:
            # Forward the engine's last alerts: stop once the forwarder has been idle as long.
            deadline = time.monotonic() + max(30.0, 3 * args.exit_when_idle_s)
            while thread.is_alive() and time.monotonic() < deadline and \
                    forwarder.idle_s() < args.exit_when_idle_s:
                time.sleep(0.2)
        stop.set()
        thread.join(timeout=15)
    return 0
