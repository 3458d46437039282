"""Goodput of a job: where its wall time went. The one place the time is classified; the
views below are read by ``trainmon goodput``, the report and the Grafana panel alike.
Definitions, with what was chosen where a log cannot tell: docs/goodput.md.

A *job* is every run of one training job across restarts: the run records' ``job_id``
(a run without one is a job of its own). An *attempt* is one run of the job: the k-th
run start of any rank begins the job's k-th attempt, whatever its run id (a requeued
Slurm job and a torchrun restart keep theirs, a fresh process makes a new one). The
job's time, from its first record to its last, is cut into pieces:

- before an attempt's first logged step: start-up (the first attempt) or a restart gap
  (from the previous attempt's last record, checkpoint load included);
- between two logged steps of an attempt: evaluation and checkpoint saves (their logged
  durations; one logged without its duration takes the interval's time beyond its
  steps' expected time), a hang or stall (what is left exceeds ``HANG_FACTOR`` x the
  steps' expected time, the attempt's median time per step: the excess), and productive
  training (the rest);
- after an attempt's last logged step: saves and evaluations as above, then for an
  attempt that did not end in success and was followed by another (a crash, a kill) a
  hang when longer than ``HANG_FACTOR`` median steps, else lost progress; for one that
  ended well (or is the newest), shutdown, counted with start-up.

Lost progress: the training of a crashed attempt after the step the next attempt
resumed from (the newest checkpoint saved before its first logged step, else the step
before it), trained again.

The statements only; :mod:`.schema_setup` runs them (through :data:`.views.VIEWS`).
"""

from __future__ import annotations

# A gap between two logged steps longer than this many times their expected time (the
# attempt's median time per step) is a hang or stall; shorter excess is jitter and counts
# as training. The alert rule `stalled` fires at 10x (and 5 minutes): a goodput account
# also wants the shorter stalls a data loader or a slow collective causes.
HANG_FACTOR = 3

CATEGORIES = ("productive", "startup", "checkpoint", "restart", "hang", "eval", "lost")
LABELS = {
    "productive": "productive training",
    "startup": "start-up and shutdown",
    "checkpoint": "checkpoint saves",
    "restart": "restart gaps",
    "hang": "hangs and stalls",
    "eval": "evaluation",
    "lost": "lost progress (retrained)",
}


def _seconds(since: str, until: str) -> str:
    return f"((toUnixTimestamp64Micro({until}) - toUnixTimestamp64Micro({since})) / 1e6)"


# The job of every run: its run records' job_id, else its own id (a run that logged steps
# and no run record too).
JOB_RUNS = """
CREATE OR REPLACE VIEW {db}.job_runs AS
SELECT run_id, assumeNotNull(ifNull(any(job), toString(run_id))) AS job_id
FROM (
    SELECT run_id, job_id AS job FROM {db}.run
    UNION ALL
    SELECT DISTINCT run_id, CAST(NULL, 'Nullable(String)') AS job FROM {db}.step_stats
)
GROUP BY run_id
"""

