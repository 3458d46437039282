"""Direct notifications through apprise (Slack, Discord, Teams, e-mail, ntfy, Telegram,
generic JSON and webhooks ...): one URL each, with a minimum severity and a rate limit
per run, so that a run gone bad floods nobody.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque

from .config import Channel, at_least
from .messages import Message

log = logging.getLogger("trainmon.notify")

NOTIFY_TYPE = {"info": "info", "warning": "warning", "critical": "failure"}
RESOLVED_TYPE = "success"


class ChannelError(ValueError):
    pass


class AppriseChannel:
    def __init__(self, channel: Channel, rate_per_minute: int):
        import apprise  # the alerts extra: pip install 'trainmon[alerts]'

        self.channel = channel
        self.rate_per_minute = rate_per_minute
        self._apprise = apprise.Apprise()
        if not self._apprise.add(channel.url):
            raise ChannelError(f"TRAINMON_NOTIFY: apprise does not take {redact(channel.url)}")
        self.name = redact(channel.url)  # for logs
        # What its deliveries are marked with: the whole URL (two on one host are two), hashed
        # since it may hold a token.
        self.key = "url-" + hashlib.sha256(channel.url.encode()).hexdigest()[:16]
        self._sent: dict[str, deque[float]] = {}  # run -> times of the messages of the last minute
        self.held_back: dict[str, int] = {}  # run -> messages the rate limit held back since

    def wants(self, message: Message) -> bool:
        return at_least(message.severity, self.channel.min_severity)

    def within_rate(self, run_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        window = self._sent.setdefault(run_id, deque())
        while window and window[0] <= now - 60.0:
            window.popleft()
        return len(window) < self.rate_per_minute

    def send(self, message: Message) -> bool:
        """One try; True once the service took it."""
        held = self.held_back.get(message.run_id, 0)
        body = message.body
        if held:
            body += f"\n({held} earlier message(s) of this run held back by the rate limit)"
        kind = RESOLVED_TYPE if message.state == "resolved" else NOTIFY_TYPE[message.severity]
        ok = bool(self._apprise.notify(title=message.title, body=body, notify_type=kind))
        if ok:
            self._sent.setdefault(message.run_id, deque()).append(time.monotonic())
            self.held_back.pop(message.run_id, None)
        return ok

    def hold_back(self, message: Message) -> None:
        self.held_back[message.run_id] = self.held_back.get(message.run_id, 0) + 1


def redact(url: str) -> str:
    """The URL without what may be a secret (tokens, passwords): scheme and host only."""
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}{sep}{host}" if sep else "<invalid url>"
