"""Writes the Grafana dashboards (trainmon/grafana/dashboards/*.json, shipped in the package) from the compact
definitions below: `python infra/grafana/build.py`. tests/test_dashboards.py checks the
JSON files are what this script writes, and runs every query against chDB.

Queries use the ClickHouse plugin's macros ($__timeFilter, $__timeInterval,
$__conditionalAll, ...) and the template variables run_id and rank. Tables and views are
those of trainmon.consumers.clickhouse (docs/clickhouse.md); names are unqualified so
the data source's default database applies.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainmon.consumers.clickhouse.rollups import GPU_VALUES, THROTTLED, gpu_standing

OUT = Path(__file__).resolve().parents[2] / "trainmon" / "grafana" / "dashboards"
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = {"type": PLUGIN, "uid": "trainmon-clickhouse"}
# The run id as a heredoc string ($$...$$): Grafana puts a single-valued variable in as it
# is, and a run id is any text; in '...' an apostrophe broke the query and a backslash
# was read as an escape.
RUN = "run_id = $$${run_id}$$"
RANKS = "$__conditionalAll(rank IN (${rank:csv}), $rank)"
# Series name of one GPU of one rank.
GPU_SERIES = "concat('rank ', toString(rank), ' gpu ', toString(id))"

RUN_VARIABLE = {
    "name": "run_id", "label": "Run", "type": "query", "datasource": DATASOURCE,
    # Newest first, from the run table (plus runs that logged steps but no run record).
    "query": ("SELECT run_id FROM (\n"
              "    SELECT run_id, max(time) AS seen FROM run GROUP BY run_id\n"
              "    UNION ALL SELECT run_id, max(last_time) FROM step_stats GROUP BY run_id\n"
              ")\nGROUP BY run_id\nORDER BY max(seen) DESC"),
    "refresh": 2, "multi": False, "includeAll": False, "sort": 0, "current": {}, "options": [],
}
ALERT_ANNOTATION = {
    "name": "trainmon alerts", "enable": True, "iconColor": "red", "datasource": DATASOURCE,
    "target": {
        "refId": "Anno", "editorType": "sql", "format": 1, "queryType": "table",
        # One marker per incident: from firing to resolved (open incidents have no end).
        "rawSql": (
            "SELECT fired_at AS time, resolved_at AS timeEnd, text, tags\n"
            "FROM (\n"
            "    SELECT minIf(time, state = 'firing') AS fired_at,\n"
            "           if(countIf(state = 'resolved') > 0, maxIf(time, state = 'resolved'), NULL) AS resolved_at,\n"
            "           concat(upper(any(severity)), ' ', any(rule), ': ', argMinIf(message, time, state = 'firing')) AS text,\n"
            "           [any(rule), any(severity)] AS tags\n"
            "    FROM alert FINAL\n"
            f"    WHERE {RUN} AND $__timeFilter(time)\n"
            "    GROUP BY incident_id\n"
            "    HAVING countIf(state = 'firing') > 0\n"
            ")\n"
            "ORDER BY time"),
    },
}
# The annotations `trainmon consume alerts` writes to Grafana (GRAFANA_URL), found by their
# tags: every dashboard shows those of its run. With the forwarder on, they mark the same
# incidents as the ClickHouse markers above (either can be switched off in the dashboard).
FORWARDED_ANNOTATION = {
    "name": "trainmon alerts (Grafana annotations)", "enable": True, "iconColor": "orange",
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "target": {"type": "tags", "tags": ["trainmon", "run_id:${run_id}"], "matchAny": False, "limit": 500},
}
BUILTIN_ANNOTATION = {
    "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
    "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
    "type": "dashboard",
}


def timeseries(title: str, *queries: str, unit: str = "short", width: int = 12,
               height: int = 8, description: str = "", stack: bool = False, log: bool = False) -> dict:
    custom = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": True}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    return {"type": "timeseries", "title": title, "description": description,
            "w": width, "h": height, "format": 0, "queryType": "timeSeries", "queries": queries,
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def table(title: str, query: str, width: int = 12, height: int = 8, description: str = "",
          units: dict[str, str] | None = None) -> dict:
    overrides = [{"matcher": {"id": "byName", "options": column},
                  "properties": [{"id": "unit", "value": unit}]}
                 for column, unit in (units or {}).items()]
    return {"type": "table", "title": title, "description": description, "w": width, "h": height,
            "format": 1, "queryType": "table", "queries": (query,),
            "fieldConfig": {"defaults": {}, "overrides": overrides},
            "options": {"showHeader": True, "cellHeight": "sm"}}


def stat(title: str, query: str, unit: str = "short", width: int = 4, height: int = 4,
         description: str = "") -> dict:
    return {"type": "stat", "title": title, "description": description, "w": width, "h": height,
            "format": 1, "queryType": "table", "queries": (query,),
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "none", "textMode": "auto"}}


def heatmap(title: str, *queries: str, unit: str, width: int = 24, height: int = 9,
            description: str = "") -> dict:
    return {"type": "heatmap", "title": title, "description": description, "w": width, "h": height,
            "format": 0, "queryType": "timeSeries", "queries": queries,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left"},
                        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                        "rowsFrame": {"layout": "auto"},
                        "tooltip": {"mode": "single", "yHistogram": False}}}


def bar_chart(title: str, query: str, width: int = 12, height: int = 8, description: str = "") -> dict:
    return {"type": "barchart", "title": title, "description": description, "w": width, "h": height,
            "format": 1, "queryType": "table", "queries": (query,),
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"orientation": "auto", "showValue": "auto", "legend": {"showLegend": False}}}


def series(value: str, table_: str, *, label: str | None = None, time: str = "time",
           where: str = "", alias: str = "value") -> str:
    """A time series query: one value per interval, one series per ``label`` value."""
    label_sql = f", {label} AS series" if label else ""
    group = "time, series" if label else "time"
    extra = f" AND {where}" if where else ""
    return (f"SELECT $__timeInterval({time}) AS time{label_sql}, {value} AS \"{alias}\"\n"
            f"FROM {table_}\n"
            f"WHERE {RUN} AND $__timeFilter({time}){extra}\n"
            f"GROUP BY {group}\n"
            f"ORDER BY time")


# -- across ranks: every rank's line in small runs, the distribution in big ones -------
#
# A 1,024-rank run cannot be drawn as 1,024 lines (and a million points). An across-rank
# panel therefore has three queries, of which the run's size switches on one or two:
#   A. one line per rank (per GPU): runs of at most PER_RANK_LINES_UP_TO ranks, or the
#      ranks picked in the rank variable;
#   B. min / median / max over the ranks per interval: bigger runs with all ranks;
#   C. the STANDOUTS ranks that stand out most over the time range, as lines: bigger runs
#      (ties go to the lowest rank: the same lines at every refresh).
# The switch is a constant after ClickHouse evaluates the scalar subquery, so a query
# switched off reads no rows.
PER_RANK_LINES_UP_TO = 16
STANDOUTS = 3
RANK_COUNT = f"(SELECT uniqExact(rank) FROM rank_latest WHERE {RUN})"
ALL_RANKS = "$__conditionalAll(0, $rank)"  # "1=1" with All selected, "0" with ranks picked
LINES = f"(NOT ({ALL_RANKS}) OR {RANK_COUNT} <= {PER_RANK_LINES_UP_TO})"
DISTRIBUTION = f"({ALL_RANKS}) AND {RANK_COUNT} > {PER_RANK_LINES_UP_TO}"
RANK_SERIES = "concat('rank ', toString(rank))"

# -- the rank variable: every rank in small runs, the standouts in big ones -------------
#
# A drop-down of 16,384 ranks is unusable, and Grafana loads every option on each refresh.
# Runs of up to RANK_OPTIONS_UP_TO ranks list every rank; bigger runs list only the ranks
# worth a look, each labelled with why: the RANK_PICKS slowest over the time range (a
# superset of the "slowest" lines of the across-rank panels), the RANK_PICKS most behind
# (2 steps or more: a rank that stopped), and the ranks named by the run's alerts in the
# time range (those naming at most 8 ranks). "All" keeps its meaning, every rank: the
# panels test it with $__conditionalAll (Grafana's "$__all", not the listed options, and
# no allValue), so bands and standouts still cover the whole run. Any other rank can be
# typed in (allowCustomValue).
RANK_OPTIONS_UP_TO = 256
RANK_PICKS = 10
RANK_OPTIONS = f"""SELECT rank, label FROM (
    SELECT rank, toString(rank) AS label
    FROM rank_latest
    WHERE {RUN} AND {RANK_COUNT} <= {RANK_OPTIONS_UP_TO}
    GROUP BY rank
    UNION ALL
    SELECT rank, concat(toString(rank), ' (', arrayStringConcat(arraySort(groupUniqArray(why)), ', '), ')')
    FROM (
        SELECT rank, 'slowest' AS why FROM rank_10s WHERE {RUN} AND $__timeFilter(time)
        GROUP BY rank ORDER BY sum(duration_ms_sum) / nullIf(sum(duration_ms_count), 0) DESC, rank LIMIT {RANK_PICKS}
        UNION ALL
        SELECT rank, 'behind' FROM rank_latest WHERE {RUN}
        GROUP BY rank HAVING max(step) < (SELECT max(step) FROM rank_latest WHERE {RUN}) - 1
        ORDER BY max(step), rank LIMIT {RANK_PICKS}
        UNION ALL
        SELECT arrayJoin(ranks) AS rank, 'alert' FROM alert FINAL
        WHERE {RUN} AND $__timeFilter(time) AND length(ranks) <= 8
        GROUP BY rank ORDER BY max(time) DESC LIMIT {2 * RANK_PICKS}
    )
    WHERE {RANK_COUNT} > {RANK_OPTIONS_UP_TO}
    GROUP BY rank
)
ORDER BY rank"""
RANK_VARIABLE = {
    "name": "rank", "label": "Rank", "type": "query", "datasource": DATASOURCE,
    "description": f"Up to {RANK_OPTIONS_UP_TO} ranks: every rank. Bigger runs: only the ranks "
                   f"that stand out (the {RANK_PICKS} slowest in the time range, those 2 steps or "
                   "more behind, those named by alerts); type any other rank. All: every rank "
                   "(min / median / max bands and the standouts).",
    "query": RANK_OPTIONS,
    "refresh": 2, "multi": True, "includeAll": True, "allowCustomValue": True, "sort": 0,
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
}


def _and(*conditions: str) -> str:
    return " AND ".join(c for c in conditions if c)


def bands(low: str, mid: str, high: str, source: str, alias: str, time: str = "time") -> str:
    """Min / median / max per interval as three series (query B)."""
    return (f"SELECT time, series, value AS \"{alias}\"\nFROM (\n"
            f"    SELECT $__timeInterval({time}) AS time, {low} AS low, {mid} AS mid, {high} AS high\n"
            f"    FROM {source}\n"
            f"    WHERE {_and(RUN, f'$__timeFilter({time})', DISTRIBUTION)}\n"
            f"    GROUP BY time\n)\n"
            f"ARRAY JOIN ['min', 'median', 'max'] AS series, [low, mid, high] AS value\n"
            f"ORDER BY time")


def across(row: str, agg: str, table: str, alias: str, worst: str, *, key: str = "rank",
           label: str = RANK_SERIES, where: str = "") -> tuple[str, str, str]:
    """Queries A, B, C of an across-rank panel over a record table: ``agg(row)`` per rank
    (or per ``key``, e.g. "rank, id" for GPUs) and interval; the distribution of ``row``
    over the samples of each interval; the STANDOUTS keys with the highest (``worst`` =
    "max") or lowest ("min") ``agg(row)`` over the range."""
    lines = series(f"{agg}({row})", table, label=label, where=_and(RANKS, LINES, where), alias=alias)
    distribution = bands("min(v)", "quantileBFloat16(0.5)(v)", "max(v)",
                         f"(SELECT run_id, time, {row} AS v FROM {table} WHERE {_and(RUN, where)})", alias)
    order = "DESC" if worst == "max" else "ASC"
    picked = (f"({key}) IN (SELECT {key} FROM {table} WHERE {_and(RUN, '$__timeFilter(time)', where)} "
              f"GROUP BY {key} ORDER BY {agg}({row}) {order}, {key} LIMIT {STANDOUTS})")
    standouts = series(f"{agg}({row})", table, label=label, where=_and(DISTRIBUTION, picked, where),
                       alias=alias)
    return lines, distribution, standouts


def per_rank(row: str, agg: str, table_: str, alias: str, worst: str = "max") -> tuple[str, str, str]:
    return across(row, agg, table_, alias, worst)


def per_gpu(row: str, agg: str, alias: str, worst: str = "max", where: str = "",
            table: str = "gpu") -> tuple[str, str, str]:
    return across(row, agg, table, alias, worst, key="rank, id", label=GPU_SERIES, where=where)


def gpu_panel(name: str, alias: str, worst: str = "max") -> tuple[str, str, str]:
    """Queries A, B, C of a GPU panel (``name`` of rollups.GPU_VALUES): each GPU's line
    from the gpu rows; the distribution from gpu_10s; the standouts picked by their
    standing in gpu_rank_1m, their lines from the gpu rows (a few GPUs: the key's rank
    prefix finds them)."""
    row, agg = GPU_VALUES[name]
    lines = per_gpu(row, agg, alias, worst)[0]
    distribution = bands(f"min({name}_min)", f"quantileBFloat16IfMerge(0.5)({name}_median)",
                         f"max({name}_max)", "gpu_10s", alias)
    order = "DESC" if worst == "max" else "ASC"
    picked = (f"(rank, id) IN (SELECT rank, id FROM gpu_rank_1m WHERE {RUN} AND $__timeFilter(time) "
              f"GROUP BY rank, id ORDER BY {gpu_standing(name)} {order}, rank, id LIMIT {STANDOUTS})")
    standouts = series(f"{agg}({row})", "gpu", label=GPU_SERIES, where=_and(DISTRIBUTION, picked),
                       alias=alias)
    return lines, distribution, standouts


def by_segment(values: str, rollup_column: str) -> tuple[str, str]:
    """Allocator memory per segment (weights, gradients, ...), the max over ranks per
    interval: from the allocator rows for the ranks picked or a small run, from
    allocator_10s (its ``rollup_column``) for every rank of a big one. Rows are grouped by
    their list of segment names first, so the element-wise max lines up names and values
    even if producers list segments in different orders."""
    def query(names: str, m: str, table_: str, where: str) -> str:
        return ("SELECT time, series, max(v) AS \"bytes\"\n"
                "FROM (\n"
                f"    SELECT $__timeInterval(time) AS time, {names} AS names, {m} AS m\n"
                f"    FROM {table_}\n"
                f"    WHERE {RUN} AND $__timeFilter(time) AND {where}\n"
                "    GROUP BY time, names\n)\n"
                "ARRAY JOIN names AS series, m AS v\n"
                "GROUP BY time, series\nORDER BY time")
    return (query("stats.name", f"maxForEach({values})", "allocator", _and(RANKS, LINES)),
            query("names", f"maxForEachMerge({rollup_column})", "allocator_10s", DISTRIBUTION))


def mean(column: str) -> str:
    """The mean of a rollup's sum / count pair (NULL where nothing was logged)."""
    return f"sum({column}_sum) / nullIf(sum({column}_count), 0)"


