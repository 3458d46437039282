"""The one-machine stack: ``trainmon up`` / ``status`` / ``logs`` / ``down``.

``up`` starts the Kafka broker (KRaft, from the Maven jars) and a supervisor process that
runs the consumers always up (the ClickHouse consumer, chDB under the stack directory, and
the alerts service), on request (``--with tensorboard,aim,wandb``) the others -- which
they are, and their settings here, come from ``consumers/registry.py`` -- and (``--ui
tensorboard|aim``) a UI for live plots, and prints the one line a training job needs::

    export TRAINMON_KAFKA_BOOTSTRAP=127.0.0.1:9092 TRAINMON_CLICKHOUSE_PATH=~/.cache/trainmon/stack/clickhouse

On loopback (the default) Kafka speaks plain text: only this machine reaches it. With
``--listen ADDR`` (an address compute nodes reach; ``--public-host NAME`` for the name
they use) the stack is secured without further options: TLS, SCRAM logins and ACLs
(trainmon.stack_security, broker.py), and ``up`` prints ``export`` lines for the
``writer`` login and the CA file to copy to the nodes (docs/cluster.md). ``--brokers 3``
runs three brokers that replicate every topic: one may crash and nothing stops.

The supervisor restarts a service that exits or is killed (after 1 s, doubling up to 30 s
while it keeps failing within a minute of its start) and logs each restart; the consumers
commit their progress with their writes, so a restart neither loses nor repeats a row.
The services stop with their supervisor, however it ends: killed with -9, it leaves none
running (each gets SIGTERM from the kernel, a parent-death signal, and commits as at
``down``). The broker deliberately does not: it is the event log the training jobs write
to whether or not anything consumes it, so a dead supervisor costs the jobs nothing; a
second ``up`` starts a supervisor beside the running broker, and ``down`` stops both.
Each consumer and the supervisor serve Prometheus metrics (docs/metrics.md) on ports the
supervisor hands out (``--metrics-port``: from that port on; 0, the default: free ones),
kept for the stack's life and recorded in ``status.json``.
``status`` shows each service with its pid, uptime, restarts, consumer lag and dead
letters; ``logs``
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

from .backoff import Backoff
from .broker import Broker, Cluster, cache_dir, is_loopback, java, pid_alive
from .process_lifetime import end_with_parent, watch
from .stack_security import StackSecrets
from .consumers import registry

RESTART_MIN_S, RESTART_MAX_S, HEALTHY_AFTER_S = 1.0, 30.0, 60.0
# How long a stopping service may take to write what it holds, all services together; one
# still running then is killed (its uncommitted records are read again at the next start).
# `down` waits a little longer than that for the supervisor before acting itself.
STOP_GRACE_S = 30.0
DOWN_TIMEOUT_S = STOP_GRACE_S + 15.0
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
    metrics_port: int | None = None  # where it serves its metrics (consumers only)
    next_start: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(RESTART_MIN_S, RESTART_MAX_S))
    proc: subprocess.Popen | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, stack: Path, bootstrap: str):
        self.stack = stack
        plan = json.loads((stack / "services.json").read_text())
        self.env = {**os.environ, **plan.get("env", {}), "TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
        self.children = [Child(s) for s in services(stack, plan["with"], plan["ui"])]
        self.stop = threading.Event()
        self.metrics_listen = self.env.get("TRAINMON_METRICS_LISTEN") or "127.0.0.1"
        self.metrics_port = self._hand_out_metrics_ports(int(self.env.get("TRAINMON_METRICS_PORT") or 0))

    def _hand_out_metrics_ports(self, first: int) -> int:
        """Its own metrics port and each consumer's: ``first``, ``first + 1``, ... or, with
        0, free ones now. Kept across restarts, so a scrape target stays where it is."""
        consumers = [c for c in self.children if c.service.group]
        ports = (list(range(first, first + 1 + len(consumers))) if first
                 else free_ports(self.metrics_listen, 1 + len(consumers)))
        for child, port in zip(consumers, ports[1:]):
            child.metrics_port = port
            child.service.env.update(TRAINMON_METRICS_PORT=str(port), TRAINMON_METRICS_LISTEN=self.metrics_listen)
        return ports[0]

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        serve_supervisor_metrics(self)
        try:
            self._write_scrape_targets()
        except OSError as exc:  # (a full disk: the services matter more)
            self._say(f"cannot write the Prometheus targets: {exc!r}")
        while not self.stop.is_set():
            for child in self.children:
                try:
                    self._watch(child)
                except Exception as exc:  # a full disk, a vanished directory: keep supervising
                    self._say(f"{child.service.name}: {exc!r}")
            try:
                self._write_status()
            except Exception as exc:  # (the same)
                self._say(f"{exc!r}")
            self.stop.wait(0.2)
        self._stop_children()
        (self.stack / "status.json").unlink(missing_ok=True)

    def _stop_children(self) -> None:
        """SIGTERM to every service at once (each writes and commits what it holds, then
        exits), then wait for all of them within one shared grace period."""
        started = time.monotonic()
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            child.proc.terminate()
        deadline = started + STOP_GRACE_S
        for child in running:
            try:
                code = child.proc.wait(max(0.0, deadline - time.monotonic()))
                self._say(f"{child.service.name} stopped (exit {code}) after {time.monotonic() - started:.1f} s")
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
                self._say(f"{child.service.name} did not stop within {STOP_GRACE_S:.0f} s; killed")

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
                    child.backoff.reset()
                return
            child.last_exit, child.proc, child.pid, child.since = code, None, None, None
            child.next_start = now + child.backoff.next()
            self._say(f"{name} exited with {code}; restarting in {child.next_start - now:.0f} s")
            return
        if now < child.next_start:
            return
        if child.started_at:
            child.restarts += 1
            self._say(f"restarting {name} (restart {child.restarts})")
        try:
            with open(self.stack / f"{name}.log", "ab") as log:
                # A supervisor killed with -9 takes its services along: each is sent SIGTERM
                # (it writes and commits what it holds, as at `down`), none is left running
                # unsupervised. The parent-death signal follows the forking thread: this loop
                # runs on the supervisor's main thread, which lives as long as it does.
                child.proc = subprocess.Popen(child.service.command, env={**self.env, **child.service.env},
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              preexec_fn=end_with_parent(signal.SIGTERM))
        except (OSError, subprocess.SubprocessError) as exc:
            # Its program is not there (a UI not installed ...): tried again with backoff, like
            # a service that exits, while the others run and status.json is kept.
            child.started_at = child.started_at or now
            child.next_start = now + child.backoff.next()
            self._say(f"cannot start {name} ({exc}); trying again in {child.next_start - now:.0f} s")
            return
        child.pid, child.started_at, child.since = child.proc.pid, now, time.time()

    def _write_scrape_targets(self) -> None:
        """``prometheus-targets.json``: every metrics endpoint of the stack, in the format
        of Prometheus' file_sd_configs (docs/metrics.md), labelled with its service."""
        host = "127.0.0.1" if self.metrics_listen in ("0.0.0.0", "::") else self.metrics_listen
        ports = [("supervisor", self.metrics_port), *((c.service.name, c.metrics_port) for c in self.children)]
        targets = [{"targets": [f"{host}:{port}"], "labels": {"service": name}} for name, port in ports if port]
        tmp = self.stack / "prometheus-targets.json.tmp"
        tmp.write_text(json.dumps(targets, indent=1))
        tmp.replace(self.stack / "prometheus-targets.json")

    def _write_status(self) -> None:
        status = {"supervisor": os.getpid(), "metrics_port": self.metrics_port,
                  "metrics_listen": self.metrics_listen, "services": {
            c.service.name: {"pid": c.pid, "since": c.since, "restarts": c.restarts,
                             "last_exit": c.last_exit, "group": c.service.group,
                             "metrics_port": c.metrics_port}
            for c in self.children}}
        tmp = self.stack / "status.json.tmp"
        tmp.write_text(json.dumps(status))
        tmp.replace(self.stack / "status.json")


