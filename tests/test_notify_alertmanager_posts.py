"""What the notify sink posts to Alertmanager's v2 API, seen by a local HTTP server in its
place (no Go needed): labels and annotations, startsAt, re-posts while firing with endsAt
ahead -- also after a restart, from the delivered state -- and endsAt when resolved.
test_notify_alertmanager.py runs the real one."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from .notify_support import WebhookServer, alert, broker_with, deliver, notify_env, resolved

pytestmark = pytest.mark.timeout(60)


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_firing_is_posted_and_reposted_with_endsat_ahead_and_resolved_ends_it(tmp_path):
    fired = alert("run-am", "stalled", "rank1", ranks=[1], severity="warning", step=90, value=None)
    with WebhookServer() as am:
        env = notify_env(tmp_path, alertmanager_url=f"http://127.0.0.1:{am.port}", notify_repost_s="0.2",
                         dashboard_url="http://grafana/d/x")
        posts = lambda: am.received.bodies("/api/v2/alerts")  # noqa: E731
        broker = broker_with([fired])
        deliver(broker, env, also=lambda: len(posts()) >= 3)  # the post, then two re-posts
        [first], [again] = posts()[0], posts()[2]
        assert first["labels"] == {"alertname": "stalled", "severity": "warning", "run_id": "run-am",
                                   "host": "node0", "job": "trainmon", "incident": fired.incident_id}
        assert first["annotations"]["step"] == "90" and first["annotations"]["ranks"] == "1 rank: 1"
        assert first["annotations"]["dashboard"] == "http://grafana/d/x?var-run_id=run-am"
        assert parse(first["startsAt"]) == fired.time == parse(again["startsAt"])
        assert parse(again["endsAt"]) > parse(first["endsAt"]) > fired.time  # valid a while ahead
        assert again["labels"] == first["labels"]

        # Restarted with nothing new to read: it still re-posts what is firing there.
        before = len(posts())
        deliver(broker, env, also=lambda: len(posts()) >= before + 1)
        assert posts()[-1][0]["labels"]["incident"] == fired.incident_id

        end = resolved(fired, later_s=30)
        broker_with([end], broker)
        sink = deliver(broker, env, also=lambda: posts()[-1][0]["endsAt"].startswith(
            end.time.strftime("%Y-%m-%dT%H:%M:%S")))
        assert parse(posts()[-1][0]["endsAt"]) == end.time
        assert parse(posts()[-1][0]["startsAt"]) == fired.time  # the incident's start, not the resolution's
        assert sink.state.firing == {}
        assert end.time - fired.time == timedelta(seconds=30)
