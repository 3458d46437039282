"""Schema and DDL cannot drift: every schema field has a column, every column a field."""

from __future__ import annotations

import json
from typing import Optional

import pytest

from trainmon.consumers.clickhouse.ddl import BOOKKEEPING, field_columns, table_fields
from trainmon.schemas import RECORD_TYPES, StepRecord

from .clickhouse_service import run_trainmon


def sql(bootstrap, path, query: str) -> list[dict]:
    done = run_trainmon(bootstrap, "sql", "--path", str(path), "-f", "jsonl", query)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def columns_by_table(bootstrap, path) -> dict[str, list[str]]:
    rows = sql(bootstrap, path, "SELECT table, groupArray(name) AS names FROM (SELECT table, name "
                                "FROM system.columns WHERE database = 'trainmon' ORDER BY position) "
                                "GROUP BY table")
    return {r["table"]: r["names"] for r in rows}


def field_of(column: str) -> str:
    return column.split(".", 1)[0]  # Nested sub-columns: "stats.name" -> "stats"


def test_tables_have_a_column_per_field_and_a_field_per_column(bootstrap, tmp_path):
    path = tmp_path / "chdb"
    done = run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path))
    assert done.returncode == 0, done.stderr
    tables = columns_by_table(bootstrap, path)
    for kind, model in RECORD_TYPES.items():
        columns = [c for c in tables[kind] if c not in BOOKKEEPING]
        fields = list(model.model_fields)
        missing = [f for f in fields if f not in {field_of(c) for c in columns}]
        orphans = [c for c in columns if field_of(c) not in fields]
        assert not missing, f"{kind}: schema fields without a column: {missing}"
        assert not orphans, f"{kind}: columns without a schema field: {orphans}"
        assert set(BOOKKEEPING) <= set(tables[kind])
    views = set(tables) - set(RECORD_TYPES)
    rollups = {"step_stats", "rank_latest", "rank_10s"}
    assert views == {"step_across_ranks", "latest_step", "run_summary", "run_overview",
                     "checkpoint_saves", "log_event_totals", "job_runs", "goodput_pieces", "goodput",
                     "goodput_daily"} | rollups \
        | {f"{name}_mv" for name in rollups}


def test_init_adds_the_columns_of_new_fields_to_existing_tables(bootstrap, tmp_path):
    path = tmp_path / "chdb"
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    # A table made by an older trainmon, before these fields and the rollups existed.
    for name in ("step_stats", "rank_latest", "rank_10s"):
        sql(bootstrap, path, f"DROP VIEW trainmon.{name}_mv")
        sql(bootstrap, path, f"DROP TABLE trainmon.{name}")
    sql(bootstrap, path, "ALTER TABLE trainmon.step DROP COLUMN sol_percent, DROP COLUMN timers")
    sql(bootstrap, path, "ALTER TABLE trainmon.allocator DROP COLUMN stats")
    assert "sol_percent" not in columns_by_table(bootstrap, path)["step"]
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    tables = columns_by_table(bootstrap, path)
    assert {"sol_percent", "timers"} <= set(tables["step"])
    assert {"stats.name", "stats.device"} <= set(tables["allocator"])
    assert "step_stats" in tables  # rollups created (and filled from the step rows)
    types = {r["name"]: r["type"] for r in sql(
        bootstrap, path, "SELECT name, type FROM system.columns WHERE database = 'trainmon' "
                         "AND table = 'step' AND name IN ('sol_percent', 'timers')")}
    assert types == {"sol_percent": "Nullable(Float64)", "timers": "Map(String, Float64)"}


def test_a_field_without_a_column_mapping_is_an_error_naming_it():
    class Future(StepRecord):
        kind = "future"
        tags: Optional[set[int]] = None

    with pytest.raises(TypeError, match=r"Future\.tags: no ClickHouse column type"):
        table_fields(Future)


def test_column_types_follow_the_schema():
    def ch(field):
        return field_columns(StepRecord, field).definition

    assert ch("step") == "`step` Int64"
    assert ch("loss") == "`loss` Nullable(Float64)"
    assert ch("params_norm") == "`params_norm` Nullable(Float64)"
    assert ch("time") == "`time` DateTime64(6, 'UTC')"
    assert ch("run_id") == "`run_id` LowCardinality(String)"
    assert ch("timers") == "`timers` Map(String, Float64)"
    run = RECORD_TYPES["run"]
    assert field_columns(run, "config").definition == "`config` String"
    assert field_columns(run, "status").definition == "`status` LowCardinality(Nullable(String))"
    assert field_columns(RECORD_TYPES["alert"], "ranks").definition == "`ranks` Array(Int64)"
    assert field_columns(RECORD_TYPES["allocator"], "stats").definition.startswith("`stats` Nested(")
