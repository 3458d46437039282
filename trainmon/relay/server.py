"""``trainmon relay``: one process per node that sends the node's ranks' records to Kafka.

Each rank's producer alone sends a Kafka message per pack window, most of them holding one
record at training rates: on the broker's disk each costs a batch header, its key and its
schema header besides the record (~480 bytes per step record at 1 step/s), and each costs
the rank librdkafka's threads and a request. Through the relay the ranks of a node write
their messages to a local Unix socket (kafka_client/relay_transport.py); the relay gathers
what arrives within ``window_s`` and sends one Kafka message per (topic, key, schema): a
run's records of one kind from every local rank (the key is the run, so they share a
partition anyway). The ranks of a data-parallel job log each step within milliseconds of
each other, so a short window catches them all.

Answers: a rank's message is answered OK once Kafka acknowledged the message that carries
it, FAILED once Kafka gave up on it (the rank spills it and sends it again), TOO_LARGE
where the relay's Kafka client refused it alone as over its message size (the rank
splits or drops it, as where its own client refuses a message). A rank that
disconnects gets no answers; it counts its unanswered messages as failed and sends them
again (a message may then reach Kafka twice; consumers keep a record once, by event id).
Answers go out at the next window's end (within frames.ANSWERS_DUE_S), or as soon as
Kafka's come to a rank that asks (frame F: its flush).
Ordering: one Kafka request in flight, messages in arrival order, so each rank's records
keep their order.

Values: a rank whose schema is the relay's (its hello's fingerprint) sends a log call's
numbers instead of its JSON, and the relay writes the JSON (relay/values.py): at training
rates the rank's log call runs with cold caches, where packing numbers costs a fraction
of writing JSON, and the relay, warm, writes every rank's records of the window at once.

Everything runs on one thread around a selector; the Kafka client is trainmon's own
(kafka_client.Producer). SIGTERM / SIGINT: stop taking connections, send what is pending,
wait for Kafka's answers (up to ``close_timeout_s``), remove the socket.
"""

from __future__ import annotations

import argparse
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from ..kafka_client import Producer
from ..kafka_client.producer import Delivery
from ..kafka_client.relay_transport import MAX_WINDOW_S
from ..schemas import MAX_MESSAGE_BYTES, MAX_RECORDS_PER_MESSAGE, SCHEMA_HEADER, count, pack, schema_fingerprint
from . import frames
from .values import Layout, LayoutRefused, layout_from_spec

log = logging.getLogger("trainmon.relay")

DEFAULT_WINDOW_S = 0.05
# zstd, as the topics are compressed (the broker keeps batches of their own codec as they
# come). Its level 1 packed step records smaller than its default 3 at 1, 10 and 100
# steps/s (103.0, 52.9, 48.9 bytes a record against 104.1, 54.9, 52.2 with
# benchmarks/disk_budget.py's records), for less CPU.
KAFKA_COMPRESSION = {"compression.type": "zstd", "compression.level": 1}
_ANSWER_WAIT_S = 0.02  # the longest one wait for Kafka's answers keeps the ranks' frames waiting
# Kafka's answers are passed on at the next window's end, at the latest
# frames.ANSWERS_DUE_S after their message went: the relay is not woken for them. A rank
# reads its answers only every 10 s or 64 messages anyway (producer/worker.py); one that
# waits for them (its flush) asks, and gets them as soon as Kafka's come (frame F). At a
# window's end, not at its first frame: then the ranks that woke the relay are still in
# their log calls. At a step a second (8 ranks), the relay's share of a rank's step went
# from 182-202 to 152-174 us (5 alternating pairs), and a rank's whole step from a median
# of 425 to 405 us (with producer/worker.py no longer waking every 2 s for them).
# Answers a rank has not read, past what its socket holds: a rank reads its answers at
# least every 64 messages or 10 s (producer/worker.py), some kilobytes; a peer that sends
# and never reads is closed here instead of growing the relay's memory.
MAX_UNREAD_ANSWER_BYTES = 8 << 20
# Out of descriptors, the listener is watched again once a connection closes, or after
# this long: the descriptors may be held elsewhere in the process (its Kafka client), with
# no connection open to close.
_ACCEPT_AGAIN_S = 1.0


