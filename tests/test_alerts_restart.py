"""Restarting the alert service mid-run: no alert twice, open incidents still resolve.

Phase 1 of a 4-rank run has a NaN loss at step 10 (fires and resolves), a throttled GPU
from step 30 and rank 3 stuck at step 35 (both still open when the service stops). Phase
2 continues the run: the GPU recovers at step 46 and rank 3 catches up. Whatever the
restart finds (its checkpoint, no checkpoint, an older checkpoint, or a new consumer group
re-reading everything), the alert topic ends up with each incident exactly once fired
and once resolved.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter

import pytest

from trainmon.consumers.alerts import checkpoint

from .alerts_support import make_service, run_until_idle, send, service_env, synthetic_run
from .conftest import read_records

RUN = "restart"


def anomalies(s, r, step, gpu, moe):
    if s == 10:
        step["loss"] = float("nan")
    if r == 1 and 30 <= s <= 45:
        gpu["throttle"] = "hw_slowdown"


def part(t0, first, last, ranks=(0, 1, 2, 3), **kw):
    return synthetic_run(RUN, t0=t0, ranks=4, steps=last + 1, first_step=first, only_ranks=set(ranks),
                         mutate=anomalies, end=False, **kw)


@pytest.mark.parametrize("restart", ["checkpoint", "no_checkpoint", "stale_checkpoint", "new_group"])
def test_restart_mid_run(bootstrap, topic_prefix, make_producer, tmp_path, restart):
    env = service_env(bootstrap, rank_mismatch_grace_s=2, wall_clock_slack_s=0.5)
    state = tmp_path / "state"
    producer = make_producer()
    t0 = time.time() - 81  # the run ends about now: no stall, and record time decides the rest

    send(producer, part(t0, 0, 19))
    first = run_until_idle(env, topic_prefix, state)
    path = first.path
    saved = tmp_path / "early-checkpoint.json"
    shutil.copy(path, saved)
    send(producer, part(t0, 20, 39, ranks=(0, 1, 2)) + part(t0, 20, 35, ranks=(3,)))
    second = run_until_idle(env, topic_prefix, state)
    published = second.stats["alerts"] + first.stats["alerts"]
    before = read_records(bootstrap, topic_prefix, "alert", published)
    assert sorted((a.rule, a.state) for a in before) == [
        ("gpu_throttle", "firing"), ("non_finite", "firing"), ("non_finite", "resolved"),
        ("rank_mismatch", "firing")]

    if restart == "no_checkpoint":
        path.unlink()
    elif restart == "stale_checkpoint":
        shutil.copy(saved, path)  # as if it crashed after committing phase 1b but before checkpointing it
    elif restart == "new_group":
        env = {**env, "TRAINMON_ALERT_GROUP_ID": "another-alerts-group"}

    send(producer, part(t0, 40, 79, ranks=(0, 1, 2)) + part(t0, 36, 79, ranks=(3,)))
    third = run_until_idle(env, topic_prefix, state)
    if restart == "stale_checkpoint":
        assert third.stats["warmup"] > 0  # phase 1b was replayed to rebuild the windows
    alerts = read_records(bootstrap, topic_prefix, "alert", published + third.stats["alerts"])

    assert len({a.event_id for a in alerts}) == len(alerts), "an alert was published twice"
    per_incident = Counter((a.incident_id, a.state) for a in alerts)
    assert set(per_incident.values()) == {1}
    assert sorted((a.rule, a.state) for a in alerts) == [
        ("gpu_throttle", "firing"), ("gpu_throttle", "resolved"),
        ("non_finite", "firing"), ("non_finite", "resolved"),
        ("rank_mismatch", "firing"), ("rank_mismatch", "resolved")]
    resolved = {a.rule: a for a in alerts if a.state == "resolved"}
    assert resolved["gpu_throttle"].step == 48  # healthy from 46, clear_after 3
    assert resolved["rank_mismatch"].step == 79
    assert "healthy again" in resolved["gpu_throttle"].message


def test_checkpoint_round_trips_the_engine(bootstrap, topic_prefix, make_producer, tmp_path):
    env = service_env(bootstrap)
    send(make_producer(), part(time.time() - 81, 0, 39))
    service = run_until_idle(env, topic_prefix, tmp_path / "state")
    saved = checkpoint.load(service.path)
    assert saved is not None and saved.offsets
    again = make_service(env, topic_prefix, tmp_path / "state")
    again.engine.load(saved.engine)
    assert again.engine.dump() == service.engine.dump()
    assert [a.rule for a in again.engine.book.open_incidents()] == ["gpu_throttle"]


def test_unreadable_checkpoint_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    assert checkpoint.load(path) is None
    assert "rebuilding from the topics" in caplog.text
