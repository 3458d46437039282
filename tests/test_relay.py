"""The node relay (trainmon relay): a node's ranks send through one local process, which
packs their records across ranks into Kafka messages. Round trips through the real
broker; the relay hung, killed with kill -9 and restarted, absent at the start, or sent
garbage: every record logged reaches Kafka, none is lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from trainmon import topics
from trainmon.broker import Broker, free_port
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.worker import _UNREAD_ANSWERS_MAX
from trainmon.relay import frames
from trainmon.relay.server import Relay, serve_metrics
from trainmon.schemas import SCHEMA_HEADER, decode, encode, schema_fingerprint, unpack

from .conftest import read_records, read_topic
from .metrics_support import scrape
from .waiting import wait_until

RANKS = 4


# -- the wire format, in memory --------------------------------------------------------

def test_frames_split_whole_frames_and_keep_a_partial_one():
    stream = frames.hello(b"abc") + frames.entry(7, "t.step", b"run", b'{"a":1}') + frames.answers([(7, 0), (8, 1)])
    buffer = bytearray(stream[:-3])
    hello, entry = frames.split(buffer)
    assert hello == b"Habc" and frames.parse_entry(entry) == (7, "t.step", b"run", b'{"a":1}')
    assert len(buffer) == len(frames.answers([(7, 0), (8, 1)])) - 3  # the partial frame stays
    buffer += stream[-3:]
    [answers] = frames.split(buffer)
    assert answers[:1] == frames.ANSWERS and not buffer


def test_a_rank_takes_the_answers_in_whole_frames_and_keeps_a_partial_one():
    stream = frames.answers([(7, frames.OK), (8, frames.FAILED)]) + frames.answers([(9, frames.OK)])
    buffer = bytearray(stream[:-2])
    assert frames.take_answers(buffer) == [(7, frames.OK), (8, frames.FAILED)]
    assert buffer == stream[len(frames.answers([(7, 0), (8, 1)])):-2]  # the partial frame stays
    buffer += stream[-2:]
    assert frames.take_answers(buffer) == [(9, frames.OK)] and not buffer
    for not_answers in (frames.entry(1, "t", b"k", b"v"), b"\0\0\0\0", (6).to_bytes(4, "big") + b"A" + bytes(5)):
        with pytest.raises(frames.FrameError, match="not an answers frame"):
            frames.take_answers(bytearray(not_answers))


def test_a_frame_the_socket_cannot_take_waits_and_goes_first_once_it_can():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    unsent = bytearray()
    first, second = frames.entry(1, "t", b"k", b"x" * (4 << 20)), frames.entry(2, "t", b"k", b"y")
    frames.write(ours, unsent, first)  # more than the socket's buffer takes at once
    assert unsent and first.endswith(unsent)
    frames.write(ours, unsent, second)  # behind what waits, never before it
    theirs.settimeout(5)
    received = bytearray()
    while len(received) < len(first) + len(second):
        received += theirs.recv(frames.READ_BYTES)
        frames.write(ours, unsent)
    assert received == first + second and not unsent
    ours.close()
    theirs.close()


def test_frames_that_are_not_the_format_are_refused_by_name():
    with pytest.raises(frames.FrameError, match="empty frame"):
        frames.split(bytearray(b"\0\0\0\0"))
    with pytest.raises(frames.FrameError, match="too short"):
        frames.parse_entry(b"E\0\0")
    with pytest.raises(frames.FrameError, match="run past the frame"):
        frames.parse_entry(b"E" + (1).to_bytes(8, "big") + (200).to_bytes(2, "big") + b"\0\0ab")
    # (not a wait for 4 GiB to arrive: a connection's buffer is bounded)
    with pytest.raises(frames.FrameError, match="past the 67,108,864 any frame may have"):
        frames.split(bytearray(b"\xff\xff\xff\xffH"))


class _NoKafka:
    """The relay's Kafka client where nothing is sent."""

    def poll(self, timeout_s=0.0):
        pass

    def flush(self, timeout_s):
        return True