def default_socket_path(env: dict | None = None) -> str:
    """TRAINMON_RELAY, else the user's runtime directory, else /tmp."""
    env = os.environ if env is None else env
    if env.get("TRAINMON_RELAY"):
        return env["TRAINMON_RELAY"]
    base = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"trainmon-relay-{os.getuid()}.sock")


@dataclass
class _Connection:
    sock: socket.socket
    fingerprint: bytes | None = None  # from its hello
    received: bytearray = field(default_factory=bytearray)
    unsent: bytearray = field(default_factory=bytearray)
    open: bool = True
    watching_writes: bool = False  # registered for EVENT_WRITE: answers wait for room
    layouts: dict[int, Layout | None] = field(default_factory=dict)  # (None: refused)


# A rank's message: its connection, its id, the value (or a values frame and its layout,
# written as JSON when the window is sent: _written)
_Member = tuple[_Connection, int, "bytes | tuple[Layout, bytes]"]
_WAKE = "wake"  # the selector's data for the wake-up socket
# a frame's first byte, as frame[0] reads it
_ENTRY, _HELLO, _LAYOUT, _VALUES, _FLUSH = (frames.ENTRY[0], frames.HELLO[0], frames.LAYOUT[0], frames.VALUES[0],
                                             frames.FLUSH[0])


@dataclass
class RelayStats:
    connections: int = 0
    entries: int = 0  # messages taken from ranks
    records: int = 0
    kafka_messages: int = 0
    failed: int = 0  # entries answered FAILED
    written: int = 0  # records the relay wrote from a rank's values (frames V)
    refused: int = 0  # frames that were not of the format (their connection closed)


