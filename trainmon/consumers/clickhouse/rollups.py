"""Pre-aggregated tables for big runs, kept up to date by materialized views.

A 1,024-rank run of 10,000 steps has 10 million step rows; a dashboard that scans them
(with ``FINAL``) for every panel takes seconds. These tables hold what the dashboards
draw, aggregated when the rows are inserted:

- ``step_stats``: one row per run and step with across-rank statistics (first / last
  time, min / max / mean step time and its median, slowest and fastest rank, loss, lr,
  grad and params norm, tokens, throughput). Medians are ``quantileBFloat16`` states:
  within 1 % (bfloat16 keeps 8 significant bits), and merging ten thousand of them takes
  10 ms where t-digests took 140. Not the timers' min / max over ranks: no dashboard draws
  them, and their ``minMap`` / ``maxMap`` states cost as much per inserted row as all the
  rest (2.2 of 5.5 µs per row with 16 ranks and 20 timers, measured); they stay exact in
  the ``step_across_ranks`` view. (A table created by an older version keeps its view and
  those columns: drop ``step_stats_mv`` and the service creates it again at start.)
- ``rank_latest``: the step every rank logged last (1,024 rows for 1,024 ranks).
- ``rank_10s``: per rank and 10-second bucket (ordered by rank, then time), step time and
  tokens/s sums and extremes (the step-time heatmap and "which ranks stand out" without
  touching the step rows).
- ``gpu_10s`` and ``gpu_rank_1m``: the GPU panels' distribution over all GPUs per 10
  seconds, and per GPU and minute what picks the standouts (GPU_VALUES below).
- ``allocator_10s``: the Memory panels' largest bytes per segment over the ranks per 10
  seconds.
- ``allocator_latest``: each rank's newest allocator sample (a ReplacingMergeTree, read
  with ``FINAL``; the rest here are AggregatingMergeTrees).

Exactly once. A Kafka message reaches these tables once, like the step table: the loader
inserts each partition's batch with a dedup token and
``deduplicate_blocks_in_dependent_materialized_views = 1`` (settings.INSERT_SETTINGS), and every
table here keeps a dedup window, so a retried batch is dropped by the views too, not
only by the step table (tested; with the setting at 0, the default of older servers, a
view counted the retry again; chDB 26.9 defaults to 1).
The one thing the views cannot see is the *same record in two Kafka messages* (a
producer re-sending a message whose acknowledgement was lost): the step table collapses
it (ReplacingMergeTree, read with ``FINAL``), and here extremes, slowest / fastest rank
and the latest step per rank stay exact (max, min, argMax are indifferent to a repeat)
while sums, counts, means and the median weigh it twice. The exact answers stay one
query away in the plain views (``step_across_ranks``, ``run_summary`` read ``FINAL``).

An AggregatingMergeTree merges rows of one key in the background; until then a key can
have several rows, so readers aggregate again (``min(min_duration_ms)``,
``sum(duration_ms_sum) / sum(duration_ms_count)``, ``quantileBFloat16IfMerge``, ...).

The statements only; :mod:`.schema_setup` runs them.
"""

from __future__ import annotations

from .settings import settings_sql

