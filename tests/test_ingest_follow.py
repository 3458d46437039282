"""``trainmon ingest --follow`` against the real broker and chDB: a job's log written
line by line, rotated, the follower killed with kill -9 and restarted; every step lands
in ClickHouse once, each within a second of its line being written."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .clickhouse_service import ClickHouseService, trainmon_env
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)

RUN = "follow-run"


def iteration_line(step: int) -> str:
    loss = 8.0 - step * 0.01
    return (f" iteration {step:8d}/    1000 | consumed samples: {step * 64:12d} | elapsed time per "
            f"iteration (ms): {400 + step % 7:.1f} | learning rate: 3.000E-04 | global batch size: "
            f"   64 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.{step % 10:03d} | number "
            f"of skipped iterations:   0 | number of nan iterations:   0 |\n"
            f"time (ms) | forward-backward: {300 + step % 5:.2f} | optimizer: 12.50\n")


class Writer:
    """The training job: appends a step at a time and remembers when each was written."""

    def __init__(self, path):
        self.path = path
        self.written: dict[int, float] = {}
        self.step = 0

    def write(self, steps: int, pause: float = 0.05) -> None:
        for _ in range(steps):
            self.step += 1
            with open(self.path, "a") as f:
                f.write(iteration_line(self.step))
                f.flush()
            self.written[self.step] = time.time()
            time.sleep(pause)  # the job's own pace between two log lines

    def rotate(self) -> None:
        os.rename(self.path, f"{self.path}.1")


def start_follower(bootstrap, prefix, log_path, tmp_path, out):
    env = trainmon_env(bootstrap, TRAINMON_TOPIC_PREFIX=prefix, TRAINMON_SPILL_DIR=tmp_path / "spill",
                       TRAINMON_LOG_LEVEL="INFO")  # says when it follows a rotation
    return subprocess.Popen([sys.executable, "-m", "trainmon", "ingest", "--follow", str(log_path),
                             "--run-id", RUN], env=env, stdout=out, stderr=subprocess.STDOUT)


def inserted(service, steps_from: int) -> dict[int, float]:
    rows = service.rows(f"SELECT step, toUnixTimestamp64Micro(min(_inserted_at)) AS at FROM "
                        f"trainmon.step WHERE run_id = '{RUN}' AND step >= {steps_from} GROUP BY step")
    return {r["step"]: int(r["at"]) / 1e6 for r in rows}


def wait_steps(service, expected: int, timeout: float = 60.0) -> None:
    service.wait_for(f"SELECT count() FROM trainmon.step FINAL WHERE run_id = '{RUN}'",
                     expected, timeout=timeout)


def test_follow_rotate_kill_restart_exactly_once(bootstrap, topic_prefix, tmp_path):
    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "ch", tmp_path / "service.log").start()
    log_path = tmp_path / "train.log"
    writer = Writer(log_path)
    with open(tmp_path / "follower.log", "ab") as out:
        follower = start_follower(bootstrap, topic_prefix, log_path, tmp_path, out)
        try:
            writer.write(1)
            wait_steps(service, 1)   # the follower is up (its start-up is not a latency)
            writer.write(19)
            wait_steps(service, 20)
            writer.rotate()          # logrotate: rename, then the job writes a new file
            writer.write(20)
            wait_steps(service, 40)
            # The restarted follower sends steps 21-40 again, and ClickHouse keeps the
            # newer copy of a row: their first arrival is measured now.
            first_arrival = inserted(service, 21)
            follower.kill()          # kill -9 while the job goes on writing
            follower.wait(30)
            writer.write(10)
            follower = start_follower(bootstrap, topic_prefix, log_path, tmp_path, out)
            wait_steps(service, 50)  # restarted: it read the file again from its start
            writer.write(10)
            wait_steps(service, 60)
        finally:
            follower.terminate()
            follower.wait(30)
    assert follower.returncode == 0, (tmp_path / "follower.log").read_text()

    # Exactly once: one row per step (FINAL collapses the resent records, which carry the
    # same deterministic event id), no step missing, no second id for any step.
    rows = service.rows(f"SELECT step, count() AS n, uniqExact(event_id) AS ids FROM trainmon.step "
                        f"FINAL WHERE run_id = '{RUN}' GROUP BY step ORDER BY step")
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert all(r["n"] == 1 and r["ids"] == 1 for r in rows)
    raw_ids = service.value(f"SELECT uniqExact(event_id) FROM trainmon.step WHERE run_id = '{RUN}'")
    assert raw_ids == 60
    timers = service.rows(f"SELECT timers FROM trainmon.step FINAL WHERE run_id = '{RUN}' AND step = 7")
    assert timers[0]["timers"] == {"forward-backward": 302.0, "optimizer": 12.5}

    # Each step visible within a second of its line being written, while the follower ran
    # (step 1 waited for the follower to start, steps 41-50 for its restart).
    at = {**inserted(service, 1), **first_arrival}
    late = {s: round(at[s] - writer.written[s], 3) for s in writer.written
            if s != 1 and not 41 <= s <= 50 and at[s] - writer.written[s] > 1.0}
    assert not late, (f"steps visible more than 1 s after their line: {late}\n"
                      f"{(tmp_path / 'follower.log').read_text()[-2000:]}")
    assert "was replaced (rotated)" in (tmp_path / "follower.log").read_text()
    service.stop()


def test_a_crash_log_ends_its_run_failed_with_the_reason_in_run_summary(bootstrap, topic_prefix, tmp_path):
    """A real Megatron-LM log (4 GPUs) whose last lines are NCCL watchdog timeouts (corpus)."""
    from pathlib import Path

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "ch", tmp_path / "service.log").start()
    log = Path(__file__).parent / "data" / "logs" / "megatron-lm-4gpu-second-iteration-nccl-watchdog-timeout.log"
    env = trainmon_env(bootstrap, TRAINMON_TOPIC_PREFIX=topic_prefix, TRAINMON_SPILL_DIR=tmp_path / "spill")
    for _ in range(2):  # a second backfill of the same log changes nothing
        done = subprocess.run([sys.executable, "-m", "trainmon", "ingest", str(log), "--run-id", "crashed"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    service.wait_for("SELECT status FROM trainmon.run_summary WHERE run_id = 'crashed'", "failed")
    (summary,) = service.rows("SELECT status, reason, steps, last_step FROM trainmon.run_summary "
                              "WHERE run_id = 'crashed'")
    assert summary["reason"].startswith("NCCL watchdog timeout: Watchdog caught collective operation "
                                        "timeout: WorkNCCL(SeqNum=33, OpType=ALLREDUCE")
    assert summary["steps"] == 0  # the job hung in its second iteration, before any was logged
    assert service.value("SELECT count() FROM trainmon.run FINAL WHERE run_id = 'crashed'") == \
        service.value("SELECT uniqExact(event_id) FROM trainmon.run WHERE run_id = 'crashed'")
    service.stop()
