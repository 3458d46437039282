"""The rank's side of the relay (kafka_client/relay_transport.py) against a stand-in relay
on a real Unix socket, in memory: answers reach the right handler, and a broken
connection's messages in flight are reported at the next serve, never from a send, in
order, before anything goes over a new connection."""

from __future__ import annotations

import socket

import pytest

from trainmon.kafka_client.errors import TransportUnavailable
from trainmon.kafka_client.relay_transport import RelayTransport
from trainmon.kafka_client.transport import TransportSettings
from trainmon.relay import frames

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