def free_ports(host: str, n: int) -> list[int]:
    """``n`` ports free on ``host`` now (each bound at once, so they differ)."""
    import socket

    sockets = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def supervisor_registry(supervisor: Supervisor):
    """The supervisor's own metrics: per service, its restarts, whether it runs now, its
    last exit code; and its process's."""
    from prometheus_client import CollectorRegistry, ProcessCollector
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Services:
        def collect(self):
            restarts = CounterMetricFamily("trainmon_service_restarts", "Times the supervisor restarted "
                                           "the service (it exited or was killed)", labels=["service"])
            up = GaugeMetricFamily("trainmon_service_up", "1 while the service's process runs",
                                   labels=["service"])
            exits = GaugeMetricFamily("trainmon_service_last_exit_code", "The exit code of the service's "
                                      "last exit (negative: the signal that ended it)", labels=["service"])
            for child in list(supervisor.children):
                name = child.service.name
                restarts.add_metric([name], child.restarts)
                up.add_metric([name], 1 if child.pid is not None else 0)
                if child.last_exit is not None:
                    exits.add_metric([name], child.last_exit)
            return [restarts, up, exits]

    registry = CollectorRegistry()
    registry.register(Services())
    ProcessCollector(registry=registry)
    return registry


def serve_supervisor_metrics(supervisor: Supervisor) -> None:
    """:func:`supervisor_registry` on the supervisor's port; a port it cannot have is said
    and otherwise ignored."""
    from prometheus_client import start_http_server

    try:
        start_http_server(supervisor.metrics_port, addr=supervisor.metrics_listen,
                          registry=supervisor_registry(supervisor))
    except OSError as exc:
        supervisor._say(f"cannot serve metrics on {supervisor.metrics_listen}:{supervisor.metrics_port} ({exc})")
        supervisor.metrics_port = None


