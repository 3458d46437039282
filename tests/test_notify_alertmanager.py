"""Alert delivery to a real Alertmanager (built from its Go module, see
alertmanager_support.py) with a webhook receiver: the alerts engine's incidents of a
2-rank run -- a NaN on rank 0, rank 1 stalled -- reach the receiver as one notification
per alert group, then resolved; a silence made through Alertmanager's API suppresses the
next one. The sink runs in memory (MemoryBroker): what is shown is Alertmanager's side."""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta, timezone

import pytest

from .alertmanager_support import Alertmanager
from .alerts_support import engine_with, run_engine, synthetic_run
from .notify_support import WebhookServer, alert, broker_with, deliver, notify_env
from .test_alerts_rules import TEST_SETTINGS, at, on_rank
from .waiting import wait_until

# A service of its own (slow); the first run builds Alertmanager.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUN = "am-run"


def two_rank_run_alerts() -> list:
    """NaN on rank 0 at step 50, rank 1 silent from step 50: what the engine publishes."""
    t0 = time.time() - 700  # the silence judged 400 s after the last record: still in the past
    engine = engine_with(**TEST_SETTINGS)
    records = synthetic_run(RUN, t0=t0, ranks=2, steps=80, end=False, stop_rank_at={1: 50},
                            mutate=on_rank(0, at(50, step={"loss": math.nan})))
    return run_engine(engine, records, tick_after_s=400)


def notifications(hook, status: str | None = None) -> list[tuple[str, str]]:
    """(alertname, status) of each webhook notification, in order."""
    return [(b["groupLabels"]["alertname"], b["status"]) for b in hook.received.bodies("/am")
            if status is None or b["status"] == status]


def test_alertmanager_groups_resolves_and_silences_trainmon_incidents(tmp_path):
    alerts = two_rank_run_alerts()
    firing = [a for a in alerts if a.state == "firing"]
    assert sorted(a.rule for a in firing) == ["non_finite", "rank_mismatch", "stalled"]
    resolved = {a.rule: a for a in alerts if a.state == "resolved"}
    assert list(resolved) == ["non_finite"]  # the next step is finite again
    with WebhookServer() as hook, Alertmanager(tmp_path, f"http://127.0.0.1:{hook.port}/am") as am:
        env = notify_env(tmp_path / "notify", alertmanager_url=am.url,
                         dashboard_url="http://grafana:3000/d/trainmon-run")
        broker = broker_with(firing)
        deliver(broker, env)
        wait_until(lambda: len(notifications(hook)) >= 3, 30, "a notification per group",
                   details=lambda: str(notifications(hook)))
        assert sorted(notifications(hook)) == [("non_finite", "firing"), ("rank_mismatch", "firing"),
                                               ("stalled", "firing")]
        nan = next(b for b in hook.received.bodies("/am") if b["groupLabels"]["alertname"] == "non_finite")
        [posted] = nan["alerts"]
        assert posted["labels"] | {"incident": "-"} == {
            "alertname": "non_finite", "severity": "critical", "run_id": RUN, "host": "node0",
            "job": "trainmon", "incident": "-"}
        assert posted["annotations"]["step"] == "50" and posted["annotations"]["ranks"] == "1 rank: 0"
        assert posted["annotations"]["dashboard"] == "http://grafana:3000/d/trainmon-run?var-run_id=am-run"
        assert "non-finite" in posted["annotations"]["message"].lower() or "nan" in posted["annotations"]["message"].lower()

        broker_with([resolved["non_finite"]], broker)
        deliver(broker, env)
        wait_until(lambda: ("non_finite", "resolved") in notifications(hook), 30, "the NaN resolved",
                   details=lambda: str(notifications(hook)))

        # A silence on the run's stall, made through Alertmanager's API: the stall's next
        # change (it resolves) is not notified; the rank mismatch's, posted with it, is.
        now = datetime.now(timezone.utc)
        silence = am.api("silences", {
            "matchers": [{"name": "alertname", "value": "stalled", "isRegex": False},
                         {"name": "run_id", "value": RUN, "isRegex": False}],
            "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat(),
            "createdBy": "trainmon test", "comment": "known: rank 1 is being replaced"})["silenceID"]
        wait_until(lambda: any(silence in a["status"]["silencedBy"] for a in am.api("alerts")),
                   10, "the stall silenced at Alertmanager")
        later = datetime.now(timezone.utc)
        ends = [alert(RUN, rule, "run", state="resolved", ranks=[1], step=81, value=None, at=later,
                      message=f"resolved (run restarted): {rule}") for rule in ("stalled", "rank_mismatch")]
        broker_with(ends, broker)
        deliver(broker, env)
        wait_until(lambda: ("rank_mismatch", "resolved") in notifications(hook), 30, "the mismatch resolved",
                   details=lambda: str(notifications(hook)))
        # Both groups flush on the same group_interval: by the time the mismatch's
        # resolution came, the stall's would have too.
        assert notifications(hook).count(("stalled", "firing")) == 1
        assert ("stalled", "resolved") not in notifications(hook)
        # ... and Alertmanager took the resolution: the stall is no longer firing there.
        assert all(a["labels"]["alertname"] != "stalled" or a["endsAt"] <= datetime.now(timezone.utc).isoformat()
                   for a in am.api("alerts"))
        assert sorted(notifications(hook, "firing")) == [("non_finite", "firing"), ("rank_mismatch", "firing"),
                                                         ("stalled", "firing")]
