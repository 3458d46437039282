"""Schema and DDL cannot drift: every schema field has a column, every column a field."""

from __future__ import annotations

from typing import Optional

import pytest

from trainmon.consumers.clickhouse import create_all
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse.ddl import BOOKKEEPING, field_columns, table_fields
from trainmon.schemas import RECORD_TYPES, StepRecord



@pytest.fixture
def chdb(tmp_path):
    """chDB in this process, as the loader opens it (the CLI's `trainmon clickhouse init`
    runs the same create_all: tests/test_clickhouse_exactly_once.py and others call it)."""
    client = connect(Target(path=tmp_path / "chdb"))
    yield client
    client.close()


def sql(client, query: str) -> list[dict]:
    result = client.query(query)
    return [dict(zip(result.column_names, row)) for row in result.result_rows]


def columns_by_table(client) -> dict[str, list[str]]:
    rows = sql(client, "SELECT table, groupArray(name) AS names FROM (SELECT table, name "
                       "FROM system.columns WHERE database = 'trainmon' ORDER BY position) "
                       "GROUP BY table")
    return {r["table"]: list(r["names"]) for r in rows}


def field_of(column: str) -> str:
    return column.split(".", 1)[0]  # Nested sub-columns: "stats.name" -> "stats"


def test_tables_have_a_column_per_field_and_a_field_per_column(chdb):
    create_all(chdb, "trainmon")
    tables = columns_by_table(chdb)
    for kind, model in RECORD_TYPES.items():
        columns = [c for c in tables[kind] if c not in BOOKKEEPING]
        fields = list(model.model_fields)
        missing = [f for f in fields if f not in {field_of(c) for c in columns}]
        orphans = [c for c in columns if field_of(c) not in fields]
        assert not missing, f"{kind}: schema fields without a column: {missing}"
        assert not orphans, f"{kind}: columns without a schema field: {orphans}"
        assert set(BOOKKEEPING) <= set(tables[kind])
    # (".tmp.inner_id...": a refreshable view's table while it refreshes, ClickHouse's own)
    views = {name for name in tables if not name.startswith(".tmp.")} - set(RECORD_TYPES)
    rollups = {"step_stats", "rank_latest", "rank_10s", "gpu_10s", "gpu_rank_1m", "allocator_10s",
               "allocator_latest"}
    assert views == {"step_across_ranks", "latest_step", "run_summary", "run_overview",
                     "checkpoint_saves", "log_event_totals", "job_runs", "goodput_pieces", "goodput",
                     "goodput_daily", "goodput_daily_latest", "goodput_daily_latest_mv"} | rollups \
        | {f"{name}_mv" for name in rollups}


def test_init_adds_the_columns_of_new_fields_to_existing_tables(chdb):
    create_all(chdb, "trainmon")
    # A table made by an older trainmon, before these fields and the rollups existed.
    for name in ("step_stats", "rank_latest", "rank_10s"):
        chdb.command(f"DROP VIEW trainmon.{name}_mv")
        chdb.command(f"DROP TABLE trainmon.{name}")
    chdb.command("ALTER TABLE trainmon.step DROP COLUMN sol_percent, DROP COLUMN timers")
    chdb.command("ALTER TABLE trainmon.allocator DROP COLUMN stats")
    assert "sol_percent" not in columns_by_table(chdb)["step"]
    create_all(chdb, "trainmon")  # as `trainmon clickhouse init` and every service start do
    tables = columns_by_table(chdb)
    assert {"sol_percent", "timers"} <= set(tables["step"])
    assert {"stats.name", "stats.device"} <= set(tables["allocator"])
    assert "step_stats" in tables  # rollups created (and filled from the step rows)
    types = {r["name"]: r["type"] for r in sql(
        chdb, "SELECT name, type FROM system.columns WHERE database = 'trainmon' "
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