def step_panel(column: str, alias: str, low: str, median: str, high: str,
                      rank_mean: str, worst: str) -> tuple[str, str, str]:
    """Queries A, B, C of a step-record panel, B and C from the rollups: the distribution
    from step_stats, the standouts (by their mean over the range) from rank_10s."""
    lines = per_rank(column, "avg", "step", alias)[0]
    distribution = bands(low, median, high, "step_stats", alias, time="last_time")
    order = "DESC" if worst == "max" else "ASC"
    picked = (f"rank IN (SELECT rank FROM rank_10s WHERE {RUN} AND $__timeFilter(time) "
              f"GROUP BY rank ORDER BY {rank_mean} {order}, rank LIMIT {STANDOUTS})")
    standouts = series(rank_mean, "rank_10s", label=RANK_SERIES, where=_and(DISTRIBUTION, picked),
                       alias=alias)
    return lines, distribution, standouts


# -- dashboards ------------------------------------------------------------------------

ETA_SQL = f"""SELECT
    last_step,
    total_steps,
    seconds_per_step,
    if(total_steps IS NULL, NULL, greatest(total_steps - last_step, 0) * seconds_per_step) AS eta
FROM (
    SELECT max(step) AS last_step,
           (SELECT max(total_steps) FROM step_stats WHERE {RUN}) AS total_steps,
           (max(toUnixTimestamp64Milli(last_time)) - min(toUnixTimestamp64Milli(last_time)))
               / 1000 / greatest(max(step) - min(step), 1) AS seconds_per_step
    FROM (SELECT step, max(last_time) AS last_time FROM step_stats WHERE {RUN}
          GROUP BY step ORDER BY step DESC LIMIT 50)
)"""
# Tokens of all ranks per step over the slowest rank's step time, averaged per interval.
TOKENS_PER_SECOND = ("SELECT $__timeInterval(step_time) AS time, avg(step_tokens * 1000 / nullIf(slowest_ms, 0)) "
                     "AS \"tokens/s\"\n"
                     "FROM (SELECT step, max(last_time) AS step_time, sum(step_tokens) AS step_tokens, "
                     "max(max_duration_ms) AS slowest_ms\n"
                     f"      FROM step_stats WHERE {RUN} AND $__timeFilter(last_time) GROUP BY step)\n"
                     "GROUP BY time\nORDER BY time")

