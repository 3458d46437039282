"""Views for the common questions, created with the tables (plain views: computed at
query time, so they are never stale and need no backfill). Columns are listed in
docs/clickhouse.md; the Grafana dashboards query these names.

All views read with FINAL, so a record the producer sent twice (same event_id, e.g. a
spill-file replay) is counted once even before ClickHouse merges the duplicate away.
The statements only; :mod:`.schema_setup` runs them.
"""

from __future__ import annotations

from .goodput import VIEWS as GOODPUT_VIEWS

# Megatron's "minmax" timers: per step, each timer's min and max over the ranks, and
# which rank was slowest (the straggler). Step times not logged (NULL) or NaN are left
# out of the timing columns (aggregates skip NULL), so one rank's broken timer does not
# make the step's mean NaN; all of them missing gives NULL.
STEP_ACROSS_RANKS = """
CREATE OR REPLACE VIEW {db}.step_across_ranks AS
SELECT
    run_id,
    step,
    -- ranks, not rows: a rank that logs a step again after resuming from a checkpoint
    -- (same run id, new event ids) is still one rank
    uniqExact(rank) AS ranks_reporting,
    max(world_size) AS world_size,
    min(time) AS first_time,
    max(time) AS last_time,
    min(ms) AS min_duration_ms,
    max(ms) AS max_duration_ms,
    avg(ms) AS mean_duration_ms,
    argMax(rank, ms) AS slowest_rank,
    argMin(rank, ms) AS fastest_rank,
    max(ms) / nullIf(avg(ms), 0) AS straggler_ratio,
    sum(step_tokens) AS step_tokens,
    avg(loss) AS mean_loss,
    min(loss) AS min_loss,
    max(loss) AS max_loss,
    minMap(timers) AS timers_min_ms,
    maxMap(timers) AS timers_max_ms
FROM (
    SELECT run_id, step, rank, world_size, time, step_tokens, loss, timers,
           if(isNaN(duration_ms), NULL, duration_ms) AS ms
    FROM {db}.step FINAL
)
GROUP BY run_id, step
"""

# From the rank_latest rollup (argMax: exact even for a record stored twice): 1,024 rows
# for 1,024 ranks instead of a scan of every step row. The row each rank logged last (by
# time): after a restart from a checkpoint, the new run's step.
LATEST_STEP = """
CREATE OR REPLACE VIEW {db}.latest_step AS
SELECT
    run_id,
    rank,
    step,
    latest.1 AS time,
    latest.2 AS loss,
    latest.3 AS duration_ms,
    latest.4 AS tokens_per_second,
    latest.5 AS lr,
    latest.6 AS norm,
    latest.7 AS epoch,
    latest.8 AS host,
    dateDiff('millisecond', latest.1, now64(6)) / 1000 AS seconds_since
FROM (
    SELECT run_id, rank, argMaxMerge(latest) AS latest, latest.9 AS step
    FROM {db}.rank_latest
    GROUP BY run_id, rank
)
"""

RUN_SUMMARY = """
CREATE OR REPLACE VIEW {db}.{name} AS
SELECT
    seen.run_id AS run_id,
    runs.name AS name,
    runs.project AS project,
    runs.status AS status,
    runs.reason AS reason,
    steps.world_size AS world_size,
    steps.ranks AS ranks,
    coalesce(steps.steps, 0) AS steps,
    steps.last_step AS last_step,
    if(steps.steps > 0, steps.tokens, 0) AS tokens,
    steps.last_loss AS last_loss,
    evals.best_eval_loss AS best_eval_loss,
    coalesce(evals.evals, 0) AS evals,
    coalesce(alerts.alerts_fired, 0) AS alerts_fired,
    coalesce(alerts.alerts_critical, 0) AS alerts_critical,
    coalesce(alerts.alerts_open, 0) AS alerts_open,
    seen.started_at AS started_at,
    seen.last_seen_at AS last_seen_at,
    (toUnixTimestamp64Micro(seen.last_seen_at) - toUnixTimestamp64Micro(seen.started_at)) / 1e6
        AS wall_seconds
FROM (
    SELECT run_id, min(time) AS started_at, max(time) AS last_seen_at
    FROM (
        SELECT run_id, time FROM {db}.run
        UNION ALL {step_times}
        UNION ALL SELECT run_id, time FROM {db}.eval
    )
    GROUP BY run_id
) AS seen
LEFT JOIN (
    SELECT run_id,
           toNullable(anyIf(name, event = 'start')) AS name,
           toNullable(anyIf(project, event = 'start')) AS project,
           toNullable(argMax(status, time)) AS status,
           -- the latest end record that gave a reason; none once the run started again
           if(argMax(event, time) = 'end', argMaxIf(reason, time, event = 'end'), NULL) AS reason
    FROM {db}.run FINAL
    GROUP BY run_id
) AS runs ON runs.run_id = seen.run_id
LEFT JOIN (
{steps}
) AS steps ON steps.run_id = seen.run_id
LEFT JOIN (
    SELECT run_id, toNullable(minIf(loss, isFinite(loss))) AS best_eval_loss, count() AS evals
    FROM {db}.eval FINAL
    GROUP BY run_id
) AS evals ON evals.run_id = seen.run_id
LEFT JOIN (
    SELECT run_id,
           sum(fired) AS alerts_fired,
           sum(critical) AS alerts_critical,
           countIf(last_state = 'firing') AS alerts_open
    FROM (
        SELECT run_id, incident_id,
               countIf(state = 'firing') AS fired,
               countIf(state = 'firing' AND severity = 'critical') AS critical,
               argMax(state, time) AS last_state
        FROM {db}.alert FINAL
        GROUP BY run_id, incident_id
    )
    GROUP BY run_id
) AS alerts ON alerts.run_id = seen.run_id
SETTINGS join_use_nulls = 1
"""
# The columns a run without a match shows as NULL are Nullable in their subqueries too:
# under readonly = 1 (the SQL endpoint's viewer, Grafana's user) ClickHouse does not apply
# the view's join_use_nulls, and an unmatched row would otherwise read 0 or ''.