# Columns of step_stats: name -> (type, expression over the step rows of one insert).
# NaN step times are NULL here (as in step_across_ranks), so one broken timer does not
# poison its step.
STEP_STATS_COLUMNS = {
    "first_time": ("SimpleAggregateFunction(min, DateTime64(6, 'UTC'))", "min(time)"),
    "last_time": ("SimpleAggregateFunction(max, DateTime64(6, 'UTC'))", "max(time)"),
    "world_size": ("SimpleAggregateFunction(max, Int64)", "max(world_size)"),
    "total_steps": ("SimpleAggregateFunction(max, Nullable(Int64))", "max(total_steps)"),
    "rows": ("SimpleAggregateFunction(sum, UInt64)", "count()"),
    "min_duration_ms": ("SimpleAggregateFunction(min, Nullable(Float64))", "min(ms)"),
    "max_duration_ms": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(ms)"),
    "duration_ms_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(ms, 0))"),
    "duration_ms_count": ("SimpleAggregateFunction(sum, UInt64)", "count(ms)"),
    "duration_ms_quantiles": ("AggregateFunction(quantileBFloat16If(0.5), Float64, UInt8)",
                              "quantileBFloat16IfState(0.5)(assumeNotNull(ms), isNotNull(ms))"),
    "slowest": ("AggregateFunction(argMaxIf, Int64, Float64, UInt8)",
                "argMaxIfState(rank, assumeNotNull(ms), isNotNull(ms))"),
    "fastest": ("AggregateFunction(argMinIf, Int64, Float64, UInt8)",
                "argMinIfState(rank, assumeNotNull(ms), isNotNull(ms))"),
    "step_tokens": ("SimpleAggregateFunction(sum, Int64)", "sum(ifNull(step_tokens, 0))"),
    # NaN kept: a NaN loss on any rank shows as a NaN mean, as in step_across_ranks.
    "loss_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(loss, 0))"),
    "loss_count": ("SimpleAggregateFunction(sum, UInt64)", "count(loss)"),
    "min_loss": ("SimpleAggregateFunction(min, Nullable(Float64))", "min(loss)"),
    "max_loss": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(loss)"),
    "lr": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(lr)"),
    "norm": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(norm)"),
    "params_norm": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(params_norm)"),
    "tflops_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(tflops_per_gpu, 0))"),
    "tflops_count": ("SimpleAggregateFunction(sum, UInt64)", "count(tflops_per_gpu)"),
    "sol_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(sol_percent, 0))"),
    "sol_count": ("SimpleAggregateFunction(sum, UInt64)", "count(sol_percent)"),
    "min_tokens_per_second": ("SimpleAggregateFunction(min, Nullable(Float64))", "min(tokens_per_second)"),
    "max_tokens_per_second": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(tokens_per_second)"),
    "tokens_per_second_quantiles": ("AggregateFunction(quantileBFloat16If(0.5), Float64, UInt8)",
                                    "quantileBFloat16IfState(0.5)(assumeNotNull(tokens_per_second), "
                                    "isNotNull(tokens_per_second))"),
}
_STEP_ROWS = "SELECT *, if(isNaN(duration_ms), NULL, duration_ms) AS ms FROM {db}.step"
_STEP_ROWS_10S = ("SELECT *, if(isNaN(duration_ms), NULL, duration_ms) AS ms, "
                  "toStartOfInterval(time, INTERVAL 10 second) AS bucket FROM {db}.step")

# The latest row of a rank, kept whole in a tuple (argMax on lone Nullable columns would
# skip NULLs and mix steps), its step included. Latest in time: after a restart
# from a checkpoint the steps start again below the crashed run's last one, and the row
# the rank logged last is the new run's, not the crashed run's highest step.
LATEST_ROW = "(time, loss, duration_ms, tokens_per_second, lr, norm, epoch, host, step_number)"
LATEST_ROW_TYPE = ("Tuple(DateTime64(6, 'UTC'), Nullable(Float64), Nullable(Float64), Nullable(Float64), "
                   "Nullable(Float64), Nullable(Float64), Nullable(Float64), String, Int64)")
# By time alone: a (time, step) tuple made the 16,384-rank "Latest step per rank" panel
# 75-80 ms against 55-60. (Two rows of a rank with one time are a record sent twice: equal.)
LATEST_BY = "time"
LATEST_BY_TYPE = "DateTime64(6, 'UTC')"
# A query that fails on a rollup table an older version made with columns this one cannot
# read: schema_setup.create_rollups makes the table again and fills it from the step table.
PROBES = {"rank_latest": "SELECT finalizeAggregation(latest).9 FROM {db}.rank_latest LIMIT 0"}

RANK_10S_COLUMNS = {
    "duration_ms_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(ms, 0))"),
    "duration_ms_count": ("SimpleAggregateFunction(sum, UInt64)", "count(ms)"),
    "max_duration_ms": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(ms)"),
    "tokens_per_second_sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(tokens_per_second, 0))"),
    "tokens_per_second_count": ("SimpleAggregateFunction(sum, UInt64)", "count(tokens_per_second)"),
    "min_tokens_per_second": ("SimpleAggregateFunction(min, Nullable(Float64))", "min(tokens_per_second)"),
}


