"""Incidents posted to Alertmanager's v2 API (``POST /api/v2/alerts``), so that its
grouping, silences, inhibition and receivers work unchanged.

An alert is identified by its labels: alertname (the rule), severity, run_id, host, job
and ``incident`` (the incident id: two incidents of one rule on one run stay two alerts).
While firing it is re-posted every ``repost_s`` with ``endsAt`` four intervals ahead, as
Prometheus does: Alertmanager resolves an alert nobody re-posts once its endsAt passed.
Resolved, it is posted once more with ``endsAt`` the time it resolved.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

from ...schemas import AlertRecord
from ..runtime import RetriableError
from .messages import dashboard_link, ranks_text

UTC = timezone.utc


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def payload(alert: AlertRecord, fired: AlertRecord | None, *, job: str, dashboard_url: str | None,
            now: datetime, valid_for_s: float) -> dict:
    """Alertmanager's postable alert for this incident: ``fired`` is its firing event (the
    labels and startsAt come from it), ``alert`` its latest event."""
    fired = fired or alert
    annotations = {
        "message": fired.message if alert.state == "firing" else alert.message,
        "step": "" if fired.step is None else str(fired.step),
        "value": "" if fired.value is None else f"{fired.value:.6g}",
        "threshold": "" if fired.threshold is None else f"{fired.threshold:.6g}",
        "ranks": ranks_text(alert.ranks or fired.ranks or [fired.rank]),
        "event_id": alert.event_id,
    }
    link = dashboard_link(dashboard_url, fired.run_id)
    if link:
        annotations["dashboard"] = link
    body = {
        "labels": {"alertname": fired.rule, "severity": fired.severity, "run_id": fired.run_id,
                   "host": fired.host, "job": job, "incident": fired.incident_id},
        "annotations": annotations,
        "startsAt": _iso(fired.time),
        "endsAt": _iso(alert.time if alert.state == "resolved" else now + timedelta(seconds=valid_for_s)),
    }
    if link:
        body["generatorURL"] = link
    return body


class AlertmanagerClient:
    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.timeout_s = timeout_s

    def post(self, alerts: list[dict]) -> None:
        """Raises RetriableError when Alertmanager is away or refuses them."""
        if not alerts:
            return
        request = urllib.request.Request(self.url, data=json.dumps(alerts).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise RetriableError(f"Alertmanager {self.url}: HTTP {exc.code} {exc.read()[:200]!r}") from exc
        except OSError as exc:
            raise RetriableError(f"Alertmanager {self.url}: {exc}") from exc
