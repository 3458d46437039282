"""The rank's side of the relay (kafka_client/relay_transport.py) against a stand-in relay
on a real Unix socket, in memory: answers reach the right handler, and a broken
connection's messages in flight are reported at the next serve, never from a send, in
order, before anything goes over a new connection. A log call's values go as numbers
only to a relay that said it writes them, and come back as the rank's own JSON when they
fail."""

from __future__ import annotations

import socket
import threading

import pytest

from trainmon.kafka_client.errors import TransportUnavailable
from trainmon.kafka_client.relay_transport import RelayTransport
from trainmon.kafka_client.transport import TransportSettings
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.deferred import VALUES_AT, DeferredRecord, checked_values, queued
from trainmon.producer.encoding import Encoder
from trainmon.producer.worker import _UNREAD_ANSWERS_MAX
from trainmon.relay import frames
from trainmon.relay.values import layout_from_spec
from trainmon.schemas import StepRecord

from .waiting import wait_until


class StandIn:
    """Accepts one connection at a time and hands over the entry frames it reads."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.conn: socket.socket | None = None
        self.buffer = bytearray()

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(5)
        self.buffer.clear()

    def entries(self, n: int) -> list[tuple[int, str, bytes, bytes]]:
        got: list = []
        while len(got) < n:
            self.buffer += self.conn.recv(65536)
            got += [frames.parse_entry(f) for f in frames.split(self.buffer) if f[:1] == frames.ENTRY]
        return got

    def frames(self, n: int) -> list[bytes]:
        got: list = []
        while len(got) < n:
            self.buffer += self.conn.recv(65536)
            got += [f for f in frames.split(self.buffer) if f[:1] != frames.HELLO]
        return got

    def answer(self, statuses) -> None:
        self.conn.sendall(frames.answers(statuses))


@pytest.fixture
def relay(tmp_path):
    stand_in = StandIn(str(tmp_path / "relay.sock"))
    yield stand_in
    stand_in.listener.close()


def transport(relay, failed: list) -> RelayTransport:
    path = relay.listener.getsockname()
    return RelayTransport(path, TransportSettings("unused:9092", {}), failed.extend)


def test_answers_reach_the_ack_hook_or_the_messages_failure_handler(relay):
    failed, acked, own = [], [], []
    t = transport(relay, failed)
    t.on_ack = lambda: acked.append(1)
    t.send(("t.step", b"run", b'{"a":1}'))
    relay.accept()
    t.send(("t.step", b"run", b'{"a":2}'), on_undelivered=own.extend)
    (first, *_), (second, *_) = relay.entries(2)
    relay.answer([(first, frames.OK), (second, frames.FAILED)])
    wait_until(lambda: (t.serve(0.05), not t.in_flight)[1], what="both answers")
    assert acked == [1] and failed == [] and own == [("t.step", b"run", b'{"a":2}')]
    assert t.flush(1)


def test_a_message_the_relay_says_is_too_large_goes_back_one_record_each_or_is_dropped_alone(relay, caplog):
    """TOO_LARGE: the relay's Kafka client refused the rank's message by itself. As a rank's
    own client's refusal (transport.split_or_drop): packed records go back one per message
    to the failure handler, a single record is dropped and counted, never sent again."""
    import logging

    failed: list = []
    t = transport(relay, failed)
    t.send(("t.step", b"run", b'{"a":1}\n{"a":2}'))
    relay.accept()
    t.send(("t.step", b"run", b'{"a":3}'))
    (packed, *_), (single, *_) = relay.entries(2)
    with caplog.at_level(logging.ERROR, logger="trainmon.producer"):
        relay.answer([(packed, frames.TOO_LARGE), (single, frames.TOO_LARGE)])
        wait_until(lambda: (t.serve(0.05), not t.in_flight)[1], what="both answers")
    assert failed == [("t.step", b"run", b'{"a":1}'), ("t.step", b"run", b'{"a":2}')] and t.dropped == 1
    assert "Kafka refused a 7-byte record on t.step as too large; dropped it" in caplog.text


def test_a_broken_connections_messages_are_reported_at_serve_in_order_before_a_new_one(relay):
    failed: list = []
    t = transport(relay, failed)
    t.send(("t.step", b"run", b"a"))
    relay.accept()
    t.send(("t.step", b"run", b"b"))
    relay.entries(2)
    relay.conn.close()  # the relay goes away with both unanswered
    with pytest.raises(TransportUnavailable, match="writing to the relay failed"):
        t.send(("t.step", b"run", b"c"))  # (a Unix socket whose peer closed: EPIPE at once)
    assert failed == []  # never reported from a send (that may be the training loop's call)
    with pytest.raises(TransportUnavailable):
        t.send(("t.step", b"run", b"d"))  # no new connection before they are reported
    t.serve()
    assert [value for _, _, value in failed] == [b"a", b"b"]
    t.send(("t.step", b"run", b"e"))  # a new connection
    relay.accept()
    assert [value for *_, value in relay.entries(1)] == [b"e"]


def test_a_connection_broken_with_nothing_in_flight_is_made_anew_at_the_next_send(relay):
    """Nothing to report, so no serve may come (the worker serves only while messages are
    in flight): the next send itself connects again, or the records would wait forever."""
    failed: list = []
    t = transport(relay, failed)
    t.send(("t.step", b"run", b"a"))
    relay.accept()
    ((first, *_),) = relay.entries(1)
    relay.answer([(first, frames.OK)])
    wait_until(lambda: (t.serve(0.05), not t.in_flight)[1], what="the answer")
    relay.conn.close()  # the relay goes away while nothing is in flight
    with pytest.raises(TransportUnavailable, match="writing to the relay failed"):
        t.send(("t.step", b"run", b"b"))  # (kept by the worker, which tries again after a backoff)
    t.send(("t.step", b"run", b"b"))  # no serve in between
    relay.accept()
    assert [value for *_, value in relay.entries(1)] == [b"b"] and failed == []


ENVELOPE = (("run_id", "values"), ("rank", 3), ("world_size", 8), ("host", "node-1"))
REJECTED: list = []
ENCODER = Encoder([], 1_000_000, lambda record, reason: REJECTED.append(reason))


def step_item(step: int, **fields) -> tuple:
    """A log call's queued values, as deferred.queued makes them."""
    fields = {"step": step, "loss": 2.5, "duration_ms": 812, "step_tokens": 524288, **fields}
    return queued(StepRecord, ENVELOPE, 1.7e9 + step / 3, "prefix", step, checked_values(StepRecord, fields))


