"""`trainmon up` as a user would run it: the broker and the supervised consumers start, a
2-rank torchrun job configured by the printed env line alone lands in ClickHouse, a
consumer killed with -9 is back within 10 s and nothing is lost or written twice, `trainmon
report` writes the run's plots, `trainmon down` stops every process."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainmon.broker import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
JOB = """
import os, time
import trainmon.producer as tm
phase = os.environ["PHASE"]
first = 0 if phase == "a" else {steps}
tm.run_start(config={{"phase": phase}})
for step in range(first, first + {steps}):
    tm.log_step(step, loss=3.0 - step / 100, norm=1.0, lr=1e-4, duration_ms=10.0, step_tokens=1024)
    if step % 10 == 9:
        tm.log_eval(step, loss=3.1 - step / 100)
    time.sleep(0.01)
tm.run_end("success")
assert tm.get_producer().close(30)
""".format(steps=STEPS)


def trainmon(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def job_env(line: str, tmp: Path, **extra) -> dict:
    """A clean environment plus the printed `export A=B C=D` line, nothing else of trainmon's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMON_")}
    words = shlex.split(line)
    assert words[0] == "export"
    env.update(dict(w.split("=", 1) for w in words[1:]))
    return {**env, "TRAINMON_SPILL_DIR": str(tmp / "spill"), **extra}


def status(stack: Path) -> dict:
    return json.loads((stack / "status.json").read_text())


def sql(env: dict, query: str) -> str:
    done = trainmon("sql", "-f", "TabSeparated", query, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def wait_for(what, condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, TypeError):
        return False
    return True


def test_up_job_kill_report_down(tmp_path):
    stack = tmp_path / "stack"
    up = trainmon("up", "--dir", str(stack), "--port", str(free_port()), "--with", "tensorboard")
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        line = up.stdout.strip().splitlines()[-1]
        env = job_env(line, tmp_path)
        shown = trainmon("status", "--dir", str(stack))
        assert shown.returncode == 0, shown.stdout
        for name in ("clickhouse", "alerts", "tensorboard"):
            assert re.search(rf"^{name} +running \(pid \d+, up \d+m\d+s\), 0 restarts, lag \d+ records$",
                             shown.stdout, re.M), shown.stdout

        def torchrun(phase: str) -> None:
            script = tmp_path / "job.py"
            script.write_text(JOB)
            done = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone",
                                   "--nproc-per-node", "2", str(script)],
                                  env={**env, "PHASE": phase, "TRAINMON_RUN_ID": "up-run"},
                                  capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr[-3000:]

        torchrun("a")
        steps = "SELECT count() FROM step WHERE run_id = 'up-run'"
        wait_for("phase a in ClickHouse", lambda: sql(env, steps) == str(2 * STEPS), 60)

        killed = status(stack)["services"]["clickhouse"]["pid"]
        os.kill(killed, signal.SIGKILL)
        back = wait_for("the consumer back", lambda: alive(status(stack)["services"]["clickhouse"]["pid"])
                        and status(stack)["services"]["clickhouse"]["pid"] != killed, 10)
        assert back <= 10
        shown = trainmon("status", "--dir", str(stack))
        assert re.search(r"^clickhouse +running .*, 1 restarts, last exit -9, lag", shown.stdout, re.M), shown.stdout
        logs = trainmon("logs", "--dir", str(stack))
        assert "clickhouse exited with -9" in logs.stdout and "restarting clickhouse (restart 1)" in logs.stdout

        torchrun("b")  # through the restarted consumer
        wait_for("phase b in ClickHouse", lambda: sql(env, steps) == str(4 * STEPS), 60)
        # Without FINAL: every row once, none lost, none repeated across the kill.
        assert sql(env, "SELECT count(), uniqExact(event_id), uniqExact(rank, step) FROM step "
                        "WHERE run_id = 'up-run'") == "\t".join([str(4 * STEPS)] * 3)
        assert sql(env, "SELECT count() FROM eval WHERE run_id = 'up-run'") == str(2 * 2 * STEPS // 10)

        wait_for("the TensorBoard forwarder's event files", lambda: list((stack / "tensorboard").rglob("events.out.tfevents.*")), 30)

        report = trainmon("report", "up-run", "-o", str(tmp_path / "report.html"), env=env)
        assert report.returncode == 0, report.stderr
        html = (tmp_path / "report.html").read_text()
        assert "trainmon report: up-run" in html and html.count("<img src='data:image/png;base64,") >= 2
    finally:
        before = json.loads((stack / "status.json").read_text()) if (stack / "status.json").exists() else None
        down = trainmon("down", "--dir", str(stack))
    assert down.returncode == 0, down.stderr
    assert before is not None
    pids = [before["supervisor"], *(c["pid"] for c in before["services"].values())]
    wait_for("every process gone", lambda: not any(alive(p) for p in pids), 30)
    assert trainmon("status", "--dir", str(stack)).returncode == 1
    assert re.search(r"^kafka +stopped", trainmon("status", "--dir", str(stack)).stdout, re.M)
