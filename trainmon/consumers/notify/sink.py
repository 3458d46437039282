"""``trainmon consume notify``: alert delivery as a sink on the consumer runtime.

It reads the alert topic with a group of its own (``trainmon-notify``), so it can be
replayed or reset without touching the alerts engine. Per batch (``put`` gathers a burst
for ``group_wait_s``), ``flush`` delivers every alert not delivered yet:

1. actions, at most once per incident (marked before the command runs);
2. Alertmanager: the incident posted (and re-posted from ``tick`` while firing);
3. apprise URLs: one message per run, rule and change, within each URL's rate limit.

Each delivery is marked in the delivered-state file (:mod:`.delivered`) as soon as it
succeeded; the runtime commits the batch's offsets only after ``flush`` returned. So a
restart -- kill -9 included -- replays the uncommitted alerts and delivers only what was
not delivered. A failed delivery raises RetriableError: the runtime retries the flush with
its backoff, the deliveries done are not repeated. Counts go to ``<state>-stats.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ... import topics
from ...schemas import AlertRecord
from .. import runtime, serving
from ..stream import Message as StreamMessage
from .actions import run_action
from .alertmanager import AlertmanagerClient, payload
from .channels import AppriseChannel, ChannelError
from .config import ConfigError, NotifyConfig, load_config, parse_action, parse_channels
from .delivered import DeliveredLog
from .messages import group

log = logging.getLogger("trainmon.notify")
UTC = timezone.utc
# A destination given up on and without a failure for this long is in a new outage when it
# fails again: waited for give_up_after_s again. (Within one outage the runtime retries at
# least every 30 s, its backoff's cap.)
NEW_OUTAGE_AFTER_S = 120.0


class NotifySink(runtime.Sink):
    name = "notify"
    kinds = ("alert",)
    poll_s = 1.0  # how often tick looks whether Alertmanager is due a re-post

    def __init__(self, config: NotifyConfig, *, topic_prefix: str | None = None):
        self.config = config
        # A re-post interval under a second is kept too: tick looks that often.
        self.poll_s = min(NotifySink.poll_s, config.repost_s)
        self.prefix = topics.prefix() if topic_prefix is None else topic_prefix
        self.channels = [AppriseChannel(c, config.rate_per_minute) for c in config.channels]
        self.alertmanager = AlertmanagerClient(config.alertmanager_url) if config.alertmanager_url else None
        # Named by the topics, not the group: a replay under a new group must see what the
        # usual one delivered. (So one process at a time per state directory.)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"notify-{self.prefix}")
        self.state_path = Path(config.state_dir) / f"{safe}delivered.jsonl"
        self.stats_path = Path(config.state_dir) / f"{safe}stats.json"
        self.state: DeliveredLog | None = None
        self.pending: list[AlertRecord] = []
        self._first_put_at: float | None = None
        self._reposted_at = 0.0
        # URL key or "alertmanager" -> (failing since, last failure)
        self._failing_since: dict[str, tuple[float, float]] = {}
        self.stats = {"alerts": 0, "messages": 0, "failures": 0, "rate_limited": 0, "stale": 0,
                      "actions": 0, "action_failures": 0, "alertmanager_posts": 0, "given_up": 0}

    @property
    def group(self) -> str:
        return self.config.group_id

    def start(self, context: runtime.SinkContext) -> None:
        super().start(context)
        self.state = DeliveredLog(self.state_path)
        self.stats.update(self._saved_stats())
        # Counted since the state directory began (the stats file), so they never go back.
        context.metrics.counters_from(self.stats, {
            "messages": ("trainmon_notifications_sent", "Notifications delivered (apprise URLs)"),
            "failures": ("trainmon_notifications_failed", "Deliveries that failed (retried with backoff)"),
            "given_up": ("trainmon_notifications_given_up", "Deliveries given up after failing for "
                                                            "TRAINMON_NOTIFY_GIVE_UP_AFTER_S"),
            "rate_limited": ("trainmon_notifications_rate_limited", "Notifications held back by the rate limit"),
            "alertmanager_posts": ("trainmon_alertmanager_posts", "Incidents posted to Alertmanager"),
            "action_failures": ("trainmon_notify_action_failures", "Actions (commands) that failed"),
        })
        log.info("trainmon notify: %d URL(s), %s, %d action(s); %d incident(s) firing at Alertmanager",
                 len(self.channels), "Alertmanager" if self.alertmanager else "no Alertmanager",
                 len(self.config.actions), len(self.state.firing))

    # -- the runtime's calls -------------------------------------------------------------

    def put(self, messages: list[StreamMessage]) -> None:
        for m in messages:
            if isinstance(m.record, AlertRecord):
                self.pending.append(m.record)
        if self.pending and self._first_put_at is None:
            self._first_put_at = time.monotonic()

    def flush_in_s(self) -> float | None:
        if not self.pending:
            return None
        return max(0.0, self._first_put_at + self.config.group_wait_s - time.monotonic())

    def flush(self) -> None:
        alerts = self.pending
        failures = []
        now = datetime.now(UTC)
        fresh = [a for a in alerts if (now - a.time).total_seconds() <= self.config.stale_after_s]
        fresh_ids = {a.event_id for a in fresh}
        self._run_actions(fresh)
        if self.alertmanager is not None:
            # A stale resolution still ends what Alertmanager holds as firing.
            failures += self._post_alertmanager(
                [a for a in alerts if a.event_id in fresh_ids or a.incident_id in self.state.firing], now)
        for channel in self.channels:
            failures += self._notify(channel, fresh)
        self._save_stats()
        if failures:
            raise runtime.RetriableError("; ".join(failures))
        self.stats["alerts"] += len(alerts)
        self.stats["stale"] += len(alerts) - len(fresh)
        self.pending, self._first_put_at = [], None
        self._save_stats()

    def tick(self) -> None:
        if self.alertmanager is None or not self.state.firing:
            return
        if time.monotonic() - self._reposted_at < self.config.repost_s:
            return
        self._reposted_at = time.monotonic()
        now = datetime.now(UTC)
        alerts = [payload(AlertRecord.model_validate(a), None, job=self.config.job,
                          dashboard_url=self.config.dashboard_url, now=now,
                          valid_for_s=4 * self.config.repost_s) for a in self.state.firing.values()]
        try:
            self.alertmanager.post(alerts)
            self.stats["alertmanager_posts"] += 1
        except runtime.RetriableError as exc:  # the next tick tries again
            self.stats["failures"] += 1
            log.warning("trainmon notify: re-posting %d firing alert(s): %s", len(alerts), exc)

    def stop(self) -> None:
        self._save_stats()
        if self.state is not None:
            self.state.close()

    # -- deliveries ----------------------------------------------------------------------

    def _run_actions(self, alerts: list[AlertRecord]) -> None:
        for alert in alerts:
            if alert.state != "firing":
                continue
            for index, action in enumerate(self.config.actions):
                key = f"action{index}#{alert.incident_id}"
                if key in self.state or not action.matches(alert.rule, alert.severity):
                    continue
                self.state.mark([key])  # before it runs: at most once, a kill -9 included
                status = run_action(action, alert, self.config.action_timeout_s)
                self.stats["actions"] += 1
                if status != 0:
                    self.stats["action_failures"] += 1

    def _post_alertmanager(self, alerts: list[AlertRecord], now: datetime) -> list[str]:
        todo = [a for a in alerts if f"am#{a.event_id}" not in self.state]
        if not todo:
            return []
        bodies = []
        for alert in todo:
            fired = self.state.firing.get(alert.incident_id)
            bodies.append(payload(alert, AlertRecord.model_validate(fired) if fired else None,
                                  job=self.config.job, dashboard_url=self.config.dashboard_url,
                                  now=now, valid_for_s=4 * self.config.repost_s))
        try:
            self.alertmanager.post(bodies)
        except runtime.RetriableError as exc:
            self.stats["failures"] += 1
            if not self._give_up("alertmanager", f"Alertmanager: {len(todo)} alert(s)"):
                return [str(exc)]
            # Given up: what fired is re-posted from tick all the same; what resolved ends
            # there at the endsAt it was last posted with.
        else:
            self._failing_since.pop("alertmanager", None)
            self.stats["alertmanager_posts"] += 1
        for alert in todo:
            if alert.state == "firing":
                self.state.set_firing(alert.model_dump(mode="json"))
            else:
                self.state.end_firing(alert.incident_id)
        self.state.mark([f"am#{a.event_id}" for a in todo])
        return []

    def _notify(self, channel: AppriseChannel, alerts: list[AlertRecord]) -> list[str]:
        todo = [a for a in alerts if f"{channel.key}#{a.event_id}" not in self.state]
        for message in group(todo, self.config.dashboard_url):
            keys = [f"{channel.key}#{e}" for e in message.event_ids]
            if not channel.wants(message):
                continue
            if not channel.within_rate(message.run_id):
                channel.hold_back(message)
                self.stats["rate_limited"] += 1
                self.state.mark(keys)  # held back for good, not retried
                continue
            if not channel.send(message):
                self.stats["failures"] += 1
                if self._give_up(channel.key, f"{channel.name}: {message.title}"):
                    self.state.mark(keys)
                    continue
                return [f"{channel.name} refused or unreachable"]  # its next ones wait for the retry
            self._failing_since.pop(channel.key, None)
            self.stats["messages"] += 1
            self.state.mark(keys)
        return []

    def _give_up(self, key: str, what: str) -> bool:
        """Whether a delivery to ``key`` (a URL, Alertmanager) failing since long enough is
        given up: a URL gone for good must not hold back every other delivery (the runtime
        retries a failed flush before it reads anything new). Failing since is per
        destination, until a delivery there succeeds: once it is given up on, its next
        messages are not each waited for that long again (unless nothing failed there for
        NEW_OUTAGE_AFTER_S: a new outage)."""
        now = time.monotonic()
        since, last = self._failing_since.get(key, (now, now))
        if now - last > NEW_OUTAGE_AFTER_S:
            since = now  # not tried there since: a new outage, waited for again
        self._failing_since[key] = (since, now)
        if now - since < self.config.give_up_after_s:
            return False
        self.stats["given_up"] += 1
        log.error("trainmon notify: gave up on %s after %.0f s of failures", what, now - since)
        return True

    # -- counts, for trainmon status -------------------------------------------------------

    def _saved_stats(self) -> dict:
        try:
            saved = json.loads(self.stats_path.read_text())
            return {k: v for k, v in saved.items() if k in self.stats}
        except (OSError, ValueError):
            return {}

    def _save_stats(self) -> None:
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.stats, "updated": time.time()}))
        os.replace(tmp, self.stats_path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainmon consume notify",
        description="deliver the alert topic's incidents to Alertmanager, apprise URLs and actions")
    parser.add_argument("--alertmanager", metavar="URL", help="Alertmanager (default: TRAINMON_ALERTMANAGER_URL)")
    parser.add_argument("--notify", metavar="[SEVERITY=]URL", action="append", default=[],
                        help="an apprise URL, repeatable (added to TRAINMON_NOTIFY)")
    parser.add_argument("--action", metavar="MATCH=COMMAND", action="append", default=[],
                        help="MATCH a minimum severity or rule:NAME, repeatable (added to TRAINMON_NOTIFY_ACTIONS)")
    parser.add_argument("--state-dir", type=Path, help="default: TRAINMON_NOTIFY_STATE_DIR or ./trainmon-data/notify")
    parser.add_argument("--group", help="Kafka consumer group (default: TRAINMON_NOTIFY_GROUP or trainmon-notify)")
    parser.add_argument("--topic-prefix", default=None, help="default: TRAINMON_TOPIC_PREFIX or 'trainmon.'")
    parser.add_argument("-v", "--verbose", action="store_true")
    serving.add_exit_when_idle_argument(parser)
    serving.add_metrics_arguments(parser)
    return parser


def config_from(args: argparse.Namespace, env: dict | None = None) -> NotifyConfig:
    config = load_config(env, alertmanager_url=args.alertmanager, state_dir=args.state_dir,
                         group_id=args.group)
    channels = config.channels + parse_channels(" ".join(args.notify))
    actions = config.actions + tuple(parse_action(a) for a in args.action)
    return NotifyConfig(**{**config.__dict__, "channels": channels, "actions": actions})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from(args)
        if config.empty:
            raise ConfigError("nowhere to deliver: set TRAINMON_ALERTMANAGER_URL, TRAINMON_NOTIFY "
                              "or TRAINMON_NOTIFY_ACTIONS (or --alertmanager / --notify / --action)")
        sink = NotifySink(config, topic_prefix=args.topic_prefix)
    except (ConfigError, ChannelError) as exc:
        print(f"trainmon consume notify: {exc}", file=sys.stderr)
        return 2
    runtime_ = serving.serve(sink, topic_prefix=args.topic_prefix, stop=runtime.stop_on_signals(),
                             exit_when_idle_s=args.exit_when_idle_s, **serving.metrics_options(args))
    log.info("trainmon notify: stopped after %d record(s): %s", runtime_.records, sink.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