RUN_OVERVIEW = {
    "uid": "trainmon-run-overview", "title": "trainmon / Run overview", "ranks": False,
    "description": "Loss, eval loss, learning rate, grad norm, throughput and ETA of one run.",
    "panels": [
        stat("Status", f"SELECT status FROM run_overview WHERE {RUN}", width=4),
        stat("Last step", f"SELECT max(step) FROM step_stats WHERE {RUN}", width=4),
        stat("Tokens", f"SELECT sum(step_tokens) FROM step_stats WHERE {RUN}", width=4),
        stat("Best eval loss", f"SELECT minIf(loss, isFinite(loss)) FROM eval FINAL WHERE {RUN}", width=4),
        stat("Open alerts", f"SELECT alerts_open FROM run_overview WHERE {RUN}", width=4),
        stat("ETA", f"SELECT eta FROM ({ETA_SQL})", unit="s", width=4,
             description="Steps left (total_steps - last step) times the mean wall time "
                         "per step over the last 50 steps."),
        timeseries("Loss",
                   series(mean("loss"), "step_stats", time="last_time", alias="train loss"),
                   series("avg(loss)", "eval", alias="eval loss"),
                   description="Train loss: the mean over ranks."),
        timeseries("Learning rate", series("max(lr)", "step_stats", time="last_time", alias="lr")),
        timeseries("Grad norm", series("max(norm)", "step_stats", time="last_time", alias="grad norm"),
                   series("max(params_norm)", "step_stats", time="last_time", alias="params norm"),
                   description="Global grad L2 norm (before clipping, as Megatron and the HF Trainer "
                               "log it); the max over ranks."),
        timeseries("Tokens / s", TOKENS_PER_SECOND,
                   description="Tokens of all ranks per step over the slowest rank's step time."),
        timeseries("TFLOPS per GPU and SOL %",
                   series(mean("tflops"), "step_stats", time="last_time", alias="TFLOPS per GPU"),
                   series(mean("sol"), "step_stats", time="last_time", alias="SOL %")),
        table("Run", f"SELECT * FROM run_overview WHERE {RUN}",
              units={"wall_seconds": "s", "tokens": "short"}),
        table("Goodput of the run's job, per day",
              "SELECT day, round(100 * goodput, 1) AS `goodput %`, productive_s AS training, "
              "startup_s AS `start-up`, checkpoint_s AS `checkpoint saves`, restart_s AS restarts, "
              "hang_s AS `hangs and stalls`, eval_s AS evaluation, lost_s AS `lost progress`, "
              "wall_s AS wall\n"
              # (the view recomputed every minute into a table: the view itself costs
              # ~130 ms of query planning, see consumers/clickhouse/goodput.py)
              f"FROM goodput_daily_latest\nWHERE job_id IN (SELECT job_id FROM job_runs WHERE {RUN})\n"
              "ORDER BY day DESC",
              width=24, height=6,
              units={c: "s" for c in ("training", "start-up", "checkpoint saves", "restarts",
                                      "hangs and stalls", "evaluation", "lost progress", "wall")},
              description="Every run of this run's job (TRAINMON_JOB_ID, the Slurm job id, ...) "
                          "across restarts: where each UTC day's wall time went, recomputed every "
                          "minute. Definitions: docs/goodput.md."),
    ],
}