# One row per piece of a job's wall time, its seconds in the column of its category.
# One scan of the record tables, then window functions over a stream that shrinks at each
# level (rows -> one item per step, save and evaluation -> one slot per step interval):
# ClickHouse evaluates a WITH subquery again at each mention, so each is mentioned once.
GOODPUT_PIECES = """
CREATE OR REPLACE VIEW {db}.goodput_pieces AS
WITH
job_rows AS (
    SELECT j.job_id AS job_id, r.rank AS rank, r.time AS time, r.what AS what,
           r.step AS step, r.ms AS ms, r.status AS status
    FROM (
        SELECT run_id, rank, time, concat('run_', event) AS what,
               CAST(NULL, 'Nullable(Int64)') AS step, CAST(NULL, 'Nullable(Float64)') AS ms,
               toString(ifNull(status, '')) AS status
        FROM {db}.run FINAL
        UNION ALL
        SELECT run_id, rank, time, 'step', toNullable(step), CAST(NULL, 'Nullable(Float64)'), ''
        FROM {db}.step FINAL
        -- the lowest rank that logs steps stands for the run (its ranks step together):
        -- the table's key, so 1/world_size of the rows are read
        WHERE (run_id, rank) IN (SELECT run_id, min(rank) FROM {db}.rank_latest GROUP BY run_id)
        UNION ALL
        SELECT run_id, rank, time, concat('checkpoint_', event), toNullable(step), duration_ms, ''
        FROM {db}.checkpoint FINAL
        UNION ALL
        SELECT run_id, rank, time, 'eval', toNullable(step), duration_ms, ''
        FROM {db}.eval FINAL
    ) AS r
    INNER JOIN {db}.job_runs AS j ON j.run_id = r.run_id
),
-- the k-th run start of any rank begins the job's k-th attempt (a start sorts before a
-- record of the same instant: a log read by trainmon ingest dates it at the first step)
placed AS (
    SELECT job_id, time, what, step, ms, status,
           greatest(max(rank_attempt) OVER (PARTITION BY job_id ORDER BY time, what != 'run_start'
                                            ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), 1) AS attempt
    FROM (
        SELECT *, countIf(what = 'run_start') OVER (PARTITION BY job_id, rank ORDER BY time, what != 'run_start'
                                                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS rank_attempt
        FROM job_rows
    )
),
-- one item per logged step (its first rank's time), finished save, evaluation, and one
-- for the attempt's run records
items AS (
    SELECT job_id, attempt,
           multiIf(what = 'step', 'step', startsWith(what, 'checkpoint_'), 'checkpoint',
                   what = 'eval', 'eval', 'run') AS kind,
           if(kind = 'run', 0, assumeNotNull(step)) AS at_step,
           if(kind = 'checkpoint', maxIf(time, what = 'checkpoint_saved'), min(time)) AS t,
           min(time) AS first_time,
           max(time) AS last_time,
           multiIf(countIf(what != 'checkpoint_started' AND isFinite(ifNull(ms, nan))) > 0,
                   toNullable(maxIf(ms, what != 'checkpoint_started' AND isFinite(ifNull(ms, nan))) / 1000),
                   countIf(what = 'checkpoint_started') > 0,
                   toNullable({save_span}),
                   CAST(NULL, 'Nullable(Float64)')) AS seconds,
           countIf(what = 'checkpoint_saved') AS saves,
           countIf(what = 'run_end') AS ends,
           countIf(what = 'run_end' AND status != 'success') AS bad_ends
    FROM placed
    GROUP BY job_id, attempt, kind, at_step
    HAVING kind != 'checkpoint' OR saves > 0
),
-- slot n: the n-th logged step of the attempt and the saves and evaluations before it
-- (after the step before); the slot after the last step: its tail; slot 0: run records
slots AS (
    SELECT job_id, attempt, slot,
           countIf(kind = 'step') > 0 AS has_mark,
           anyIf(t, kind = 'step') AS t,
           anyIf(at_step, kind = 'step') AS mark_step,
           min(first_time) AS slot_first, max(last_time) AS slot_last,
           sumIf(ifNull(seconds, 0), kind = 'checkpoint') AS save_known,
           countIf(kind = 'checkpoint' AND seconds IS NULL) AS save_unknown,
           sumIf(ifNull(seconds, 0), kind = 'eval') AS eval_known,
           countIf(kind = 'eval' AND seconds IS NULL) AS eval_unknown,
           groupArrayIf(at_step, kind = 'checkpoint') AS saved_steps,
           sum(ends) AS ends, sum(bad_ends) AS bad_ends
    FROM (
        SELECT *, if(kind = 'run', 0,
                     countIf(kind = 'step') OVER (PARTITION BY job_id, attempt, kind = 'run'
                                                  ORDER BY t, kind != 'step', at_step
                                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) + 1) AS slot
        FROM items
    )
    GROUP BY job_id, attempt, slot
),
attempt_level AS (
    SELECT *,
           if(has_mark AND slot > 1 AND mark_step > prev_step, {interval} / (mark_step - prev_step),
              NULL) AS per_step_s,
           min(slot_first) OVER a AS started_at,
           max(slot_last) OVER a AS ended_at,
           sum(ends) OVER a > 0 AND sum(bad_ends) OVER a = 0 AS ended_well,
           countIf(has_mark) OVER a > 0 AS has_steps,
           minIf(t, has_mark) OVER a AS first_step_time,
           maxIf(t, has_mark) OVER a AS last_step_time,
           -- the tail follows one slot: steps logged at the same instant (a log's coarse
           -- timestamps) share the last step's time, and each would add the tail again
           maxIf(slot, has_mark) OVER a AS last_step_slot,
           argMinIf(mark_step, t, has_mark) OVER a AS first_step,
           min(slot) OVER a AS first_slot,
           sumIf(save_known, NOT has_mark AND slot > 0) OVER a AS tail_save_known,
           sumIf(save_unknown, NOT has_mark AND slot > 0) OVER a AS tail_save_unknown,
           sumIf(eval_known, NOT has_mark AND slot > 0) OVER a AS tail_eval_known,
           sumIf(eval_unknown, NOT has_mark AND slot > 0) OVER a AS tail_eval_unknown
    FROM (
        SELECT *, lagInFrame(t) OVER a AS prev_t, lagInFrame(mark_step) OVER a AS prev_step
        FROM slots
        WINDOW a AS (PARTITION BY job_id, attempt ORDER BY slot
                     ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
    )
    WINDOW a AS (PARTITION BY job_id, attempt ORDER BY slot
                 ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
),
job_level AS (
    SELECT *,
           quantileExact(0.5)(per_step_s) OVER (PARTITION BY job_id, attempt) AS step_s,
           attempt = min(attempt) OVER (PARTITION BY job_id) AS first_attempt,
           max(attempt) OVER (PARTITION BY job_id) > attempt AS followed,
           max(ended_at) OVER (PARTITION BY job_id ORDER BY attempt
                               RANGE BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous_end,
           -- the first step of the next attempt that logged one
           argMinIf(first_step, attempt, has_steps) OVER (PARTITION BY job_id ORDER BY attempt
                               RANGE BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_first_step,
           countIf(has_steps) OVER (PARTITION BY job_id ORDER BY attempt
                               RANGE BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) > 0 AS resumed_later,
           groupArrayArray(saved_steps) OVER (PARTITION BY job_id ORDER BY attempt
                               RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS saved_so_far
    FROM attempt_level
),
classified AS (
    SELECT *,
           followed AND NOT ended_well AS crashed,
           -- the step the next attempt resumed from: the newest checkpoint saved so far
           -- below its first logged step, else the step before that; no later attempt
           -- logged a step: nothing is known to be trained again
           if(NOT resumed_later, 9223372036854775807,
              arrayMax(arrayConcat([next_first_step - 1],
                                   arrayFilter(s -> s < next_first_step, saved_so_far)))) AS resume_step,
           if(first_attempt, started_at, previous_end) AS gap_from,
           -- between two logged steps
           {interval} AS d,
           greatest(mark_step - prev_step, 1) * step_s AS expected,
           least(save_known, d) AS save_k,
           least(eval_known, d - save_k) AS eval_k,
           d - save_k - eval_k AS rest,
           greatest(rest - expected, 0) AS excess,
           if(save_unknown > 0, excess, 0) AS save_x,
           if(save_unknown = 0 AND eval_unknown > 0, excess, 0) AS eval_x,
           if(save_unknown + eval_unknown = 0 AND rest > {factor} * expected, excess, 0) AS hang,
           rest - save_x - eval_x - hang AS trained,
           crashed AND mark_step > resume_step AS retrained,
           -- after the last logged step
           {tail} AS tail_d,
           least(tail_save_known, tail_d) AS tail_save_k,
           least(tail_eval_known, tail_d - tail_save_k) AS tail_eval_k,
           tail_d - tail_save_k - tail_eval_k AS tail_rest,
           if(tail_save_unknown > 0, tail_rest, 0) AS tail_save_x,
           if(tail_save_unknown = 0 AND tail_eval_unknown > 0, tail_rest, 0) AS tail_eval_x,
           tail_rest - tail_save_x - tail_eval_x AS tail_left,
           if(crashed AND tail_left > {factor} * step_s, tail_left, 0) AS tail_hang
    FROM job_level
)
SELECT job_id, attempt, p.1 AS piece, p.2 AS time_from, p.3 AS time_to,
       p.4 AS productive_s, p.5 AS startup_s, p.6 AS checkpoint_s, p.7 AS restart_s,
       p.8 AS hang_s, p.9 AS eval_s, p.10 AS lost_s
FROM classified
ARRAY JOIN arrayConcat(
    -- start-up or restart gap: up to the first logged step, or the whole attempt without one
    if((has_steps AND has_mark AND slot = 1) OR (NOT has_steps AND slot = first_slot),
       [('start', gap_from, if(has_steps, t, ended_at), 0.,
         if(first_attempt, {gap}, 0.), 0., if(first_attempt, 0., {gap}), 0., 0., 0.)], []),
    if(has_mark AND slot > 1,
       [('steps', prev_t, t, if(retrained, 0., trained), 0., save_k + save_x, 0., hang,
         eval_k + eval_x, if(retrained, trained, 0.))], []),
    if(has_mark AND slot = last_step_slot,
       [('tail', t, ended_at, 0., if(crashed, 0., tail_left), tail_save_k + tail_save_x, 0.,
         tail_hang, tail_eval_k + tail_eval_x, if(crashed, tail_left - tail_hang, 0.))], [])
) AS p
""".replace("{interval}", _seconds("prev_t", "t")) \
   .replace("{save_span}", _seconds("minIf(time, what = 'checkpoint_started')",
                                    "maxIf(time, what = 'checkpoint_saved')")) \
   .replace("{gap}", _seconds("gap_from", "if(has_steps, t, ended_at)")) \
   .replace("{tail}", _seconds("last_step_time", "ended_at")) \
   .replace("{factor}", str(HANG_FACTOR))

