"""A real single-node Apache Kafka broker (KRaft, loopback only) run from Maven jars.

There is no Docker engine where trainmon is developed and tested, so the broker's
classpath is resolved from Maven Central (``infra/kafka/pom.xml``) into a cache
directory outside git, and the JVM is started directly: ``kafka.Kafka`` as a combined
broker + controller. ``trainmon broker start|stop|status`` and the test fixture use it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

POM = Path(__file__).resolve().parents[1] / "infra" / "kafka" / "pom.xml"
DEFAULT_PARTITIONS = 4


def cache_dir() -> Path:
    base = os.environ.get("TRAINMON_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainmon"
    )
    return Path(base)


def libs_dir() -> Path:
    return Path(os.environ.get("TRAINMON_KAFKA_LIBS") or cache_dir() / "kafka-libs")


def fetch(quiet: bool = True) -> Path:
    """Resolve the broker jars with Maven once; later calls return the cached dir."""
    libs = libs_dir()
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if not POM.exists():
        raise RuntimeError(f"Kafka pom not found at {POM}: run from a trainmon source checkout")
    if shutil.which("mvn") is None:
        raise RuntimeError("Maven (mvn) is needed to fetch the Kafka broker jars from Maven Central")
    tmp = libs.with_name(libs.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"trainmon: fetching Kafka broker jars from Maven Central into {libs} ...", file=sys.stderr)
    cmd = ["mvn", "-B", "-f", str(POM), "dependency:copy-dependencies",
           "-DincludeScope=runtime", f"-DoutputDirectory={tmp}"]
    if quiet:
        cmd.insert(1, "-q")
    subprocess.run(cmd, check=True)
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text("ok\n")
    return libs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Broker:
    """One broker process whose state (ports, pid) lives in ``data_dir/broker.json``."""

    data_dir: Path
    port: int = 0
    controller_port: int = 0
    heap: str = "512m"
    partitions: int = DEFAULT_PARTITIONS

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        state = self._read_state()
        # Restarting on the same data dir keeps the same ports: clients reconnect.
        self.port = self.port or state.get("port") or free_port()
        self.controller_port = self.controller_port or state.get("controller_port") or free_port()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        return self.pid() is not None and _port_open(self.port)

    def _write_properties(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir / "logs"),
            "num.partitions": str(self.partitions),
            "auto.create.topics.enable": "true",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "log.retention.hours": "-1",
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, main: str, *args: str, **popen) -> list[str]:
        classpath = os.pathsep.join(str(p) for p in sorted(fetch().glob("*.jar")))
        return ["java", f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC",
                "-Djava.awt.headless=true", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                "-cp", classpath, main, *args]

    def start(self, timeout: float = 60.0) -> "Broker":
        if self.running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self._write_properties()
        if not (self.data_dir / "logs" / "meta.properties").exists():
            cluster_id = subprocess.run(
                self._java("kafka.tools.StorageTool", "random-uuid"),
                check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                           "-c", str(props), "--standalone"),
                check=True, capture_output=True, text=True)
        log = open(self.data_dir / "broker.log", "ab")
        proc = subprocess.Popen(self._java("kafka.Kafka", str(props)), stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self._state_file.write_text(json.dumps(
            {"pid": proc.pid, "port": self.port, "controller_port": self.controller_port}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"Kafka broker exited with {proc.returncode}; "
                                   f"see {self.data_dir / 'broker.log'}")
            if _port_open(self.port) and self._metadata_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"Kafka broker not ready on {self.bootstrap} after {timeout:.0f}s")

    def _metadata_ready(self) -> bool:
        from .kafka_client import KafkaError, list_topics

        try:
            list_topics(bootstrap=self.bootstrap, timeout_s=2)
            return True
        except KafkaError:
            return False

    def stop(self, timeout: float = 30.0, kill: bool = False) -> None:
        pid = self.pid()
        if pid is None:
            return
        os.killpg(pid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
            _reap(pid)
        # The port must be free before a restart on it.
        while _port_open(self.port) and time.monotonic() < deadline + 10:
            time.sleep(0.1)

    def create_topics(self, names: list[str], partitions: int | None = None) -> None:
        from .kafka_client import create_topics

        create_topics(names, partitions or self.partitions, bootstrap=self.bootstrap)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
