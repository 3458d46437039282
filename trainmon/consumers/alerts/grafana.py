"""Alerts as Grafana annotations, through grafana-client, driven from the alert topic.

A firing alert becomes an annotation tagged ``trainmon``, ``rule:<rule>``,
``severity:<severity>``, ``run_id:<run>`` and ``incident:<hash>``; its resolved alert turns
that annotation into a region (``timeEnd``). The incident tag makes both steps idempotent:
before creating, the sink looks the annotation up, so a retry or a restart never adds a
second one. The forwarder is its own consumer group over the alert topic and commits an
alert only once Grafana has it; while Grafana is down, slow or refusing the token it
retries with backoff and the engine, in its own thread or process, is not held up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from urllib.parse import urlparse

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, TokenAuth

from ...schemas import AlertRecord
from ..stream import RecordStream
from .config import AlertsConfig

log = logging.getLogger("trainmon.alerts.grafana")


# Worth retrying: a token or permission an operator can fix, an annotation deleted meanwhile
# (the retry recreates it), a timeout, rate limiting. Other 4xx reject the request itself.
RETRYABLE_4XX = {401, 403, 404, 408, 429}


class PermanentError(Exception):
    """Grafana rejected the request itself (e.g. 400): retrying the same alert cannot help."""


def incident_tag(alert: AlertRecord) -> str:
    return "incident:" + hashlib.sha256(alert.incident_id.encode()).hexdigest()[:16]


def annotation_tags(alert: AlertRecord) -> list[str]:
    return ["trainmon", f"rule:{alert.rule}", f"severity:{alert.severity}", f"run_id:{alert.run_id}",
            incident_tag(alert)]


def epoch_ms(alert: AlertRecord) -> int:
    return int(alert.time.timestamp() * 1000)


class GrafanaAnnotations:
    def __init__(self, url: str, token: str | None, *, dashboard_uid: str | None = None,
                 timeout_s: float = 5.0):
        credential = TokenAuth(token) if token else None
        self.api = GrafanaApi.from_url(url, credential=credential, timeout=timeout_s)
        self.dashboard_uid = dashboard_uid

    def send(self, alert: AlertRecord) -> int:
        """Create or close the alert's annotation; returns its id. Raises GrafanaException
        (or a niquests error) when Grafana cannot take it now, PermanentError when never."""
        try:
            existing = self._find(alert)
            if alert.state == "firing":
                return existing["id"] if existing else self._create(alert, time_end=None)
            if existing is None:  # its firing annotation is gone: mark the resolution alone
                return self._create(alert, time_end=None)
            if existing.get("timeEnd") != epoch_ms(alert):
                self.api.client.PATCH(f"/annotations/{existing['id']}", json={
                    "time": existing.get("time") or epoch_ms(alert), "timeEnd": epoch_ms(alert),
                    "text": f"{existing.get('text', '')}\n\nResolved: {alert.message}",
                    "tags": annotation_tags(alert)})
            return existing["id"]
        except GrafanaClientError as exc:
            if exc.status_code in RETRYABLE_4XX:
                raise
            raise PermanentError(f"Grafana rejected the annotation for {alert.incident_id}: "
                                 f"{exc.status_code} {exc.response}") from exc

    def _find(self, alert: AlertRecord) -> dict | None:
        params = {"tags": ["trainmon", incident_tag(alert)], "type": "annotation", "limit": 1}
        found = self.api.client.GET("/annotations", params=params)
        return found[0] if found else None

    def _create(self, alert: AlertRecord, time_end: int | None) -> int:
        body = {"time": epoch_ms(alert), "tags": annotation_tags(alert), "text": _text(alert)}
        if time_end is not None:
            body["timeEnd"] = time_end
        if self.dashboard_uid:
            body["dashboardUID"] = self.dashboard_uid
        return self.api.client.POST("/annotations", json=body)["id"]


def _text(alert: AlertRecord) -> str:
    prefix = "Resolved: " if alert.state == "resolved" else f"[{alert.severity}] "
    return f"{prefix}{alert.message}"


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = 30.0):
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.cap, self.delay * 2)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.delay = self.first


class GrafanaForwarder:
    """Alert topic -> Grafana, in order, at least once (and idempotent on Grafana's side)."""

    def __init__(self, sink: GrafanaAnnotations, config: AlertsConfig, *, topic_prefix: str | None = None,
                 env: dict | None = None, stop: threading.Event | None = None,
                 backoff: Backoff | None = None):
        self.sink = sink
        self.config = config
        self.topic_prefix = topic_prefix
        self.env = env
        self.stop = stop or threading.Event()
        self.backoff = backoff or Backoff()
        self.delivered = 0
        self.failures = 0
        self.dead_lettered = 0
        self.last_error: str | None = None
        self.idle_since = time.monotonic()  # the last alert received or delivered, or joining

    @classmethod
    def from_env(cls, config: AlertsConfig, *, env: dict | None = None, **kw) -> "GrafanaForwarder":
        env = os.environ if env is None else env
        url = env.get("GRAFANA_URL")
        if not url:
            raise SystemExit("trainmon consume alerts: GRAFANA_URL is not set")
        token = env.get("GRAFANA_TOKEN")
        if not token and not urlparse(url).password:
            raise SystemExit("trainmon consume alerts: GRAFANA_TOKEN is not set (a Grafana service "
                             "account token with annotations:write), nor user:password in GRAFANA_URL")
        sink = GrafanaAnnotations(url, token, dashboard_uid=config.grafana_dashboard_uid,
                                  timeout_s=config.grafana_timeout_s)
        return cls(sink, config, env=env, **kw)

    def run(self, exit_when_idle_s: float | None = None) -> None:
        stream = RecordStream(self.config.grafana_group_id, ["alert"], topic_prefix=self.topic_prefix,
                              env=self.env)
        self.idle_since = time.monotonic()
        try:
            while not self.stop.is_set():
                messages = stream.poll(timeout_ms=500)
                if messages or not stream.consumer.assignment():
                    self.idle_since = time.monotonic()  # idle time counts from joining the group
                elif exit_when_idle_s is not None and time.monotonic() - self.idle_since >= exit_when_idle_s:
                    return
                for m in messages:
                    if not self._deliver(stream, m):
                        return  # stopping: this alert and the rest stay uncommitted
                    stream.commit([m])
                    self.idle_since = time.monotonic()
                if not messages:
                    stream.commit_polled()  # dead letters of undecodable messages
        finally:
            stream.close()

    def _deliver(self, stream: RecordStream, message) -> bool:
        alert = message.record
        while not self.stop.is_set():
            try:
                self.sink.send(alert)
                self.delivered += 1
                self.backoff.reset()
                return True
            except PermanentError as exc:
                self.dead_lettered += 1
                log.error("trainmon alerts: %s; dead-lettered", exc)
                stream.dead_letter(message, str(exc))
                return True
            except (GrafanaException, niquests.exceptions.RequestException, OSError, ValueError) as exc:
                self.failures += 1
                self.last_error = _describe(exc)
                delay = self.backoff.next()
                (log.error if _is_auth(exc) else log.warning)(
                    "trainmon alerts: Grafana did not take alert %s (%s); retrying in %.1f s",
                    alert.event_id, self.last_error, delay)
                self.stop.wait(delay)
        return False


def _is_auth(exc: Exception) -> bool:
    return isinstance(exc, GrafanaClientError) and exc.status_code in (401, 403)


def _describe(exc: Exception) -> str:
    if isinstance(exc, GrafanaException):
        if _is_auth(exc):
            return f"{exc.status_code} {exc.message}: check GRAFANA_TOKEN (a service account token " \
                   f"with the annotations:write permission)"
        return f"{exc.status_code or 'no response'}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"
