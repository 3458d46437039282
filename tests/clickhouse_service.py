"""Helpers for the ClickHouse tests: the service runs as a subprocess (chDB hosts one
data directory per process, and other tests may use chDB in the pytest process), and
every query goes through ``trainmon sql``'s path: the service's SQL endpoint while it
runs, a ``trainmon sql`` subprocess otherwise. The pytest process never opens chDB."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmon.consumers.clickhouse.cli import OUTPUT_SETTINGS
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint, query_endpoint

from .waiting import wait_until

REPO = Path(__file__).resolve().parents[1]


def trainmon_env(bootstrap: str, **extra) -> dict:
    env = dict(os.environ, TRAINMON_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(REPO))
    env.pop("TRAINMON_CLICKHOUSE_URL", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_trainmon(bootstrap: str, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon", *args], env=trainmon_env(bootstrap, **env),
                          capture_output=True, text=True, timeout=timeout)


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def kill_leftover_services():
    """A test that fails before stopping its service must not leave it running."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class ClickHouseService:
    def __init__(self, bootstrap: str, topic_prefix: str, path: Path, log: Path, **env):
        self.bootstrap = bootstrap
        self.prefix = topic_prefix
        self.path = Path(path)
        self.log = Path(log)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str, **env) -> "ClickHouseService":
        cmd = [sys.executable, "-m", "trainmon", "consume", "clickhouse", "--path", str(self.path),
               "--topic-prefix", self.prefix, "--group", f"{self.prefix}clickhouse", *args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=trainmon_env(self.bootstrap, **{**self.env, **env}),
                                         stdout=log, stderr=subprocess.STDOUT)
        _STARTED.append(self.proc)
        deadline = time.monotonic() + 60
        while find_endpoint(self.path) is None or self._endpoint_pid() != self.proc.pid:
            if self.proc.poll() is not None:
                return self  # e.g. a crash hook fired already: callers check returncode
            assert time.monotonic() < deadline, f"service did not start: {self.log.read_text()}"
            time.sleep(0.1)
        return self

    def _endpoint_pid(self):
        info = find_endpoint(self.path)
        return info and info["pid"]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rows(self, sql: str) -> list[dict]:
        """Query rows as dicts (JSONEachRow; NaN / Inf as "nan" / "inf")."""
        if self.running() and self._endpoint_pid() == self.proc.pid:
            out = query_endpoint(find_endpoint(self.path), sql, "JSONEachRow", OUTPUT_SETTINGS).decode()
        else:
            done = run_trainmon(self.bootstrap, "sql", "--path", str(self.path), "-f", "jsonl", sql)
            assert done.returncode == 0, done.stderr
            out = done.stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def value(self, sql: str):
        rows = self.rows(sql)
        return next(iter(rows[0].values())) if rows else None

    def wait_for(self, sql: str, expected, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.value(sql)
            if value == expected:
                return value
            if not self.running():
                break
            time.sleep(0.2)
        raise AssertionError(f"{sql!r} gave {value!r}, expected {expected!r}; log:\n"
                             f"{self.log.read_text()[-3000:]}")

    def wait_for_log(self, condition, timeout: float = 60.0) -> str:
        """Wait until ``condition(log text)`` holds; return the log as it was then."""
        seen = ""

        def holds() -> bool:
            nonlocal seen
            seen = self.log.read_text()
            return condition(seen)

        wait_until(holds, timeout, "the service's log", pause=0.1, details=lambda: seen[-3000:])
        return seen

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
