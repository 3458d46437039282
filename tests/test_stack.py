"""`trainmon up` as a user would run it: the broker and the supervised consumers start, a
2-rank torchrun job configured by the printed env line alone lands in ClickHouse, a
consumer killed with -9 is back within 10 s and nothing is lost or written twice (the
supervisor's metrics count the restart, the loader's its rows), `trainmon
report` writes the run's plots, `trainmon down` stops every process; `trainmon down` takes at
most 10 s and keeps every record logged before it; `trainmon up --help` shows up's options."""

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

from trainmon import stack as stack_module
from trainmon.broker import free_port
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint

from .metrics_support import scrape

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
            assert re.search(rf"^{name} +running \(pid \d+, up \d+m\d+s\), 0 restarts, lag \d+ records",
                             shown.stdout, re.M), shown.stdout

        def metrics_shown() -> bool:  # once each service has started serving them
            shown = trainmon("status", "--dir", str(stack)).stdout
            return all(re.search(rf"^{name} +running .*, lag \d+ records, 0 dead letters \(metrics on :\d+\)$",
                                 shown, re.M) for name in ("clickhouse", "alerts", "tensorboard"))

        wait_for("each service's dead letters in trainmon status", metrics_shown, 30)
        # Prometheus' file_sd targets: every endpoint, labelled with its service, answering.
        targets = json.loads((stack / "prometheus-targets.json").read_text())
        assert sorted(t["labels"]["service"] for t in targets) == ["alerts", "clickhouse", "supervisor", "tensorboard"]
        for target in targets:
            assert scrape(int(target["targets"][0].rsplit(":", 1)[1])).value("process_open_fds") > 0
        assert re.search(r"^supervisor +running \(pid \d+, metrics on 127.0.0.1:\d+\)$", shown.stdout, re.M)

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
        supervisor = scrape(status(stack)["metrics_port"])
        assert supervisor.value("trainmon_service_restarts_total", service="clickhouse") == 1
        assert supervisor.value("trainmon_service_restarts_total", service="alerts") == 0
        assert supervisor.value("trainmon_service_last_exit_code", service="clickhouse") == -9

        torchrun("b")  # through the restarted consumer
        wait_for("phase b in ClickHouse", lambda: sql(env, steps) == str(4 * STEPS), 60)
        # The restarted loader's own counts: phase b's rows, resumed from ClickHouse's offsets.
        loader_port = status(stack)["services"]["clickhouse"]["metrics_port"]
        wait_for("phase b's rows on the loader's endpoint",
                 lambda: scrape(loader_port).value("trainmon_records_written_total", kind="step") == 2 * STEPS, 10)
        assert scrape(loader_port).value("trainmon_records_dead_lettered_total", kind="step") == 0
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
        down_started = time.monotonic()
        down = trainmon("down", "--dir", str(stack))
    assert down.returncode == 0, down.stderr
    assert before is not None
    pids = [before["supervisor"], *(c["pid"] for c in before["services"].values())]
    wait_for("every process gone", lambda: not any(alive(p) for p in pids), 30)
    took = time.monotonic() - down_started
    assert took <= 10, f"trainmon down took {took:.1f} s"
    assert trainmon("status", "--dir", str(stack)).returncode == 1
    assert re.search(r"^kafka +stopped", trainmon("status", "--dir", str(stack)).stdout, re.M)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie -- reaped here when it is this process's child
    (signal 0 still reaches a zombie, so it alone cannot tell)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2:].startswith("Z")


def test_down_within_10_s_keeps_what_was_logged(tmp_path):
    """`up` and `down` in this process, as `trainmon demo` runs them: the supervisor (and the
    broker) are this process's children, and a child that exits stays a zombie until
    reaped -- `down` used to wait its whole 90 s timeout for the supervisor's zombie. A
    job's records, then `down` at once: within 10 s every process is gone, and every record
    is in ClickHouse. (`trainmon down` from another shell: test_up_job_kill_report_down.)"""
    stack_dir = tmp_path / "stack"
    assert stack_module.up(stack_dir, stack_module.Layout(port=free_port()), [], None, announce=False) == 0
    before = status(stack_dir)
    broker_pid = stack_module.broker_of(stack_dir).pid()
    try:
        env = job_env(stack_module.env_line(stack_module.broker_of(stack_dir).bootstrap, stack_dir), tmp_path,
                      TRAINMON_RUN_ID="down-run")
        script = tmp_path / "job.py"
        script.write_text(JOB)

        def job(phase: str) -> None:
            done = subprocess.run([sys.executable, str(script)], env={**env, "PHASE": phase},
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]

        # `up` returns once the services run; the ClickHouse consumer answers SQL a little later.
        wait_for("the ClickHouse consumer answering SQL",
                 lambda: find_endpoint(stack_dir / "clickhouse") is not None, 60)
        job("a")  # the consumer is loading: phase a reaches ClickHouse while the stack runs
        steps = "SELECT count() FROM step WHERE run_id = 'down-run'"
        wait_for("phase a in ClickHouse", lambda: sql(env, steps) == str(STEPS), 60)
        job("b")  # acknowledged by Kafka when the job returns; `down` follows at once
    finally:
        started = time.monotonic()
        stack_module.down(stack_dir, announce=False)  # what `trainmon down` and the demo run
    pids = [before["supervisor"], *(s["pid"] for s in before["services"].values()), broker_pid]
    wait_for("every process gone", lambda: all(gone(pid) for pid in pids),
             max(0.0, 10 - (time.monotonic() - started)))
    took = time.monotonic() - started
    assert took <= 10, f"trainmon down took {took:.1f} s"
    # The directory is free again: `trainmon sql` opens it itself.
    assert sql(env, "SELECT count(), uniqExact(event_id), uniqExact(step) FROM step "
                    "WHERE run_id = 'down-run'") == "\t".join([str(2 * STEPS)] * 3)
    assert sql(env, "SELECT count() FROM eval WHERE run_id = 'down-run'") == str(2 * STEPS // 10)


def test_up_help_shows_only_ups_options():
    shown = trainmon("up", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: trainmon up ")
    assert "--with" in shown.stdout and "--ui" in shown.stdout
    for other in ("status", "logs", "down", "--lines", "--follow"):
        assert other not in shown.stdout, (other, shown.stdout)