def welcomed(relay, failed: list) -> RelayTransport:
    """A transport whose relay answered its hello: it writes records from values."""
    t = transport(relay, failed)
    t.send(("t.step", b"run", b"{}"))
    relay.accept()
    ((first, *_),) = relay.entries(1)
    relay.answer([(frames.HELLO_ID, frames.TAKES_VALUES), (first, frames.OK)])
    wait_until(lambda: (t.serve(0.05), not t.in_flight)[1], what="the answers")
    return t


def test_a_calls_values_go_as_numbers_and_the_relay_writes_the_json_the_rank_would(relay):
    t = welcomed(relay, [])
    items = [step_item(1, timers={"forward": 80, "backward": 160.5}), step_item(2, timers={"forward": 81.0, "backward": 1.0}),
             step_item(3, norm=0.9), step_item(4, timers={"forward": 1e300, "backward": float("inf")})]
    assert all(t.send_values("t.step", b"run", item, ENCODER.entry) for item in items)
    layout_a, values_1, values_2, layout_b, values_3, values_4 = relay.frames(6)  # a layout once per shape
    assert [f[:1] for f in (layout_a, layout_b)] == [frames.LAYOUT] * 2
    layouts = {}
    for frame in (layout_a, layout_b):
        layout_id, spec = frames.parse_layout(frame)
        layouts[layout_id] = layout_from_spec(layout_id, spec)
    for frame, item in zip((values_1, values_2, values_3, values_4), items):
        entry_id, layout_id = frames.values_ids(frame)
        layout = layouts[layout_id]
        written = layout.write(*frames.read_values(frame, layout.reader))
        assert (layout.topic, layout.key, written) == ENCODER.entry("t.step", b"run", item)
        assert entry_id == item[4] + 1  # (the first entry went as JSON)
    assert t.in_flight == 4


def test_values_go_only_to_a_relay_that_said_it_writes_them_and_never_past_64_bits(relay):
    t = transport(relay, [])
    assert not t.send_values("t.step", b"run", step_item(1), ENCODER.entry)  # no hello answered yet
    t = welcomed(relay, [])
    # (the schema bounds every int field to 64 bits; a value past them would go as JSON)
    past_64_bits = (*step_item(2)[:5], ("step", "step_tokens", "loss"), 2, 2**70, 2.5)
    assert not t.send_values("t.step", b"run", past_64_bits, ENCODER.entry)
    assert t.send_values("t.step", b"run", (*past_64_bits[:VALUES_AT], 2, 2**40, 2.5), ENCODER.entry)
    relay.answer([(frames.HELLO_ID, frames.FAILED)])  # a relay that refused a layout: JSON from now on
    wait_until(lambda: (t.serve(0.05), not t._takes_values)[1], what="the refusal")
    assert not t.send_values("t.step", b"run", step_item(3), ENCODER.entry)