def test_a_peer_that_never_reads_its_answers_is_closed_before_they_fill_the_relays_memory(
        relay_path, monkeypatch):
    import selectors

    from trainmon.relay import server

    monkeypatch.setattr(server, "MAX_UNREAD_ANSWER_BYTES", 1 << 20)
    relay = Relay(relay_path, kafka=_NoKafka())
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = server._Connection(ours)
    relay._selector.register(ours, selectors.EVENT_READ, conn)
    answered = 0
    while conn.open and answered < 1_000_000:
        answered += 1
        relay._write(conn, frames.answers([(answered, frames.OK)]))
    assert not conn.open and len(frames.answers([(1, frames.OK)])) * answered > 1 << 20
    theirs.close()
    relay.close()


# -- through the real broker ------------------------------------------------------------

@pytest.fixture
def relay_path(tmp_path) -> str:
    return str(tmp_path / "relay.sock")


class RelayThread:
    """A relay on a thread of the test process (its stats readable)."""

    def __init__(self, path: str, bootstrap: str):
        self.relay = Relay(path, bootstrap=bootstrap)
        self.relay.listen()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.relay.wake()
        self.thread.join(30)
        assert not self.thread.is_alive()


def relay_process(path: str, bootstrap: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "trainmon", "relay", "--socket", path],
                               env=dict(os.environ, TRAINMON_KAFKA_BOOTSTRAP=bootstrap),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: os.path.exists(path) or process.poll() is not None, what="the relay's socket")
    assert process.poll() is None, process.stderr.read().decode()
    return process


def ranks(make_producer, relay_path: str, run_id: str) -> list[Producer]:
    return [make_producer(run_id=run_id, rank=rank, world_size=RANKS, relay=relay_path, linger_ms=0)
            for rank in range(RANKS)]


def log_steps(producers: list[Producer], steps: range) -> int:
    for step in steps:
        for producer in producers:  # the ranks of a data-parallel job log each step together
            assert producer.log_step(step, loss=2.0 + producer.config.rank, duration_ms=100.0)
    return len(steps) * len(producers)


def event_ids(records) -> list[str]:
    return [r.event_id for r in records]


def test_a_nodes_ranks_reach_kafka_through_the_relay_packed_across_ranks(
        make_producer, bootstrap, topic_prefix, relay_path):
    relay = RelayThread(relay_path, bootstrap)
    metrics = serve_metrics(relay.relay, 0, "127.0.0.1")
    try:
        producers = ranks(make_producer, relay_path, "relay-run")
        logged = log_steps(producers, range(30))
        assert all(p.flush(30) for p in producers)
        records = read_records(bootstrap, topic_prefix, "step", logged)
        assert len(records) == logged and len(set(event_ids(records))) == logged
        assert {(r.rank, r.step) for r in records} == {(rank, s) for rank in range(RANKS) for s in range(30)}
        # One Kafka message carries several ranks' records, with the producers' schema header.
        messages = read_topic(bootstrap, topics.topic_for("step", topic_prefix), 1)
        ranks_per_message = [len({line.split(b'"rank":')[1].split(b",")[0] for line in unpack(m.value)})
                             for m in messages]
        assert max(ranks_per_message) > 1 and len(messages) < logged
        assert all(dict(m.headers)[SCHEMA_HEADER] == schema_fingerprint() for m in messages)
        assert all(m.key == topics.record_key("relay-run") for m in messages)
    finally:
        relay.close()
    samples = scrape(metrics.port)  # its endpoint: what it took and sent
    metrics.close()
    assert samples.value("trainmon_relay_records_total") == logged
    assert samples.value("trainmon_relay_connections_total") == RANKS
    assert 0 < samples.value("trainmon_relay_kafka_messages_total") < samples.value("trainmon_relay_messages_total")
    assert samples.value("trainmon_relay_failed_total") == 0
    assert not os.path.exists(relay_path)  # removed at its stop