# -- GPU: the distribution over a big run's GPUs, and its standouts --------------------
#
# A gpu sample held down by something other than the power cap (alert rule gpu_throttle's
# default): throttle lists the reasons comma separated, "" when none.
THROTTLED = "arrayExists(r -> r NOT IN ('', 'sw_power_cap'), splitByChar(',', throttle))"
# The GPU dashboard's values, one panel each (infra/grafana/build.py): name -> (the value
# of one gpu row, how a GPU's values over a time range make its standing: avg, max or
# min). At 16,384 ranks the gpu table holds 2 million rows of 20 minutes; the panels'
# distribution and standouts read these rollups instead (6x and 40x fewer rows).
GPU_VALUES = {
    "power_w": ("power / 1000", "avg"),
    "power_percent": ("power / nullIf(power_limit, 0) * 100", "avg"),
    "temperature": ("temperature", "max"),
    "below_slowdown": ("temp_slowdown - temperature", "min"),
    "gpu_util": ("gpu_util", "avg"),
    "mem_util": ("mem_util", "avg"),
    "dram_free": ("dram_free", "min"),
    "clock": ("clock", "avg"),
    "pcie_rx": ("pcie_rx", "avg"),
    "pcie_tx": ("pcie_tx", "avg"),
    "throttled": (f"{THROTTLED} * 100", "avg"),
}
_GPU_ROWS = ("SELECT run_id, rank, id, toStartOfInterval(time, INTERVAL {seconds} second) AS bucket, "
             + ", ".join(f"toNullable(toFloat64({row})) AS v_{name}" for name, (row, _) in GPU_VALUES.items())
             + " FROM {{db}}.gpu")
# gpu_10s: per run and 10 seconds, each value's min, median and max over the GPUs.
GPU_10S_COLUMNS = {column: spec for name in GPU_VALUES for column, spec in {
    f"{name}_min": ("SimpleAggregateFunction(min, Nullable(Float64))", f"min(v_{name})"),
    f"{name}_max": ("SimpleAggregateFunction(max, Nullable(Float64))", f"max(v_{name})"),
    f"{name}_median": ("AggregateFunction(quantileBFloat16If(0.5), Float64, UInt8)",
                       f"quantileBFloat16IfState(0.5)(assumeNotNull(v_{name}), isNotNull(v_{name}))"),
}.items()}
# gpu_rank_1m: per run, GPU and minute, what its standing needs (sum and count for avg).
GPU_STANDING = {"avg": {"sum": ("SimpleAggregateFunction(sum, Float64)", "sum(ifNull(v_{0}, 0))"),
                        "count": ("SimpleAggregateFunction(sum, UInt64)", "count(v_{0})")},
                "max": {"max": ("SimpleAggregateFunction(max, Nullable(Float64))", "max(v_{0})")},
                "min": {"min": ("SimpleAggregateFunction(min, Nullable(Float64))", "min(v_{0})")}}
GPU_RANK_1M_COLUMNS = {f"{name}_{part}": (kind, expr.format(name))
                       for name, (_, agg) in GPU_VALUES.items() for part, (kind, expr) in GPU_STANDING[agg].items()}


def gpu_standing(name: str) -> str:
    """A GPU's standing over the rows of gpu_rank_1m it is read from."""
    agg = GPU_VALUES[name][1]
    return {"avg": f"sum({name}_sum) / nullIf(sum({name}_count), 0)", "max": f"max({name}_max)",
            "min": f"min({name}_min)"}[agg]


# -- allocator: memory by segment over a big run's ranks ---------------------------------
#
# At 16,384 ranks the allocator table holds a million rows of 20 minutes; the Memory
# dashboard's segment panels read this when it shows every rank of a big run.
_ALLOCATOR_ROWS = ("SELECT *, toStartOfInterval(time, INTERVAL 10 second) AS bucket, "
                   "CAST(stats.name, 'Array(String)') AS names, "
                   "arrayMap((p, q) -> p + q, stats.pinned, stats.pageable) AS host_bytes FROM {db}.allocator")
# allocator_10s: per run, 10 seconds and list of segment names (producers may list them in
# different orders), each segment's largest device and host bytes over the ranks.
ALLOCATOR_10S_COLUMNS = {
    "device": ("AggregateFunction(maxForEach, Array(Int64))", "maxForEachState(stats.device)"),
    "host": ("AggregateFunction(maxForEach, Array(Int64))", "maxForEachState(host_bytes)"),
}


# allocator_latest: each rank's newest allocator sample (the Memory dashboard's "Latest
# segments per rank"), one row per run and rank. Read from the allocator rows, that
# table took 125-190 ms at 16,384 ranks: every sample of the last 10 minutes, segment
# arrays and all. Here a ReplacingMergeTree on time keeps the newest row of a key, each
# insert already cut to one row per rank by the view, and background merges hold it at a
# few parts of about one row per rank, read with FINAL (15-28 ms, measured with inserts
# as a live stream makes them). An AggregatingMergeTree of argMax states was tried and
# was no faster: merging 16,384 states of four arrays costs what reading the rows does.
_ALLOCATOR_LATEST_ROWS = ("SELECT run_id, rank, time AS sampled_at, step AS step_number, "
                          "CAST(stats.name, 'Array(String)') AS names, stats.device AS device, "
                          "stats.pinned AS pinned, stats.pageable AS pageable FROM {db}.allocator")
