"""``trainmon demo``: the whole pipeline on one machine in a couple of minutes.

1. a local Kafka broker (KRaft, from Maven jars);
2. the ClickHouse consumer on embedded chDB, and the alerts engine, as services;
3. a real multi-rank torch training job (gloo, CPU) logging through the producer, with
   injected anomalies: a grad spike, one rank stalling, a NaN loss;
4. then what happened: rows per table, the alerts that fired, example SQL with answers,
   and an HTML report with the plots a person would look at.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import stack
from ..broker import free_port
from ..consumers.clickhouse.cli import query
from ..consumers.clickhouse.client import Target
from ..consumers.clickhouse.sql_endpoint import find_endpoint
from ..schemas import RECORD_TYPES

TABLES = list(RECORD_TYPES)  # one table per record kind

# The alert thresholds are the engine's defaults; only time windows are shortened so a
# 100-step demo can show the rules that need a grace period.
DEMO_ALERT_ENV = {
    "TRAINMON_ALERT_RANK_MISMATCH_GRACE_S": "4",
    "TRAINMON_ALERT_WALL_CLOCK_SLACK_S": "2",
}

EXAMPLE_QUERIES = [
    ("Run summary", "SELECT * FROM trainmon.run_summary WHERE run_id = {run}", "Vertical"),
    ("The five slowest steps and who held them up (the straggler view)",
     "SELECT step, ranks_reporting AS ranks, round(min_duration_ms) AS min_ms, "
     "round(mean_duration_ms) AS mean_ms, round(max_duration_ms) AS max_ms, slowest_rank "
     "FROM trainmon.step_across_ranks WHERE run_id = {run} ORDER BY max_ms DESC LIMIT 5",
     "PrettyCompactMonoBlock"),
    ("Loss and grad norm per rank around the NaN",
     "SELECT step, rank, loss, norm, skipped FROM trainmon.step FINAL WHERE run_id = {run} "
     "AND step BETWEEN {nan_step} - 1 AND {nan_step} + 1 ORDER BY step, rank", "PrettyCompactMonoBlock"),
    ("Mean tokens/s per rank",
     "SELECT rank, round(avg(tokens_per_second)) AS tokens_per_s, round(quantile(0.99)(duration_ms)) "
     "AS p99_step_ms FROM trainmon.step FINAL WHERE run_id = {run} GROUP BY rank ORDER BY rank",
     "PrettyCompactMonoBlock"),
]


@dataclass(frozen=True)
class Injected:
    """The anomalies the training job injects, and so the alerts the demo expects."""

    spike_step: int
    stall_step: int
    stall_rank: int
    nan_step: int
    nan_rank: int


class Progress:
    def __init__(self, total: int):
        self.total, self.n, self.started = total, 0, time.monotonic()

    def __call__(self, text: str) -> None:
        self.n += 1
        print(f"[{self.n}/{self.total} {time.monotonic() - self.started:5.1f}s] {text}", flush=True)


def _rows(target: Target, sql: str) -> list[dict]:
    out = query(target, sql, "JSONEachRow").decode()
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _wait_for(condition, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except Exception:  # the service may still be creating its tables
            pass
        time.sleep(interval)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainmon demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("demo-output"),
                        help="where the broker, chDB, logs and report.html go (emptied first)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stall-seconds", type=float, default=12.0)
    args = parser.parse_args(argv)

    out = args.output.resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    injected = Injected(spike_step=30, stall_step=52, stall_rank=min(2, args.ranks - 1),
                        nan_step=75, nan_rank=1 % args.ranks)
    progress = Progress(6)

    progress("starting the stack as 'trainmon up' does: Kafka (KRaft, loopback) and the supervised "
             "consumers, ClickHouse (embedded chDB) and the alerts engine")
    stack_dir = out / "stack"
    started = stack.up(stack_dir, stack.Layout(port=free_port()), [], None, env=DEMO_ALERT_ENV, announce=False, stop_with_caller=True)
    try:
        if started != 0:
            raise RuntimeError(f"the stack did not start; see {stack_dir}/*.log")
        target = Target(path=stack_dir / "clickhouse")
        env = {**os.environ,
               "TRAINMON_KAFKA_BOOTSTRAP": stack.broker_of(stack_dir).bootstrap,
               "TRAINMON_CLICKHOUSE_PATH": str(target.path),
               "TRAINMON_RUN_ID": run_id,
               "TRAINMON_SPILL_DIR": str(out / "spill"),
               "PYTHONUNBUFFERED": "1"}
        # The report reads through the service's SQL endpoint, never the directory itself:
        # chDB locks it, and a service starting while we held it would find it busy.
        if not _wait_for(lambda: find_endpoint(target.path) is not None, 120):
            raise RuntimeError(f"the ClickHouse consumer did not start; see {stack_dir}/clickhouse.log")

        progress(f"training a tiny MoE language model on {args.ranks} ranks (gloo, CPU), "
                 f"{args.steps} steps, run {run_id}")
        print(f"   injected: grad spike at step {injected.spike_step} (all ranks), rank "
              f"{injected.stall_rank} stalls {args.stall_seconds:.0f}s at step {injected.stall_step}, "
              f"NaN loss on rank {injected.nan_rank} at step {injected.nan_step}")
        master_port = free_port()
        ranks = []
        for rank in range(args.ranks):
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "trainmon.demo.train", "--steps", str(args.steps),
                 "--spike-step", str(injected.spike_step), "--stall-step", str(injected.stall_step),
                 "--stall-rank", str(injected.stall_rank), "--stall-seconds", str(args.stall_seconds),
                 "--nan-step", str(injected.nan_step), "--nan-rank", str(injected.nan_rank)],
                env=rank_env, stdout=None if rank == 0 else subprocess.DEVNULL,
                stderr=open(out / "logs" / f"rank{rank}.log", "wb")))
        codes = [p.wait() for p in ranks]
        if any(codes):
            raise RuntimeError(f"training ranks exited with {codes}; see {out / 'logs'}")

        progress("waiting for ClickHouse and the alerts engine to catch up")
        expected = args.steps * args.ranks
        sql = f"SELECT count() AS n FROM trainmon.step FINAL WHERE run_id = '{run_id}'"
        if not _wait_for(lambda: _rows(target, sql)[0]["n"] >= expected, 90):
            raise RuntimeError(f"ClickHouse did not receive all {expected} steps; see {out / 'logs'}")
        _wait_for(lambda: _rows(target, "SELECT count() AS n FROM trainmon.alert FINAL "
                                        "WHERE state = 'resolved'")[0]["n"] > 0, 20)
        time.sleep(2)  # the last alerts in flight land in their next batch
        progress("stopping the stack as 'trainmon down' does: each service writes what it holds")
        stopping = time.monotonic()
        stack.down(stack_dir, announce=False)
        print(f"   stopped in {time.monotonic() - stopping:.1f} s")

        progress("what happened")
        from .report import check_injected, print_summary, write_report

        print_summary(target, run_id, TABLES, EXAMPLE_QUERIES,
                      dict(run="'" + run_id + "'", nan_step=injected.nan_step))
        missed = check_injected(target, run_id, injected)
        progress("writing the report")
        report = write_report(target, run_id, out / "report.html")
        print(f"   report: {report}")
        print(f"   query it yourself: TRAINMON_CLICKHOUSE_PATH={target.path} trainmon sql "
              f"\"SELECT * FROM trainmon.alert FINAL\"")
        return 1 if missed else 0
    finally:
        stack.down(stack_dir, announce=False)
