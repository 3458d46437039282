"""Rank iteration mismatch with the alert service running live on the real broker."""

from __future__ import annotations

import time

from .alerts_support import BackgroundService, send, service_env, synthetic_run, wait_for
from .conftest import read_records


def alerts_on_topic(bootstrap, prefix, expected, timeout):
    return read_records(bootstrap, prefix, "alert", expected, timeout=timeout)


def test_rank_that_stops_fires_one_mismatch_naming_it_and_resolves_when_it_catches_up(
        bootstrap, topic_prefix, make_producer, tmp_path):
    env = service_env(bootstrap, rank_mismatch_grace_s=10)
    producer = make_producer()
    # Record times from now on, one step per second: record time alone decides here.
    t0 = time.time()
    with BackgroundService(env, topic_prefix, tmp_path / "state") as bg:
        send(producer, synthetic_run("mm", t0=t0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False))
        # Waiting on the service's own count keeps this process from churning Kafka clients.
        wait_for(lambda: bg.service.stats["alerts"] >= 1, what="the mismatch alert", details=bg.describe)
        time.sleep(2)  # the service keeps ticking: it must not fire again
        # Rank 3 catches up: steps 41..60, later in record time than the others'.
        send(producer, synthetic_run("mm", t0=t0 + 20, ranks=8, steps=61, first_step=41, only_ranks={3},
                                     end=False))
        wait_for(lambda: bg.service.stats["alerts"] >= 2, what="the resolution", details=bg.describe)
        time.sleep(1)
    alerts = alerts_on_topic(bootstrap, topic_prefix, expected=2, timeout=30)
    assert [(a.rule, a.state) for a in alerts] == [("rank_mismatch", "firing"), ("rank_mismatch", "resolved")]
    firing, resolved = alerts
    assert firing.ranks == [3] and firing.step == 40
    # It fires as soon as the others' records prove rank 3 behind for 10 s, so where the
    # others are in that moment varies; rank 3 and its step do not.
    assert "1 rank at step 40 (rank 3)" in firing.message and "ranks at step" in firing.message
    assert firing.severity == "critical" and firing.threshold == 10
    assert firing.value > 10  # seconds behind
    assert resolved.incident_id == firing.incident_id and resolved.step == 60
    assert resolved.event_id != firing.event_id


def test_hang_one_step_behind_is_caught_on_the_wall_clock(bootstrap, topic_prefix, make_producer, tmp_path):
    """All ranks stop (the others wait in an all-reduce for rank 5): no record arrives any
    more, so only the wall clock can tell that rank 5 never reported step 30."""
    env = service_env(bootstrap, rank_mismatch_grace_s=3, wall_clock_slack_s=2)
    producer = make_producer()
    steps = 31
    t0 = time.time() - steps  # the run's last records are from about now
    with BackgroundService(env, topic_prefix, tmp_path / "state") as bg:
        send(producer, synthetic_run("hang", t0=t0, ranks=8, steps=steps, stop_rank_at={5: 29}, end=False))
        wait_for(lambda: bg.service.stats["alerts"] >= 1, what="the mismatch alert", details=bg.describe)
    alerts = alerts_on_topic(bootstrap, topic_prefix, expected=1, timeout=30)
    assert [(a.rule, a.state, a.ranks, a.step) for a in alerts] == [("rank_mismatch", "firing", [5], 29)]
    assert "7 ranks at step 30, 1 rank at step 29 (rank 5)" in alerts[0].message