def test_a_relay_hung_then_killed_loses_nothing_and_a_new_relay_takes_over(
        make_producer, bootstrap, topic_prefix, relay_path):
    first = relay_process(relay_path, bootstrap)
    producers = ranks(make_producer, relay_path, "relay-kill")
    logged = log_steps(producers, range(10))
    assert all(p.flush(30) for p in producers)

    first.send_signal(signal.SIGSTOP)  # hung: messages go out and no answer comes
    logged += log_steps(producers, range(10, 20))
    wait_until(lambda: all(p._worker.in_flight for p in producers), what="messages in flight to the hung relay")
    first.kill()  # kill -9: the connections break with those messages unanswered
    first.wait(10)
    wait_until(lambda: all(p.spilled for p in producers), timeout=30,
               what="every rank to keep its unanswered messages in its spill file")
    logged += log_steps(producers, range(20, 30))  # logged while no relay runs

    second = relay_process(relay_path, bootstrap)  # the dead relay's socket file is replaced
    try:
        assert all(p.flush(60) for p in producers)
        records = read_records(bootstrap, topic_prefix, "step", logged)
        assert len(set(event_ids(records))) == logged  # every record, at least once
        assert {(r.rank, r.step) for r in records} == {(rank, s) for rank in range(RANKS) for s in range(30)}
    finally:
        second.terminate()
        assert second.wait(30) == 0


def test_records_logged_before_the_relay_starts_wait_and_arrive_once_it_does(
        make_producer, bootstrap, topic_prefix, relay_path):
    [producer] = ranks(make_producer, relay_path, "relay-late")[:1]
    logged = log_steps([producer], range(5))
    assert not producer.flush(1)  # no relay yet: kept, not delivered
    assert producer.spilled or producer._worker.held_in_memory
    relay = RelayThread(relay_path, bootstrap)
    try:
        assert producer.flush(60)
        records = read_records(bootstrap, topic_prefix, "step", logged)
        assert sorted(r.step for r in records) == list(range(5))
    finally:
        relay.close()


def test_a_connection_sending_garbage_is_closed_and_the_other_ranks_go_on(
        make_producer, bootstrap, topic_prefix, relay_path):
    relay = RelayThread(relay_path, bootstrap)
    try:
        garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        garbage.connect(relay_path)
        garbage.sendall(b"\0\0\0\x05Xjunk")
        wait_until(lambda: garbage.recv(1) == b"", what="the relay to close the garbage connection")
        garbage.close()
        producers = ranks(make_producer, relay_path, "relay-garbage")[:2]
        logged = log_steps(producers, range(5))
        assert all(p.flush(30) for p in producers)
        assert len(read_records(bootstrap, topic_prefix, "step", logged)) == logged
    finally:
        relay.close()
    assert relay.relay.stats.refused == 1


def test_a_forked_child_that_logs_connects_anew_and_the_parent_goes_on(
        make_producer, bootstrap, topic_prefix, relay_path):
    """A DataLoader worker is a fork of its rank: it must not write into the parent's
    connection, or the relay would read one stream of two processes' frames (the worker
    makes a fresh transport in a child: producer/worker.py, _reset)."""
    relay = RelayThread(relay_path, bootstrap)
    try:
        [producer] = ranks(make_producer, relay_path, "relay-fork")[:1]
        logged = log_steps([producer], range(3))
        assert producer.flush(30)
        child = os.fork()
        if child == 0:  # the child logs through the inherited producer, then exits at once
            code = 0 if producer.log_step(100, loss=1.0) and producer.flush(30) else 1
            os._exit(code)
        logged += log_steps([producer], range(3, 6))
        assert producer.flush(30)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        records = read_records(bootstrap, topic_prefix, "step", logged + 1)
        assert sorted(r.step for r in records) == [*range(6), 100]
    finally:
        relay.close()
    assert relay.relay.stats.refused == 0 and relay.relay.stats.connections == 2


