-- The DDL trainmon 3763773 (2026-11-23, a previous session's release) ran on a fresh database:
-- every statement its create_all sent, recorded by running that commit's own code from a git
-- worktree against chDB (scripts/record_release_ddl.py 3763773). tests/test_upgrades.py creates a database with it and has today's
-- loader migrate and load it. Since then: step/eval fields became optional, Megatron's
-- nan_iterations was added, and the gpu_health, checkpoint, disk and log_event kinds.

CREATE DATABASE IF NOT EXISTS trainmon;

CREATE TABLE IF NOT EXISTS trainmon.step (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `step` Int64,
    `epoch` Float64,
    `step_tokens` Int64,
    `duration_ms` Float64,
    `loss` Float64,
    `norm` Float64,
    `lr` Float64,
    `tokens_per_second` Nullable(Float64),
    `total_steps` Nullable(Int64),
    `loss_scale` Nullable(Float64),
    `params_norm` Nullable(Float64),
    `num_zeros` Nullable(Int64),
    `num_params` Nullable(Int64),
    `consumed_samples` Nullable(Int64),
    `skipped` Nullable(Int64),
    `global_batch_size` Nullable(Int64),
    `tflops_per_gpu` Nullable(Float64),
    `sol_percent` Nullable(Float64),
    `losses` Map(String, Float64),
    `timers` Map(String, Float64),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, step, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.eval (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `step` Int64,
    `epoch` Float64,
    `eval_tokens` Int64,
    `duration_ms` Float64,
    `loss` Float64,
    `tokens_per_second` Nullable(Float64),
    `perplexity` Nullable(Float64),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, step, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.moe (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `step` Int64,
    `aux_loss` Float64,
    `z_loss` Float64,
    `expert_utilization` Float64,
    `load_imbalance` Float64,
    `layer_aux_loss` Array(Float64),
    `layer_z_loss` Array(Float64),
    `layer_utilization` Array(Float64),
    `layer_imbalance` Array(Float64),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, step, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.gpu (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `step` Int64,
    `id` Int64,
    `clock` Int64,
    `max_clock` Int64,
    `power` Int64,
    `power_limit` Int64,
    `temperature` Int64,
    `temp_slowdown` Int64,
    `gpu_util` Int64,
    `mem_util` Int64,
    `dram_free` Int64,
    `pcie_rx` Int64,
    `pcie_tx` Int64,
    `fan` Int64,
    `throttle` LowCardinality(String),
    `energy` Nullable(Int64),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, step, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.allocator (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `step` Int64,
    `stats` Nested(`name` LowCardinality(String), `device` Int64, `managed` Int64, `pinned` Int64, `pageable` Int64),
    `allocated` Nullable(Int64),
    `peak_allocated` Nullable(Int64),
    `active` Nullable(Int64),
    `inactive` Nullable(Int64),
    `reserved` Nullable(Int64),
    `alloc_retries` Nullable(Int64),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, step, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.dataset (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `split` LowCardinality(String),
    `files` Int64,
    `tokens` Int64,
    `file_index` Int64,
    `chunk_index` Int64,
    `seed` Int64,
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, time, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.gpu_model (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `id` Int64,
    `name` LowCardinality(String),
    `sm_count` Int64,
    `major` Int64,
    `minor` Int64,
    `memory` Int64,
    `free` Int64,
    `l2_size` Int64,
    `uuid` String,
    `ecc` Bool,
    `cuda_driver` LowCardinality(String),
    `cuda_runtime` LowCardinality(String),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, time, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.run (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `event` LowCardinality(String),
    `status` LowCardinality(Nullable(String)),
    `name` LowCardinality(Nullable(String)),
    `project` LowCardinality(Nullable(String)),
    `config` String,
    `hostnames` Array(String),
    `versions` Map(String, String),
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, time, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS trainmon.alert (
    `run_id` LowCardinality(String),
    `rank` Int64,
    `world_size` Int64,
    `host` LowCardinality(String),
    `time` DateTime64(6, 'UTC'),
    `event_id` String,
    `schema_version` Int64,
    `rule` LowCardinality(String),
    `severity` LowCardinality(String),
    `state` LowCardinality(String),
    `incident_id` String,
    `ranks` Array(Int64),
    `step` Nullable(Int64),
    `value` Nullable(Float64),
    `threshold` Nullable(Float64),
    `message` String,
    `_topic` LowCardinality(String),
    `_partition` Int32,
    `_offset` Int64,
    `_inserted_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (run_id, rank, time, event_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE OR REPLACE VIEW trainmon.step_across_ranks AS
SELECT
    run_id,
    step,
    count() AS ranks_reporting,
    max(world_size) AS world_size,
    min(time) AS first_time,
    max(time) AS last_time,
    min(duration_ms) AS min_duration_ms,
    max(duration_ms) AS max_duration_ms,
    avg(duration_ms) AS mean_duration_ms,
    argMax(rank, duration_ms) AS slowest_rank,
    argMin(rank, duration_ms) AS fastest_rank,
    max(duration_ms) / nullIf(avg(duration_ms), 0) AS straggler_ratio,
    sum(step_tokens) AS step_tokens,
    avg(loss) AS mean_loss,
    min(loss) AS min_loss,
    max(loss) AS max_loss,
    minMap(timers) AS timers_min_ms,
    maxMap(timers) AS timers_max_ms
FROM trainmon.step FINAL
GROUP BY run_id, step;

CREATE OR REPLACE VIEW trainmon.latest_step AS
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
    SELECT run_id, rank, max(step_number) AS step, argMax(row, step_number) AS latest
    FROM (
        SELECT run_id, rank, step AS step_number,
               (time, loss, duration_ms, tokens_per_second, lr, norm, epoch, host) AS row
        FROM trainmon.step FINAL
    )
    GROUP BY run_id, rank
);

CREATE OR REPLACE VIEW trainmon.run_summary AS
SELECT
    seen.run_id AS run_id,
    runs.name AS name,
    runs.project AS project,
    runs.status AS status,
    steps.world_size AS world_size,
    steps.ranks AS ranks,
    coalesce(steps.steps, 0) AS steps,
    steps.last_step AS last_step,
    coalesce(steps.tokens, 0) AS tokens,
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
        SELECT run_id, time FROM trainmon.run
        UNION ALL SELECT run_id, time FROM trainmon.step
        UNION ALL SELECT run_id, time FROM trainmon.eval
    )
    GROUP BY run_id
) AS seen
LEFT JOIN (
    SELECT run_id,
           anyIf(name, event = 'start') AS name,
           anyIf(project, event = 'start') AS project,
           argMax(status, time) AS status
    FROM trainmon.run FINAL
    GROUP BY run_id
) AS runs ON runs.run_id = seen.run_id
LEFT JOIN (
    SELECT run_id,
           max(world_size) AS world_size,
           max(ranks_reporting) AS ranks,
           count() AS steps,
           max(step) AS last_step,
           sum(step_tokens) AS tokens,
           argMax(mean_loss, step) AS last_loss
    FROM trainmon.step_across_ranks
    GROUP BY run_id
) AS steps ON steps.run_id = seen.run_id
LEFT JOIN (
    SELECT run_id, minIf(loss, isFinite(loss)) AS best_eval_loss, count() AS evals
    FROM trainmon.eval FINAL
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
        FROM trainmon.alert FINAL
        GROUP BY run_id, incident_id
    )
    GROUP BY run_id
) AS alerts ON alerts.run_id = seen.run_id
SETTINGS join_use_nulls = 1;

