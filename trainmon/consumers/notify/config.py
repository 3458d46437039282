"""Where alerts go, from the environment (and ``trainmon consume notify``'s options).

    TRAINMON_ALERTMANAGER_URL     http://host:9093 -- incidents posted to its v2 API
    TRAINMON_NOTIFY               apprise URLs, whitespace-separated; each may start with
                                  SEVERITY= (info, warning, critical): its minimum severity
                                  (default warning), e.g. ``critical=slack://T/B/C json://h:8080``
    TRAINMON_NOTIFY_ACTIONS       one action a line: MATCH=COMMAND, MATCH a minimum severity
                                  or ``rule:NAME``, e.g. ``rule:nan=scancel $SLURM_JOB_ID``
    TRAINMON_NOTIFY_STATE_DIR     the delivered-state file (default ./trainmon-data/notify)
    TRAINMON_NOTIFY_RATE_PER_MIN  messages per run per URL per minute (default 20)
    TRAINMON_NOTIFY_GROUP_WAIT_S  how long a burst is gathered into one message (default 0.5)
    TRAINMON_NOTIFY_ACTION_TIMEOUT_S  an action's time limit (default 60)
    TRAINMON_DASHBOARD_URL        Grafana's dashboard URL; the run is added as var-run_id
    TRAINMON_NOTIFY_GROUP         its consumer group (default trainmon-notify)
    TRAINMON_NOTIFY_REPOST_S      how often firing incidents are posted to Alertmanager again (60)
    TRAINMON_NOTIFY_GIVE_UP_AFTER_S  a delivery failing this long is given up, counted (600)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SEVERITIES = ("info", "warning", "critical")
DEFAULT_MIN_SEVERITY = "warning"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Channel:
    url: str
    min_severity: str = DEFAULT_MIN_SEVERITY


@dataclass(frozen=True)
class Action:
    command: str
    rule: str | None = None  # this rule's incidents, at any severity
    min_severity: str | None = None  # or every incident at least this severe

    def matches(self, rule: str, severity: str) -> bool:
        if self.rule is not None:
            return rule == self.rule
        return at_least(severity, self.min_severity or "critical")


@dataclass(frozen=True)
class NotifyConfig:
    alertmanager_url: str | None = None
    channels: tuple[Channel, ...] = ()
    actions: tuple[Action, ...] = ()
    state_dir: Path = Path("trainmon-data/notify")
    group_id: str = "trainmon-notify"
    rate_per_minute: int = 20
    group_wait_s: float = 0.5
    action_timeout_s: float = 60.0
    dashboard_url: str | None = None
    job: str = "trainmon"
    # Alertmanager forgets an alert not re-posted before its endsAt: posted again this often,
    # each time valid for four intervals (as Prometheus does with its resend delay).
    repost_s: float = 60.0
    # Events older than this when first read are not notified (a new group replaying a
    # month of alerts); Alertmanager still gets the resolutions.
    stale_after_s: float = 6 * 3600.0
    # A delivery failing this long is given up (counted): the runtime retries a failed flush
    # before reading on, so a URL gone for good would otherwise stop every delivery.
    give_up_after_s: float = 600.0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return not (self.alertmanager_url or self.channels or self.actions)


def at_least(severity: str, minimum: str) -> bool:
    return SEVERITIES.index(severity) >= SEVERITIES.index(minimum)


def parse_channels(text: str) -> tuple[Channel, ...]:
    channels = []
    for entry in text.split():
        head, sep, rest = entry.partition("=")
        if sep and "://" not in head:
            if head not in SEVERITIES:
                raise ConfigError(f"TRAINMON_NOTIFY: {head!r} is not a severity ({', '.join(SEVERITIES)})")
            channels.append(Channel(rest, head))
        else:
            channels.append(Channel(entry))
    return tuple(channels)


def parse_action(line: str) -> Action:
    match, sep, command = line.partition("=")
    match, command = match.strip(), command.strip()
    if not sep or not command:
        raise ConfigError(f"action {line!r}: expected MATCH=COMMAND")
    if match.startswith("rule:"):
        return Action(command, rule=match.removeprefix("rule:"))
    if match not in SEVERITIES:
        raise ConfigError(f"action {line!r}: MATCH is a severity ({', '.join(SEVERITIES)}) or rule:NAME")
    return Action(command, min_severity=match)


def load_config(env: dict | None = None, **overrides) -> NotifyConfig:
    env = os.environ if env is None else env
    actions = tuple(parse_action(line) for line in env.get("TRAINMON_NOTIFY_ACTIONS", "").splitlines()
                    if line.strip())
    settings = dict(
        alertmanager_url=env.get("TRAINMON_ALERTMANAGER_URL") or None,
        channels=parse_channels(env.get("TRAINMON_NOTIFY", "")),
        actions=actions,
        state_dir=Path(env.get("TRAINMON_NOTIFY_STATE_DIR", "trainmon-data/notify")),
        group_id=env.get("TRAINMON_NOTIFY_GROUP", "trainmon-notify"),
        rate_per_minute=int(env.get("TRAINMON_NOTIFY_RATE_PER_MIN", "20")),
        group_wait_s=float(env.get("TRAINMON_NOTIFY_GROUP_WAIT_S", "0.5")),
        action_timeout_s=float(env.get("TRAINMON_NOTIFY_ACTION_TIMEOUT_S", "60")),
        dashboard_url=env.get("TRAINMON_DASHBOARD_URL") or None,
        repost_s=float(env.get("TRAINMON_NOTIFY_REPOST_S", "60")),
        give_up_after_s=float(env.get("TRAINMON_NOTIFY_GIVE_UP_AFTER_S", "600")),
    )
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if not settings["repost_s"] > 0:
        raise ConfigError(f"TRAINMON_NOTIFY_REPOST_S: {settings['repost_s']!r} is not a positive number of seconds")
    return NotifyConfig(**settings)
