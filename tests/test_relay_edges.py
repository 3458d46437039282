"""The relay and its rank transport at their edges, in memory (no Kafka: a stand-in client
that stores every message at once): a relay that goes away under a training process whose
SIGPIPE is at its default, a relay out of descriptors with no connection to close, and a
pack window the relay cannot keep."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from trainmon.kafka_client.producer import Delivery
from trainmon.relay import frames, server
from trainmon.relay.server import Relay
from trainmon.schemas import schema_fingerprint

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


class StoredAtOnce:
    """The relay's Kafka client where every message is stored as it is sent."""

    def __init__(self):
        self.sent: list[tuple[str, bytes]] = []

    def send(self, topic, value, key=None, headers=None) -> Delivery:
        self.sent.append((topic, value))
        return Delivery(done=True, offset=len(self.sent))

    def poll(self, timeout_s=0.0):
        pass

    def flush(self, timeout_s):
        return True


@pytest.fixture
def relay_path(tmp_path) -> str:
    return str(tmp_path / "relay.sock")


def running(relay: Relay) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def stopped(relay: Relay, stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    relay.wake()
    thread.join(30)
    assert not thread.is_alive()


_RANK_WHOSE_SIGPIPE_IS_THE_DEFAULT = """
import signal, socket, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # (a training script's own choice, common in CLIs)
from trainmon.kafka_client.errors import TransportUnavailable
from trainmon.kafka_client.relay_transport import RelayTransport
from trainmon.kafka_client.transport import TransportSettings

relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
relay.bind(sys.argv[1])
relay.listen(1)
kept = []
rank = RelayTransport(sys.argv[1], TransportSettings("unused:9092", {}), kept.extend)
rank.send(("t.step", b"run", b'{"a":1}'))
conn, _ = relay.accept()
conn.close()  # the relay goes away (killed) with the message unanswered
try:
    rank.send(("t.step", b"run", b'{"a":2}'))
except TransportUnavailable as exc:
    print("unavailable:", exc)
rank.serve()
print("kept", len(kept), flush=True)
"""


def test_a_relay_that_goes_away_does_not_kill_a_rank_whose_sigpipe_is_the_default(relay_path):
    """A write to a socket whose peer closed raises SIGPIPE besides EPIPE; a process whose
    SIGPIPE is at its default (a training script may set it so) was killed by it: the
    relay going away ended the training job instead of its records going to the spill."""
    done = subprocess.run([sys.executable, "-c", _RANK_WHOSE_SIGPIPE_IS_THE_DEFAULT, relay_path],
                          capture_output=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
    assert b"unavailable: writing to the relay failed" in done.stdout and b"kept 1" in done.stdout


def test_a_relay_out_of_descriptors_with_no_connection_to_close_takes_ranks_again(relay_path, monkeypatch):
    """accept() failing (EMFILE: descriptors held elsewhere in the relay's process) stopped
    the relay watching its listener until a connection closed: with none open, none ever
    would, and the relay took no rank again."""
    real_accept, tries = socket.socket.accept, []

    def accept_failing_once(sock):
        tries.append(1)
        if len(tries) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(sock)

    monkeypatch.setattr(socket.socket, "accept", accept_failing_once)
    relay = Relay(relay_path, kafka=StoredAtOnce())
    relay.listen()
    stop, thread = running(relay)
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        rank.connect(relay_path)  # (the listen backlog takes it while the relay cannot)
        rank.sendall(frames.hello(schema_fingerprint()))
        rank.settimeout(0.1)
        received = bytearray()

        def answered():
            try:
                received.extend(rank.recv(64))
            except socket.timeout:
                pass
            return frames.take_answers(received)

        assert wait_until(answered, 15, "the relay to take the rank after its failed accept") == [
            (frames.HELLO_ID, frames.TAKES_FLUSH), (frames.HELLO_ID, frames.TAKES_VALUES)]
        assert len(tries) >= 2 and relay.stats.connections == 1
    finally:
        rank.close()
        stopped(relay, stop, thread)


@pytest.mark.parametrize("window_ms", ["inf", "nan", "-50", "60000"])
def test_a_pack_window_the_relay_cannot_keep_is_refused_by_name(relay_path, window_ms, monkeypatch, capsys):
    """--window-ms inf crashed the relay at the first rank's message (time.sleep
    overflows), a window of a minute outlasted every rank's wait for its answers (each
    gave its messages up and sent them again, for ever), nan or a negative one was taken
    silently as none."""
    def ran(self, stop):
        raise AssertionError(f"the relay ran with --window-ms {window_ms}")

    monkeypatch.setattr(Relay, "run", ran)
    monkeypatch.setattr(server, "signal", types.SimpleNamespace(
        SIGTERM=15, SIGINT=2, signal=lambda *args: None, set_wakeup_fd=lambda fd: None))
    monkeypatch.delenv("TRAINMON_METRICS_PORT", raising=False)
    with pytest.raises(SystemExit) as exc:
        server.main(["--socket", relay_path, "--window-ms", window_ms])
    assert exc.value.code == 2
    assert "--window-ms" in capsys.readouterr().err and not os.path.exists(relay_path)
    with pytest.raises(ValueError, match="window_s"):
        Relay(relay_path, kafka=StoredAtOnce(), window_s=float(window_ms) / 1000)


class RefusesOver(StoredAtOnce):
    """The relay's Kafka client with a message size of ``limit`` bytes: a message over it
    is refused at once, before it is sent (as librdkafka's message.max.bytes)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def send(self, topic, value, key=None, headers=None) -> Delivery:
        if len(value) > self.limit:
            return Delivery(done=True, error="KafkaError{code=MSG_SIZE_TOO_LARGE}", too_large=True)
        return super().send(topic, value, key, headers)


def test_ranks_messages_packed_past_the_clients_message_size_go_again_apart_and_only_one_too_large_alone_is_refused(
        relay_path):
    """The relay packs a window's messages up to its own bound; its client may still refuse
    the packed message as too large. Then the ranks' messages go again in smaller Kafka
    messages (in order): each that fits is stored and answered OK; only one too large by
    itself is answered TOO_LARGE (its rank drops it: not FAILED, which it would send again
    for ever)."""
    kafka = RefusesOver(1000)
    relay = Relay(relay_path, kafka=kafka, window_s=0.2)
    relay.listen()
    stop, thread = running(relay)
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        rank.connect(relay_path)
        values = {1: b"a" * 400, 2: b"b" * 400, 3: b"c" * 400, 4: b"d" * 1500, 5: b"e" * 100}
        rank.sendall(frames.hello(b"another schema") + b"".join(
            frames.entry(entry_id, "t.step", b"run", value) for entry_id, value in values.items()))
        rank.settimeout(0.1)
        received, answers = bytearray(), []

        def all_answered():
            try:
                received.extend(rank.recv(4096))
            except socket.timeout:
                pass
            answers.extend(a for a in frames.take_answers(received) if a[0] != frames.HELLO_ID)  # (TAKES_FLUSH)
            return len(answers) == len(values)

        wait_until(all_answered, 15, "the relay's answers", details=lambda: str(answers))
        assert dict(answers) == {1: frames.OK, 2: frames.OK, 3: frames.OK, 4: frames.TOO_LARGE, 5: frames.OK}
        stored = [line for _, value in kafka.sent for line in value.split(b"\n")]
        assert stored == [values[1], values[2], values[3], values[5]]  # each once, in order
        assert relay.stats.failed == 0
    finally:
        rank.close()
        stopped(relay, stop, thread)
