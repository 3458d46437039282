"""The SQL layer at its edges, each once a wrong number or a failed query: a job requeued
under one run id (steps logged again after a checkpoint), a run id with an apostrophe
and a backslash in every dashboard query, a rollup table an older version made. chDB
runs in a child process (it hosts one data directory per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from trainmon.grafana_sql import ALL, TimeRange, dashboard_queries, expand, load_dashboards

REPO = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records
client = connect(Target(path=sys.argv[1]))
create_all(client)
def q(sql):
    return [list(r) for r in client.query(sql).result_rows]
"""


def _child(body: str, tmp_path: Path, stdin: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", PRELUDE + body, str(tmp_path / "chdb")], input=stdin,
                          capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# A job requeued under one run id (tests/goodput_job.py: world size 1; the second and third
# runs resume from a checkpoint and log steps 6-8 and 13-14 a second time).
REQUEUED = r"""
from tests.goodput_job import job_records, T0
recs = job_records(run_ids=("R", "R", "R"), job_id=None)
cut = T0 + timedelta(seconds=float(sys.argv[2])) if len(sys.argv) > 2 else None
insert_records(client, [r for r in recs if cut is None or r.time <= cut])
"""


def test_a_step_logged_again_after_a_restart_is_not_two_ranks(tmp_path):
    """ranks_reporting is documented as "ranks that logged this step" and run_summary.ranks
    as "most ranks that reported one step"; they counted rows, so a rank that logs a step
    again after resuming from a checkpoint counted twice: 2 ranks in a world of 1."""
    out = _child(REQUEUED + r"""
print(json.dumps({
    "across": q("SELECT step, ranks_reporting, world_size FROM trainmon.step_across_ranks "
                "WHERE run_id = 'R' AND step IN (5, 6, 13) ORDER BY step"),
    "summary": q("SELECT world_size, ranks FROM trainmon.run_summary WHERE run_id = 'R'"),
    "overview": q("SELECT world_size, ranks FROM trainmon.run_overview WHERE run_id = 'R'"),
}))
""", tmp_path)
    assert out["across"] == [[5, 1, 1], [6, 1, 1], [13, 1, 1]]
    assert out["summary"] == [[1, 1]]
    assert out["summary"] == out["overview"]


def test_latest_step_after_a_restart_is_the_step_the_rank_logged_last(tmp_path):
    """Run 1 logged up to step 8 at +150 s and crashed; run 2 (same run id) resumed from the
    step-5 checkpoint and logged step 6 at +260 s and 7 at +270 s. The rank's latest step is
    7, logged at +270; latest_step (argMax by step) kept step 8 of the crashed run, 120 s
    older: the rank looked stalled until the new run passed its old step."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + REQUEUED + r"""
print(json.dumps(q("SELECT rank, step, toString(time) FROM trainmon.latest_step WHERE run_id = 'R'")))
""", str(tmp_path / "chdb"), "275"], capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [[0, 7, "2026-03-01 23:54:30.000000"]]


ODD_RUN_ID = "bob's run \\ 2"  # an apostrophe and a backslash: a run id is any text


def test_every_dashboard_query_runs_for_a_run_id_with_a_quote(tmp_path):
    """Panels said run_id = '${run_id}': Grafana puts a single-valued variable in as it is,
    so a run id with an apostrophe (or a backslash, an escape in ClickHouse's strings) made
    every panel and the rank variable a syntax error, or a filter that matched nothing."""
    dashboards = load_dashboards(REPO / "trainmon" / "grafana" / "dashboards")
    from tests.dashboard_data import T0
    time = TimeRange(T0 - timedelta(minutes=10), T0 + timedelta(hours=1), interval_s=10)
    queries = {f"{q.dashboard} / {q.panel} / {q.ref_id}": expand(q.sql, time, {"run_id": ODD_RUN_ID, "rank": ALL})
               for d in dashboards for q in dashboard_queries(d)}
    out = _child(r"""
from tests.dashboard_data import records, RUN_ID
insert_records(client, [r.model_copy(update={"run_id": %r}) for r in records() if r.run_id == RUN_ID])
client.database = "trainmon"
results = {}
for name, sql in json.load(sys.stdin).items():
    try:
        results[name] = q(sql)
    except Exception as exc:
        results[name] = "error: " + str(exc)[:200]
print(json.dumps(results, default=str))
""" % ODD_RUN_ID, tmp_path, json.dumps(queries))
    errors = {name: r for name, r in out.items() if isinstance(r, str)}
    assert errors == {}
    last_step = [r for name, r in out.items() if name.endswith("/ Last step / A")]
    assert last_step and last_step[0][0][0] > 0  # the run's rows are found


def test_a_rank_latest_table_of_the_previous_version_is_made_again(tmp_path):
    """(For the fix of latest_step:) rank_latest as the previous version made it (argMax by
    step, no step in the row) is made again and filled from the step table at start."""
    out = _child(r"""
from trainmon.schemas import StepRecord
from trainmon.consumers.clickhouse.settings import settings_sql
old_row = "(time, loss, duration_ms, tokens_per_second, lr, norm, epoch, host)"
old_type = ("Tuple(DateTime64(6, 'UTC'), Nullable(Float64), Nullable(Float64), Nullable(Float64), "
            "Nullable(Float64), Nullable(Float64), Nullable(Float64), String)")
client.command("DROP VIEW trainmon.rank_latest_mv")
client.command("DROP TABLE trainmon.rank_latest")
client.command("CREATE TABLE trainmon.rank_latest (`run_id` LowCardinality(String), `rank` Int64, "
               "`step` SimpleAggregateFunction(max, Int64), "
               f"`latest` AggregateFunction(argMax, {old_type}, Int64)) ENGINE = AggregatingMergeTree "
               f"ORDER BY (run_id, rank) SETTINGS {settings_sql()}")
client.command("CREATE MATERIALIZED VIEW trainmon.rank_latest_mv TO trainmon.rank_latest AS "
               f"SELECT run_id, rank, max(step_number) AS step, argMaxState({old_row}, step_number) AS latest "
               "FROM (SELECT *, step AS step_number FROM trainmon.step) GROUP BY run_id, rank")
t0 = datetime(2026, 4, 1, tzinfo=timezone.utc)
insert_records(client, [StepRecord(run_id="m", rank=0, world_size=1, host="h", time=t0 + timedelta(seconds=n),
                                   event_id=f"m{n}", step=n, loss=1.0) for n in range(3)])
create_all(client)
print(json.dumps(q("SELECT rank, step, loss FROM trainmon.latest_step WHERE run_id = 'm'")))
""", tmp_path)
    assert out == [[0, 2, 1.0]]


def test_a_rank_10s_table_ordered_time_first_is_made_again_rank_first(tmp_path):
    """rank_10s as earlier versions made it, ordered (run_id, time, rank), is made again
    ordered by rank first (the standouts' lines read their ranks by the key) and filled
    from the step table at start; a table already in this version's order is left alone."""
    out = _child(r"""
from trainmon.schemas import StepRecord
from trainmon.consumers.clickhouse.schema_setup import create_rollups
ddl = q("SELECT create_table_query FROM system.tables WHERE database = 'trainmon' AND name = 'rank_10s'")[0][0]
view = q("SELECT create_table_query FROM system.tables WHERE database = 'trainmon' AND name = 'rank_10s_mv'")[0][0]
client.command("DROP VIEW trainmon.rank_10s_mv")
client.command("DROP TABLE trainmon.rank_10s")
client.command(ddl.replace("ORDER BY (run_id, rank, time)", "ORDER BY (run_id, time, rank)"))
client.command(view)
t0 = datetime(2026, 4, 1, tzinfo=timezone.utc)
insert_records(client, [StepRecord(run_id="m", rank=r, world_size=2, host="h", time=t0 + timedelta(seconds=n),
                                   event_id=f"m{r}-{n}", step=n, duration_ms=100.0 + r) for n in range(30)
                        for r in range(2)])
old_key = q("SELECT sorting_key FROM system.tables WHERE database = 'trainmon' AND name = 'rank_10s'")[0][0]
create_all(client)
print(json.dumps({
    "old_key": old_key,
    "key": q("SELECT sorting_key FROM system.tables WHERE database = 'trainmon' AND name = 'rank_10s'")[0][0],
    "rows": q("SELECT rank, toString(time), sum(duration_ms_count), sum(duration_ms_sum) FROM trainmon.rank_10s "
              "WHERE run_id = 'm' GROUP BY rank, time ORDER BY rank, time"),
    "again": create_rollups(client, "trainmon"),
}))
""", tmp_path)
    assert out["old_key"] == "run_id, time, rank" and out["key"] == "run_id, rank, time"
    assert out["rows"] == [[r, f"2026-04-01 00:00:{s:02d}", 10, 10 * (100.0 + r)] for r in range(2) for s in (0, 10, 20)]
    assert out["again"] == []
