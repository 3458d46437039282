"""The stack's edges, each once a process left running or a record lost: a service whose
program cannot be started, a second broker start on a running broker's directory, a pid
in broker.json that another program now has, a consumer logged in as ``reader``
dead-lettering a record (real brokers, SASL_SSL for the last)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import wait_until
from trainmon import stack
from trainmon.broker import pid_alive

REPO = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    return not stack._alive(pid)


def test_a_service_that_cannot_be_started_neither_blocks_the_others_nor_hides_the_supervisor(tmp_path):
    """A service whose program is not there (``--ui aim`` without aim's CLI installed, a
    moved venv) must not stop the supervisor from running the other services and writing
    status.json: without that file ``trainmon down`` finds no supervisor and stops only
    the broker, leaving the supervisor and every consumer running."""
    (tmp_path / "services.json").write_text(json.dumps({"with": [], "ui": None, "env": {}}))
    supervisor = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from pathlib import Path
        from trainmon import stack
        stack.services = lambda *_: [stack.Service("stand-in", ["sleep", "300"]),
                                     stack.Service("missing-ui", [str(Path(sys.argv[1]) / "no-such-program")])]
        stack.Supervisor(Path(sys.argv[1]), "127.0.0.1:9").run()
    """), str(tmp_path)], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        service = wait_until(lambda: (stack.read_status(tmp_path) or {}).get("services", {}).get(
            "stand-in", {}).get("pid"), 10, "status.json naming the running stand-in service")
        stack.down(tmp_path, timeout=10, announce=False)
        wait_until(lambda: supervisor.poll() is not None, 10, "the supervisor stopped by down")
        wait_until(lambda: _gone(service), 10, "the stand-in service stopped by down")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()  # its services get SIGTERM (parent-death signal)
        supervisor.wait(5)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_second_start_on_a_running_brokers_directory_leaves_it_stoppable(tmp_path):
    """``trainmon broker start --port P`` (or $TRAINMON_BROKER_PORT) with another port than
    the running broker of that data directory: ``running()`` looks at the new port only,
    so a second JVM was started on the same log directory. It fails on the directory's
    lock, but it had already overwritten broker.json with its own pid: the running broker
    was then unknown to ``trainmon broker stop`` / ``trainmon down`` (left running)."""
    from trainmon.broker import Broker, free_port

    first = Broker(tmp_path / "kafka", heap="256m", throwaway=True).start()
    pid = first.pid()
    try:
        again = Broker(tmp_path / "kafka", port=free_port(), heap="256m", throwaway=True)
        with contextlib.suppress(RuntimeError):  # (with the fix: "already runs ... on port ...")
            again.start(timeout=60)
        assert Broker(tmp_path / "kafka").pid() == pid  # still known: `broker stop` stops it
    finally:
        import signal

        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
        first.stop()
        wait_until(lambda: not pid_alive(pid) or _zombie(pid), 20, "the first broker stopped")


def _zombie(pid: int) -> bool:
    return stack._zombie(pid)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_consumer_with_the_reader_login_can_dead_letter(tmp_path):
    """docs/cluster.md: consumers on other hosts (another ClickHouse loader, a W&B
    forwarder) log in as ``reader``. A record they cannot decode is dead-lettered to
    ``<prefix>deadletter`` -- which the reader's ACLs did not let it write: the dead
    letter was refused (TOPIC_AUTHORIZATION_FAILED), the stream's settle step saw every
    delivery answered, and the record's offset was committed: the record was gone from
    the pipeline with no dead letter to say so."""
    from trainmon import topics
    from trainmon.broker import Broker
    from trainmon.consumers.stream import RecordStream
    from trainmon.kafka_client import Consumer, KafkaError, Producer, TopicPartition, create_topics
    from trainmon.kafka_client.acls import grant_stack_acls
    from trainmon.stack_security import StackSecrets

    secrets = StackSecrets.ensure(tmp_path / "security", ["127.0.0.1"])
    broker = Broker(tmp_path / "kafka", heap="256m", secrets=secrets, throwaway=True).start()
    try:
        prefix = "trainmon."
        create_topics(topics.all_topics(prefix), 1, env=broker.client_env("admin"), bootstrap=broker.bootstrap)
        grant_stack_acls(prefix, env=broker.client_env("admin"), bootstrap=broker.bootstrap)
        admin = Producer(env=broker.client_env("admin"))
        admin.send(topics.topic_for("step", prefix), b"not a record", key=b"run")
        assert admin.flush(30)
        admin.close()
        stream = RecordStream("loader-elsewhere", ["step"], topic_prefix=prefix,
                              env=broker.client_env("reader"), group_instance_id=None)
        try:
            wait_until(lambda: stream.poll(200) is not None and stream.dead_letters, 60,
                       "the undecodable record dead-lettered")
            try:
                stream.commit_polled()  # (with the dead letter refused it must not commit)
            except KafkaError:
                pass
            dead = TopicPartition(topics.topic_for(topics.DEADLETTER, prefix), 0)
            step = TopicPartition(topics.topic_for("step", prefix), 0)
            looker = Consumer("loader-elsewhere", env=broker.client_env("admin"))  # (asks, never joins)
            try:
                letters = looker.end_offsets([dead])[dead]
                committed = looker.committed([step])
            finally:
                looker.close()
            # Lost would be: committed past the record, and no dead letter for it.
            assert letters == 1 or committed[step] is None, (letters, committed)
        finally:
            stream.close()
    finally:
        broker.stop()


def test_a_pid_in_broker_json_that_another_program_now_has_is_not_taken_for_the_broker(tmp_path):
    """After a reboot broker.json's pid may be any program's: a start must not take it for
    a broker of this directory (wait for it, or refuse another port), only a process whose
    command line names this directory's properties."""
    from trainmon.broker import _started_with

    properties = tmp_path / "kafka" / "server.properties"
    assert not _started_with(os.getpid(), properties)
    named = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()",
                              str(properties)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert named.stdout.readline() == b"up\n"  # (exec'd: its own command line, not ours)
        assert _started_with(named.pid, properties)
    finally:
        named.communicate(b"", timeout=10)
