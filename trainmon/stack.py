"""The one-machine stack: ``trainmon up`` / ``status`` / ``logs`` / ``down``.

``up`` starts the Kafka broker (KRaft, from the Maven jars) and a supervisor process that
runs the consumers always up (the ClickHouse consumer, chDB under the stack directory, and
the alerts service), on request (``--with tensorboard,aim,wandb``) the others -- which
they are, and their settings here, come from ``consumers/registry.py`` -- and (``--ui
tensorboard|aim``) a UI for live plots, and prints the one line a training job needs::

    export TRAINMON_KAFKA_BOOTSTRAP=127.0.0.1:9092 TRAINMON_CLICKHOUSE_PATH=~/.cache/trainmon/stack/clickhouse

The supervisor restarts a service that exits or is killed (after 1 s, doubling up to 30 s
while it keeps failing within a minute of its start) and logs each restart; the consumers
commit their progress with their writes, so a restart neither loses nor repeats a row.
``status`` shows each service with its pid, uptime, restarts and consumer lag; ``logs``
prints a service's log; ``down`` stops the supervisor, which stops its services, then the
broker. Everything lives under ``--dir`` (default ``$TRAINMON_STACK_DIR`` or
~/.cache/trainmon/stack): the broker's data, the chDB directory, the alerts state, the
forwarders' output, one log per process.
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

from .broker import Broker, cache_dir, pid_alive
from .consumers import registry

RESTART_MIN_S, RESTART_MAX_S, HEALTHY_AFTER_S = 1.0, 30.0, 60.0
# The consumers it runs, from the one list of them (consumers/registry.py).
ALWAYS = tuple(c.name for c in registry.CONSUMERS if c.always_up)
ON_REQUEST = tuple(c.name for c in registry.CONSUMERS if not c.always_up)
UIS = ("tensorboard", "aim")


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    group: str | None = None  # its Kafka consumer group, for the lag
    env: dict = field(default_factory=dict)


def consumer_service(stack: Path, consumer: registry.Consumer) -> Service:
    command = [sys.executable, "-m", "trainmon", "consume", consumer.name, *consumer.stack_arguments(stack)]
    return Service(consumer.name, command, consumer.group, consumer.stack_env(stack))


def services(stack: Path, extra: list[str], ui: str | None) -> list[Service]:
    """What the supervisor runs: the consumers always up, those asked for, a UI."""
    bin_dir = Path(sys.executable).parent
    chosen = [consumer_service(stack, registry.BY_NAME[name]) for name in [*ALWAYS, *extra]]
    if ui == "tensorboard":
        chosen.append(Service("tensorboard-ui", [str(bin_dir / "tensorboard"), "--logdir",
                                                 str(stack / "tensorboard"), "--port", "6006"]))
    elif ui == "aim":
        chosen.append(Service("aim-ui", [str(bin_dir / "aim"), "up", "--repo", str(stack / "aim"),
                                         "--port", "43800"]))
    return chosen


def default_dir() -> Path:
    return Path(os.environ.get("TRAINMON_STACK_DIR") or cache_dir() / "stack")


def env_line(bootstrap: str, stack: Path) -> str:
    return f"export TRAINMON_KAFKA_BOOTSTRAP={bootstrap} TRAINMON_CLICKHOUSE_PATH={stack / 'clickhouse'}"


# -- the supervisor (its own process, started by `up`) ---------------------------------------

@dataclass
class Child:
    service: Service
    pid: int | None = None
    started_at: float = 0.0  # monotonic
    since: float | None = None  # wall clock, for status
    restarts: int = 0
    last_exit: int | None = None
    next_start: float = 0.0
    backoff_s: float = RESTART_MIN_S
    proc: subprocess.Popen | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, stack: Path, bootstrap: str):
        self.stack = stack
        plan = json.loads((stack / "services.json").read_text())
        self.env = {**os.environ, **plan.get("env", {}), "TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
        self.children = [Child(s) for s in services(stack, plan["with"], plan["ui"])]
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
                self._say(f"{exc!r}")
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

    @staticmethod
    def _say(text: str) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} trainmon supervisor: {text}", file=sys.stderr, flush=True)

    def _watch(self, child: Child) -> None:
        now = time.monotonic()
        name = child.service.name
        if child.proc is not None:
            code = child.proc.poll()
            if code is None:
                if now - child.started_at >= HEALTHY_AFTER_S:
                    child.backoff_s = RESTART_MIN_S
                return
            child.last_exit, child.proc, child.pid, child.since = code, None, None, None
            child.next_start = now + child.backoff_s
            child.backoff_s = min(child.backoff_s * 2, RESTART_MAX_S)
            self._say(f"{name} exited with {code}; restarting in {child.next_start - now:.0f} s")
            return
        if now < child.next_start:
            return
        if child.started_at:
            child.restarts += 1
            self._say(f"restarting {name} (restart {child.restarts})")
        with open(self.stack / f"{name}.log", "ab") as log:
            child.proc = subprocess.Popen(child.service.command, env={**self.env, **child.service.env},
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child.pid, child.started_at, child.since = child.proc.pid, now, time.time()

    def _write_status(self) -> None:
        status = {"supervisor": os.getpid(), "services": {
            c.service.name: {"pid": c.pid, "since": c.since, "restarts": c.restarts,
                             "last_exit": c.last_exit, "group": c.service.group}
            for c in self.children}}
        tmp = self.stack / "status.json.tmp"
        tmp.write_text(json.dumps(status))
        tmp.replace(self.stack / "status.json")


# -- the commands ---------------------------------------------------------------------------

def read_status(stack: Path) -> dict | None:
    try:
        status = json.loads((stack / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return status if _alive(status.get("supervisor")) else None


def _alive(pid: int | None) -> bool:
    return pid is not None and pid_alive(pid)


def broker_of(stack: Path, port: int | None = None) -> Broker:
    saved = stack / "broker-port"
    if port is None:
        port = int(saved.read_text()) if saved.exists() else 9092
    return Broker(stack / "broker", port=port)


def up(stack: Path, port: int, extra: list[str], ui: str | None, timeout: float = 90.0,
       env: dict | None = None, announce: bool = True) -> int:
    """``env``: settings for the services (the demo's shorter alert windows)."""
    from . import topics

    stack.mkdir(parents=True, exist_ok=True)
    running = read_status(stack)
    if running is not None:
        print(f"trainmon: already up (supervisor {running['supervisor']}); 'trainmon down' first to change it")
        print(env_line(broker_of(stack).bootstrap, stack))
        return 0
    broker = broker_of(stack, port)
    (stack / "broker-port").write_text(str(port))
    if not broker.running():
        print(f"trainmon: starting Kafka on {broker.bootstrap}", file=sys.stderr)
        broker.start()
    broker.create_topics(topics.all_topics())
    (stack / "services.json").write_text(json.dumps({"with": extra, "ui": ui, "env": env or {}}))
    with open(stack / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "trainmon.stack", "supervise", str(stack), broker.bootstrap],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # outlives this command and its terminal
    deadline = time.monotonic() + timeout
    while not _all_running(read_status(stack)):
        if time.monotonic() > deadline or supervisor.poll() is not None:
            print(f"trainmon: the services did not start; see {stack}/*.log", file=sys.stderr)
            return 1
        time.sleep(0.2)
    names = ", ".join(read_status(stack)["services"])
    if not announce:
        return 0
    print(f"trainmon: up: Kafka on {broker.bootstrap}; {names} (logs: trainmon logs NAME). "
          "In the training job's environment:")
    print(env_line(broker.bootstrap, stack))
    return 0


def _all_running(status: dict | None) -> bool:
    return status is not None and all(_alive(s["pid"]) for s in status["services"].values())


def _uptime(since: float | None) -> str:
    if since is None:
        return "-"
    s = int(time.time() - since)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def show_status(stack: Path) -> int:
    from . import topics
    from .kafka_client import KafkaError, group_lag

    broker = broker_of(stack)
    running = broker.running()
    print(f"kafka           {'running on ' + broker.bootstrap if running else 'stopped'}")
    status = read_status(stack)
    if status is None:
        print("supervisor      stopped")
        return 1
    print(f"supervisor      running (pid {status['supervisor']})")
    record_topics = topics.all_topics()[:-1]
    for name, s in status["services"].items():
        state = f"running (pid {s['pid']}, up {_uptime(s['since'])})" if _alive(s["pid"]) else "restarting"
        last = f", last exit {s['last_exit']}" if s["last_exit"] is not None else ""
        lag = ""
        if s["group"] and running:
            try:
                lag = f", lag {group_lag(s['group'], record_topics, bootstrap=broker.bootstrap, timeout_s=5):,} records"
            except KafkaError:
                lag = ", lag unknown"
        print(f"{name:<15} {state}, {s['restarts']} restarts{last}{lag}")
    return 0 if running and _all_running(status) else 1


def show_logs(stack: Path, name: str, lines: int, follow: bool) -> int:
    path = stack / f"{name}.log"
    if not path.exists():
        known = sorted(p.stem for p in stack.glob("*.log"))
        print(f"trainmon logs: no log for {name!r}; there are: {', '.join(known) or 'none'}", file=sys.stderr)
        return 1
    return subprocess.call(["tail", "-n", str(lines), *(["-F"] if follow else []), str(path)])


def down(stack: Path, timeout: float = 90.0, announce: bool = True) -> int:
    status = read_status(stack)
    if status is not None:
        os.kill(status["supervisor"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(status["supervisor"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    # A supervisor that died without stopping its services (kill -9) left them running.
    try:
        left = json.loads((stack / "status.json").read_text())["services"].values()
    except (OSError, ValueError, KeyError):
        left = []
    for service in left:
        if _alive(service["pid"]):
            os.kill(service["pid"], signal.SIGTERM)
    broker = broker_of(stack)
    if broker.running():
        broker.stop()
    if announce:
        print("trainmon: down")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "supervise":  # the supervisor process itself (started by `up`)
        Supervisor(Path(argv[1]), argv[2]).run()
        return 0
    parser = argparse.ArgumentParser(prog=f"trainmon {argv[0] if argv else ''}".strip(),
                                     description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "status", "logs", "down"])
    parser.add_argument("name", nargs="?", default="supervisor", help="logs: the service (default supervisor)")
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where everything lives")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRAINMON_BROKER_PORT", 0)) or 9092)
    parser.add_argument("--with", dest="extra", default="",
                        help=f"up: consumers to run too, comma-separated ({', '.join(ON_REQUEST)})")
    parser.add_argument("--ui", choices=UIS, help="up: a UI for live plots (TensorBoard on 6006, Aim on 43800)")
    parser.add_argument("-n", "--lines", type=int, default=40, help="logs: how many lines")
    parser.add_argument("-f", "--follow", action="store_true", help="logs: keep printing")
    args = parser.parse_args(argv)
    stack = args.dir.expanduser().resolve()
    extra = [x.strip() for x in args.extra.split(",") if x.strip()]
    unknown = set(extra) - set(ON_REQUEST)
    if unknown:
        parser.error(f"--with: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ON_REQUEST)}")
    if args.ui and args.ui not in extra:
        extra.append(args.ui)  # a UI shows what its forwarder writes
    if args.action == "up":
        return up(stack, args.port, extra, args.ui)
    if args.action == "status":
        return show_status(stack)
    if args.action == "logs":
        return show_logs(stack, args.name, args.lines, args.follow)
    return down(stack)


if __name__ == "__main__":
    sys.exit(main())
