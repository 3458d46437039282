"""The alert service end to end on the real broker, for a few rules that cover every input
topic (step, eval, moe, gpu, gpu_health, disk, checkpoint, log_event, run) and both clocks (record time, the wall clock of a silent
run): the anomalous run fires its rule at the right step, its healthy twin nothing. The
rules' logic is tested in memory (test_alerts_rules.py, test_alerts_thresholds.py).

All runs go through one broker round trip: they are produced together, the alert service
runs once over them until idle, and each test reads its run's alerts from the alert topic.
"""

from __future__ import annotations

import json
import math
import uuid

import pytest

from trainmon import topics
from trainmon.consumers.alerts.config import Rules
from trainmon.producer import Producer, ProducerConfig

from .alerts_support import failed_run_alerts, past_t0, run_until_idle, send, service_env, synthetic_run
from .conftest import read_records, read_topic, send_raw
from .test_alerts_rules import NCCL_BURST, SHAPE, TEST_SETTINGS, Scenario, at

S = 50
STEPS = 80
GARBAGE = [b"not json at all", json.dumps({"run_id": "garbage", "rank": 0, "world_size": 1, "host": "h",
                                           "time": "2026-01-01T00:00:00Z", "event_id": "g1", "loss": 1.0,
                                           "epoch": 0, "step_tokens": 1, "duration_ms": 1, "norm": 1,
                                           "lr": 1}).encode()]  # no step

SCENARIOS = [
    Scenario("non_finite", at(S, step={"loss": math.nan})),  # step topic
    Scenario("eval_loss_spike", at(S, S + 2, step={"eval_loss": 4.0}), bad_run=dict(eval_every=5)),  # eval
    Scenario("moe_aux_loss", at(S, S + 5, moe={"aux_loss": 2.0}), step=S + 2),  # moe
    Scenario("gpu_memory_low", at(S, gpu={"dram_free": 100 << 20})),  # gpu, a threshold rule
    Scenario("xid_critical", at(S, health={"xids": [79]}), bad_run=dict(health_every=5)),  # gpu_health
    Scenario("checkpoint_disk_low", at(S, STEPS, disk={"free_bytes": 20 << 30}),
             bad_run=dict(health_every=5)),  # disk
    Scenario("checkpoint_slow", at(S, checkpoint={"duration_ms": 200_000.0}),
             bad_run=dict(checkpoint_every=10)),  # checkpoint
    Scenario("nccl_warning_burst", at(S, log_events=NCCL_BURST), bad_run=dict(log_events=True)),  # log_event
    Scenario("run_failed", step=STEPS - 1,  # run topic
             bad_run=dict(end_status="failed", end_reason="NCCL watchdog timeout: ALLREDUCE ran for 600034 ms")),
    Scenario("rank_mismatch", ranks=4, bad_run=dict(stop_rank_at={3: S}, end=False), alert_ranks=[3],
             also={"stalled"}),  # the wall clock of a silent run
    Scenario("stalled", bad_run=dict(steps=S + 1, end=False)),
]
BY_RULE = {s.rule: s for s in SCENARIOS}


@pytest.fixture(scope="module")
def alerts_by_run(kafka_broker, tmp_path_factory):
    """Produce every scenario's anomalous and healthy run, run the service once over them."""
    bootstrap = kafka_broker.bootstrap
    prefix = f"t{uuid.uuid4().hex[:10]}."
    tmp = tmp_path_factory.mktemp("alert-kafka")
    t0 = past_t0(900)
    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="alert-tests",
                                       spill_dir=tmp / "spill", linger_ms=5))
    try:
        for i, sc in enumerate(SCENARIOS):
            bad = dict(sc.bad_run)
            bad.setdefault("steps", STEPS)
            send(producer, synthetic_run(f"{sc.rule}-bad", t0=t0, ranks=sc.ranks, seed=i,
                                         mutate=sc.mutate, **bad))
            shape = {k: v for k, v in sc.bad_run.items() if k in SHAPE}
            send(producer, synthetic_run(f"{sc.rule}-ok", t0=t0, ranks=sc.ranks, steps=STEPS, seed=i,
                                         **shape))
    finally:
        producer.close()
    send_raw(bootstrap, [(topics.topic_for("step", prefix), b"garbage/0", bad, None) for bad in GARBAGE])
    env = service_env(bootstrap, **TEST_SETTINGS)
    service = run_until_idle(env, prefix, tmp / "state", idle_s=2.0)
    assert service.stats["errors"] == 0
    alerts = read_records(bootstrap, prefix, "alert", expected=service.stats["alerts"], timeout=30)
    by_run: dict[str, list] = {}
    for a in alerts:
        by_run.setdefault(a.run_id, []).append(a)
    by_run["__deadletters__"] = [json.loads(m.value) for m in
                                 read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, prefix), len(GARBAGE))]
    by_run["__metrics__"] = service.context.metrics.registry  # what its endpoint served
    return by_run


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_anomaly_fires_at_the_right_step(alerts_by_run, rule):
    sc = BY_RULE[rule]
    alerts = alerts_by_run.get(f"{rule}-bad", [])
    firing = [a for a in alerts if a.state == "firing"]
    assert {a.rule for a in firing} - sc.also == {rule}, [a.message for a in firing]
    (alert,) = [a for a in firing if a.rule == rule]
    assert alert.step == sc.step, alert.message
    assert alert.run_id == f"{rule}-bad" and f"{rule}-bad" in alert.message
    assert alert.severity == getattr(Rules(), rule).severity
    if sc.alert_ranks is not None:
        assert alert.ranks == sc.alert_ranks, alert.message
    same = [a for a in alerts if a.incident_id == alert.incident_id]
    assert sorted(a.state for a in same) in (["firing"], ["firing", "resolved"])
    assert len({a.event_id for a in alerts}) == len(alerts)


