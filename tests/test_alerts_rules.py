"""Every rule on the real broker: a synthetic run with the anomaly fires it at the right
step, the same run without the anomaly stays silent (no alert of any rule).

All runs go through one broker round trip: they are produced together, the alert service
runs once over them until idle, and each test reads its run's alerts from the alert topic.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pytest
from kafka import KafkaProducer

from trainmon import topics
from trainmon.consumers.alerts.config import Rules
from trainmon.consumers.alerts.engine import RULE_CLASSES
from trainmon.producer import Producer, ProducerConfig

from .alerts_support import past_t0, run_until_idle, send, service_env, synthetic_run
from .conftest import read_records, read_topic

S = 50  # the step every anomaly starts at
GARBAGE = [b"not json at all", json.dumps({"run_id": "garbage", "rank": 0, "world_size": 1, "host": "h",
                                           "time": "2026-01-01T00:00:00Z", "event_id": "g1", "loss": 1.0,
                                           "epoch": 0, "step_tokens": 1, "duration_ms": 1, "norm": 1,
                                           "lr": 1}).encode()]  # no step
STEPS = 80

# Smaller windows than the defaults so a run of 80 steps can show them.
TEST_SETTINGS = dict(
    loss_plateau_window=20, loss_plateau_fire_after=3, loss_plateau_clear_after=3,
    lr_zero_after_step=20, gpu_underutilized_fire_after_s=10, straggler_fire_after=3,
    stalled_min_s=30, rank_mismatch_grace_s=10, wall_clock_slack_s=1,
)


def at(first: int, last: int | None = None, **changes) -> Callable:
    """A mutation setting ``changes`` (step=, gpu=, moe= dicts) on steps first..last."""
    last = first if last is None else last

    def mutate(s, r, step, gpu, moe):
        if first <= s <= last:
            step.update(changes.get("step", {}))
            gpu.update(changes.get("gpu", {}))
            moe.update(changes.get("moe", {}))
    return mutate


def on_rank(rank: int, mutate: Callable) -> Callable:
    return lambda s, r, *fields: mutate(s, r, *fields) if r == rank else None


def loss_rises_from(first: int):
    base = {}

    def mutate(s, r, step, gpu, moe):
        if s == first:
            base[r] = step["loss"]
        if s >= first:
            step["loss"] = base[r] + 0.003 * (s - first)
    return mutate


def loss_scale_halving_from(first: int):
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step["loss_scale"] = 65536.0 / 2 ** (s - first + 1)
    return mutate


def slower_from(first: int, factor: float):
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step["duration_ms"] *= factor
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


SCENARIOS = [
    Scenario("grad_spike", at(S, step={"norm": 8.0})),
    Scenario("non_finite", at(S, step={"loss": math.nan})),
    Scenario("exploding_grad", at(S, step={"norm": 150.0}), also={"grad_spike"}),
    Scenario("dead_gradients", at(S, S + 5, step={"norm": 0.0}), step=S + 2),
    Scenario("loss_spike", at(S, step={"loss": 4.0})),
    Scenario("loss_plateau", loss_rises_from(S), step=(S, S + 20 + 3)),
    Scenario("rank_mismatch", ranks=4, bad_run=dict(stop_rank_at={3: S}, end=False), alert_ranks=[3],
             also={"stalled"}),
    Scenario("straggler", on_rank(2, slower_from(S, 2.0)), ranks=4, step=S + 2, alert_ranks=[2],
             also={"throughput_drop"}),
    Scenario("iteration_time_spike", at(S, step={"duration_ms": 5000.0})),
    Scenario("throughput_drop", slower_from(S, 2.0), step=S + 4),
    Scenario("lr_zero", at(S, STEPS, step={"lr": 0.0}), step=S + 2),
    Scenario("loss_scale_collapse", loss_scale_halving_from(S), step=S + 15),
    Scenario("num_zeros", at(S, step={"num_zeros": 600_000})),
    Scenario("gpu_temperature", at(S, gpu={"temperature": 91})),
    Scenario("gpu_throttle", at(S, gpu={"throttle": "hw_slowdown,sw_thermal"})),
    Scenario("gpu_underutilized", at(S, STEPS, gpu={"gpu_util": 30}), step=S + 10),
    Scenario("gpu_memory_low", at(S, gpu={"dram_free": 100 << 20})),
    Scenario("moe_aux_loss", at(S, S + 5, moe={"aux_loss": 2.0}), step=S + 2),
    Scenario("moe_z_loss", at(S, S + 5, moe={"z_loss": 0.5}), step=S + 2),
    Scenario("moe_expert_utilization", at(S, S + 5, moe={"expert_utilization": 0.3}), step=S + 2),
    Scenario("moe_load_imbalance", at(S, S + 5, moe={"load_imbalance": 5.0}), step=S + 2),
    Scenario("stalled", bad_run=dict(steps=S + 1, end=False)),
]
BY_RULE = {s.rule: s for s in SCENARIOS}


def test_every_rule_has_a_scenario():
    assert set(BY_RULE) == set(RULE_CLASSES)


@pytest.fixture(scope="module")
def alerts_by_run(kafka_broker, tmp_path_factory):
    """Produce every scenario's anomalous and healthy run, run the service once over them."""
    bootstrap = kafka_broker.bootstrap
    prefix = f"t{uuid.uuid4().hex[:10]}."
    tmp = tmp_path_factory.mktemp("alert-rules")
    t0 = past_t0(900)
    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="alert-tests",
                                       spill_dir=tmp / "spill", linger_ms=5))
    try:
        for i, sc in enumerate(SCENARIOS):
            bad = dict(steps=STEPS, **sc.bad_run) if "steps" not in sc.bad_run else sc.bad_run
            send(producer, synthetic_run(f"{sc.rule}-bad", t0=t0, ranks=sc.ranks, seed=i,
                                         mutate=sc.mutate, **bad))
            send(producer, synthetic_run(f"{sc.rule}-ok", t0=t0, ranks=sc.ranks, steps=STEPS, seed=i))
    finally:
        producer.close()
    raw = KafkaProducer(bootstrap_servers=bootstrap)
    for bad in GARBAGE:
        raw.send(topics.topic_for("step", prefix), key=b"garbage/0", value=bad)
    raw.flush()
    raw.close()
    env = service_env(bootstrap, **TEST_SETTINGS)
    service = run_until_idle(env, prefix, tmp / "state", idle_s=2.0)
    assert service.stats["errors"] == 0
    alerts = read_records(bootstrap, prefix, "alert", expected=service.stats["alerts"], timeout=30)
    by_run: dict[str, list] = {}
    for a in alerts:
        by_run.setdefault(a.run_id, []).append(a)
    by_run["__deadletters__"] = [json.loads(m.value) for m in
                                 read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, prefix), len(GARBAGE))]
    return by_run


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_anomaly_fires_at_the_right_step(alerts_by_run, rule):
    sc = BY_RULE[rule]
    alerts = alerts_by_run.get(f"{rule}-bad", [])
    firing = [a for a in alerts if a.state == "firing"]
    assert {a.rule for a in firing} - sc.also == {rule}, [a.message for a in firing]
    mine = [a for a in firing if a.rule == rule]
    assert len(mine) == 1, [a.message for a in mine]
    alert = mine[0]
    if isinstance(sc.step, tuple):
        assert sc.step[0] <= alert.step <= sc.step[1], alert.message
    else:
        assert alert.step == sc.step, alert.message
    assert alert.run_id == f"{rule}-bad" and f"{rule}-bad" in alert.message
    assert alert.severity == getattr(Rules(), rule).severity
    if sc.alert_ranks is not None:
        assert alert.ranks == sc.alert_ranks, alert.message
    # One incident, one firing, at most one resolution, both with the same incident id.
    same = [a for a in alerts if a.incident_id == alert.incident_id]
    assert sorted(a.state for a in same) in (["firing"], ["firing", "resolved"])
    assert len({a.event_id for a in alerts}) == len(alerts)


def test_bad_input_is_dead_lettered_and_the_rules_carry_on(alerts_by_run):
    letters = alerts_by_run["__deadletters__"]
    assert len(letters) == len(GARBAGE)
    assert {d["consumer"] for d in letters} == {"trainmon-alerts"}
    assert any("not JSON" in d["error"] for d in letters)
    assert any("step" in d["error"] for d in letters)  # names the missing field


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_same_run_without_the_anomaly_stays_silent(alerts_by_run, rule):
    assert alerts_by_run.get(f"{rule}-ok", []) == []