_SUMS = ",\n    ".join(f"sum({c}_s) AS {c}_s" for c in CATEGORIES)

# Per job: its wall time, split; goodput = productive / wall.
GOODPUT = f"""
CREATE OR REPLACE VIEW {{db}}.goodput AS
SELECT job_id,
    max(attempt) AS runs,
    min(time_from) AS started_at,
    max(time_to) AS ended_at,
    {_SUMS},
    productive_s + startup_s + checkpoint_s + restart_s + hang_s + eval_s + lost_s AS wall_s,
    productive_s / nullIf(wall_s, 0) AS goodput
FROM {{db}}.goodput_pieces
GROUP BY job_id
"""

# Per job and UTC day: a piece counts on the day it ends.
GOODPUT_DAILY = f"""
CREATE OR REPLACE VIEW {{db}}.goodput_daily AS
SELECT job_id, toDate(time_to) AS day,
    {_SUMS},
    productive_s + startup_s + checkpoint_s + restart_s + hang_s + eval_s + lost_s AS wall_s,
    productive_s / nullIf(wall_s, 0) AS goodput
FROM {{db}}.goodput_pieces
GROUP BY job_id, day
"""

# What the Grafana panel reads: goodput_daily, recomputed by ClickHouse every minute into a
# table (a refreshable materialized view). The view itself costs ~130 ms of query planning
# alone (measured on empty tables; the same at 16,384 ranks), over a dashboard query's
# 100 ms; a day's goodput a minute old serves the panel as well. ``trainmon goodput`` and
# the report read the views, current to the record. The table is made again at every
# start from the view's columns (EMPTY AS SELECT), so it follows a view that changed.
REFRESHED_EVERY = "1 MINUTE"
GOODPUT_DAILY_LATEST = """
CREATE OR REPLACE TABLE {db}.goodput_daily_latest
ENGINE = MergeTree ORDER BY (job_id, day)
EMPTY AS SELECT * FROM {db}.goodput_daily
"""
# (Dropped and made again rather than CREATE OR REPLACE, which a materialized view takes
# only in recent ClickHouse versions; IF NOT EXISTS: two services starting at once.)
DROP_GOODPUT_DAILY_LATEST_MV = "DROP VIEW IF EXISTS {db}.goodput_daily_latest_mv"
GOODPUT_DAILY_LATEST_MV = f"""
CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.goodput_daily_latest_mv
REFRESH EVERY {REFRESHED_EVERY} TO {{db}}.goodput_daily_latest
AS SELECT * FROM {{db}}.goodput_daily
"""
# The refreshed views: schema_setup.refresh_now runs them at once (after a load, a replay).
REFRESHED = ("goodput_daily_latest_mv",)

VIEWS = {
    "job_runs": JOB_RUNS,
    "goodput_pieces": GOODPUT_PIECES,
    "goodput": GOODPUT,
    "goodput_daily": GOODPUT_DAILY,
    "goodput_daily_latest": GOODPUT_DAILY_LATEST,
    "goodput_daily_latest_mv (the old one)": DROP_GOODPUT_DAILY_LATEST_MV,
    "goodput_daily_latest_mv": GOODPUT_DAILY_LATEST_MV,
}
