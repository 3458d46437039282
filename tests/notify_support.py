"""For the alert delivery tests: alert events as the engine writes them, a local webhook
server that records what it was sent (and can refuse, or act before it answers), and the
notify sink run over a MemoryBroker until what it was given is delivered."""

from __future__ import annotations

import email
import json
import socket
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from trainmon import topics
from trainmon.consumers import serving
from trainmon.consumers.alerts.incidents import event_id, incident_id
from trainmon.consumers.memory_stream import memory_streams
from trainmon.consumers.notify.config import load_config
from trainmon.consumers.notify.sink import NotifySink
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import AlertRecord, encode

from .runtime_support import FAST

UTC = timezone.utc
PREFIX = "notify."
ALERT_TOPIC = topics.topic_for("alert", PREFIX)


def alert(run_id: str = "run-a", rule: str = "nan", subject: str = "rank0", *, state: str = "firing",
          severity: str = "critical", ranks: list[int] | None = None, step: int = 120, ordinal: int = 1,
          message: str | None = None, value: float | None = float("nan"), at: datetime | None = None,
          threshold: float | None = None) -> AlertRecord:
    """One state change of an incident, ids made as the engine makes them."""
    iid = incident_id(run_id, rule, subject, ordinal)
    ranks = [0] if ranks is None else ranks
    text = message or f"{rule} on {subject} at step {step}"
    if state == "resolved" and message is None:
        text = f"resolved (healthy again) at step {step + 5}, 5 s after it fired: {text}"
    return AlertRecord(run_id=run_id, rank=ranks[0], world_size=max(ranks) + 1, host="node0",
                       time=at or datetime.now(UTC), event_id=event_id(iid, state), rule=rule,
                       severity=severity, state=state, incident_id=iid, ranks=ranks, step=step,
                       value=value, threshold=threshold, message=text)


def nan_burst(run_id: str, ranks: int, step: int = 120) -> list[AlertRecord]:
    """A NaN loss seen on every rank: one incident per rank, as the nan rule fires them."""
    return [alert(run_id, "nan", f"rank{r}", ranks=[r], step=step) for r in range(ranks)]


def resolved(fired: AlertRecord, later_s: float = 5.0) -> AlertRecord:
    subject = fired.incident_id.removeprefix(f"{fired.run_id}/{fired.rule}/").rpartition("#")[0]
    return alert(fired.run_id, fired.rule, subject, state="resolved", severity=fired.severity,
                 ranks=fired.ranks, step=(fired.step or 0) + 5, value=None,
                 at=fired.time + timedelta(seconds=later_s))


def broker_with(alerts: list[AlertRecord], broker: MemoryBroker | None = None) -> MemoryBroker:
    broker = broker or MemoryBroker()
    for a in alerts:
        broker.append(ALERT_TOPIC, a.incident_id.encode(), encode(a))
    return broker


class Received:
    """What the webhook server took (answered 2xx), in order."""

    def __init__(self):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.refuse = 0  # answer this many next requests with 503
        self.before_answer: Callable[[dict], bool] | None = None  # False: drop it unanswered
        self.refused = 0

    def bodies(self, path: str | None = None) -> list:
        with self.lock:
            return [r["body"] for r in self.requests if path is None or r["path"] == path]

    def event_ids(self, path: str | None = None) -> list[str]:
        """Every event id the messages carried (their ``events:`` line), repeats included."""
        out = []
        for body in self.bodies(path):
            text = body.get("message", "") if isinstance(body, dict) else ""
            for line in text.splitlines():
                if line.startswith("events: "):
                    out += line.removeprefix("events: ").split()
        return out


class WebhookServer:
    """A local HTTP server taking JSON posts: ``url`` for apprise's json:// scheme."""

    def __init__(self):
        self.received = Received()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {"raw": raw.decode(errors="replace")}
                entry = {"path": self.path, "body": body}
                with received.lock:
                    if received.refuse:
                        received.refuse -= 1
                        received.refused += 1
                        self.send_response(503)
                        self.end_headers()
                        return
                if received.before_answer is not None and not received.before_answer(entry):
                    self.close_connection = True
                    return  # taken away unanswered: not delivered, as the sender sees it
                with received.lock:
                    received.requests.append(entry)
                # Slack's webhook answers "ok", which apprise's Slack plugin checks.
                answer = b"ok" if self.path.startswith("/services/") else b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def json_url(self, path: str = "/hook") -> str:
        return f"json://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "WebhookServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def notify_env(state_dir: Path, notify: str = "", **settings: str) -> dict:
    env = {"TRAINMON_NOTIFY": notify, "TRAINMON_NOTIFY_STATE_DIR": str(state_dir),
           "TRAINMON_NOTIFY_GROUP_WAIT_S": "0.05"}
    env.update({f"TRAINMON_{k.upper()}": v for k, v in settings.items()})
    return env


def deliver(broker: MemoryBroker, env: dict, *, group: str | None = None,
            also: Callable[[], bool] = lambda: True) -> NotifySink:
    """The notify sink over the broker's alert topic until it has read and delivered it
    all (and ``also()`` holds)."""
    sink = NotifySink(load_config(env), topic_prefix=PREFIX)
    serving.serve(sink, group=group, topic_prefix=PREFIX, open_stream=memory_streams(broker), retry=FAST,
                  until=lambda runtime: runtime.sink.context.read_to_end() and also())
    return sink


class MailServer:
    """A local SMTP server (aiosmtpd) keeping every message it is given."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.messages: list = []
        messages = self.messages

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                messages.append(envelope)
                return "250 OK"

        # aiosmtpd checks the server is up by connecting to its port: it needs one named.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)

    def url(self, to: str = "oncall@example.com") -> str:
        return f"mailto://127.0.0.1:{self.port}?from=trainmon@example.com&to={to}&mode=insecure"

    def texts(self) -> list[str]:
        """Each message's subject and plain-text body."""
        out = []
        for envelope in self.messages:
            mail = email.message_from_bytes(envelope.content)
            plain = next(p for p in mail.walk() if p.get_content_type() == "text/plain")
            out.append(f"{mail['Subject']}\n{plain.get_payload(decode=True).decode()}")
        return out

    def __enter__(self) -> "MailServer":
        self.controller.start()
        return self

    def __exit__(self, *exc) -> None:
        self.controller.stop()