class Relay:
    def __init__(self, path: str, *, env: dict | None = None, bootstrap: str | None = None,
                 window_s: float = DEFAULT_WINDOW_S, delivery_timeout_ms: int = 5000,
                 close_timeout_s: float = 10.0, kafka: Producer | None = None):
        # A rank waits for an answer Kafka's delivery timeout plus the relay's share, its
        # window (at most MAX_WINDOW_S) and its hold on Kafka's answers: a window past it
        # has every message given up on and sent again, for ever (and time.sleep refuses
        # inf; NaN fails the test too).
        if not 0 <= window_s < MAX_WINDOW_S:
            raise ValueError(f"window_s must be from 0 to under {MAX_WINDOW_S:g} s, not {window_s!r}")
        self.path = path
        self.window_s = window_s
        self.close_timeout_s = close_timeout_s
        # As a rank's own transport sends (kafka_client/confluent_transport.py): acks from
        # every replica, one request in flight (order), no idempotence (a resend may
        # duplicate, consumers keep one), Kafka's answer within the delivery timeout. zstd,
        # the topics' own compression (KAFKA_COMPRESSION): the broker keeps the batches as
        # they come.
        self.kafka = kafka or Producer(env=env, bootstrap=bootstrap, **KAFKA_COMPRESSION, **{
            "linger.ms": 0, "enable.idempotence": False,
            "max.in.flight.requests.per.connection": 1, "message.timeout.ms": delivery_timeout_ms,
            "request.timeout.ms": min(4000, delivery_timeout_ms)})
        self.stats = RelayStats()
        self._fingerprint = schema_fingerprint()  # a rank with this one may send values
        self._selector = selectors.DefaultSelector()
        # The current window's messages by (topic, key, schema fingerprint), in arrival order.
        self._pending: dict[tuple[str, bytes, bytes], list[_Member]] = {}
        self._window_started: float | None = None
        # Messages Kafka has not answered yet, in the order they went, with when (monotonic).
        self._deliveries: list[tuple[Delivery, list[_Member], float]] = []
        self._asked = False  # a rank asked for its answers (F): passed on as soon as Kafka's come
        self._listener: socket.socket | None = None
        self._accepting = True  # the listener is watched (not while out of descriptors: _accept)
        self._accept_again_at = 0.0  # (monotonic) when it is watched again, if not before
        self._said_cannot_accept = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)

    # -- the loop ------------------------------------------------------------------------

    def listen(self) -> None:
        """Bind the socket (a stale one, whose relay is gone, is replaced)."""
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
            else:
                probe.close()
                raise SystemExit(f"trainmon relay: another relay already answers at {self.path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(256)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)

    def run(self, stop: threading.Event) -> None:
        if self._listener is None:
            self.listen()
        try:
            while not stop.is_set():
                self.step(None)
        finally:
            self.close()

    @property
    def wake_fd(self) -> int:
        """A non-blocking descriptor whose write ends the loop's wait (signal.set_wakeup_fd)."""
        return self._wake_w.fileno()

    def wake(self) -> None:
        """End the current wait (from another thread, or a signal: see main)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # (full: it wakes anyway)
            pass

    def step(self, timeout: float | None) -> None:
        """One round: wait up to ``timeout`` (None: until something comes) for ranks' frames,
        or until Kafka's answers are due; once a frame came, sleep out the window and take
        what the other ranks sent meanwhile; send it; pass on Kafka's answers so far. A
        window costs this thread two wake-ups however many ranks send in it: the first
        frame, the window's end. Kafka's answers come within milliseconds and wait in its
        client for the next window's end (frames.ANSWERS_DUE_S at the latest)."""
        if self._deliveries:
            if self._asked or time.monotonic() >= self._answers_due:
                # A rank waits for its answers, or they are due: wait in the client, which
                # returns at Kafka's report. The ranks' frames meanwhile wait in their sockets.
                self.kafka.poll(_ANSWER_WAIT_S)
                self._answer()
                if not self._deliveries:
                    return  # (the next step's wait takes the frames that came meanwhile)
                timeout = 0.0
            else:
                # (Passed on at this window's end, after its send: not now, while the ranks
                # that woke the relay are still in their log calls.)
                due_in = max(0.0, self._answers_due - time.monotonic())
                timeout = due_in if timeout is None else min(timeout, due_in)
        self._take(timeout)
        if self._window_started is not None:
            wait = self._window_started + self.window_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                self._take(0.0)
            self._send_pending()
            self._answer()  # (a message Kafka's client refused at once is answered now)

    def _take(self, timeout: float | None) -> None:
        if not self._accepting:
            wait = self._accept_again_at - time.monotonic()
            if wait <= 0:
                self._watch_listener()
            else:
                timeout = wait if timeout is None else min(timeout, wait)
        for key, events in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data is _WAKE:
                self._wake_r.recv(4096)
            elif events & selectors.EVENT_READ:
                self._read(key.data)
            if isinstance(key.data, _Connection) and events & selectors.EVENT_WRITE:
                self._write(key.data)

    # -- ranks ---------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # out of descriptors (EMFILE, ENFILE): the relay goes on
            # The listener stays readable while the rank waits: it is not watched (else the
            # loop would spin) until a connection closes and frees a descriptor, or
            # _ACCEPT_AGAIN_S passed (said once until a connection is taken again).
            if not self._said_cannot_accept:
                self._said_cannot_accept = True
                log.error("trainmon relay: cannot take a connection (%s); new ranks wait until one closes", exc)
            self._selector.unregister(self._listener)
            self._accepting = False
            self._accept_again_at = time.monotonic() + _ACCEPT_AGAIN_S
            return
        self._said_cannot_accept = False
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))
        self.stats.connections += 1

    def _watch_listener(self) -> None:
        """Watch the listener again, where it was not (_accept)."""
        if not self._accepting and self._listener is not None:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._accepting = True

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(frames.READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.received += data
        try:
            for frame in frames.split(conn.received):
                if not conn.open:  # (an answer this loop wrote found the rank gone)
                    return
                if frame[0] == _VALUES:
                    self._take_values(conn, frame)
                elif frame[0] == _ENTRY:
                    self._gather(conn, *frames.parse_entry(frame))
                elif frame[0] == _HELLO:
                    conn.fingerprint = frame[1:]
                    # TAKES_FLUSH before TAKES_VALUES: a rank of an earlier version takes
                    # the last hello answer's status for whether values go.
                    said = [(frames.HELLO_ID, frames.TAKES_FLUSH)]
                    if conn.fingerprint == self._fingerprint:  # (the same records: values will do)
                        said.append((frames.HELLO_ID, frames.TAKES_VALUES))
                    self._write(conn, frames.answers(said))
                elif frame[0] == _LAYOUT:
                    self._take_layout(conn, *frames.parse_layout(frame))
                elif frame[0] == _FLUSH:
                    self._asked = True
                else:
                    raise frames.FrameError(f"a frame of type {frame[:1]!r}")
        except (frames.FrameError, UnicodeDecodeError) as exc:
            self.stats.refused += 1
            log.error("trainmon relay: closed a connection that sent what is not a trainmon "
                      "producer's frame (%s)", exc)
            self._drop(conn)

    def _take_layout(self, conn: _Connection, layout_id: int, spec: dict) -> None:
        try:
            if conn.fingerprint != self._fingerprint:
                raise LayoutRefused(f"layout {layout_id} from a rank whose schema is not the relay's")
            if layout_id not in conn.layouts and len(conn.layouts) >= frames.MAX_LAYOUTS:
                raise LayoutRefused(f"layout {layout_id}: more than {frames.MAX_LAYOUTS} on one connection")
            conn.layouts[layout_id] = layout_from_spec(layout_id, spec)
        except Exception as exc:  # LayoutRefused; anything else too: a rank's bytes never end the relay
            # Not the rank's fault alone (another trainmon version on either side, say):
            # its records still go, as JSON it writes itself from now on.
            conn.layouts[layout_id] = None
            log.error("trainmon relay: a rank's %s; it sends its records' JSON instead",
                      exc if isinstance(exc, LayoutRefused) else f"layout {layout_id}: {type(exc).__name__}: {exc}")
            self._write(conn, frames.answers([(frames.HELLO_ID, frames.FAILED)]))

    def _take_values(self, conn: _Connection, frame: bytes) -> None:
        """A rank's values (relay/values.py), written as JSON when the window goes out
        (_written); answered FAILED at once where its layout was refused (the rank writes
        it itself)."""
        entry_id, layout_id = frames.values_ids(frame)
        if layout_id not in conn.layouts:
            raise frames.FrameError(f"values of layout {layout_id}, which the rank did not lay out")
        layout = conn.layouts[layout_id]
        if layout is None:
            self._fail(conn, entry_id)
            return
        frames.check_values(frame, layout.reader)
        self._gather(conn, entry_id, layout.topic, layout.key, (layout, frame))

    def _fail(self, conn: _Connection, entry_id: int) -> None:
        """Answer a rank's values FAILED now: the rank writes their JSON itself and sends it."""
        self.stats.failed += 1
        self._write(conn, frames.answers([(entry_id, frames.FAILED)]))

    def _gather(self, conn: _Connection, entry_id: int, topic: str, key: bytes, value: bytes) -> None:
        if self._window_started is None:
            self._window_started = time.monotonic()
        self._pending.setdefault((topic, key, conn.fingerprint or b""), []).append((conn, entry_id, value))
        self.stats.entries += 1

    def _drop(self, conn: _Connection) -> None:
        """A rank went away: its messages not sent yet are not sent (it sends them again)."""
        conn.open = False
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self._watch_listener()  # (a descriptor is free again)
        for group, members in list(self._pending.items()):
            members[:] = [m for m in members if m[0] is not conn]
            if not members:
                del self._pending[group]

    # -- Kafka ---------------------------------------------------------------------------

    def _send_pending(self) -> None:
        pending, self._pending, self._window_started = self._pending, {}, None
        for (topic, key, fingerprint), members in pending.items():
            headers = [(SCHEMA_HEADER, fingerprint)] if fingerprint else None
            for chunk in _chunks(self._written(members)):
                self._send(topic, key, headers, chunk)

    def _send(self, topic: str, key: bytes, headers: list | None, chunk: list[_Member]) -> None:
        value = pack([value for _, _, value in chunk])
        delivery = self.kafka.send(topic, value, key=key or None, headers=headers)
        if delivery.too_large:
            # Refused by the client, unsent, as over its message size: sent again as it is,
            # it would be refused again. Several ranks' messages go again in two halves (in
            # order), so that only one too large by itself is refused (_answer: TOO_LARGE).
            if len(chunk) > 1:
                half = len(chunk) // 2
                self._send(topic, key, headers, chunk[:half])
                self._send(topic, key, headers, chunk[half:])
                return
            log.error("trainmon relay: Kafka's client refused a rank's %s-byte message on %s as too large "
                      "(%s); the rank drops it, or sends its records one per message",
                      f"{len(value):,}", topic, delivery.error)
        self._deliveries.append((delivery, chunk, time.monotonic()))
        self.stats.kafka_messages += 1
        self.stats.records += count(value)

    def _written(self, members: list[_Member]) -> list[_Member]:
        """The members, values written as JSON; one that cannot be written is answered
        FAILED (the rank then writes it itself). All of a window's at once, not as each
        frame comes: at 1 step/s the relay's caches are as cold as a rank's, and the first
        record warms them for the others."""
        written = []
        for conn, entry_id, value in members:
            if type(value) is tuple:
                layout, frame = value
                try:
                    value = layout.write(*frames.read_values(frame, layout.reader))
                except Exception as exc:  # (a derived field's validator, say): the rank's to judge
                    log.warning("trainmon relay: could not write a %s record from a rank's values (%s: %s); "
                                "the rank writes it itself", layout.model.kind, type(exc).__name__, exc)
                    self._fail(conn, entry_id)
                    continue
                self.stats.written += 1
            written.append((conn, entry_id, value))
        return written

    @property
    def _answers_due(self) -> float:
        """(monotonic) When the oldest unanswered message's answer is passed on at the latest."""
        return self._deliveries[0][2] + frames.ANSWERS_DUE_S

    def _answer(self) -> None:
        """Pass on the answers Kafka's client has reported (its poll runs the reports)."""
        answers: dict[int, tuple[_Connection, list[tuple[int, int]]]] = {}
        still = []
        for delivery, members, sent_at in self._deliveries:
            if not delivery.done:
                still.append((delivery, members, sent_at))
                continue
            status = frames.FAILED if delivery.failed else frames.OK
            if delivery.too_large:  # (a rank's message alone: _send said so)
                status = frames.TOO_LARGE
            elif delivery.failed:
                self.stats.failed += len(members)
                log.warning("trainmon relay: Kafka gave up on a message of %d rank message(s): %s; "
                            "the ranks send them again", len(members), delivery.error)
            for conn, entry_id, _ in members:
                if conn.open:
                    answers.setdefault(id(conn), (conn, []))[1].append((entry_id, status))
        self._deliveries = still
        if not still and self._window_started is None:
            self._asked = False  # (every rank that asked has its answers)
        for conn, statuses in answers.values():
            self._write(conn, frames.answers(statuses))

    def _write(self, conn: _Connection, frame: bytes = b"") -> None:
        """Write what waits for the rank, then ``frame`` (frames.write)."""
        if not conn.open:
            return
        try:
            frames.write(conn.sock, conn.unsent, frame)
        except OSError:
            self._drop(conn)
            return
        if len(conn.unsent) > MAX_UNREAD_ANSWER_BYTES:
            log.error("trainmon relay: closed a connection that left %d bytes of answers unread",
                      len(conn.unsent))
            self._drop(conn)
            return
        if bool(conn.unsent) != conn.watching_writes:  # (a syscall: only when it changes)
            conn.watching_writes = bool(conn.unsent)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.unsent else 0)
            self._selector.modify(conn.sock, events, conn)

    def close(self) -> None:
        """Send what is pending, wait for Kafka's answers, pass them on, remove the socket."""
        if self._listener is not None:
            if self._accepting:
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._send_pending()
        deadline = time.monotonic() + self.close_timeout_s
        while self._deliveries and time.monotonic() < deadline:
            self.kafka.poll(0.05)
            self._answer()
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if isinstance(conn, _Connection):
                if conn.unsent:  # the last answers, best effort
                    conn.sock.setblocking(True)
                    conn.sock.settimeout(1.0)
                    try:
                        conn.sock.sendall(conn.unsent)
                    except OSError:
                        pass
                self._drop(conn)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _chunks(members: list[_Member]):
    """Members in order, in runs that fit one Kafka message (records and bytes)."""
    chunk, records, size = [], 0, 0
    for member in members:
        value = member[2]
        n = count(value)
        if chunk and (records + n > MAX_RECORDS_PER_MESSAGE or size + len(value) + 1 > MAX_MESSAGE_BYTES):
            yield chunk
            chunk, records, size = [], 0, 0
        chunk.append(member)
        records += n
        size += len(value) + 1
    if chunk:
        yield chunk