SLOWEST = "if(sum(duration_ms_count) = 0, NULL, argMaxIfMerge(slowest))"
# Ranks per heatmap row in big runs: at most 64 rows.
RANK_GROUP = f"greatest(intDiv({RANK_COUNT} + 63, 64), 1)"
RANKS_DASHBOARD = {
    "uid": "trainmon-ranks", "title": "trainmon / Ranks", "ranks": True,
    "description": "Step time per rank, stragglers and the latest step of every rank.",
    "panels": [
        heatmap("Step time heatmap",
                per_rank("duration_ms", "avg", "step", "step ms")[0],
                "SELECT time, concat('ranks ', leftPad(toString(first_rank), 5, '0')) AS series, "
                "slowest AS \"step ms\"\n"
                "FROM (\n"
                f"    SELECT $__timeInterval(time) AS time, intDiv(rank, {RANK_GROUP}) * {RANK_GROUP} AS first_rank,\n"
                "           max(duration_ms_sum / nullIf(duration_ms_count, 0)) AS slowest\n"
                "    FROM rank_10s\n"
                f"    WHERE {RUN} AND $__timeFilter(time) AND {DISTRIBUTION}\n"
                "    GROUP BY time, first_rank\n)\nORDER BY time", unit="ms",
                description="Rows are ranks, color is step time: a straggler is a hot row. In runs "
                            f"of more than {PER_RANK_LINES_UP_TO} ranks a row is a group of ranks "
                            "(at most 64 rows) colored by its slowest rank."),
        timeseries("Step time across ranks",
                   *step_panel("duration_ms", "step ms", "min(min_duration_ms)",
                                      "quantileBFloat16IfMerge(0.5)(duration_ms_quantiles)",
                                      "max(max_duration_ms)", mean("duration_ms"), worst="max"),
                   unit="ms", description=f"One line per rank up to {PER_RANK_LINES_UP_TO} ranks; "
                                          f"above, min / median / max over the ranks and the "
                                          f"{STANDOUTS} slowest ranks."),
        timeseries("Tokens / s across ranks",
                   *step_panel("tokens_per_second", "tokens/s", "min(min_tokens_per_second)",
                                      "quantileBFloat16IfMerge(0.5)(tokens_per_second_quantiles)",
                                      "max(max_tokens_per_second)", mean("tokens_per_second"), worst="min"),
                   description=f"One line per rank up to {PER_RANK_LINES_UP_TO} ranks; above, min / "
                               f"median / max over the ranks and the {STANDOUTS} slowest ranks."),
        table("Stragglers (slowest steps)",
              f"SELECT step, {SLOWEST} AS slowest_rank, max(max_duration_ms) AS max_duration_ms,\n"
              f"       {mean('duration_ms')} AS mean_duration_ms,\n"
              "       max_duration_ms / nullIf(mean_duration_ms, 0) AS straggler_ratio, sum(rows) AS ranks_reporting\n"
              "FROM step_stats\n"
              f"WHERE {RUN} AND $__timeFilter(last_time)\n"
              "GROUP BY step\n"
              "ORDER BY straggler_ratio DESC, step DESC\nLIMIT 20",
              units={"max_duration_ms": "ms", "mean_duration_ms": "ms"},
              description="straggler_ratio = slowest rank's step time / mean over ranks."),
        bar_chart("Ranks most often the slowest",
                  "SELECT toString(slowest_rank) AS rank, count() AS steps_slowest\n"
                  f"FROM (SELECT step, {SLOWEST} AS slowest_rank FROM step_stats\n"
                  f"      WHERE {RUN} AND $__timeFilter(last_time) GROUP BY step)\n"
                  "WHERE slowest_rank IS NOT NULL\n"
                  "GROUP BY rank\nORDER BY steps_slowest DESC\nLIMIT 20"),
        table("Latest step per rank",
              "SELECT rank, host, step, max(step) OVER () - step AS steps_behind, loss, "
              "duration_ms, tokens_per_second, seconds_since\n"
              "FROM latest_step\n"
              f"WHERE {RUN} AND {RANKS}\n"
              "ORDER BY steps_behind DESC, seconds_since DESC, rank",
              units={"duration_ms": "ms", "seconds_since": "s"},
              description="Ranks most behind first: a rank that stopped reporting falls behind "
                          "and its seconds_since grows."),
    ],
}

