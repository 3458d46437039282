"""Every rule with logic of its own (the modules of rules/), in memory: a synthetic run with
the anomaly fires it at the right step, and its healthy twin (the same run without the
anomaly) fires nothing at all. The threshold rules (thresholds.py) have their cases in
test_alerts_thresholds.py; the Kafka path end to end is test_alerts_kafka.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest

from trainmon.consumers.alerts.config import Rules
from trainmon.consumers.alerts.engine import RULE_CLASSES
from trainmon.consumers.alerts.thresholds import BY_NAME as THRESHOLD_RULES

from .alerts_support import engine_with, firing, run_engine, synthetic_run

S = 50  # the step every anomaly starts at
STEPS = 80
T0 = 1.7e9
SILENCE_S = 400.0  # the wall clock this long after each run's last record: a silent job

# Smaller windows than the defaults so a run of 80 steps can show them.
TEST_SETTINGS = dict(
    loss_plateau_window=20, loss_plateau_fire_after=3, loss_plateau_clear_after=3,
    lr_zero_after_step=20, straggler_fire_after=3, stalled_min_s=30, rank_mismatch_grace_s=10,
    wall_clock_slack_s=1, loss_scale_collapse_warmup_steps=10, loss_jump_after_step=10, skipped_iterations_warmup_steps=10,
    throughput_drop_fire_after_s=5, eval_loss_spike_window=3, ecc_corrected_rising_min_span_s=10,
)


def at(first: int, last: int | None = None, **changes) -> Callable:
    """A mutation setting ``changes`` (step=, gpu=, moe=, health=, disk= dicts) on steps
    first..last (health / disk: the gpu_health and disk records, see ``health_every``)."""
    last = first if last is None else last

    def mutate(s, r, step, gpu, moe):
        if first <= s <= last:
            step.update(changes.get("step", {}))
            gpu.update(changes.get("gpu", {}))
            moe.update(changes.get("moe", {}))
            for part in ("health", "disk", "checkpoint"):
                if part in changes:
                    gpu[part] = None if changes[part] is None else {**gpu[part], **changes[part]}
            gpu["log_events"] += changes.get("log_events", [])
    return mutate


def on_rank(rank: int, mutate: Callable) -> Callable:
    return lambda s, r, *fields: mutate(s, r, *fields) if r == rank else None


def loss_rises_from(first: int, per_step: float = 0.003):
    base = {}

    def mutate(s, r, step, gpu, moe):
        if s == first:
            base[r] = step["loss"]
        if s >= first:
            step["loss"] = base[r] + per_step * (s - first)
    return mutate


def loss_scale_halving_from(first: int, times: int = 3):
    """Overflows on ``times`` steps in a row from ``first``: the scale halves each time."""
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step["loss_scale"] = 65536.0 / 2 ** min(s - first + 1, times)
    return mutate


def ecc_corrected_growing_from(first: int, per_step: int):
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            gpu["health"]["ecc_volatile_corrected"] = per_step * (s - first)
    return mutate


NCCL_BURST = [dict(level="warning", source="nccl", count=16, first_step=S, last_step=S,
                   signature="NCCL WARN NET/IB : Got completion from peer # with status=# opcode=#",
                   text="NCCL WARN NET/IB : Got completion from peer 10.0.0.7<49152> with status=12 "
                        "opcode=0 len=0 vendor err 129 (Recv)")]


def slower_from(first: int, factor: float):
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step["duration_ms"] *= factor
    return mutate


def overfitting_from(first: int):
    """Evals every 5 steps; from ``first`` the eval loss climbs while the train loss falls."""
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step["eval_loss"] = 2.4 + 0.02 * (s - first)
    return mutate


@dataclass
class Scenario:
    rule: str
    mutate: Callable | None = None
    step: int | tuple[int, int] = S  # where it must fire (inclusive range for trend rules)
    ranks: int = 1
    also: set[str] = field(default_factory=set)  # rules the same anomaly legitimately trips
    bad_run: dict = field(default_factory=dict)  # synthetic_run arguments of the anomalous run
    alert_ranks: list[int] | None = None
    severity: str | None = None  # when not the rule's default


SCENARIOS = [
    Scenario("non_finite", at(S, step={"loss": math.nan})),
    Scenario("grad_spike", at(S, step={"norm": 8.0})),
    Scenario("exploding_grad", lambda s, r, step, gpu, moe: step.update(norm=150.0 + s) if S <= s <= S + 5
             else None, step=S + 2, also={"grad_spike"}),
    Scenario("grad_norm_beyond_clip", at(S, step={"norm": 150.0}), bad_run=dict(first_step=S)),
    Scenario("frozen_grad_norm", at(S, STEPS, step={"norm": 1.2345}), step=S + 4),
    Scenario("loss_spike", at(S, S + 3, step={"loss": 3.5}), step=S + 1),
    Scenario("loss_jump", at(S, S + 3, step={"loss": 5.0}), also={"loss_spike"}),
    Scenario("loss_divergence", loss_rises_from(S, 0.015), step=(S + 15, S + 25), also={"loss_plateau"}),
    Scenario("loss_plateau", loss_rises_from(S), step=(S, S + 20 + 3)),
    Scenario("frozen_loss", at(S, STEPS, step={"loss": 2.3}), step=S + 7, also={"loss_plateau"}),
    Scenario("eval_loss_spike", at(S, S + 2, step={"eval_loss": 4.0}), bad_run=dict(eval_every=5)),
    Scenario("eval_divergence", overfitting_from(S), step=(S + 5, S + 15), bad_run=dict(eval_every=5),
             also={"eval_loss_spike"}),
    Scenario("train_loss_above_eval", at(S, S + 3, step={"loss": 7.0}), step=S + 1,
             bad_run=dict(eval_every=5), also={"loss_spike", "loss_jump"}),
    Scenario("loss_scale_collapse", loss_scale_halving_from(S), step=S + 2),
    Scenario("skipped_iterations", at(S, S + 5, step={"skipped": 1}), step=S + 2),
    Scenario("lr_zero", at(S, STEPS, step={"lr": 0.0}), step=S + 2),
    Scenario("iteration_time_spike", at(S, S + 5, step={"duration_ms": 5000.0}), step=S + 2,
             also={"throughput_drop"}),
    Scenario("throughput_drop", slower_from(S, 2.0), step=S + 5),
    Scenario("straggler", on_rank(2, slower_from(S, 2.0)), ranks=4, step=S + 2, alert_ranks=[2],
             also={"throughput_drop"}),
    Scenario("rank_mismatch", ranks=4, bad_run=dict(stop_rank_at={3: S}, end=False), alert_ranks=[3],
             also={"stalled"}),
    Scenario("stalled", step=S, bad_run=dict(steps=S + 1, end=False)),
    Scenario("run_failed", step=STEPS - 1,
             bad_run=dict(end_status="failed", end_reason="CUDA out of memory. Tried to allocate 2 GiB")),
    Scenario("gpu_temperature", at(S, gpu={"temperature": 91})),
    Scenario("gpu_throttle", at(S, gpu={"throttle": "hw_slowdown,sw_thermal"})),
    Scenario("moe_aux_loss", at(S, S + 5, moe={"aux_loss": 2.0}), step=S + 2),
    Scenario("moe_z_loss", at(S, S + 5, moe={"z_loss": 0.5}), step=S + 2),
    Scenario("ecc_corrected_rising", ecc_corrected_growing_from(S, 50), step=S + 5,
             bad_run=dict(health_every=5)),
    Scenario("checkpoint_overdue", at(S, STEPS, checkpoint=None), step=S + 11,
             bad_run=dict(checkpoint_every=10)),
    Scenario("checkpoint_slow", at(S, checkpoint={"duration_ms": 200_000.0}), bad_run=dict(checkpoint_every=10)),
    Scenario("checkpoint_disk_filling", at(S, STEPS, disk={"free_bytes": 100 << 30}),
             bad_run=dict(checkpoint_every=10, health_every=5)),
    Scenario("nccl_warning_burst", at(S, log_events=NCCL_BURST), bad_run=dict(log_events=True)),
]
# The run's shape (which record kinds it has) is the healthy twin's too: only the anomaly differs.
SHAPE = ("eval_every", "health_every", "checkpoint_every", "log_events")
BY_RULE = {s.rule: s for s in SCENARIOS}


def test_every_rule_with_logic_has_a_scenario():
    assert set(BY_RULE) == set(RULE_CLASSES) - set(THRESHOLD_RULES)


def alerts_of(sc: Scenario, bad: bool, seed: int) -> list:
    kwargs = dict(sc.bad_run) if bad else {k: v for k, v in sc.bad_run.items() if k in SHAPE}
    kwargs.setdefault("steps", STEPS)
    records = synthetic_run(f"{sc.rule}-{'bad' if bad else 'ok'}", t0=T0, ranks=sc.ranks, seed=seed,
                            mutate=sc.mutate if bad else None, **kwargs)
    return run_engine(engine_with(**TEST_SETTINGS), records, tick_after_s=SILENCE_S)


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_anomaly_fires_at_the_right_step(rule):
    sc = BY_RULE[rule]
    alerts = alerts_of(sc, True, seed=list(BY_RULE).index(rule))
    fired = firing(alerts)
    assert {a.rule for a in fired} - sc.also == {rule}, [a.message for a in fired]
    mine = [a for a in fired if a.rule == rule]
    assert len(mine) == 1, [a.message for a in mine]
    alert = mine[0]
    if isinstance(sc.step, tuple):
        assert sc.step[0] <= alert.step <= sc.step[1], alert.message
    else:
        assert alert.step == sc.step, alert.message
    assert alert.run_id == f"{rule}-bad" and f"{rule}-bad" in alert.message
    assert alert.severity == (sc.severity or getattr(Rules(), rule).severity)
    if sc.alert_ranks is not None:
        assert alert.ranks == sc.alert_ranks, alert.message
    # One incident, one firing, at most one resolution, both with the same incident id.
    same = [a for a in alerts if a.incident_id == alert.incident_id]
    assert sorted(a.state for a in same) in (["firing"], ["firing", "resolved"])
    assert len({a.event_id for a in alerts}) == len(alerts)


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_same_run_without_the_anomaly_stays_silent(rule):
    sc = BY_RULE[rule]
    assert alerts_of(sc, False, seed=list(BY_RULE).index(rule)) == []


def test_checkpoint_overdue_waits_for_the_checkpoint_topic_to_be_read():
    """The service ticks only once every partition is read, so steps read ahead of a save
    still unread on the checkpoint topic are no missing save; a tick after it is read
    judges the save as made, and a tick with the save truly missing fires."""
    records = synthetic_run("ckpt-order", t0=T0, steps=STEPS, checkpoint_every=10, end=False)
    saves = [r for r in records if r.kind == "checkpoint"]
    others = [r for r in records if r.kind != "checkpoint"]
    engine = engine_with(**TEST_SETTINGS)
    for r in saves[:4]:  # steps 10, 20, 30, 40: a cadence of 10
        engine.process(r)
    late = [r for r in others if r.kind != "step" or r.step <= 70]
    out = [a for r in late for a in engine.process(r)]  # the step topic read up to step 70 ...
    out += [a for r in saves[4:] for a in engine.process(r)]  # ... the saves at 50-70 after it
    out += engine.tick()
    assert firing(out) == []
    missing = engine_with(**TEST_SETTINGS)
    for r in saves[:4] + late:
        missing.process(r)
    (alert,) = firing(missing.tick())
    assert alert.rule == "checkpoint_overdue" and alert.step == 70, alert.message
    assert "since the save at step 40: 30 steps" in alert.message