# RelayStats field -> (Prometheus counter, without _total; help), served with --metrics-port
METRICS = {
    "connections": ("trainmon_relay_connections", "Rank connections accepted"),
    "entries": ("trainmon_relay_messages", "Messages taken from ranks (each one or more records)"),
    "records": ("trainmon_relay_records", "Records sent to Kafka"),
    "kafka_messages": ("trainmon_relay_kafka_messages", "Kafka messages sent, each packing ranks' messages"),
    "failed": ("trainmon_relay_failed", "Rank messages answered FAILED: Kafka gave up on them (or the relay "
                                        "could not write a record from its values); the ranks keep them and "
                                        "send them again"),
    "written": ("trainmon_relay_written_records", "Records the relay wrote as JSON from a rank's values"),
    "refused": ("trainmon_relay_refused_connections", "Connections closed for sending what is not a "
                                                      "trainmon producer's frame"),
}


def serve_metrics(relay: Relay, port: int, addr: str):
    """The relay's counters (and its process's memory, files, CPU) at http://ADDR:PORT/metrics;
    the ServiceMetrics serving them (``.port``, ``.close()``)."""
    from ..consumers.metrics import ServiceMetrics  # prometheus-client: trainmon[runtime]

    metrics = ServiceMetrics("relay")
    metrics.counters_from(relay.stats.__dict__, METRICS)
    metrics.serve(port, addr)
    return metrics