GPU_DASHBOARD = {
    "uid": "trainmon-gpu", "title": "trainmon / GPU", "ranks": True,
    "description": "NVML telemetry of every GPU: power, temperature, utilization, memory, "
                   "clocks and throttling.",
    "panels": [
        timeseries("Power", *gpu_panel("power_w", "W", worst="min"), unit="watt"),
        timeseries("Power / limit", *gpu_panel("power_percent", "% of limit", worst="min"),
                   unit="percent"),
        timeseries("Temperature", *gpu_panel("temperature", "°C"), unit="celsius"),
        timeseries("Degrees below slowdown", *gpu_panel("below_slowdown", "°C", worst="min"),
                   unit="celsius", description="Headroom to the slowdown threshold."),
        timeseries("GPU utilization", *gpu_panel("gpu_util", "%", worst="min"), unit="percent"),
        timeseries("Memory-bus utilization", *gpu_panel("mem_util", "%"), unit="percent"),
        timeseries("Free GPU memory", *gpu_panel("dram_free", "bytes", worst="min"), unit="bytes"),
        timeseries("SM clock", *gpu_panel("clock", "MHz", worst="min"), unit="rotmhz"),
        timeseries("PCIe", *gpu_panel("pcie_rx", "rx"), *gpu_panel("pcie_tx", "tx"),
                   unit="Bps"),
        timeseries("Throttled samples", *gpu_panel("throttled", "%"),
                   unit="percent", description=(
                       "Share of samples with a throttle reason other than the power cap "
                       "(sw_power_cap is how a busy GPU runs: a healthy H200 training run "
                       "showed it on 74 % of its samples).")),
        table("Throttle events",
              "SELECT time, rank, id AS gpu, throttle, clock, max_clock, temperature, power\n"
              "FROM gpu\n"
              f"WHERE {RUN} AND $__timeFilter(time) AND {RANKS} AND {THROTTLED}\n"
              # a sample Kafka stored twice (a retried send) is listed once; FINAL would
              # merge every GPU sample of the run first, this only the throttled ones
              "ORDER BY time DESC\nLIMIT 1 BY event_id\nLIMIT 200",
              units={"power": "mwatt"}),
        table("GPU models",
              "SELECT rank, host, id AS gpu, name, sm_count, memory, l2_size, uuid, ecc, "
              "cuda_driver, cuda_runtime\n"
              "FROM gpu_model FINAL\n"
              f"WHERE {RUN} AND {RANKS}\n"
              "ORDER BY rank, gpu",
              units={"memory": "bytes", "l2_size": "bytes"}),
    ],
}