def test_bad_input_is_dead_lettered_and_the_rules_carry_on(alerts_by_run):
    letters = alerts_by_run["__deadletters__"]
    assert len(letters) == len(GARBAGE)
    prefix = letters[0]["topic"].rsplit(".", 1)[0] + "."
    assert {d["consumer"] for d in letters} == {f"{prefix}alerts"}  # the service's group
    assert any("not JSON" in d["error"] for d in letters)
    assert any("step" in d["error"] for d in letters)  # names the missing field


def test_its_metrics_count_the_alerts_per_rule_and_the_dead_letters(alerts_by_run):
    registry = alerts_by_run["__metrics__"]
    published: dict[tuple[str, str], int] = {}
    for run_id, alerts in alerts_by_run.items():
        for a in alerts if not run_id.startswith("__") else []:
            published[(a.rule, a.state)] = published.get((a.rule, a.state), 0) + 1
    assert len(published) >= len(BY_RULE)
    for (rule, state), n in published.items():
        assert registry.get_sample_value("trainmon_alerts_total", {"rule": rule, "state": state}) == n
    assert registry.get_sample_value("trainmon_records_dead_lettered_total", {"kind": "step"}) == len(GARBAGE)
    assert registry.get_sample_value("trainmon_alert_engine_errors_total") == 0


@pytest.mark.parametrize("rule", list(BY_RULE))
def test_same_run_without_the_anomaly_stays_silent(alerts_by_run, rule):
    assert alerts_by_run.get(f"{rule}-ok", []) == []


def test_publishing_a_failed_run_of_thousands_of_ranks_does_not_fail_forever(bootstrap, topic_prefix):
    """The consequence on a real broker: AlertPublisher.publish raises RetriableError on
    every call for that alert, so the service's flush is retried without end: no alert of
    any run is published again (nor the input committed) until the engine is reset."""
    from trainmon import topics
    from trainmon.consumers.alerts.alert_topic import AlertPublisher
    from trainmon.consumers.runtime import RetriableError

    alerts = failed_run_alerts(8192)
    publisher = AlertPublisher(topics.topic_for("alert", topic_prefix), {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    try:
        errors = []
        for _ in range(3):  # (the runtime retries the flush like this, with backoff, forever)
            try:
                publisher.publish(alerts)
                break
            except RetriableError as exc:
                errors.append(str(exc))
        else:
            raise AssertionError(f"never published: {errors[-1]}")
    finally:
        publisher.close()


def test_an_alert_is_on_its_topic_before_the_rest_of_its_batch_is_flushed(bootstrap, topic_prefix, tmp_path):
    """A rule's finding goes out as the record is judged, not at the batch's flush: at
    16,384 ranks a poll's 10,000 records take the engine 1-2 s, which a page would wait."""
    from datetime import datetime, timedelta, timezone

    from trainmon.consumers.alerts.alert_topic import AlertLog, AlertPublisher
    from trainmon.consumers.stream import Message
    from trainmon.schemas import StepRecord

    from .alerts_support import make_service, wait_for

    env = service_env(bootstrap)
    service = make_service(env, topic_prefix, tmp_path)
    service._publisher = AlertPublisher(service.alert_topic, env)  # (what run() opens)
    t0 = datetime(2026, 11, 27, 12, tzinfo=timezone.utc)
    topic = topics.topic_for("step", topic_prefix)
    messages = [Message("step", topic, 0, step, b"r", b"", StepRecord(
        run_id="early", rank=0, world_size=1, host="n0", event_id=f"early-{step}",
        time=t0 + timedelta(seconds=step), step=step,
        loss=math.nan if step == 5 else 2.0 - 0.002 * step, norm=1.0 + 0.01 * (step % 7), lr=1e-4,
        duration_ms=1000.0 + step % 3)) for step in range(50)]
    alert_log = AlertLog(service.alert_topic, env)
    try:
        service.put(messages)  # judged; no flush yet
        found: list = []
        wait_for(lambda: found.extend(alert_log.read()[0]) or bool(found), timeout=30,
                 what="the NaN's alert on the alert topic before any flush")
        assert [(a.rule, a.state, a.step) for a in found] == [("non_finite", "firing", 5),
                                                               ("non_finite", "resolved", 6)]
        service._publisher.publish(service._unpublished)  # (the flush): acknowledged, not sent again
        again = alert_log.read()[0]
        assert [a.event_id for a in again] == [a.event_id for a in found]
    finally:
        alert_log.close()
        service._publisher.close()