def _window_ms(text: str) -> float:
    """--window-ms: milliseconds the relay can wait out (Relay's window_s)."""
    try:
        window_ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not 0 <= window_ms < MAX_WINDOW_S * 1000:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text}: must be from 0 to under {MAX_WINDOW_S * 1000:g}, "
                                         "the ranks' wait for an answer beyond Kafka's")
    return window_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainmon relay", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", default=None,
                        help="the Unix socket the node's ranks connect to (default: TRAINMON_RELAY, "
                             f"else {default_socket_path({})})")
    parser.add_argument("--window-ms", type=_window_ms, default=DEFAULT_WINDOW_S * 1000,
                        help="how long a message waits for the other ranks' (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=os.environ.get("TRAINMON_METRICS_PORT") or None,
                        metavar="PORT", help="serve Prometheus metrics at http://ADDR:PORT/metrics (needs "
                                             "trainmon[runtime]; default: $TRAINMON_METRICS_PORT, else none)")
    parser.add_argument("--metrics-listen", default=os.environ.get("TRAINMON_METRICS_LISTEN", "127.0.0.1"),
                        metavar="ADDR", help="the metrics endpoint's address (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    relay = Relay(args.socket or default_socket_path(), window_s=args.window_ms / 1000)
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = serve_metrics(relay, args.metrics_port, args.metrics_listen)
        except ModuleNotFoundError as exc:
            print(f"trainmon relay: --metrics-port needs {exc.name!r}: pip install 'trainmon[runtime]'",
                  file=sys.stderr)
            return 2
    relay.listen()
    log.info("trainmon relay: listening at %s (window %.0f ms)", relay.path, args.window_ms)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    signal.set_wakeup_fd(relay.wake_fd)  # a signal ends the loop's wait
    relay.run(stop)
    log.info("trainmon relay: stopped: %s", relay.stats)
    if metrics is not None:
        metrics.close()
    return 0