def test_log_calls_at_training_rates_go_as_values_and_the_relay_writes_the_ranks_json(
        make_producer, bootstrap, topic_prefix, relay_path):
    """A log call that sends its own record (a training loop's pace) sends its numbers;
    the relay writes the JSON the rank's encoder would (pydantic's bytes of the record)."""
    relay = RelayThread(relay_path, bootstrap)
    try:
        producer = make_producer(run_id="relay-values", rank=1, world_size=2, relay=relay_path,
                                 linger_ms=0, pack_window_ms=0)
        assert producer.log_step(0, loss=2.0) and producer.flush(30)  # (as JSON: the hello's answer came after)
        for step in range(1, 6):
            wait_until(lambda: producer._worker._watching, what="the sender thread to watch (a log call sends)")
            assert producer.log_step(step, loss=2.0 + step, duration_ms=100.0, step_tokens=4096,
                                     timers={"forward": 40, "backward": 60.5})
        assert producer.flush(30)
        records = {r.step: r for r in read_records(bootstrap, topic_prefix, "step", 6)}
        assert sorted(records) == list(range(6))
        assert records[5].timers == {"forward": 40.0, "backward": 60.5} and records[5].tokens_per_second == 40960.0
        assert records[5].event_id.endswith("-5") and records[5].rank == 1
        lines = [line for m in read_topic(bootstrap, topics.topic_for("step", topic_prefix), 1) for line in unpack(m.value)]
        assert len(lines) == 6 and all(encode(decode("step", line)) == line for line in lines)
    finally:
        relay.close()
    assert relay.relay.stats.written == 5 and relay.relay.stats.records == 6


def test_log_calls_leave_the_relays_answers_unread_up_to_a_bound(make_producer, bootstrap, relay_path):
    """A log call through the relay sends without reading the answers to the earlier ones
    (a recv: tens of µs with cold caches); it reads them only with _UNREAD_ANSWERS_MAX
    unread, and a flush reads them all."""
    relay = RelayThread(relay_path, bootstrap)
    try:
        producer = make_producer(run_id="relay-unread", relay=relay_path, linger_ms=0, pack_window_ms=0)
        assert producer.log_step(0, loss=2.0) and producer.flush(30)
        transport, read_by_calls = producer._worker._transport, []
        serve = transport.serve

        def counted_serve(*args, **kwargs):
            if threading.current_thread() is threading.main_thread():  # (a log call's)
                read_by_calls.append(transport.in_flight)
            return serve(*args, **kwargs)

        transport.serve = counted_serve
        in_flight = []
        for step in range(1, 4 * _UNREAD_ANSWERS_MAX):
            wait_until(lambda: producer._worker._watching, what="the sender thread to watch (a log call sends)")
            assert producer.log_step(step, loss=2.0)
            in_flight.append(transport.in_flight)
        assert max(in_flight) > 1  # answers left unread
        assert read_by_calls and all(unread >= _UNREAD_ANSWERS_MAX for unread in read_by_calls)
        assert len(read_by_calls) < len(in_flight) / 4  # (each call read them before)
        assert producer.flush(30) and transport.in_flight == 0
    finally:
        relay.close()
    assert relay.relay.stats.failed == 0 and relay.relay.stats.written > len(in_flight) / 2


def test_a_layout_the_relay_refuses_turns_values_off_and_values_of_no_layout_close_the_connection(
        bootstrap, relay_path):
    relay = RelayThread(relay_path, bootstrap)
    try:
        rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rank.connect(relay_path)
        rank.settimeout(10)
        received = bytearray()

        def answers(n: int) -> list:
            got: list = []
            while len(got) < n:
                received.extend(rank.recv(65536))
                got += frames.take_answers(received)
            return got

        rank.sendall(frames.hello(schema_fingerprint()))
        assert answers(2) == [(frames.HELLO_ID, frames.TAKES_FLUSH),  # (it takes frame F)
                              (frames.HELLO_ID, frames.TAKES_VALUES)]  # the relay's own schema
        spec = frames.layout_spec("t.step", b"run", "step", (("run_id", "r"),), "p", ("step", "nonesuch"), (1, 2.0))
        values = frames.values_packer(spec["codes"])
        rank.sendall(frames.layout(1, spec) + values.pack(values.size - 4, frames.VALUES, 9, 1, 1.7e9, 1, 1, 2.0))
        assert answers(2) == [(frames.HELLO_ID, frames.FAILED), (9, frames.FAILED)]  # JSON from now on, this one too
        rank.sendall(values.pack(values.size - 4, frames.VALUES, 10, 2, 1.7e9, 2, 1, 2.0))  # layout 2: never laid out
        wait_until(lambda: rank.recv(1) == b"", what="the relay to close the connection")
        rank.close()
    finally:
        relay.close()
    assert relay.relay.stats.refused == 1 and relay.relay.stats.written == 0


