"""Nothing left running: a broker started for one process stops when that process ends,
however it ends (trainmon/process_lifetime.py), and a `trainmon up` service stops with
its supervisor.

The watchdog and the parent-death signal are shown with ``sleep`` processes (no broker,
well under a second each); then, once per signal, a process that owns a real throwaway
broker is sent SIGTERM or SIGKILL and no broker JVM is left within 10 s. The owner does
not wait for the broker to be ready: the JVM running is what must not outlive it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import wait_until
from trainmon import stack
from trainmon.broker import pid_alive

REPO = Path(__file__).resolve().parents[1]


def _owner(script: str) -> tuple[subprocess.Popen, list[int]]:
    """A Python process running ``script``, which prints the pids it wants watched on
    one line, then sleeps; returns it once that line is read."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip(), f"the owner said nothing (exit {proc.poll()})"
    return proc, [int(pid) for pid in line.split()]


def _gone(pid: int) -> bool:
    """Exited, and not a zombie waiting for its (dead) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return not pid_alive(pid)


def _broker_jvms(data_dir: Path) -> list[int]:
    """Pids of Kafka JVMs running on ``data_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if (b"kafka.Kafka" in cmdline and str(data_dir).encode() in cmdline
                        and not _gone(int(entry.name))):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


WATCHING_SLEEP = """
    import subprocess, sys, time
    from trainmon.process_lifetime import watch
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    watch([sleeper.pid], grace_s=1.0, remove=sys.argv[1] if len(sys.argv) > 1 else None)
    print(sleeper.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_watchdog_stops_what_it_watches_once_the_owner_is_gone(sig, tmp_path):
    owner, (sleeper,) = _owner(WATCHING_SLEEP)
    assert not _gone(sleeper)
    owner.send_signal(sig)
    owner.wait(5)
    wait_until(lambda: _gone(sleeper), 5, f"sleep {sleeper} stopped after its owner got {sig.name}")


def test_the_watchdog_removes_the_directory_it_was_given(tmp_path):
    data = tmp_path / "broker-data"
    data.mkdir()
    (data / "segment.log").write_bytes(b"x" * 100)
    script = WATCHING_SLEEP.replace("sys.argv[1] if len(sys.argv) > 1 else None", repr(str(data)))
    owner, (sleeper,) = _owner(script)
    owner.kill()
    owner.wait(5)
    wait_until(lambda: _gone(sleeper) and not data.exists(), 5, "the sleeper stopped and its directory removed")


def test_the_watchdog_leaves_by_itself_when_the_watched_process_ends_first():
    from trainmon.process_lifetime import watch

    sleeper = subprocess.Popen(["sleep", "300"])
    watchdog = watch([sleeper.pid])
    sleeper.kill()
    sleeper.wait()
    assert watchdog.wait(5) == 0  # gone, and it had nothing to stop


def test_no_service_outlives_a_supervisor_killed_with_minus_9(tmp_path):
    """The real supervisor loop, running a stand-in service (sleep) instead of the
    consumers; its status file names the service's pid."""
    (tmp_path / "services.json").write_text(json.dumps({"with": [], "ui": None, "env": {}}))
    supervisor = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from pathlib import Path
        from trainmon import stack
        stack.services = lambda *_: [stack.Service("stand-in", ["sleep", "300"])]
        stack.Supervisor(Path(sys.argv[1]), "127.0.0.1:9").run()
    """), str(tmp_path)], cwd=REPO)
    try:
        service = wait_until(lambda: (stack.read_status(tmp_path) or {}).get("services", {}).get(
            "stand-in", {}).get("pid"), 10, "the supervisor's service started")
        assert not _gone(service)
    finally:
        supervisor.kill()
        supervisor.wait(5)
    wait_until(lambda: _gone(service), 5, f"service {service} stopped after its supervisor was killed -9")


OWNING_A_BROKER = """
    import sys, time
    from trainmon.broker import Broker
    broker = Broker(sys.argv[1], heap="256m", throwaway=True).start(wait=False)
    print(broker.pid(), flush=True)
    time.sleep(300)
"""


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_broker_jvm_outlives_the_process_that_owns_it(sig, tmp_path):
    data = tmp_path / "kafka"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OWNING_A_BROKER), str(data)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    jvm = int(proc.stdout.readline())
    assert not _gone(jvm) and _broker_jvms(data) == [jvm]
    proc.send_signal(sig)
    proc.wait(5)
    wait_until(lambda: _gone(jvm) and not _broker_jvms(data), 10,
               f"no broker JVM left after its owner got {sig.name}", pause=0.1,
               details=lambda: f"still running: {_broker_jvms(data)}")
    wait_until(lambda: not data.exists(), 5, "the throwaway broker's data directory removed")


def test_free_ports_are_distinct_and_a_brokers_three_listeners_never_share_one():
    from trainmon.broker import Broker, free_ports

    for _ in range(50):  # picked one after another, two of nine repeated now and then (CI saw it)
        ports = free_ports(9)
        assert len(set(ports)) == 9
    broker = Broker("/nonexistent-never-started", port=free_ports(1)[0])
    assert len({broker.port, broker.controller_port, broker.internal_port}) == 3
