"""kill -9 of the consumer, mid-stream and between insert and commit: after restarts
every (run, rank, step) is in the step table exactly once, with no gaps."""

from __future__ import annotations

import threading


from trainmon import topics

from .clickhouse_service import ClickHouseService, run_trainmon
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .conftest import committed_offsets

RANKS, STEPS = 4, 240

# Every insert that really lands in trainmon.step is copied here. A plain MergeTree never
# collapses rows, so a duplicate insert stays visible even if ReplacingMergeTree has
# already merged it away in the step table itself. ClickHouse does not write a table and
# its views atomically: a kill -9 inside an insert can leave the step rows written and
# their copies not, so the audit may miss rows; it must never hold one twice.
AUDIT = [
    "CREATE TABLE trainmon.step_audit (run_id String, rank Int64, step Int64, _offset Int64) "
    "ENGINE = MergeTree ORDER BY (run_id, rank, step)",
    "CREATE MATERIALIZED VIEW trainmon.step_audit_mv TO trainmon.step_audit AS "
    "SELECT run_id, rank, step, _offset FROM trainmon.step",
]


def produce(make_producer, steps: range) -> None:
    producers = [make_producer(run_id="eo-run", rank=r, world_size=RANKS) for r in range(RANKS)]
    for step in steps:
        for rank, p in enumerate(producers):
            p.log_step(step, step_tokens=100, duration_ms=10 + rank, loss=1.0 / (step + 1),
                       norm=1.0, lr=1e-3)
    for p in producers:
        assert p.flush(30)



def test_kill_9_then_restart_loads_every_step_exactly_once(bootstrap, topic_prefix, make_producer, tmp_path):
    path = tmp_path / "chdb"
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    for sql in AUDIT:
        done = run_trainmon(bootstrap, "sql", "--path", str(path), sql)
        assert done.returncode == 0, done.stderr
    produce(make_producer, range(0, STEPS // 2))
    service = ClickHouseService(bootstrap, topic_prefix, path, tmp_path / "svc.log")

    # 1. Killed right after its second insert, before any Kafka commit.
    service.start("--batch-rows", "60", TRAINMON_CLICKHOUSE_CRASH_AFTER_INSERTS="2")
    assert service.proc.wait(60) == -9
    stored = service.value("SELECT count() FROM trainmon.step")
    assert stored > 0
    # Rows are in ClickHouse that Kafka's committed offsets do not cover yet.
    group, step_topic = f"{topic_prefix}clickhouse", topics.topic_for("step", topic_prefix)
    committed = committed_offsets(bootstrap, group, step_topic)
    loaded = {r["_partition"]: r["next"] for r in service.rows(
        "SELECT _partition, max(_offset) + 1 AS next FROM trainmon.step GROUP BY _partition")}
    assert any((committed[p] or 0) < next_offset for p, next_offset in loaded.items()), (committed, loaded)

    # 2. Killed mid-stream while the second half is being produced.
    service.start("--batch-rows", "60")
    second_half = threading.Thread(target=produce, args=(make_producer, range(STEPS // 2, STEPS)))
    second_half.start()
    try:
        service.wait_for(f"SELECT count() > {stored} FROM trainmon.step", 1)
        service.kill()
    finally:
        second_half.join()

    # 3. Runs to the end.
    service.start()
    try:
        service.wait_for("SELECT count() FROM trainmon.step", RANKS * STEPS)
        per_rank = service.rows(
            "SELECT rank, count() AS n, uniqExact(step) AS distinct_steps, min(step) AS first, "
            "max(step) AS last FROM trainmon.step GROUP BY rank ORDER BY rank")
        audit = service.rows("SELECT count() AS inserted, uniqExact(run_id, rank, step) AS distinct "
                             "FROM trainmon.step_audit")
    finally:
        assert service.stop() == 0
    assert per_rank == [{"rank": r, "n": STEPS, "distinct_steps": STEPS, "first": 0, "last": STEPS - 1}
                        for r in range(RANKS)]
    [row] = audit
    inserted, distinct = row["inserted"], row["distinct"]
    assert inserted == distinct, f"{inserted - distinct} rows were inserted more than once"
    assert 0 < distinct <= RANKS * STEPS
