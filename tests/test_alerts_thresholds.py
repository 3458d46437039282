"""The threshold rules (rules as data, thresholds.py), in memory: one case per rule, a run
where the value crosses the threshold and its healthy twin. Adding a threshold rule adds
its entry in ``THRESHOLD_RULES`` and one case here."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmon.consumers.alerts.config import Rules
from trainmon.consumers.alerts.thresholds import BY_NAME, THRESHOLD_RULES, markdown_table

from .alerts_support import engine_with, firing, run_engine, synthetic_run

S = 30
T0 = 1.7e9

# rule -> (the changes from step S on: step=, gpu=, moe= dicts, the step it fires at)
CASES = {
    "dead_gradients": (dict(step={"norm": 0.0}), S + 2),
    "zero_loss": (dict(step={"loss": 0.0}), S),
    "nan_iterations": (dict(step={"nan_iterations": 2, "skipped": 0}), S),
    "num_zeros": (dict(step={"num_zeros": 600_000}), S),
    "gpu_underutilized": (dict(gpu={"gpu_util": 30}), S + 60),  # 3 records and 60 s
    "gpu_memory_low": (dict(gpu={"dram_free": 100 << 20}), S),
    "moe_expert_utilization": (dict(moe={"expert_utilization": 0.3}), S + 2),
    "moe_load_imbalance": (dict(moe={"load_imbalance": 5.0}), S + 2),
    "ecc_uncorrected": (dict(health={"ecc_volatile_uncorrected": 2}), S),
    "remapped_rows_failed": (dict(health={"remapped_rows_failed": True}), S),
    "xid_critical": (dict(health={"xids": [79]}), S),
    "checkpoint_disk_low": (dict(disk={"free_bytes": 20 << 30}), S),
    "producer_dropped_records": (dict(producer={"dropped": 120}), S),
    "producer_spill_refused": (dict(producer={"held_in_memory": 3000, "spill_errors": 1,
                                              "spill_error": "OSError: [Errno 28] No space left on device"}), S),
    "producer_not_sending": (dict(producer={"last_sent_age_s": 420.0, "spilled": 5000}), S),
}


def test_every_threshold_rule_has_a_case():
    assert set(CASES) == set(BY_NAME)


def changes_from(first: int, changes: dict):
    def mutate(s, r, step, gpu, moe):
        if s >= first:
            step.update(changes.get("step", {}))
            gpu.update(changes.get("gpu", {}))
            moe.update(changes.get("moe", {}))
            gpu["health"].update(changes.get("health", {}))
            gpu["disk"].update(changes.get("disk", {}))
            gpu["producer"].update(changes.get("producer", {}))
    return mutate


@pytest.mark.parametrize("rule", list(CASES))
def test_threshold_rule_fires_where_the_value_crosses_and_its_twin_is_silent(rule):
    changes, at_step = CASES[rule]
    bad = synthetic_run(f"{rule}-bad", t0=T0, steps=S + 70, mutate=changes_from(S, changes), end=False,
                        health_every=1)
    alerts = run_engine(engine_with(), bad)
    fired = firing(alerts)
    assert [a.rule for a in fired] == [rule], [a.message for a in fired]
    (alert,) = fired
    spec = BY_NAME[rule]
    assert alert.step == at_step and alert.severity == spec.severity
    assert f"{rule}-bad" in alert.message and spec.what in alert.message
    if spec.per_gpu:
        assert alert.incident_id.endswith("/rank0/gpu0#1")
    ok = synthetic_run(f"{rule}-ok", t0=T0, steps=S + 70, end=False, health_every=1)
    assert run_engine(engine_with(), ok) == []


def test_a_threshold_rule_is_configured_like_any_other():
    engine = engine_with(gpu_memory_low_min_free_bytes=200 << 20, dead_gradients_fire_after=1,
                         zero_loss_severity="warning")
    cfg = engine.config.rules
    assert cfg.gpu_memory_low.min_free_bytes == 200 << 20 and cfg.dead_gradients.fire_after == 1
    records = synthetic_run("cfg", t0=T0, steps=S + 5, end=False,
                            mutate=changes_from(S, dict(gpu={"dram_free": 150 << 20}, step={"loss": 0.0})))
    fired = firing(run_engine(engine, records))
    assert sorted((a.rule, a.severity) for a in fired) == [("gpu_memory_low", "warning"),
                                                           ("zero_loss", "warning")]
    assert "150 MiB below 200 MiB" in next(a.message for a in fired if a.rule == "gpu_memory_low")


def test_docs_show_the_threshold_table_as_generated():
    """docs/alerts.md holds the table ``python -m trainmon.consumers.alerts`` prints."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "alerts.md").read_text()
    assert markdown_table() in doc, "regenerate it: python -m trainmon.consumers.alerts"
    for spec in THRESHOLD_RULES:
        assert getattr(Rules(), spec.name).severity == spec.severity


def test_an_xid_alert_names_the_gpu_host_rank_and_the_codes():
    bad = synthetic_run("xid", t0=T0, steps=S + 5, end=False, health_every=1,
                        mutate=changes_from(S, dict(health={"xids": [79, 48]})))
    (alert,) = firing(run_engine(engine_with(), bad))
    assert alert.rule == "xid_critical" and alert.severity == "critical"
    assert "GPU 0 of rank 0 on node0" in alert.message and "xids [79, 48]" in alert.message


def test_dropped_records_fire_while_the_count_grows_and_resolve_once_it_stops():
    """producer_health ``dropped`` counts from the producer's start: once a rank had lost
    records, ``dropped > 0`` held for the rest of the run and the incident never resolved.
    Judged is its growth: it fires when records are lost, resolves at the next health
    record that lost none; a record read again changes nothing; a producer started again
    (its count lower) counts from 0."""
    counts = {S: 120, S + 1: 120, S + 2: 120, S + 40: 150, S + 41: 150, S + 60: 10, S + 61: 10}

    def mutate(s, r, step, gpu, moe):
        gpu["producer"]["dropped"] = next((n for at, n in sorted(counts.items(), reverse=True) if s >= at), 0)

    records = synthetic_run("dropped", t0=T0, steps=S + 70, mutate=mutate, end=False, health_every=1)
    health = [r for r in records if r.kind == "producer_health"]
    again = health[S + 1]  # delivered twice: right after itself, and long after
    records = records[:records.index(again) + 1] + [again] + records[records.index(again) + 1:] + [again]
    engine = engine_with(producer_dropped_records_cooldown_s=0)
    events = [(a.state, a.step) for a in run_engine(engine, records) if a.rule == "producer_dropped_records"]
    assert events == [("firing", S), ("resolved", S + 1), ("firing", S + 40), ("resolved", S + 41),
                      ("firing", S + 60), ("resolved", S + 61)]
