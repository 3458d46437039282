"""The pure engine (no Kafka): incident lifecycle (cooldown, rate limit, deterministic
ids), the NCCL RAS style rank summary, and robustness to odd but valid records."""

from __future__ import annotations

import time

from trainmon.consumers.alerts import AlertEngine, load_config
from trainmon.consumers.alerts.incidents import event_id

from .alerts_support import synthetic_run


def nan_steps(*steps):
    def mutate(s, r, step, gpu, moe):
        if s in steps:
            step["loss"] = float("nan")
    return mutate


def run_engine(engine, records):
    out = []
    for record in records:
        out.extend(engine.process(record))
    return out


def test_cooldown_holds_back_a_second_incident_of_the_same_kind():
    t0 = time.time() - 900
    records = synthetic_run("c", t0=t0, steps=40, mutate=nan_steps(10, 20, 35), end=False)
    cooled = run_engine(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "20"})), records)
    # One step per second. NaN at 10 fires and resolves at 11; the NaN at 20 comes 9 s
    # later, within the 20 s cooldown; the one at 35 comes 24 s later and fires again.
    assert [(a.state, a.step) for a in cooled] == [("firing", 10), ("resolved", 11),
                                                  ("firing", 35), ("resolved", 36)]
    assert [a.incident_id for a in cooled] == ["c/non_finite/run#1"] * 2 + ["c/non_finite/run#2"] * 2
    no_cooldown = run_engine(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0"})), records)
    assert [a.step for a in no_cooldown if a.state == "firing"] == [10, 20, 35]


def test_rate_limit_caps_new_incidents_per_run():
    env = {"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0", "TRAINMON_ALERT_RATE_LIMIT_PER_MINUTE": "2"}
    engine = AlertEngine(load_config(env=env))
    records = synthetic_run("rl", t0=time.time() - 900, steps=40, mutate=nan_steps(*range(0, 40, 2)), end=False)
    firing = [a for a in run_engine(engine, records) if a.state == "firing"]
    # 40 s of record time: two per rolling minute.
    assert len(firing) == 2
    assert engine.book.suppressed > 0


def test_ids_are_deterministic_and_event_ids_fit_the_schema():
    records = synthetic_run("a-very-long-run-id-" * 12, t0=1.7e9, steps=20, mutate=nan_steps(5), end=False)
    first = run_engine(AlertEngine(load_config(env={})), records)
    again = run_engine(AlertEngine(load_config(env={})), records)
    assert [a.event_id for a in first] == [a.event_id for a in again]
    assert first[0].event_id == event_id(first[0].incident_id, "firing")
    assert all(len(a.event_id) <= 128 for a in first)


def test_engine_never_fails_on_odd_but_valid_records():
    def odd(s, r, step, gpu, moe):
        step.update(loss=float("inf"), norm=float("-inf"), duration_ms=0.0, lr=-1.0, num_params=0,
                    loss_scale=0.0, total_steps=0)
        gpu.update(temp_slowdown=0, temperature=-40, throttle=",,,")
        moe.update(aux_loss=float("nan"), load_imbalance=1.0)
    engine = AlertEngine(load_config(env={}))
    run_engine(engine, synthetic_run("odd", t0=1.7e9, ranks=3, steps=30, mutate=odd))
    engine.tick(time.time())
    assert engine.runs == {}  # the run ended and was forgotten


def test_mismatch_message_reads_like_nccl_ras():
    engine = AlertEngine(load_config(env={}))
    t0 = 1.7e9
    records = synthetic_run("ras", t0=t0, ranks=16, steps=1235, first_step=1100,
                            stop_rank_at={3: 1233, 7: 1233}, end=False)
    run_engine(engine, records)
    assert engine.tick() == []  # record time alone: rank 3 and 7 are 1 s behind, grace 60 s
    (alert,) = engine.tick(now=t0 + 1236 + 65)  # a minute later on the wall clock, nothing new
    assert alert.rule == "rank_mismatch" and alert.ranks == [3, 7] and alert.step == 1233
    assert "14 ranks at step 1234, 2 ranks at step 1233 (ranks 3, 7)" in alert.message
    assert engine.tick(now=t0 + 1236 + 70) == []  # still open: not again


def test_mismatch_still_fires_when_the_lagging_rank_is_read_after_a_tick():
    """Rank 3's steps reach the engine only after the others' (another partition, read
    later) and after a tick: the step times it is behind must still be known then."""
    engine = AlertEngine(load_config(env={"TRAINMON_ALERT_RANK_MISMATCH_GRACE_S": "10"}))
    t0 = 1.7e9
    records = synthetic_run("late", t0=t0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False)
    rank3_steps = [r for r in records if r.rank == 3 and r.kind != "run"]
    assert run_engine(engine, [r for r in records if r not in rank3_steps]) == []
    assert engine.tick() == []  # 7 ranks, all at step 60
    run_engine(engine, rank3_steps)
    (alert,) = engine.tick()  # by record time: rank 3 silent since step 41, 20 s ago
    assert alert.rule == "rank_mismatch" and alert.ranks == [3] and alert.step == 40
