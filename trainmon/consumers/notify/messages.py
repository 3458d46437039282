"""Alerts turned into messages a person reads: one per incident state change, a burst of
one rule on one run in one message ("nan on 64 ranks: 0, 1, 2, ... and 56 more").

A message lists the event ids it carries (its last line), so that a receiver can tell a
delivery repeated after a crash from a new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode

from ...schemas import AlertRecord
from .config import SEVERITIES

FIRST_RANKS = 8  # ranks named in a message; the rest are counted


@dataclass
class Message:
    run_id: str
    rule: str
    state: str  # firing, escalated or resolved
    severity: str
    title: str
    body: str
    alerts: list[AlertRecord]

    @property
    def event_ids(self) -> list[str]:
        return [a.event_id for a in self.alerts]


def superseded(alert: AlertRecord) -> bool:
    """The resolved half of an escalation: the escalated firing that follows says it all."""
    return alert.state == "resolved" and alert.message.startswith("resolved (escalated")


def change(alert: AlertRecord) -> str:
    if alert.state == "firing" and "[escalated from" in alert.message:
        return "escalated"
    return alert.state


def group(alerts: list[AlertRecord], dashboard_url: str | None = None) -> list[Message]:
    """The alerts of a batch as messages, one per run, rule and kind of change, in the
    order their first alert came."""
    groups: dict[tuple, list[AlertRecord]] = {}
    for alert in alerts:
        if not superseded(alert):
            groups.setdefault((alert.run_id, alert.rule, change(alert)), []).append(alert)
    return [render(run_id, rule, state, members, dashboard_url)
            for (run_id, rule, state), members in groups.items()]


def ranks_text(ranks: list[int]) -> str:
    named = ", ".join(str(r) for r in ranks[:FIRST_RANKS])
    more = f" and {len(ranks) - FIRST_RANKS} more" if len(ranks) > FIRST_RANKS else ""
    return f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}: {named}{more}"


def dashboard_link(dashboard_url: str | None, run_id: str) -> str | None:
    if not dashboard_url:
        return None
    sep = "&" if "?" in dashboard_url else "?"
    return f"{dashboard_url}{sep}{urlencode({'var-run_id': run_id})}"


def render(run_id: str, rule: str, state: str, alerts: list[AlertRecord],
           dashboard_url: str | None) -> Message:
    severity = max((a.severity for a in alerts), key=SEVERITIES.index)
    ranks = sorted({r for a in alerts for r in (a.ranks or [a.rank])})
    steps = [a.step for a in alerts if a.step is not None]
    step = f" at step {min(steps)}" if steps else ""
    count = f" ({len(alerts)} incidents)" if len(alerts) > 1 else ""
    title = f"[{severity.upper()}] {rule} {state} on run {run_id}{step}{count}"
    first = alerts[0]
    lines = [f"run {run_id}, rule {rule}, {state}{step}, {ranks_text(ranks)}", first.message]
    if first.value is not None or first.threshold is not None:
        lines.append(f"value {first.value}, threshold {first.threshold}")
    if len(alerts) > 1:
        lines.append(f"{len(alerts)} incidents of this rule in this burst, first: {first.incident_id}")
    link = dashboard_link(dashboard_url, run_id)
    if link:
        lines.append(f"dashboard: {link}")
    lines.append("events: " + " ".join(a.event_id for a in alerts))
    return Message(run_id, rule, state, severity, title, "\n".join(lines), list(alerts))
