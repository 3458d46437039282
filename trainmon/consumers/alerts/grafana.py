"""Alerts as Grafana annotations, through grafana-client, driven from the alert topic.

A firing alert becomes an annotation tagged ``trainmon``, ``rule:<rule>``,
``severity:<severity>``, ``run_id:<run>`` and ``incident:<hash>``; its resolved alert turns
that annotation into a region (``timeEnd``). The incident tag makes both steps idempotent:
before creating, the sink looks the annotation up, so a retry or a restart never adds a
second one. The forwarder is its own consumer group over the alert topic, on the consumer
runtime, which commits an alert only once Grafana has it; while Grafana is down, slow or
refusing the token it retries with backoff and the engine, in its own thread or process,
is not held up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from urllib.parse import urlparse

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, TokenAuth

from ...schemas import AlertRecord
from .. import runtime
from ..serving import serve
from ..stream import Message
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


def url_problem(url: str) -> str | None:
    """What is wrong with GRAFANA_URL, or None: http(s)://HOST[:PORT][/PATH]."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return f"GRAFANA_URL {url!r} is not an http:// or https:// URL (e.g. http://grafana:3000)"
    try:
        parsed.port
    except ValueError as exc:
        return f"GRAFANA_URL {url!r}: {exc}"
    return None


def api_base(url: str) -> str:
    """The URL as grafana-client wants it: its path ends in '/'. grafana-client appends
    'api' to the path as given, so a Grafana on a sub-path (https://host/grafana) would be
    asked at /grafanaapi/..., a 404 retried for ever."""
    parsed = urlparse(url)
    return parsed._replace(path=parsed.path.rstrip("/") + "/").geturl()


class GrafanaAnnotations:
    def __init__(self, url: str, token: str | None, *, dashboard_uid: str | None = None,
                 timeout_s: float = 5.0):
        credential = TokenAuth(token) if token else None
        self.api = GrafanaApi.from_url(api_base(url), credential=credential, timeout=timeout_s)
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


class GrafanaSink(runtime.Sink):
    """Alerts to annotations, in order. A Grafana that cannot take one now (down, slow, a
    token refused) holds the rest back: the runtime retries with backoff and commits an
    alert only once Grafana has it. One Grafana rejects for good is dead-lettered."""

    name = "grafana forwarder"
    kinds = ("alert",)

    def __init__(self, annotations: GrafanaAnnotations, *, group: str):
        self.annotations = annotations
        self.group = group
        self.delivered = 0
        self.failures = 0
        self.dead_lettered = 0
        self.last_error: str | None = None
        self._pending: list[Message] = []

    def put(self, messages: list[Message]) -> None:
        self._pending.extend(messages)

    def flush_in_s(self) -> float | None:
        return 0.0 if self._pending else None

    def flush(self) -> None:
        while self._pending:
            message = self._pending[0]
            alert = message.record
            try:
                self.annotations.send(alert)
                self.delivered += 1
            except PermanentError as exc:
                self.dead_lettered += 1
                log.error("trainmon alerts: %s; dead-lettered", exc)
                self.context.dead_letter(message, str(exc))
            except (GrafanaException, niquests.exceptions.RequestException, OSError, ValueError) as exc:
                self.failures += 1
                self.last_error = _describe(exc)
                if _is_auth(exc):  # an operator has to act: say it louder than a retry
                    log.error("trainmon alerts: Grafana refused alert %s: %s", alert.event_id, self.last_error)
                raise runtime.RetriableError(f"Grafana did not take alert {alert.event_id} "
                                             f"({self.last_error})") from exc
            self._pending.pop(0)


class GrafanaForwarder:
    """Alert topic -> Grafana: a GrafanaSink with the settings ``serve`` runs it with (from
    the alerts config and the environment). At least once, idempotent on Grafana's side."""

    def __init__(self, annotations: GrafanaAnnotations, config: AlertsConfig, *,
                 topic_prefix: str | None = None, env: dict | None = None,
                 stop: threading.Event | None = None, retry: runtime.RetryPolicy | None = None):
        self.sink = GrafanaSink(annotations, group=config.grafana_group_id)
        self.config = config
        self.topic_prefix = topic_prefix
        self.env = env
        self.stop = stop or threading.Event()
        self.retry = retry or runtime.RetryPolicy()

    delivered = property(lambda self: self.sink.delivered)
    failures = property(lambda self: self.sink.failures)
    dead_lettered = property(lambda self: self.sink.dead_lettered)
    last_error = property(lambda self: self.sink.last_error)

    def idle_s(self) -> float:
        """Seconds since an alert last came (or the forwarder joined its group)."""
        context = getattr(self.sink, "context", None)  # set once it joined
        return context.idle_s() if context is not None else 0.0

    @classmethod
    def from_env(cls, config: AlertsConfig, *, env: dict | None = None, **kw) -> "GrafanaForwarder":
        env = os.environ if env is None else env
        url = env.get("GRAFANA_URL")
        if not url:
            raise SystemExit("trainmon consume alerts: GRAFANA_URL is not set")
        problem = url_problem(url)
        if problem:
            raise SystemExit(f"trainmon consume alerts: {problem}")
        token = env.get("GRAFANA_TOKEN")
        if not token and not urlparse(url).password:
            raise SystemExit("trainmon consume alerts: GRAFANA_TOKEN is not set (a Grafana service "
                             "account token with annotations:write), nor user:password in GRAFANA_URL")
        annotations = GrafanaAnnotations(url, token, dashboard_uid=config.grafana_dashboard_uid,
                                         timeout_s=config.grafana_timeout_s)
        return cls(annotations, config, env=env, **kw)

    def run(self, exit_when_idle_s: float | None = None, **metrics) -> None:
        """``metrics``: serve's metrics_port / metrics_listen (run alone: --only grafana)."""
        serve(self.sink, topic_prefix=self.topic_prefix, env=self.env, stop=self.stop, retry=self.retry,
              exit_when_idle_s=exit_when_idle_s, **metrics)


def _is_auth(exc: Exception) -> bool:
    return isinstance(exc, GrafanaClientError) and exc.status_code in (401, 403)


def _describe(exc: Exception) -> str:
    if isinstance(exc, GrafanaException):
        if _is_auth(exc):
            return f"{exc.status_code} {exc.message}: check GRAFANA_TOKEN (a service account token " \
                   f"with the annotations:write permission)"
        return f"{exc.status_code or 'no response'}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"
