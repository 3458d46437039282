"""The one-machine stack: ``trainmon up`` / ``trainmon status`` / ``trainmon down``.

``up`` starts the Kafka broker (KRaft, from the Maven jars) and a supervisor process that
runs the ClickHouse consumer (chDB under the stack directory) and the alerts service, and
prints the one line a training job needs::

    export TRAINMON_KAFKA_BOOTSTRAP=127.0.0.1:9092 TRAINMON_CLICKHOUSE_PATH=~/.cache/trainmon/stack/clickhouse

The supervisor restarts a consumer that exits or is killed (after 1 s, doubling up to 30 s
while it keeps failing within a minute of its start); the consumers commit their progress
with their writes, so a restart neither loses nor repeats a row. ``status`` reads what the
supervisor writes (``status.json``: pid, restarts, last exit of each consumer); ``down``
stops the supervisor, which stops its consumers, then the broker. Everything lives under
``--dir`` (default ``$TRAINMON_STACK_DIR`` or ~/.cache/trainmon/stack): the broker's data,
the chDB directory, the alerts state, one log per process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .broker import Broker, cache_dir

CONSUMERS = ("clickhouse", "alerts")
RESTART_MIN_S, RESTART_MAX_S, HEALTHY_AFTER_S = 1.0, 30.0, 60.0


def default_dir() -> Path:
    return Path(os.environ.get("TRAINMON_STACK_DIR") or cache_dir() / "stack")


def consumer_command(name: str, stack: Path) -> list[str]:
    cmd = [sys.executable, "-m", "trainmon", "consume", name]
    return cmd + ["--path", str(stack / "clickhouse")] if name == "clickhouse" else cmd


def env_line(bootstrap: str, stack: Path) -> str:
    return f"export TRAINMON_KAFKA_BOOTSTRAP={bootstrap} TRAINMON_CLICKHOUSE_PATH={stack / 'clickhouse'}"


# -- the supervisor (its own process, started by `up`) ---------------------------------------

@dataclass
class Child:
    name: str
    pid: int | None = None
    started_at: float = 0.0
    restarts: int = 0
    last_exit: int | None = None
    next_start: float = 0.0
    backoff_s: float = RESTART_MIN_S
    proc: subprocess.Popen | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, stack: Path, bootstrap: str):
        self.stack = stack
        self.env = {**os.environ, "TRAINMON_KAFKA_BOOTSTRAP": bootstrap,
                    "TRAINMON_ALERT_STATE_DIR": str(stack / "alerts")}
        self.children = [Child(name) for name in CONSUMERS]
        self.stop = threading.Event()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        while not self.stop.is_set():
            try:
                for child in self.children:
                    self._watch(child)
                self._write_status()
            except Exception as exc:  # a full disk, a vanished directory: keep supervising
                print(f"trainmon supervisor: {exc!r}", file=sys.stderr, flush=True)
            self.stop.wait(0.2)
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.terminate()  # each service commits what it wrote, then exits
        for child in self.children:
            if child.proc is not None:
                try:
                    child.proc.wait(60)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
        (self.stack / "status.json").unlink(missing_ok=True)

    def _watch(self, child: Child) -> None:
        now = time.monotonic()
        if child.proc is not None:
            code = child.proc.poll()
            if code is None:
                if now - child.started_at >= HEALTHY_AFTER_S:
                    child.backoff_s = RESTART_MIN_S
                return
            child.last_exit, child.proc, child.pid = code, None, None
            child.next_start = now + child.backoff_s
            child.backoff_s = min(child.backoff_s * 2, RESTART_MAX_S)
            print(f"trainmon supervisor: {child.name} exited with {code}; restarting in "
                  f"{child.next_start - now:.0f} s", file=sys.stderr, flush=True)
            return
        if now < child.next_start:
            return
        if child.started_at:
            child.restarts += 1
        log = open(self.stack / f"{child.name}.log", "ab")
        child.proc = subprocess.Popen(consumer_command(child.name, self.stack), env=self.env,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        child.pid, child.started_at = child.proc.pid, now

    def _write_status(self) -> None:
        status = {"supervisor": os.getpid(), "consumers": {
            c.name: {"pid": c.pid, "restarts": c.restarts, "last_exit": c.last_exit}
            for c in self.children}}
        tmp = self.stack / "status.json.tmp"
        tmp.write_text(json.dumps(status))
        tmp.replace(self.stack / "status.json")


# -- the commands ---------------------------------------------------------------------------

def read_status(stack: Path) -> dict | None:
    try:
        status = json.loads((stack / "status.json").read_text())
        os.kill(status["supervisor"], 0)
    except (OSError, ValueError, KeyError):
        return None
    return status


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def broker_of(stack: Path, port: int | None = None) -> Broker:
    saved = stack / "broker-port"
    if port is None:
        port = int(saved.read_text()) if saved.exists() else 9092
    return Broker(stack / "broker", port=port)


def up(stack: Path, port: int, timeout: float = 90.0) -> int:
    from . import topics

    stack.mkdir(parents=True, exist_ok=True)
    if read_status(stack) is not None:
        broker = broker_of(stack)
        print(f"trainmon: already up (supervisor {read_status(stack)['supervisor']})")
        print(env_line(broker.bootstrap, stack))
        return 0
    broker = broker_of(stack, port)
    (stack / "broker-port").write_text(str(port))
    if not broker.running():
        print(f"trainmon: starting Kafka on {broker.bootstrap}", file=sys.stderr)
        broker.start()
    broker.create_topics(topics.all_topics())
    with open(stack / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen([sys.executable, "-m", "trainmon.stack", "supervise", str(stack), broker.bootstrap],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # outlives this command and its terminal
    deadline = time.monotonic() + timeout
    while not _all_running(read_status(stack)):
        if time.monotonic() > deadline or supervisor.poll() is not None:
            print(f"trainmon: the consumers did not start; see {stack}/*.log", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"trainmon: up: Kafka on {broker.bootstrap}, consumers {', '.join(CONSUMERS)} "
          f"(logs in {stack}). In the training job's environment:")
    print(env_line(broker.bootstrap, stack))
    return 0


def _all_running(status: dict | None) -> bool:
    return status is not None and all(_alive(c["pid"]) for c in status["consumers"].values())


def show_status(stack: Path) -> int:
    broker = broker_of(stack)
    running = broker.running()
    print(f"kafka       {'running on ' + broker.bootstrap if running else 'stopped'}")
    status = read_status(stack)
    if status is None:
        print("supervisor  stopped")
        return 1
    print(f"supervisor  running (pid {status['supervisor']})")
    for name, c in status["consumers"].items():
        state = f"running (pid {c['pid']})" if _alive(c["pid"]) else "restarting"
        last = f", last exit {c['last_exit']}" if c["last_exit"] is not None else ""
        print(f"{name:<11} {state}, {c['restarts']} restarts{last}")
    return 0 if running and _all_running(status) else 1


def down(stack: Path, timeout: float = 90.0) -> int:
    status = read_status(stack)
    if status is not None:
        os.kill(status["supervisor"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(status["supervisor"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    broker = broker_of(stack)
    if broker.running():
        broker.stop()
    print("trainmon: down")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "supervise":  # the supervisor process itself (started by `up`)
        Supervisor(Path(argv[1]), argv[2]).run()
        return 0
    parser = argparse.ArgumentParser(prog="trainmon", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "status", "down"])
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where everything lives")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRAINMON_BROKER_PORT", 0)) or 9092)
    args = parser.parse_args(argv)
    stack = args.dir.expanduser().resolve()
    if args.action == "up":
        return up(stack, args.port)
    if args.action == "status":
        return show_status(stack)
    return down(stack)


if __name__ == "__main__":
    sys.exit(main())
