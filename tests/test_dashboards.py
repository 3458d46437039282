"""The Grafana dashboards: the JSON is what infra/grafana/build.py writes, every panel,
annotation, variable and alert-rule query -- macros expanded as the ClickHouse plugin
does -- runs against chDB holding a representative run and returns rows."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from tests.dashboard_data import (BIG_RANKS, BIG_RUN_ID, RUN_ID, SLOW_RANK, T0, WIDE_ALERT_RANK, WIDE_RANKS,
                                  WIDE_RUN_ID, WIDE_SLOW_RANK, WIDE_STOPPED_RANK)
from trainmon.grafana_sql import ALL, TimeRange, dashboard_queries, expand, load_dashboards

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "trainmon" / "grafana"  # what the package ships; infra/grafana/build.py writes it
DASHBOARDS = load_dashboards(GRAFANA / "dashboards")
PROVISIONED_SOURCE = yaml.safe_load(
    (GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text())["datasources"][0]
ALERT_RULES = [rule for path in sorted((GRAFANA / "provisioning" / "alerting").glob("*.yaml"))
               for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
TIME = TimeRange(T0 - timedelta(minutes=10), T0 + timedelta(hours=1), interval_s=10)
RANK_CHOICES = {"all ranks": ALL, "ranks 0,1": [0, 1]}


RUNS = {"": RUN_ID, "big: ": BIG_RUN_ID}  # name prefix -> run


def all_queries() -> dict[str, str]:
    """name -> SQL with macros expanded, for each run and rank choice."""
    queries = {}
    for dashboard in DASHBOARDS:
        for q in dashboard_queries(dashboard):
            for prefix, run_id in RUNS.items():
                for choice, ranks in RANK_CHOICES.items():
                    name = f"{prefix}{q.dashboard} / {q.panel} / {q.ref_id} / {choice}"
                    assert name not in queries, f"two queries named {name}"
                    queries[name] = expand(q.sql, TIME, {"run_id": run_id, "rank": ranks})
    for rule in ALERT_RULES:
        for query in rule["data"]:
            if query["datasourceUid"] == PROVISIONED_SOURCE["uid"]:
                queries[f"alert rule {rule['uid']} / {query['refId']}"] = \
                    expand(query["model"]["rawSql"], TIME)
    return queries


def run_queries(tmp_path_factory, *options: str) -> dict[str, dict]:
    # chDB hosts one data directory per process: load and query in a child process.
    proc = subprocess.run([sys.executable, "-m", "tests.run_dashboard_sql",
                           str(tmp_path_factory.mktemp("chdb") / "data"), *options],
                          input=json.dumps(all_queries()), capture_output=True, text=True,
                          cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    return run_queries(tmp_path_factory)


def test_every_query_runs_and_returns_rows(results):
    """Every query runs; each returns rows for some run and rank choice (an across-rank
    panel's queries take turns: per-rank lines for the small run, the distribution for
    the big one)."""
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert errors == {}
    assert len(results) == len(all_queries())
    answered: dict[str, bool] = {}
    for name, r in results.items():
        query = name.removeprefix("big: ").rsplit(" / ", 1)[0]
        answered[query] = answered.get(query, False) or bool(r["rows"])
    assert [query for query, has_rows in answered.items() if not has_rows] == []


ACROSS_RANK_PANELS = sorted({f"{d['title']} / {p['title']}" for d in DASHBOARDS for p in d["panels"]
                             for t in p["targets"] if "['min', 'median', 'max']" in t["rawSql"]})


def test_big_runs_show_the_distribution_and_small_runs_every_rank(results):
    assert len(ACROSS_RANK_PANELS) >= 20
    for panel in ACROSS_RANK_PANELS:
        def rows(prefix, ref, choice):
            return results[f"{prefix}{panel} / {ref} / {choice}"]["rows"]

        def series(prefix, ref, choice):
            return {row[1] for row in rows(prefix, ref, choice)}

        # Two ranks: a line each, no bands. Picked ranks of the big run: their lines only.
        assert rows("", "A", "all ranks") and not rows("", "B", "all ranks") and not rows("", "C", "all ranks"), panel
        assert rows("big: ", "A", "ranks 0,1") and not rows("big: ", "B", "ranks 0,1"), panel
        assert len(series("big: ", "A", "ranks 0,1")) <= 2, panel
        # All 24 ranks: min / median / max and the few that stand out, not 24 lines.
        assert not rows("big: ", "A", "all ranks"), panel
        assert series("big: ", "B", "all ranks") == {"'min'", "'median'", "'max'"}, panel
        assert 1 <= len(series("big: ", "C", "all ranks")) <= 3, panel
    slowest = {row[1] for row in results[
        "big: trainmon / Ranks / Step time across ranks / C / all ranks"]["rows"]}
    assert f"'rank {SLOW_RANK}'" in slowest
    heat = results["big: trainmon / Ranks / Step time heatmap / B / all ranks"]["rows"]
    assert len({row[1] for row in heat}) == BIG_RANKS  # rows of one rank each: at most 64 rows


def test_queries_show_the_injected_problems(results):
    def rows(name):
        return results[name]["rows"]

    stragglers = rows("trainmon / Ranks / Stragglers (slowest steps) / A / all ranks")
    assert stragglers[0][:2] == ["22", "1"]  # rank 1 stalled at steps 20-22
    grad = dict(rows("trainmon / Run overview / Grad norm / A / all ranks"))
    assert max(float(v) for v in grad.values()) == 25.0
    open_incidents = rows("trainmon / Alerts / Open incidents / A / all ranks")
    assert sorted(r[1] for r in open_incidents) == ["'loss_not_finite'", "'straggler'"]
    annotations = rows("trainmon / Alerts / annotation trainmon alerts / annotation / all ranks")
    assert len(annotations) == 3 and annotations[0][1] != "None"  # the spike was resolved
    assert len(rows(f"alert rule {ALERT_RULES[0]['uid']} / A")) == 2
    assert rows("trainmon / Run overview / ETA / A / all ranks") == [["71.0"]]


# Panels that read a rollup's sums or counts, which weigh a record Kafka stored twice twice
# (trainmon/consumers/clickhouse/rollups.py, "Exactly once"; the plain views stay exact).
COUNTS_A_RECORD_STORED_TWICE_TWICE = {
    "Ranks / Stragglers (slowest steps) / A": "ranks_reporting (step_stats rows)",
    "Run overview / Run / A": "tokens (step_stats)",
    "Run overview / Tokens / A": "step_stats tokens",
    "Run overview / Tokens / s / A": "step_stats tokens/s",
}
NOW_DEPENDENT = {"seconds_since"}  # (columns that move between the two loads)


def same_result(once: dict, twice: dict) -> bool:
    """The same columns and rows, numbers equal to rounding (a mean of pairs is summed in
    another order), columns of NOW_DEPENDENT left out."""
    if "error" in once or "error" in twice or once["columns"] != twice["columns"]:
        return once == twice
    keep = [i for i, c in enumerate(once["columns"]) if c not in NOW_DEPENDENT]
    rows = [sorted([row[i] for i in keep] for row in r["rows"]) for r in (once, twice)]
    if len(rows[0]) != len(rows[1]):
        return False
    for a, b in zip(*rows):
        for x, y in zip(a, b):
            if x != y:
                try:
                    if not math.isclose(float(x), float(y), rel_tol=1e-9):
                        return False
                except ValueError:
                    return False
    return True


def test_a_record_kafka_stored_twice_changes_no_panel_but_the_rollup_sums(results, tmp_path_factory):
    """Every record inserted a second time in other blocks, as a retried send stores a
    message twice in Kafka (the insert dedup cannot see it; the record tables keep one row
    per event id): every query answers as before, except those reading rollup sums
    (COUNTS_A_RECORD_STORED_TWICE_TWICE). The XID lines and the throttle events listed a
    stored-twice sample twice; standouts tied on their value were picked at random."""
    twice = run_queries(tmp_path_factory, "--twice")
    changed = sorted({name.removeprefix("big: ").removeprefix("trainmon / ").rsplit(" / ", 1)[0]
                      for name in results if not same_result(results[name], twice[name])})
    assert changed == sorted(COUNTS_A_RECORD_STORED_TWICE_TWICE)


def test_only_the_chosen_ranks_are_queried(results):
    every = results["trainmon / Ranks / Latest step per rank / A / all ranks"]["rows"]
    assert [r[0] for r in every] == ["0", "1"]
    sql = all_queries()["trainmon / Ranks / Latest step per rank / A / ranks 0,1"]
    assert "rank IN (0,1)" in sql


# A drop-down a person can scroll, or narrow by typing: a few hundred options at most.
MOST_OPTIONS = 300


def test_no_variable_lists_more_than_a_few_hundred_options_for_16384_ranks(tmp_path):
    """Every query variable of every dashboard, run against a 16,384-rank run: at most
    MOST_OPTIONS options. The rank variable lists the ranks that stand out, each saying why."""
    queries = {f"{d['title']} / {v['name']}": expand(v["query"], TIME, {"run_id": WIDE_RUN_ID})
               for d in DASHBOARDS for v in d["templating"]["list"] if v["type"] == "query"}
    proc = subprocess.run([sys.executable, "-m", "tests.run_dashboard_sql", str(tmp_path / "data"), "--wide"],
                          input=json.dumps(queries), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert {name: r["error"] for name, r in results.items() if "error" in r} == {}
    assert {name: len(r["rows"]) for name, r in results.items() if len(r["rows"]) > MOST_OPTIONS} == {}
    ranks = results["trainmon / Ranks / rank"]
    assert ranks["rows"] == results["trainmon / GPU / rank"]["rows"]  # one variable, on every dashboard
    labels = {int(value): text.strip("'") for value, text in ranks["rows"]}
    assert 1 <= len(labels) < 50 and len(ranks["rows"]) == len(labels)
    assert labels[WIDE_SLOW_RANK] == f"{WIDE_SLOW_RANK} (slowest)"
    assert labels[WIDE_STOPPED_RANK] == f"{WIDE_STOPPED_RANK} (behind)"
    assert labels[WIDE_ALERT_RANK].startswith(f"{WIDE_ALERT_RANK} (") and "alert" in labels[WIDE_ALERT_RANK]
    assert max(labels) < WIDE_RANKS


def test_small_runs_list_every_rank_and_all_means_every_rank(results):
    for prefix, ranks in (("", 2), ("big: ", BIG_RANKS)):
        rows = results[f"{prefix}trainmon / Ranks / variable rank / variable / all ranks"]["rows"]
        assert rows == [[str(r), repr(str(r))] for r in range(ranks)]
    for dashboard in DASHBOARDS:
        for variable in dashboard["templating"]["list"]:
            if variable["name"] == "rank":
                # All is Grafana's "$__all" (no allValue): $__conditionalAll drops the filter,
                # so the panels cover every rank, not only the listed ones.
                assert variable["includeAll"] and variable["multi"] and variable["allowCustomValue"]
                assert "allValue" not in variable and variable["current"]["value"] == ["$__all"]
                assert variable["description"]


def test_dashboards_are_what_the_build_script_writes():
    spec = importlib.util.spec_from_file_location("grafana_build", REPO / "infra" / "grafana" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    on_disk = {p.name: p.read_text() for p in (GRAFANA / "dashboards").glob("*.json")}
    assert on_disk == build.render(), "run: python infra/grafana/build.py"


def test_dashboards_use_the_provisioned_source_and_a_run_variable():
    assert {d["title"] for d in DASHBOARDS} == {
        "trainmon / Run overview", "trainmon / Ranks", "trainmon / GPU", "trainmon / MoE",
        "trainmon / Memory", "trainmon / Health", "trainmon / Alerts"}
    assert len({d["uid"] for d in DASHBOARDS}) == len(DASHBOARDS)
    source = {"type": PROVISIONED_SOURCE["type"], "uid": PROVISIONED_SOURCE["uid"]}
    for dashboard in DASHBOARDS:
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert "run_id" in variables and variables["run_id"]["datasource"] == source
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dashboard["panels"]:
            assert panel["datasource"] == source
            for target in panel["targets"]:
                assert target["datasource"] == source and target["editorType"] == "sql"
                assert "${run_id}" in target["rawSql"], f"{panel['title']} ignores the run"
                time_series = panel["type"] in ("timeseries", "heatmap")
                assert target["format"] == (0 if time_series else 1)
        names = [a["name"] for a in dashboard["annotations"]["list"]]
        assert "trainmon alerts" in names


def test_every_dashboard_shows_the_annotations_the_forwarder_writes():
    """The Grafana forwarder's tags for an alert of a run include every tag a dashboard's
    annotation query asks for, with that run in the run_id variable."""
    from trainmon.consumers.alerts.grafana import annotation_tags
    from trainmon.schemas import AlertRecord

    alert = AlertRecord(run_id=RUN_ID, rank=0, world_size=2, host="h", time=T0, event_id="a1",
                        ranks=[0], rule="grad_spike", severity="warning", state="firing",
                        incident_id="inc-1", step=3, message="grad norm spike")
    for dashboard in DASHBOARDS:
        queries = [a for a in dashboard["annotations"]["list"]
                   if a["datasource"]["type"] == "grafana" and a.get("target", {}).get("type") == "tags"]
        assert len(queries) == 1 and queries[0]["enable"], dashboard["title"]
        wanted = [tag.replace("${run_id}", RUN_ID) for tag in queries[0]["target"]["tags"]]
        assert not queries[0]["target"]["matchAny"] and set(wanted) <= set(annotation_tags(alert))
        other_run = alert.model_copy(update={"run_id": "another-run"})
        assert not set(wanted) <= set(annotation_tags(other_run))


def test_alert_rule_reads_the_provisioned_source():
    [rule] = ALERT_RULES
    refs = {q["refId"]: q for q in rule["data"]}
    assert refs["A"]["datasourceUid"] == PROVISIONED_SOURCE["uid"]
    assert refs[rule["condition"]]["model"]["expression"] == "A"


# -- the macro expansion itself ---------------------------------------------------------

RANGE = TimeRange(datetime(2026, 1, 1, tzinfo=timezone.utc),
                  datetime(2026, 1, 1, 1, tzinfo=timezone.utc), interval_s=30)
FROM, TO = 1767225600, 1767229200


def test_time_macros_expand_like_the_plugin():
    assert expand("WHERE $__timeFilter(time)", RANGE) == \
        f"WHERE time >= toDateTime({FROM}) AND time <= toDateTime({TO})"
    assert expand("$__timeFilter_ms(t)", RANGE) == (
        f"t >= fromUnixTimestamp64Milli({FROM}000) AND t <= fromUnixTimestamp64Milli({TO}000)")
    assert expand("$__timeInterval(time)", RANGE) == \
        "toStartOfInterval(toDateTime(time), INTERVAL 30 second)"
    assert expand("$__fromTime $__toTime $__interval_s $__fromTime_ms", RANGE) == \
        f"toDateTime({FROM}) toDateTime({TO}) 30 fromUnixTimestamp64Milli({FROM}000)"


def test_variables_and_conditional_all():
    sql = "run_id = '${run_id}' AND $__conditionalAll(rank IN (${rank:csv}), $rank)"
    assert expand(sql, RANGE, {"run_id": "r1", "rank": ALL}) == "run_id = 'r1' AND 1=1"
    assert expand(sql, RANGE, {"run_id": "r1", "rank": [2, 5]}) == \
        "run_id = 'r1' AND rank IN (2,5)"
    assert expand("host IN ($host)", RANGE, {"host": ["a", "b'c"]}) == "host IN ('a','b''c')"


def test_unknown_macros_and_variables_are_errors():
    with pytest.raises(ValueError, match="timeFilterX"):
        expand("$__timeFilterX(time)", RANGE)
    with pytest.raises(ValueError, match=r"\$nope"):
        expand("x = $nope", RANGE)