# run_summary is exact: its step figures come from step_across_ranks (FINAL), so a record
# stored twice counts once; on a 10-million-row run it takes about half a second.
# run_overview is the same view over the rollups (tens of milliseconds, for dashboards):
# equal to run_summary except that tokens and last_loss weigh a record stored twice
# (a resend in a second Kafka message) twice -- see rollups.py -- and that ranks counts
# every rank that logged a step (run_summary: the most ranks that logged one same step).
EXACT_STEPS = """    SELECT run_id,
           toNullable(max(world_size)) AS world_size,
           toNullable(max(ranks_reporting)) AS ranks,
           count() AS steps,
           toNullable(max(step)) AS last_step,
           sum(step_tokens) AS tokens,
           toNullable(argMax(mean_loss, step)) AS last_loss
    FROM {db}.step_across_ranks
    GROUP BY run_id"""
ROLLUP_STEPS = """    SELECT per_step.run_id AS run_id,
           toNullable(max(world_size)) AS world_size,
           toNullable(any(rank_count.ranks)) AS ranks,
           count() AS steps,
           toNullable(max(step)) AS last_step,
           sum(step_tokens) AS tokens,
           toNullable(argMax(mean_loss, step)) AS last_loss
    FROM (
        SELECT run_id, step, max(world_size) AS world_size, sum(step_tokens) AS step_tokens,
               sum(loss_sum) / nullIf(sum(loss_count), 0) AS mean_loss
        FROM {db}.step_stats
        GROUP BY run_id, step
    ) AS per_step
    LEFT JOIN (
        SELECT run_id, uniqExact(rank) AS ranks FROM {db}.rank_latest GROUP BY run_id
    ) AS rank_count ON rank_count.run_id = per_step.run_id
    GROUP BY per_step.run_id"""

# A run's finished checkpoint saves, one row per step (a save's records from every rank
# taken together): the report's and the Health dashboard's checkpoints.
CHECKPOINT_SAVES = """
CREATE OR REPLACE VIEW {db}.checkpoint_saves AS
SELECT run_id, step, min(time) AS time, any(path) AS path, max(duration_ms) AS duration_ms,
       max(bytes) AS bytes
FROM {db}.checkpoint FINAL
WHERE event = 'saved'
GROUP BY run_id, step
"""

# Log events carry a running count per rank and message signature: the latest (largest)
# is the total. One row per run, rank, source, level and signature: the report's and the
# Health dashboard's warnings.
LOG_EVENT_TOTALS = """
CREATE OR REPLACE VIEW {db}.log_event_totals AS
SELECT run_id, rank, source, level, signature, max(count) AS n, any(text) AS text,
       min(first_step) AS first_step, max(last_step) AS last_step
FROM {db}.log_event FINAL
GROUP BY run_id, rank, source, level, signature
"""

VIEWS = {
    "step_across_ranks": STEP_ACROSS_RANKS,
    "latest_step": LATEST_STEP,
    "run_summary": RUN_SUMMARY.replace("{name}", "run_summary").replace("{steps}", EXACT_STEPS)
                              .replace("{step_times}", "SELECT run_id, time FROM {db}.step"),
    "run_overview": RUN_SUMMARY.replace("{name}", "run_overview").replace("{steps}", ROLLUP_STEPS)
                               .replace("{step_times}", "SELECT run_id, last_time FROM {db}.step_stats"),
    "checkpoint_saves": CHECKPOINT_SAVES,
    "log_event_totals": LOG_EVENT_TOTALS,
    **GOODPUT_VIEWS,  # goodput.py: a job's wall time, split
}