@pytest.mark.kafka
@pytest.mark.slow  # a broker of its own, killed and started again
def test_a_broker_killed_under_the_relay_loses_nothing(tmp_path, relay_path):
    """Kafka away behind the relay: the relay answers FAILED once Kafka gives up (its
    delivery timeout), the ranks keep those messages in their spill files, and everything
    arrives once the broker is back."""
    broker = Broker(tmp_path / "kafka", port=free_port()).start()
    relay = RelayThread(relay_path, broker.bootstrap)
    try:
        producers = [Producer(ProducerConfig(bootstrap="unused:9092", run_id="relay-outage", rank=rank,
                                             world_size=2, topic_prefix="o.", relay=relay_path,
                                             spill_dir=tmp_path / "spill"))
                     for rank in range(2)]
        logged = log_steps(producers, range(5))
        assert all(p.flush(30) for p in producers)
        broker.stop(kill=True)
        logged += log_steps(producers, range(5, 15))
        wait_until(lambda: all(p.spilled for p in producers), timeout=30,
                   what="both ranks to spill what Kafka gave up on behind the relay")
        assert relay.relay.stats.failed > 0
        broker.start()
        logged += log_steps(producers, range(15, 20))
        assert all(p.flush(60) for p in producers)
        records = read_records(broker.bootstrap, "o.", "step", logged, timeout=60)
        assert {(r.rank, r.step) for r in records} == {(rank, s) for rank in range(2) for s in range(20)}
        for p in producers:
            assert p.close(30) and p.dropped == 0
    finally:
        relay.close()
        broker.stop(kill=True)


_RELAY_OF_FEW_DESCRIPTORS = """
import resource, sys, threading
from trainmon.relay.server import Relay

class NoKafka:  # (only hellos come: nothing is sent)
    def poll(self, timeout_s=0.0): pass
    def flush(self, timeout_s): return True

relay = Relay(sys.argv[1], kafka=NoKafka())
relay.listen()
resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print("ready", flush=True)
relay.run(threading.Event())
"""


def test_a_relay_out_of_descriptors_goes_on_and_takes_ranks_again_once_some_close(relay_path):
    """accept() failing with EMFILE (more ranks and forked workers than the relay may hold)
    ended the relay's loop. It goes on, and takes new ranks again once connections close."""
    relay = subprocess.Popen([sys.executable, "-c", _RELAY_OF_FEW_DESCRIPTORS, relay_path],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd())

    def hello() -> socket.socket:
        rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rank.connect(relay_path)  # (the listen backlog takes it while the relay cannot)
        rank.sendall(frames.hello(schema_fingerprint()))
        return rank

    ranks = []
    try:
        assert relay.stdout.readline() == b"ready\n", relay.stderr.read().decode()[-2000:]
        ranks = [hello() for _ in range(60)]  # past the relay's 32 descriptors
        wait_until(lambda: len(os.listdir(f"/proc/{relay.pid}/fd")) >= 32, 30,
                   "the relay holding all the descriptors it may")
        for rank in ranks[:40]:
            rank.close()
        late = hello()
        late.settimeout(10)
        answer = bytearray(late.recv(64))  # the relay took it and answered its hello
        assert frames.take_answers(answer) == [(frames.HELLO_ID, frames.TAKES_FLUSH),
                                               (frames.HELLO_ID, frames.TAKES_VALUES)]
        late.close()
        assert relay.poll() is None
        relay.send_signal(signal.SIGTERM)  # (the script's loop has no handler: it just ends)
    finally:
        for rank in ranks[40:]:
            rank.close()
        relay.kill()
        _, stderr = relay.communicate(timeout=30)
    assert b"cannot take a connection" in stderr and b"Traceback" not in stderr, stderr.decode()[-2000:]


