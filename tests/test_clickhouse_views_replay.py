"""The views return hand-computed numbers for a small run, and a replay from the topics
into a fresh directory equals the live tables."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from trainmon.schemas import RECORD_TYPES, AlertRecord, EvalRecord, RunRecord, StepRecord

from .clickhouse_service import ClickHouseService, run_trainmon
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)

T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
DURATIONS = {0: [100.0, 110.0, 120.0], 1: [150.0, 90.0, 130.0]}
LOSSES = {0: [3.0, 2.0, 1.5], 1: [3.0, 2.0, 1.0]}
TIMERS = {0: {"fwd": 40.0, "bwd": 60.0}, 1: {"fwd": 50.0, "bwd": 55.0}}


def env(rank: int, seconds: float, event_id: str) -> dict:
    return dict(run_id="vw-run", rank=rank, world_size=2, host=f"node-{rank}",
                time=T0 + timedelta(seconds=seconds), event_id=event_id)


def fixture_records() -> list:
    records = [RunRecord(**env(0, -5, "run-start"), event="start", name="vw", project="proj",
                         config={"lr": 0.1})]
    for step in range(3):
        for rank in (0, 1):
            records.append(StepRecord(
                **env(rank, step * 10 + rank, f"step-{rank}-{step}"), step=step, epoch=0,
                step_tokens=1000, duration_ms=DURATIONS[rank][step], loss=LOSSES[rank][step],
                norm=1.0, lr=0.1, timers=TIMERS[rank]))
    records.append(records[1])  # a producer resend (same event_id): counted once
    records += [
        EvalRecord(**env(0, 23, "eval-0"), step=0, epoch=0, eval_tokens=10, duration_ms=5, loss=2.5),
        EvalRecord(**env(0, 24, "eval-1"), step=1, epoch=0, eval_tokens=10, duration_ms=5, loss=math.nan),
        EvalRecord(**env(0, 25, "eval-2"), step=2, epoch=0, eval_tokens=10, duration_ms=5, loss=1.8),
        AlertRecord(**env(0, 21, "alert-a1"), rule="loss_spike", severity="critical", state="firing",
                    incident_id="a", message="spike"),
        AlertRecord(**env(0, 26, "alert-a2"), rule="loss_spike", severity="critical", state="resolved",
                    incident_id="a", message="spike over"),
        AlertRecord(**env(1, 22, "alert-b1"), rule="straggler", severity="warning", state="firing",
                    incident_id="b", ranks=[1], message="rank 1 slow"),
        RunRecord(**env(0, 60, "run-end"), event="end", status="failed",
                  reason="CUDA out of memory"),
    ]
    return records


def table_fingerprints(service: ClickHouseService) -> list[dict]:
    """Per table: row count and the sorted hashes of all rows (bar _inserted_at), read
    with FINAL: background merges may or may not have collapsed the resent record yet."""
    parts = [f"SELECT '{kind}' AS kind, count() AS n, arraySort(groupArray(cityHash64(tuple(* EXCEPT "
             f"(_inserted_at))))) AS rows FROM trainmon.{kind} FINAL" for kind in RECORD_TYPES]
    return service.rows(f"SELECT * FROM ({' UNION ALL '.join(parts)}) ORDER BY kind")


def test_views_and_replay(bootstrap, topic_prefix, make_producer, tmp_path):
    producer = make_producer()
    for record in fixture_records():
        producer.send_record(record)
    assert producer.flush(30)
    live = ClickHouseService(bootstrap, topic_prefix, tmp_path / "live", tmp_path / "live.log").start()
    try:
        live.wait_for("SELECT count() FROM trainmon.run", 2)
        live.wait_for("SELECT count() FROM trainmon.step FINAL", 6)
        live.wait_for("SELECT count() FROM trainmon.alert", 3)
        live.wait_for("SELECT count() FROM trainmon.eval", 3)

        across = live.rows("SELECT * EXCEPT (run_id, first_time, last_time) "
                           "FROM trainmon.step_across_ranks ORDER BY step")
        timers = {"min": {"bwd": 55.0, "fwd": 40.0}, "max": {"bwd": 60.0, "fwd": 50.0}}
        expected = [  # step, min, max, mean, slowest, fastest, mean loss
            (0, 100.0, 150.0, 125.0, 1, 0, 3.0),
            (1, 90.0, 110.0, 100.0, 0, 1, 2.0),
            (2, 120.0, 130.0, 125.0, 1, 0, 1.25),
        ]
        assert across == [
            {"step": s, "ranks_reporting": 2, "world_size": 2, "min_duration_ms": lo,
             "max_duration_ms": hi, "mean_duration_ms": mean, "slowest_rank": slow,
             "fastest_rank": fast, "straggler_ratio": pytest.approx(hi / mean),
             "step_tokens": 2000, "mean_loss": loss, "min_loss": min(LOSSES[0][s], LOSSES[1][s]),
             "max_loss": max(LOSSES[0][s], LOSSES[1][s]),
             "timers_min_ms": timers["min"], "timers_max_ms": timers["max"]}
            for s, lo, hi, mean, slow, fast, loss in expected]

        latest = live.rows("SELECT rank, step, time, loss, duration_ms, host "
                           "FROM trainmon.latest_step ORDER BY rank")
        assert latest == [
            {"rank": 0, "step": 2, "time": "2026-04-01 08:00:20.000000", "loss": 1.5,
             "duration_ms": 120.0, "host": "node-0"},
            {"rank": 1, "step": 2, "time": "2026-04-01 08:00:21.000000", "loss": 1.0,
             "duration_ms": 130.0, "host": "node-1"},
        ]

        summary = live.rows("SELECT * FROM trainmon.run_summary")
        assert summary == [{
            "run_id": "vw-run", "name": "vw", "project": "proj", "status": "failed",
            "reason": "CUDA out of memory",
            "world_size": 2, "ranks": 2, "steps": 3, "last_step": 2, "tokens": 6000,
            "last_loss": 1.25, "best_eval_loss": 1.8, "evals": 3, "alerts_fired": 2,
            "alerts_critical": 1, "alerts_open": 1,
            "started_at": "2026-04-01 07:59:55.000000", "last_seen_at": "2026-04-01 08:01:00.000000",
            "wall_seconds": 65.0}]
        live_tables = table_fingerprints(live)
    finally:
        assert live.stop() == 0

    replayed = ClickHouseService(bootstrap, topic_prefix, tmp_path / "replay", tmp_path / "replay.log")
    done = run_trainmon(bootstrap, "replay", "--path", str(replayed.path), "--topic-prefix", topic_prefix)
    assert done.returncode == 0, done.stderr
    assert "replayed 15 rows" in done.stdout
    assert table_fingerprints(replayed) == live_tables
    assert sum(t["n"] for t in live_tables) == 14  # 15 records, one of them sent twice

    again = run_trainmon(bootstrap, "replay", "--path", str(replayed.path), "--topic-prefix", topic_prefix)
    assert again.returncode == 2 and "already holds" in again.stderr