ALLOCATOR_LATEST_COLUMNS = {
    "time": ("DateTime64(6, 'UTC')", "max(sampled_at)"),
    "step": ("Int64", "argMax(step_number, sampled_at)"),
    "segments": ("Array(String)", "argMax(names, sampled_at)"),
    "device_bytes": ("Array(Int64)", "argMax(device, sampled_at)"),
    "pinned_bytes": ("Array(Int64)", "argMax(pinned, sampled_at)"),
    "pageable_bytes": ("Array(Int64)", "argMax(pageable, sampled_at)"),
}


def _rollup(db: str, name: str, keys: dict[str, tuple[str, str]], columns: dict[str, tuple[str, str]],
            source: str, engine: str = "AggregatingMergeTree") -> tuple[str, str, str]:
    """CREATE TABLE, CREATE MATERIALIZED VIEW, and the backfill INSERT of one rollup."""
    definitions = [f"`{k}` {t}" for k, (t, _) in {**keys, **columns}.items()]
    table = (f"CREATE TABLE IF NOT EXISTS {db}.{name} (\n    " + ",\n    ".join(definitions) + "\n)\n"
             f"ENGINE = {engine}\nORDER BY ({', '.join(keys)})\nSETTINGS {settings_sql()}")
    select = ("SELECT " + ", ".join(f"{e} AS `{k}`" for k, (_, e) in {**keys, **columns}.items())
              + f"\nFROM ({source.format(db=db)})\nGROUP BY {', '.join(keys)}")
    view = f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{name}_mv TO {db}.{name} AS\n{select}"
    backfill = f"INSERT INTO {db}.{name}\n{select}"
    return table, view, backfill


def rollups(db: str) -> dict[str, tuple[str, str, str]]:
    return {
        "step_stats": _rollup(db, "step_stats",
                              {"run_id": ("LowCardinality(String)", "run_id"), "step": ("Int64", "step")},
                              STEP_STATS_COLUMNS, _STEP_ROWS),
        "rank_latest": _rollup(db, "rank_latest",
                               {"run_id": ("LowCardinality(String)", "run_id"), "rank": ("Int64", "rank")},
                               {"step": ("SimpleAggregateFunction(max, Int64)", "max(step_number)"),
                                "latest": (f"AggregateFunction(argMax, {LATEST_ROW_TYPE}, {LATEST_BY_TYPE})",
                                           f"argMaxState({LATEST_ROW}, {LATEST_BY})")},
                               "SELECT *, step AS step_number FROM {db}.step"),
        # Rank before time: the standouts' lines (a few ranks) read their ranks' rows by the
        # key, and picking them groups by rank; time first, both read every rank's rows
        # (at 16,384 ranks the step panels' standouts took 90-110 ms, 48 rank first).
        "rank_10s": _rollup(db, "rank_10s",
                            {"run_id": ("LowCardinality(String)", "run_id"),
                             "rank": ("Int64", "rank"),
                             "time": ("DateTime('UTC')", "bucket")},
                            RANK_10S_COLUMNS, _STEP_ROWS_10S),
        "gpu_10s": _rollup(db, "gpu_10s",
                           {"run_id": ("LowCardinality(String)", "run_id"),
                            "time": ("DateTime('UTC')", "bucket")},
                           GPU_10S_COLUMNS, _GPU_ROWS.format(seconds=10)),
        "gpu_rank_1m": _rollup(db, "gpu_rank_1m",
                               {"run_id": ("LowCardinality(String)", "run_id"),
                                "time": ("DateTime('UTC')", "bucket"),
                                "rank": ("Int64", "rank"), "id": ("Int64", "id")},
                               GPU_RANK_1M_COLUMNS, _GPU_ROWS.format(seconds=60)),
        "allocator_10s": _rollup(db, "allocator_10s",
                                 {"run_id": ("LowCardinality(String)", "run_id"),
                                  "time": ("DateTime('UTC')", "bucket"),
                                  "names": ("Array(String)", "names")},
                                 ALLOCATOR_10S_COLUMNS, _ALLOCATOR_ROWS),
        "allocator_latest": _rollup(db, "allocator_latest",
                                    {"run_id": ("LowCardinality(String)", "run_id"), "rank": ("Int64", "rank")},
                                    ALLOCATOR_LATEST_COLUMNS, _ALLOCATOR_LATEST_ROWS,
                                    engine="ReplacingMergeTree(time)"),  # readers add FINAL
    }