MOE_DASHBOARD = {
    "uid": "trainmon-moe", "title": "trainmon / MoE", "ranks": True,
    "description": "Router health of mixture-of-experts layers.",
    "panels": [
        timeseries("Load-balancing aux loss", *per_rank("aux_loss", "avg", "moe", "aux loss"),
                   description="Switch / Megatron E·Σ f·P; 1.0 is perfectly balanced."),
        timeseries("Router z-loss", *per_rank("z_loss", "avg", "moe", "z-loss")),
        timeseries("Expert utilization", *per_rank("expert_utilization * 100", "avg", "moe", "%", worst="min"),
                   unit="percent", description="Share of experts that received tokens."),
        timeseries("Load imbalance", *per_rank("load_imbalance", "max", "moe", "max / mean"),
                   description="Most loaded expert over the mean load; 1.0 is balanced."),
        heatmap("Load imbalance per layer",
                "SELECT $__timeInterval(time) AS time, "
                "concat('layer ', leftPad(toString(layer), 3, '0')) AS series, "
                "max(imbalance) AS \"max / mean\"\n"
                "FROM moe\n"
                "ARRAY JOIN layer_imbalance AS imbalance, arrayEnumerate(layer_imbalance) AS layer\n"
                f"WHERE {RUN} AND $__timeFilter(time) AND {RANKS}\n"
                "GROUP BY time, series\nORDER BY time",
                unit="short"),
        table("Worst layers (latest step)",
              "SELECT layer, max(imbalance) AS load_imbalance, min(utilization) AS expert_utilization\n"
              "FROM moe\n"
              "ARRAY JOIN layer_imbalance AS imbalance, layer_utilization AS utilization, "
              "arrayEnumerate(layer_imbalance) AS layer\n"
              f"WHERE {RUN} AND {RANKS} AND step = (SELECT max(step) FROM moe WHERE {RUN})\n"
              "GROUP BY layer\nORDER BY load_imbalance DESC\nLIMIT 20"),
    ],
}

MEMORY_DASHBOARD = {
    "uid": "trainmon-memory", "title": "trainmon / Memory", "ranks": True,
    "description": "torch.cuda caching allocator counters and memory by segment.",
    "panels": [
        timeseries("Allocated", *per_rank("allocated", "max", "allocator", "allocated"), unit="bytes"),
        timeseries("Peak allocated", *per_rank("peak_allocated", "max", "allocator", "peak"),
                   unit="bytes"),
        timeseries("Reserved", *per_rank("reserved", "max", "allocator", "reserved"), unit="bytes",
                   description="Held by the caching allocator; reserved - allocated is cache."),
        timeseries("Inactive (fragmentation)", *per_rank("inactive", "max", "allocator", "inactive"),
                   unit="bytes"),
        timeseries("Memory by segment (device)", *by_segment("stats.device", "device"), unit="bytes",
                   stack=True, description="weights / gradients / optimizer / activations, max over ranks."),
        timeseries("Memory by segment (host)",
                   *by_segment("arrayMap((p, q) -> p + q, stats.pinned, stats.pageable)", "host"),
                   unit="bytes", stack=True, description="Pinned plus pageable host memory."),
        stat("Allocation retries", f"SELECT max(alloc_retries) FROM allocator WHERE {RUN}",
             description="cudaMalloc retries after freeing cache: a sign of memory pressure."),
        table("Latest segments per rank",
              # allocator_latest: one row per rank (rollups.py); from the allocator rows,
              # every sample of the last 10 minutes, this took 125-190 ms at 16,384 ranks
              "SELECT rank, segment, device, pinned, pageable\n"
              "FROM allocator_latest FINAL\n"
              "ARRAY JOIN segments AS segment, device_bytes AS device, pinned_bytes AS pinned,\n"
              "           pageable_bytes AS pageable\n"
              f"WHERE {RUN} AND {RANKS}\n"
              f"    AND time >= (SELECT max(time) FROM allocator_latest WHERE {RUN}) - INTERVAL 10 MINUTE\n"
              "ORDER BY device DESC, rank, segment\nLIMIT 200",
              width=20, units={"device": "bytes", "pinned": "bytes", "pageable": "bytes"},
              description="The latest sample of every rank that reported in the run's last 10 "
                          "minutes; the biggest segments first."),
    ],
}

# Views the report reads too (trainmon/consumers/clickhouse/views.py): one row per save,
# one per rank and message signature with its total count.
SAVES = f"SELECT step, time, path, duration_ms, bytes FROM checkpoint_saves WHERE {RUN}"
WARNING_TOTALS = f"SELECT * FROM log_event_totals WHERE {RUN} AND {RANKS}"