def test_values_that_fail_come_back_as_the_ranks_own_json(relay):
    failed: list = []
    t = welcomed(relay, failed)
    first, second, third = step_item(1), step_item(2), step_item(3)
    for item in (first, second, third):
        assert t.send_values("t.step", b"run", item, ENCODER.entry)
    frames_sent = relay.frames(4)
    ids = [frames.values_ids(f)[0] for f in frames_sent[1:]]
    relay.answer([(ids[0], frames.FAILED)])  # Kafka gave up on it behind the relay
    wait_until(lambda: (t.serve(0.05), failed)[1], what="the failure")
    assert failed == [ENCODER.entry("t.step", b"run", first)]
    relay.conn.close()  # the relay goes away with the other two unanswered
    wait_until(lambda: (t.serve(0.05), len(failed) == 3)[1], what="the lost connection's messages")
    assert failed[1:] == [ENCODER.entry("t.step", b"run", item) for item in (second, third)]
    assert not REJECTED
    # Values only over a connection whose relay said it writes them: until a new one's
    # hello is answered, they go as JSON, whose send connects anew.
    assert not t.send_values("t.step", b"run", step_item(4), ENCODER.entry)


def steps_sent_and_watching(producer, relay):
    """Steps 1 and 2 logged, sent and answered, the relay's hello answered (it writes
    values), and the producer's sender thread watching: a log call now sends its own
    values. The worker."""
    assert producer.log_step(1, loss=2.0)  # JSON, from the thread (the hello not answered yet)
    relay.accept()
    ((first, *_),) = relay.entries(1)
    relay.answer([(frames.HELLO_ID, frames.TAKES_VALUES), (first, frames.OK)])
    assert producer.flush(5)
    assert producer.log_step(2, loss=2.0)  # the thread sends it, then watches: log calls send
    ((second, *_),) = relay.entries(1)
    relay.answer([(second, frames.OK)])  # (read by the rank later: answers may wait)
    worker = producer._worker
    wait_until(lambda: worker._watching, what="the sender thread watching (log calls send)")
    return worker


def test_values_that_fail_and_whose_json_the_rank_rejects_are_not_counted_as_sent(relay, tmp_path, monkeypatch):
    """A log call counts its values as sent when it sends them. Should they fail and the
    rank's encoder then refuse their JSON, they are a rejected record, no longer sent."""
    producer = Producer(ProducerConfig(bootstrap="unused:9092", relay=relay.listener.getsockname(),
                                       run_id="rejected-values", spill_dir=tmp_path / "spill"))
    try:
        worker = steps_sent_and_watching(producer, relay)

        def refuse(self):
            raise ValueError("refused by the rank's encoder")

        monkeypatch.setattr(DeferredRecord, "encode", refuse)
        assert producer.log_step(3, loss=2.0)
        layout, values = relay.frames(2)
        assert layout[:1] == frames.LAYOUT and values[:1] == frames.VALUES and worker.sent == 3
        relay.answer([(frames.values_ids(values)[0], frames.FAILED)])
        producer.flush(5)
        assert worker.sent == 2 and producer.rejected == {"step": 1}
    finally:
        producer.close(1)


def test_values_that_failed_found_by_a_log_call_go_back_to_the_sender_thread_unwritten(relay, tmp_path, monkeypatch):
    """A log call reads the relay's answers itself once 64 are unread (worker.py); a failure
    among them is the sender thread's to write as JSON and keep, not the training loop's
    call's (64 records' JSON at once, with cold caches)."""
    producer = Producer(ProducerConfig(bootstrap="unused:9092", relay=relay.listener.getsockname(),
                                       run_id="failed-values", spill_dir=tmp_path / "spill", pack_window_ms=0))
    encode, written_by = DeferredRecord.encode, []

    def encode_and_say_who(self):
        written_by.append((self.values[0], threading.current_thread().name))
        return encode(self)

    try:
        worker = steps_sent_and_watching(producer, relay)
        monkeypatch.setattr(DeferredRecord, "encode", encode_and_say_who)
        calls = 0
        while worker.in_flight < _UNREAD_ANSWERS_MAX:  # (step 2's answer unread too)
            wait_until(lambda: worker._watching, what="the sender thread watching")
            calls += 1
            assert producer.log_step(2 + calls, loss=2.0)  # sent by the call itself, as values
        sent = relay.frames(1 + calls)  # a layout, then the values
        ids = [frames.values_ids(frame)[0] for frame in sent[1:]]
        assert not written_by  # none written as JSON
        relay.answer([(ids[0], frames.FAILED)] + [(i, frames.OK) for i in ids[1:]])
        assert producer.log_step(3 + calls, loss=2.0)  # this call reads the answers
        assert ("MainThread" not in {who for _, who in written_by}), written_by
        # The thread wrote step 3's JSON, kept it and sends it again (from the spill file).
        (_, _, _, value), = relay.entries(1)
        assert b'"step":3,' in value
        assert (3, "trainmon-producer") in written_by
    finally:
        producer.close(1)