def test_a_record_the_relays_kafka_client_refuses_as_too_large_is_dropped_by_name_and_holds_nothing_back(
        make_producer, bootstrap, topic_prefix, relay_path, caplog):
    """A rank whose producer allows 2 MB messages logs a 1.1 MB record; the relay's Kafka
    client (librdkafka's 1 MB message.max.bytes) refuses it at once. The relay answered
    FAILED, so the rank kept it and sent it again, refused again, for ever (its flush never
    ended). As a rank's own client's refusal: dropped, counted and named; the rest arrive."""
    import logging

    relay = RelayThread(relay_path, bootstrap)
    try:
        producer = make_producer(run_id="relay-too-large", relay=relay_path, linger_ms=0,
                                 max_message_bytes=2_000_000)
        with caplog.at_level(logging.ERROR, logger="trainmon.producer"):
            assert producer.run_start(config={"vocab": "x" * 1_100_000})  # the rank takes it
            logged = log_steps([producer], range(5))
            transport = producer._worker._transport
            # (The flush asks the relay for its answers and reads them: the rank's thread
            # otherwise reads them at its next watch, within 10 s.)
            assert producer.flush(30)
            assert transport.dropped == 1, f"failed answers {relay.relay.stats.failed}"
        run_topic = topics.topic_for("run", topic_prefix)
        assert "Kafka refused a 1,1" in caplog.text and f"on {run_topic} as too large; dropped it" in caplog.text
        assert not producer.spilled and producer.rejected == {}
        assert sorted(r.step for r in read_records(bootstrap, topic_prefix, "step", logged)) == list(range(5))
        assert read_records(bootstrap, topic_prefix, "run", 0, timeout=2) == []
    finally:
        relay.close()
    assert relay.relay.stats.failed == 0  # (never answered FAILED: a rank would send it again)


def test_kafkas_answers_go_out_with_the_next_window_or_at_once_to_a_rank_that_asks(
        make_producer, bootstrap, topic_prefix, relay_path):
    """The relay is not woken for Kafka's answers (at a step a second that wake-up was a
    seventh of its CPU): they go out as the next window's frames come, at the latest
    frames.ANSWERS_DUE_S after their message went, and at once to a rank that asks (frame
    F, its flush)."""
    import time

    relay = RelayThread(relay_path, bootstrap)
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        rank.connect(relay_path)
        received = bytearray()

        def answers(within: float) -> list:
            rank.settimeout(within)
            try:
                received.extend(rank.recv(65536))
            except socket.timeout:
                return []
            return [a for a in frames.take_answers(received) if a[0] != frames.HELLO_ID]

        topic = topics.topic_for("step", topic_prefix)
        rank.sendall(frames.hello(b"another schema") + frames.entry(1, topic, b"run", b'{"step":1}'))
        sent = time.monotonic()
        assert wait_until(lambda: answers(0.2), 15, "the first entry's answer") == [(1, frames.OK)]
        # Nothing else came: it went out when it was due, not when Kafka answered.
        assert time.monotonic() - sent >= frames.ANSWERS_DUE_S - 0.1

        rank.sendall(frames.entry(2, topic, b"run", b'{"step":2}'))
        assert answers(0.5) == []  # Kafka has answered by now; the relay holds it
        rank.sendall(frames.entry(3, topic, b"run", b'{"step":3}'))  # the next window
        assert wait_until(lambda: answers(0.2), 1.5, "the held answer, with the next window") == [(2, frames.OK)]

        rank.sendall(frames.flush())  # entry 3's answer: asked for
        asked = time.monotonic()
        assert wait_until(lambda: answers(0.2), 15, "the answer asked for") == [(3, frames.OK)]
        assert time.monotonic() - asked < frames.ANSWERS_DUE_S - 0.5

        # A producer's flush asks: its answers come as soon as Kafka's.
        producer = make_producer(run_id="relay-flush", relay=relay_path, linger_ms=0)
        producer.log_step(1, loss=1.0)
        assert producer.flush(30)
        producer.log_step(2, loss=1.0)
        flushed = time.monotonic()
        assert producer.flush(30) and time.monotonic() - flushed < frames.ANSWERS_DUE_S - 0.5
    finally:
        rank.close()
        relay.close()