HEALTH_DASHBOARD = {
    "uid": "trainmon-health", "title": "trainmon / Health", "ranks": True,
    "description": "The rest of the production checklist: GPU error counters (ECC, row "
                   "remapping, XID), checkpoints and the disk they go to, warnings the logs printed.",
    "panels": [
        timeseries("Corrected ECC errors", *per_gpu("ecc_volatile_corrected", "max", "errors", table="gpu_health"),
                   description="Volatile count since the driver loaded; a steady climb is memory "
                               "going bad (rule ecc_corrected_rising)."),
        timeseries("Uncorrected ECC errors and XIDs",
                   *per_gpu("ecc_volatile_uncorrected", "max", "uncorrected", table="gpu_health"),
                   # FINAL: a sample Kafka stored twice (a retried send) is one row, not two sums
                   series("sum(xid_count)", "gpu_health FINAL", label=f"concat({GPU_SERIES}, ' xid')",
                          where=f"{RANKS} AND xid_count > 0", alias="critical XIDs"),
                   description="Any uncorrected error or critical XID is an alert (ecc_uncorrected, "
                               "xid_critical)."),
        table("GPU health (latest per GPU)",
              "SELECT rank, host, id AS gpu,\n"
              "       argMax(ecc_volatile_corrected, time) AS ecc_corrected,\n"
              "       argMax(ecc_volatile_uncorrected, time) AS ecc_uncorrected,\n"
              "       argMax(ecc_aggregate_uncorrected, time) AS ecc_uncorrected_lifetime,\n"
              "       argMax(remapped_rows_pending, time) AS remap_pending,\n"
              "       argMax(remapped_rows_failed, time) AS remap_failed,\n"
              "       argMax(retired_pages_double_bit, time) AS retired_pages_dbe,\n"
              "       argMax(pcie_replays, time) AS pcie_replays,\n"
              "       sum(xid_count) AS xid_events, arrayDistinct(arrayFlatten(groupArray(xids))) AS xid_codes\n"
              "FROM gpu_health FINAL\n"
              f"WHERE {RUN} AND {RANKS}\n"
              "GROUP BY rank, host, gpu\n"
              "ORDER BY ecc_uncorrected DESC, xid_events DESC, rank, gpu",
              width=24, description="Empty cells: the GPU does not report that counter (not zero)."),
        stat("Steps since the last checkpoint",
             f"SELECT (SELECT max(step) FROM step WHERE {RUN}) - max(step) AS steps\n"
             f"FROM checkpoint_saves WHERE {RUN}", width=6),
        stat("Last save took", f"SELECT argMax(duration_ms, step) FROM ({SAVES})", unit="ms", width=6),
        stat("Disk free now", f"SELECT argMax(free_bytes, time) FROM disk WHERE {RUN}",
             unit="bytes", width=6),
        stat("Warnings in the logs", f"SELECT sum(n) FROM ({WARNING_TOTALS})", width=6),
        timeseries("Checkpoint save duration", series("max(duration_ms)", "checkpoint",
                                                      where="event = 'saved'", alias="save"),
                   unit="ms", description="A save much slower than the run's usual is an alert "
                                          "(checkpoint_slow)."),
        timeseries("Checkpoint disk free", series("min(free_bytes)", "disk",
                                                  label="concat(host, ':', path)", alias="free"),
                   unit="bytes", description="Free space where checkpoints go "
                                             "(TRAINMON_CHECKPOINT_DIR); checkpoint_disk_filling "
                                             "projects when it runs out."),
        table("Checkpoints",
              "SELECT step, time, steps_since_previous, seconds_since_previous, duration_ms, bytes, path\n"
              "FROM (\n"
              "    SELECT step, time, path, duration_ms, bytes,\n"
              "           step - lagInFrame(step, 1, step) OVER w AS steps_since_previous,\n"
              "           dateDiff('second', lagInFrame(time, 1, time) OVER w, time) AS seconds_since_previous\n"
              f"    FROM ({SAVES})\n"
              "    WINDOW w AS (ORDER BY step ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)\n"
              ")\n"
              "ORDER BY step DESC\nLIMIT 100",
              units={"duration_ms": "ms", "bytes": "bytes", "seconds_since_previous": "s"},
              description="Time between checkpoints: a gap much longer than the cadence is an "
                          "alert (checkpoint_overdue)."),
        bar_chart("Warnings per rank",
                  "SELECT concat('rank ', toString(rank)) AS rank_name, sum(n) AS warnings\n"
                  f"FROM ({WARNING_TOTALS})\n"
                  "GROUP BY rank\nORDER BY rank",
                  description="NCCL, CUDA and Python warnings and errors the ingest parsers "
                              "counted; a burst on one rank is an alert (nccl_warning_burst)."),
        table("Warnings and errors in the logs",
              "SELECT source, level, sum(n) AS count, groupArray(rank) AS ranks, min(first_step) AS first_step,\n"
              "       max(last_step) AS last_step, any(text) AS example\n"
              f"FROM ({WARNING_TOTALS})\n"
              "GROUP BY source, level, signature\n"
              "ORDER BY count DESC\nLIMIT 100",
              width=24, description="One row per message signature (numbers, addresses and paths "
                                    "masked), counted over ranks."),
        table("Producer health (latest per rank)",
              "SELECT rank, host, argMax(step, time) AS step, argMax(queued, time) AS queued,\n"
              "       argMax(spilled, time) AS spilled, argMax(held_in_memory, time) AS in_memory,\n"
              "       argMax(dropped, time) AS dropped, argMax(last_sent_age_s, time) AS last_sent_age_s,\n"
              "       argMax(spill_error, time) AS spill_error, max(time) AS reported\n"
              "FROM producer_health FINAL\n"
              f"WHERE {RUN} AND {RANKS}\n"
              "GROUP BY rank, host\n"
              "ORDER BY dropped DESC, spilled + in_memory DESC, rank",
              units={"last_sent_age_s": "s"},
              description="Each rank's producer, from its producer_health records (every minute): "
                          "records waiting for Kafka, lost, and how long since it last sent "
                          "(rules producer_dropped_records, producer_spill_refused, "
                          "producer_not_sending; docs/metrics.md)."),
        timeseries("Records waiting for Kafka",
                   series("max(spilled + held_in_memory)", "producer_health",
                          label="concat('rank ', toString(rank))", where=RANKS, alias="waiting"),
                   description="Records in the producers' spill files or memory: 0 while Kafka "
                               "takes everything; a rise is an outage, told once the records arrive."),
    ],
}