def scraped_counts(listen: str, port: int | None) -> dict[str, float] | None:
    """A service's dead letters and lag, summed, from its metrics endpoint (None: not
    answering)."""
    if not port:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    host = "127.0.0.1" if listen in ("0.0.0.0", "::") else listen
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    sums = {"dead_letters": 0.0, "lag": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "trainmon_records_dead_lettered_total":
                sums["dead_letters"] += sample.value
            elif sample.name == "trainmon_consumer_lag":
                sums["lag"] += sample.value
    return sums


# -- the commands ---------------------------------------------------------------------------

def read_status(stack: Path) -> dict | None:
    try:
        status = json.loads((stack / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return status if _alive(status.get("supervisor")) else None


def _alive(pid: int | None) -> bool:
    """Running: not gone and not a zombie. A supervisor started by ``up`` in this very
    process (the demo does that) is this process's child: once it exits it stays a zombie,
    which signal 0 still reaches, until reaped -- here, or by nobody before ``down`` gave up."""
    if pid is None:
        return False
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours: its own parent reaps it
        pass
    return pid_alive(pid) and not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Exited but not reaped (Linux; elsewhere, as if not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].startswith("Z")  # the state follows "pid (comm) "


@dataclass(frozen=True)
class Layout:
    """How the stack's Kafka is laid out, kept in ``stack.json`` for status and down."""

    port: int = 9092
    listen: str = "127.0.0.1"
    public_host: str | None = None
    brokers: int = 1

    @property
    def secured(self) -> bool:
        return not is_loopback(self.listen)

    @classmethod
    def of(cls, stack: Path) -> "Layout":
        try:
            return cls(**json.loads((stack / "stack.json").read_text()))
        except (OSError, ValueError):
            saved = stack / "broker-port"  # (a stack of an earlier version)
            return cls(port=int(saved.read_text())) if saved.exists() else cls()

    def save(self, stack: Path) -> None:
        (stack / "stack.json").write_text(json.dumps(self.__dict__))


def broker_of(stack: Path, layout: Layout | None = None, secrets: StackSecrets | None = None) -> Broker | Cluster:
    """The stack's broker, or brokers (a Cluster), as laid out."""
    layout = layout or Layout.of(stack)
    if layout.secured and secrets is None:
        secrets = StackSecrets.ensure(stack / "security", [layout.public_host or layout.listen])
    if layout.brokers > 1:
        cluster = Cluster(stack / "brokers", nodes=layout.brokers, listen=layout.listen,
                          public_host=layout.public_host, secrets=secrets)
        for i, broker in enumerate(cluster.brokers):  # client ports port, port + 1, ...
            broker.port = layout.port + i
        return cluster
    return Broker(stack / "broker", port=layout.port, listen=layout.listen,
                  public_host=layout.public_host, secrets=secrets)


def _running(kafka: Broker | Cluster) -> bool:
    return all(kafka.running()) if isinstance(kafka, Cluster) else kafka.running()


def job_env_lines(kafka: Broker | Cluster, stack: Path) -> list[str]:
    """What a training job needs, as the lines to put in its environment."""
    if kafka.secrets is None:
        return [env_line(kafka.bootstrap, stack)]
    return [f"export {name}={value}" for name, value in kafka.client_env("writer").items()]


def up(stack: Path, layout: Layout, extra: list[str], ui: str | None, timeout: float = 90.0,
       env: dict | None = None, announce: bool = True, tls: dict | None = None,
       stop_with_caller: bool = False) -> int:
    """``env``: settings for the services (the demo's shorter alert windows); ``tls``: the
    operator's certificate, key and CA (``--tls-cert/--tls-key/--tls-ca``);
    ``stop_with_caller``: a stack for this process alone (the demo): once it ends, however
    it ends, a watchdog stops the supervisor (its services with it), then the broker."""
    from . import topics
    from .kafka_client.acls import grant_stack_acls

    stack.mkdir(parents=True, exist_ok=True)
    running = read_status(stack)
    if running is not None:
        print(f"trainmon: already up (supervisor {running['supervisor']}); 'trainmon down' first to change it")
        print("\n".join(job_env_lines(broker_of(stack), stack)))
        return 0
    secrets = None
    if layout.secured:
        secrets = StackSecrets.ensure(stack / "security", [layout.public_host or layout.listen, layout.listen],
                                      **{f"tls_{k}": v for k, v in (tls or {}).items()})
    kafka = broker_of(stack, layout, secrets)
    layout.save(stack)
    if not _running(kafka):
        print(f"trainmon: starting Kafka on {kafka.bootstrap}", file=sys.stderr)
        kafka.start()
    kafka.create_topics(topics.all_topics())
    if secrets is not None:
        grant_stack_acls(topics.DEFAULT_PREFIX, env=kafka.client_env(), bootstrap=kafka.bootstrap)
    # The services log in as the stack's admin; the file holds its password where secured.
    services_env = {**kafka.client_env(), **(env or {})}
    if secrets is not None:
        # The SQL endpoint (ClickHouse's HTTP interface) on the same address, over HTTPS
        # with the broker's certificate (its PEM holds the key and the chain).
        services_env.update({"TRAINMON_SQL_LISTEN": layout.listen,
                             "TRAINMON_SQL_TLS_CERT": str(secrets.broker_keystore),
                             "TRAINMON_SQL_TLS_KEY": str(secrets.broker_keystore)})
    plan = stack / "services.json"
    fd = os.open(plan, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"with": extra, "ui": ui, "env": services_env}, out)
    with open(stack / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "trainmon.stack", "supervise", str(stack), kafka.bootstrap],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # outlives this command and its terminal
    if stop_with_caller:
        brokers = kafka.brokers if isinstance(kafka, Cluster) else [kafka]
        watch([supervisor.pid, *(pid for b in brokers if (pid := b.pid()) is not None)],
              grace_s=STOP_GRACE_S + 5)
    deadline = time.monotonic() + timeout
    while not _all_running(read_status(stack)):
        if time.monotonic() > deadline or supervisor.poll() is not None:
            print(f"trainmon: the services did not start; see {stack}/*.log", file=sys.stderr)
            return 1
        time.sleep(0.2)
    names = ", ".join(read_status(stack)["services"])
    if not announce:
        return 0
    how = (f"SASL_SSL with logins and ACLs, {layout.brokers} broker(s)" if secrets is not None
           else f"plain text on loopback, {layout.brokers} broker(s)")
    print(f"trainmon: up: Kafka on {kafka.bootstrap} ({how}); {names} (logs: trainmon logs NAME). "
          "In the training job's environment:")
    print("\n".join(job_env_lines(kafka, stack)))
    if secrets is not None:
        print(f"trainmon: copy {secrets.ca_file} to the nodes and point TRAINMON_KAFKA_SSL_CAFILE at it "
              "there; keep these lines private (the password lets anyone write to the topics)")
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
    from .kafka_client import KafkaError, group_lag, replication_state

    broker = broker_of(stack)
    running = _running(broker)
    print(f"kafka           {'running on ' + broker.bootstrap if running else 'stopped'}")
    try:
        print(f"java            {java()[1]}")
    except RuntimeError as exc:
        print(f"java            none: {exc}")
    if isinstance(broker, Cluster) and running:
        try:
            for line in replication_state(env=broker.client_env(), bootstrap=broker.bootstrap):
                print(f"                {line}")
        except KafkaError as exc:
            print(f"                replication unknown: {exc}")
    status = read_status(stack)
    if status is None:
        print("supervisor      stopped")
        return 1
    listen = status.get("metrics_listen", "127.0.0.1")
    metrics = f", metrics on {listen}:{status['metrics_port']}" if status.get("metrics_port") else ""
    print(f"supervisor      running (pid {status['supervisor']}{metrics})")
    record_topics = topics.all_topics()[:-1]
    for name, s in status["services"].items():
        state = f"running (pid {s['pid']}, up {_uptime(s['since'])})" if _alive(s["pid"]) else "restarting"
        last = f", last exit {s['last_exit']}" if s["last_exit"] is not None else ""
        lag = ""
        if s["group"] and running:
            try:
                lag = group_lag(s['group'], record_topics, env=broker.client_env(),
                                bootstrap=broker.bootstrap, timeout_s=5)
                lag = f", lag {lag:,} records"
            except KafkaError:
                lag = ", lag unknown"
        scraped = scraped_counts(listen, s.get("metrics_port"))
        if scraped is not None:
            lag = lag or f", lag {int(scraped['lag']):,} records"
            lag += f", {int(scraped['dead_letters']):,} dead letters (metrics on :{s['metrics_port']})"
        print(f"{name:<15} {state}, {s['restarts']} restarts{last}{lag}{_delivery_counts(stack, name)}")
    return 0 if running and _all_running(status) else 1


def _delivery_counts(stack: Path, service: str) -> str:
    """The notify sink's failed and given-up deliveries, from the counts it writes."""
    if service != "notify":
        return ""
    try:
        counts = json.loads(next((stack / "notify").glob("notify-*.stats.json")).read_text())
    except (StopIteration, OSError, ValueError):
        return ""
    return (f", {counts.get('messages', 0)} messages, {counts.get('failures', 0)} failed sends, "
            f"{counts.get('given_up', 0)} given up")


def show_logs(stack: Path, name: str, lines: int, follow: bool) -> int:
    path = stack / f"{name}.log"
    if not path.exists():
        known = sorted(p.stem for p in stack.glob("*.log"))
        print(f"trainmon logs: no log for {name!r}; there are: {', '.join(known) or 'none'}", file=sys.stderr)
        return 1
    return subprocess.call(["tail", "-n", str(lines), *(["-F"] if follow else []), str(path)])


def down(stack: Path, timeout: float = DOWN_TIMEOUT_S, announce: bool = True) -> int:
    """Stop the supervisor (it stops its services, each writing what it holds first), then
    any service a supervisor killed with -9 left behind, then the broker -- last, so the
    services can still commit to it."""
    status = read_status(stack)
    if status is not None:
        _signal(status["supervisor"], signal.SIGTERM)
        if not _wait_gone([status["supervisor"]], timeout):
            # Stuck: it must not restart the services stopped below.
            _signal(status["supervisor"], signal.SIGKILL)
            _wait_gone([status["supervisor"]], 5.0)
    try:
        left = json.loads((stack / "status.json").read_text())["services"].values()
    except (OSError, ValueError, KeyError):
        left = []
    orphans = [s["pid"] for s in left if _alive(s["pid"])]
    for pid in orphans:
        _signal(pid, signal.SIGTERM)
    if orphans and not _wait_gone(orphans, STOP_GRACE_S):
        for pid in orphans:
            _signal(pid, signal.SIGKILL)
        _wait_gone(orphans, 5.0)
    (stack / "status.json").unlink(missing_ok=True)
    broker = broker_of(stack)
    if isinstance(broker, Cluster) or broker.running():
        broker.stop()
    if announce:
        print("trainmon: down")
    return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it exited meanwhile
        pass


def _wait_gone(pids: list[int], timeout: float) -> bool:
    """Whether every one of them exited within ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


ACTIONS = {"up": "Start Kafka and the supervised consumers on this machine; print the job's env line.",
           "status": "Show Kafka, the supervisor, and each service with its uptime, restarts, lag "
                     "and dead letters.",
           "logs": "Print a service's log.",
           "down": "Stop the services (each writes what it holds first), the supervisor, then Kafka."}


def build_parser(action: str) -> argparse.ArgumentParser:
    """One action's own options: ``trainmon up --help`` shows up's and nothing else."""
    parser = argparse.ArgumentParser(prog=f"trainmon {action}", description=ACTIONS[action])
    parser.add_argument("--dir", type=Path, default=default_dir(),
                        help="where everything lives (default: $TRAINMON_STACK_DIR or ~/.cache/trainmon/stack)")
    if action == "up":
        parser.add_argument("--port", type=int, default=int(os.environ.get("TRAINMON_BROKER_PORT", 0)) or 9092,
                            help="the broker's port (default: $TRAINMON_BROKER_PORT or 9092; with "
                                 "--brokers N, N ports from it)")
        parser.add_argument("--listen", default="127.0.0.1", metavar="ADDR",
                            help="the address Kafka listens on (default 127.0.0.1, plain text); any "
                                 "other (0.0.0.0 for all) turns on TLS, SCRAM logins and ACLs")
        parser.add_argument("--public-host", metavar="NAME",
                            help="the name the compute nodes use for this host (default: --listen)")
        parser.add_argument("--brokers", type=int, default=1, choices=(1, 3),
                            help="Kafka brokers: 1, or 3 that replicate every topic (default 1)")
        parser.add_argument("--notify", action="append", default=[], metavar="[SEVERITY=]URL",
                            help="tell a person of each alert: an apprise URL (slack://, mailto://, "
                                 "json://, ...), with its minimum severity; again for more (docs/notify.md)")
        parser.add_argument("--alertmanager", metavar="URL", help="post every incident to this Alertmanager")
        for what in ("cert", "key", "ca"):
            parser.add_argument(f"--tls-{what}", type=Path, metavar="PEM",
                                help=f"your site's TLS {what} (default: up makes a CA and a certificate)")
        parser.add_argument("--with", dest="extra", default="",
                            help=f"consumers to run too, comma-separated ({', '.join(ON_REQUEST)})")
        parser.add_argument("--ui", choices=UIS, help="a UI for live plots (TensorBoard on 6006, Aim on 43800)")
        parser.add_argument("--metrics-port", type=int, default=os.environ.get("TRAINMON_METRICS_PORT") or "0",
                            metavar="PORT", help="Prometheus metrics: the supervisor on PORT, each consumer "
                                                 "on the next ones (default: $TRAINMON_METRICS_PORT, else 0: "
                                                 "free ports, recorded in the stack's directory; docs/metrics.md)")
        parser.add_argument("--metrics-listen", default=os.environ.get("TRAINMON_METRICS_LISTEN", "127.0.0.1"),
                            metavar="ADDR", help="the metrics endpoints' address (default: "
                                                 "$TRAINMON_METRICS_LISTEN or %(default)s)")
    elif action == "logs":
        parser.add_argument("name", nargs="?", default="supervisor", help="the service (default supervisor)")
        parser.add_argument("-n", "--lines", type=int, default=40, help="how many lines")
        parser.add_argument("-f", "--follow", action="store_true", help="keep printing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "supervise":  # the supervisor process itself (started by `up`)
        Supervisor(Path(argv[1]), argv[2]).run()
        return 0
    if not argv or argv[0] not in ACTIONS:
        print(f"usage: trainmon {{{','.join(ACTIONS)}}} [--help]", file=sys.stderr)
        return 2
    action = argv[0]
    parser = build_parser(action)
    args = parser.parse_args(argv[1:])
    stack = args.dir.expanduser().resolve()
    if action == "status":
        return show_status(stack)
    if action == "logs":
        return show_logs(stack, args.name, args.lines, args.follow)
    if action == "down":
        return down(stack)
    extra = [x.strip() for x in args.extra.split(",") if x.strip()]
    unknown = set(extra) - set(ON_REQUEST)
    if unknown:
        parser.error(f"--with: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ON_REQUEST)}")
    if args.ui and args.ui not in extra:
        extra.append(args.ui)  # a UI shows what its forwarder writes
    if args.listen == "0.0.0.0" and not args.public_host:
        parser.error("--listen 0.0.0.0 needs --public-host: the name the nodes reach this host by")
    tls = {k: getattr(args, f"tls_{k}") for k in ("cert", "key", "ca") if getattr(args, f"tls_{k}")}
    if tls and len(tls) != 3:
        parser.error("--tls-cert, --tls-key and --tls-ca go together")
    if tls:
        try:
            StackSecrets.load_given(tls["cert"], tls["key"], tls["ca"])
        except ValueError as exc:
            parser.error(str(exc))
    layout = Layout(port=args.port, listen=args.listen, public_host=args.public_host, brokers=args.brokers)
    paging = {"TRAINMON_NOTIFY": " ".join(args.notify), "TRAINMON_ALERTMANAGER_URL": args.alertmanager or ""}
    paging = {name: value for name, value in paging.items() if value}
    if paging and "notify" not in extra:
        extra.append("notify")  # (trainmon consume notify delivers them)
    metrics = {"TRAINMON_METRICS_PORT": str(args.metrics_port), "TRAINMON_METRICS_LISTEN": args.metrics_listen}
    return up(stack, layout, extra, args.ui, env={**paging, **metrics}, tls=tls or None)


if __name__ == "__main__":
    sys.exit(main())