def test_answers_read_together_with_the_relays_close_are_taken_before_the_connection_ends(relay):
    """A relay that stops answers what Kafka took, then closes. Read in one serve (a full
    read, then the end), those answers count: their messages are not sent again."""
    failed: list = []
    t = transport(relay, failed)
    for value in (b"a", b"b", b"c"):
        t.send(("t.step", b"run", value))
    relay.accept()
    ids = [entry_id for entry_id, *_ in relay.entries(3)]
    # Exactly one full read (frames.READ_BYTES): 5 answer frames of 5 + 9 bytes an answer
    # (the padding answers ids nothing waits for), then the end of the connection.
    padding = [(10**9 + i, frames.OK) for i in range(7279 - len(ids))]
    chunks = [[(i, frames.OK) for i in ids] + padding[:1453], *(padding[1453 + 1456 * k:][:1456] for k in range(4))]
    body = b"".join(frames.answers(chunk) for chunk in chunks)
    assert len(body) == frames.READ_BYTES
    relay.conn.sendall(body)
    relay.conn.close()
    t.serve()
    assert failed == [] and t.in_flight == 0


# -- found in review (2026-11-27): descriptors ------------------------------------------------

def test_a_flush_waits_on_a_socket_numbered_past_1023(relay):
    """A training process may hold over 1,024 descriptors (loaders, NCCL, datasets); select
    refuses the socket's then, and a flush raised instead of waiting for the answers."""
    import os
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("fewer than 1,200 descriptors allowed here")
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        failed = []
        rank = transport(relay, failed)
        rank.send(("t.step", b"run", b'{"a":1}'))
        relay.accept()
        assert rank._sock.fileno() >= 1024
        [(first, *_)] = relay.entries(1)
        assert rank.flush(0.2) is False  # unanswered: the flush waits its time, then says so
        relay.answer([(first, frames.OK)])
        assert rank.flush(5) is True
        rank.send(("t.step", b"run", b'{"a":2}'))
        relay.entries(1)
        rank.close(0.2)  # unanswered at close: kept by its failure handler
        assert failed == [("t.step", b"run", b'{"a":2}')]
    finally:
        for fd in held:
            os.close(fd)


def test_a_process_out_of_descriptors_is_told_the_relay_is_unavailable(relay, monkeypatch):
    """socket() itself fails with EMFILE: a send says TransportUnavailable (the worker keeps
    the record and tries again), not an OSError the sender thread does not expect."""
    import errno
    import types

    from trainmon.kafka_client import relay_transport

    def out_of_descriptors(*args):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(relay_transport, "socket", types.SimpleNamespace(
        socket=out_of_descriptors, AF_UNIX=socket.AF_UNIX, SOCK_STREAM=socket.SOCK_STREAM))
    rank = transport(relay, [])
    with pytest.raises(TransportUnavailable, match="Too many open files"):
        rank.send(("t.step", b"run", b'{"a":1}'))


def test_the_sender_thread_does_not_wake_for_the_relays_answers_before_its_watch(relay, tmp_path, monkeypatch):
    """Through a relay a message is nearly always unanswered (the relay passes Kafka's
    answers on with its next window): the sender thread waits for them as long as its
    watch (_WATCH_S), not _ANSWER_WAIT_S, which woke it every 2 s at 1 step/s."""
    import time

    from trainmon.producer import worker as worker_module

    monkeypatch.setattr(worker_module, "_ANSWER_WAIT_S", 0.2)  # (so that a wake for it comes at once)
    producer = Producer(ProducerConfig(bootstrap="unused:9092", relay=relay.listener.getsockname(),
                                       run_id="unanswered", spill_dir=tmp_path / "spill"))
    try:
        worker = steps_sent_and_watching(producer, relay)  # step 2's answer unread: in flight
        ticks, tick = [], worker._tick
        worker._tick = lambda: (ticks.append(time.monotonic()), tick())[1]
        assert producer.log_step(3, loss=2.0) and worker.in_flight == 2  # sent by the call
        time.sleep(1.0)  # (what must not happen: the thread waking for the answers)
        assert ticks == [] and worker.in_flight == 2
    finally:
        producer.close(1)