OPEN_INCIDENTS = (
    "SELECT run_id, rule, severity, incident_id, first_fired, last_value, message\n"
    "FROM (\n"
    "    SELECT run_id, rule, incident_id, any(severity) AS severity,\n"
    "           minIf(time, state = 'firing') AS first_fired, argMax(state, time) AS last_state,\n"
    "           argMax(value, time) AS last_value, argMax(message, time) AS message\n"
    "    FROM alert FINAL\n"
    "    WHERE {where}\n"
    "    GROUP BY run_id, rule, incident_id\n"
    ")\n"
    "WHERE last_state = 'firing'\n"
    "ORDER BY first_fired DESC")

ALERTS_DASHBOARD = {
    "uid": "trainmon-alerts", "title": "trainmon / Alerts", "ranks": False,
    "description": "Alerts raised by `trainmon consume alerts`, also shown as markers on "
                   "every dashboard.",
    "panels": [
        stat("Incidents open now", f"SELECT alerts_open FROM run_overview WHERE {RUN}", width=6),
        stat("Critical alerts fired", f"SELECT alerts_critical FROM run_overview WHERE {RUN}",
             width=6),
        bar_chart("Alerts by rule",
                  "SELECT rule, countIf(state = 'firing') AS fired\n"
                  f"FROM alert FINAL\nWHERE {RUN} AND $__timeFilter(time)\n"
                  "GROUP BY rule\nORDER BY fired DESC"),
        table("Open incidents", OPEN_INCIDENTS.format(where=RUN), width=24),
        table("Alert events",
              "SELECT time, state, severity, rule, ranks, step, value, threshold, message, incident_id\n"
              f"FROM alert FINAL\nWHERE {RUN} AND $__timeFilter(time)\n"
              "ORDER BY time DESC\nLIMIT 500",
              width=24, height=10),
    ],
}

DASHBOARDS = {"run-overview": RUN_OVERVIEW, "ranks": RANKS_DASHBOARD, "gpu": GPU_DASHBOARD,
              "moe": MOE_DASHBOARD, "memory": MEMORY_DASHBOARD, "health": HEALTH_DASHBOARD,
              "alerts": ALERTS_DASHBOARD}


def _layout(panels: list[dict]) -> list[dict]:
    """Grafana JSON panels, placed left to right in rows of 24 columns."""
    out, x, y, row_height = [], 0, 0, 0
    for number, spec in enumerate(panels, start=1):
        if x + spec["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "editorType": "sql",
                    "format": spec["format"], "queryType": spec["queryType"], "rawSql": sql}
                   for i, sql in enumerate(spec["queries"])]
        labelled = [sql for sql in spec["queries"] if " AS series" in sql]
        if labelled and spec["format"] == 0:
            # Name each series by its label ("rank 1 gpu 1") instead of "W {series=...}".
            name = "${__field.labels.series}" + (" ${__field.name}" if len(spec["queries"]) > 1 else "")
            spec["fieldConfig"]["defaults"]["displayName"] = name
        panel = {"id": number, "type": spec["type"], "title": spec["title"],
                 "gridPos": {"x": x, "y": y, "w": spec["w"], "h": spec["h"]},
                 "datasource": DATASOURCE, "targets": targets,
                 "fieldConfig": spec["fieldConfig"], "options": spec["options"]}
        if spec["description"]:
            panel["description"] = spec["description"]
        out.append(panel)
        x += spec["w"]
        row_height = max(row_height, spec["h"])
    return out


def dashboard(spec: dict) -> dict:
    links = [{"title": "trainmon", "type": "dashboards", "tags": ["trainmon"], "asDropdown": True,
              "includeVars": True, "keepTime": True}]
    variables = [RUN_VARIABLE] + ([RANK_VARIABLE] if spec["ranks"] else [])
    return {
        "uid": spec["uid"], "title": spec["title"], "description": spec["description"],
        "tags": ["trainmon"], "editable": False, "graphTooltip": 1, "schemaVersion": 39,
        "version": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "timepicker": {}, "timezone": "browser", "links": links,
        "annotations": {"list": [BUILTIN_ANNOTATION, ALERT_ANNOTATION, FORWARDED_ANNOTATION]},
        "templating": {"list": variables},
        "panels": _layout(spec["panels"]),
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{name}.json": json.dumps(dashboard(spec), indent=2, ensure_ascii=False) + "\n"
            for name, spec in DASHBOARDS.items()}


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(OUT / name)


if __name__ == "__main__":
    main()
