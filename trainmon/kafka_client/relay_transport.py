"""The producer's transport to its node's relay (``trainmon relay``, see trainmon.relay):
messages go over a local Unix socket, and the relay answers each once Kafka stored it or
gave up on it.

A rank then runs no Kafka client at all: a send is one non-blocking write to the socket,
an answer one read, and the relay packs the records of every rank of the node into one
Kafka message per (topic, key) and window. Nothing is lost when the relay is away or
dies: a message counts as in flight until its answer, and every message in flight when
the connection fails, or still unanswered after the delivery timeout (a relay that hangs),
goes to ``on_undelivered``, so the worker spills it and sends it again once a connection
works. A message the relay stored but whose answer was lost is sent again: a duplicate in
Kafka, which every consumer keeps once (by event id), as after a librdkafka resend.

A relay that runs the rank's own schema says so in its answer to the hello; from then on
a log call's checked values go as numbers (``send_values``: one ``struct`` pack into a
frame of the call's layout, declared once per connection) and the relay writes their
JSON (relay/values.py). Should such a message fail, the rank writes its JSON itself (the
worker's encoder) before it hands it to ``on_undelivered``.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import time
from typing import Callable

from ..producer.deferred import VALUES_AT
from ..relay import frames
from .errors import TransportUnavailable
from .transport import Entry, TransportSettings, Undelivered, split_or_drop

log = logging.getLogger("trainmon.producer")

# Bytes written to the socket and not yet taken by the relay: past this the relay is not
# reading, and sends are refused (the worker keeps the records in its spill file).
_MAX_UNSENT_BYTES = 8 << 20
# The relay answers within Kafka's delivery timeout; this much more is the relay's own
# share (its pack window, at most MAX_WINDOW_S, its loop, and up to frames.ANSWERS_DUE_S
# holding Kafka's answer for its next window) before an unanswered message counts as lost.
MAX_WINDOW_S = 5.0
ANSWER_GRACE_S = MAX_WINDOW_S + frames.ANSWERS_DUE_S

Encode = Callable[[str, bytes, tuple], "Entry | None"]  # the worker's encoder: a log call's values -> its entry


class _Values:
    """A log call's values the relay was to write: the entry they make, should the rank
    have to keep them (None: the encoder rejected them, counted and logged)."""

    __slots__ = ("topic", "key", "item", "encode")

    def __init__(self, topic: str, key: bytes, item: tuple, encode: Encode):
        self.topic, self.key, self.item, self.encode = topic, key, item, encode

    def entry(self) -> Entry | None:
        return self.encode(self.topic, self.key, self.item)


class RelayTransport:
    # A send is one non-blocking write to a local socket: a log call may send its own record.
    sends_without_blocking = True
    # ... without reading the answers to the earlier ones first (worker.py reads them later).
    answers_may_wait = True

    def __init__(self, path: str, config: TransportSettings, on_undelivered: Undelivered):
        self.path = path
        self._on_undelivered = on_undelivered
        # A layout whose records could come near Kafka's message limit goes as JSON, whose
        # size the encoder checks: a record's JSON is at most its layout frame (names,
        # envelope), 32 bytes a value and 4 KiB (time, id, the model's defaults).
        self._max_layout_bytes = config.max_message_bytes // 2
        self._answer_within_s = config.delivery_timeout_ms / 1000 + ANSWER_GRACE_S
        self._sock: socket.socket | None = None
        self._unsent = bytearray()
        self._received = bytearray()
        # id -> (entry or values, sent at, its failure handler or None for the transport's own); in id order
        self._waiting: dict[int, tuple[Entry | _Values, float, Undelivered | None]] = {}
        self._takes_values = False  # the relay said it writes records from values (this connection)
        self._takes_flush = False  # the relay said it takes frame F (this connection)
        # (topic, key, kind, envelope, id prefix, names) -> (layout id, values_packer), or
        # None where the call's values go as JSON (this connection)
        self._layouts: dict[tuple, tuple[int, struct.Struct] | None] = {}
        self._last_id = 0
        self._broken: str | None = None  # why the connection broke, until serve reports its messages
        self._said_away = False
        self.dropped = 0
        self.on_ack: Callable[[], None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    @property
    def unsent_bytes(self) -> int:
        """Bytes the socket did not take yet (written on at the next send or serve)."""
        return len(self._unsent)

    def send(self, entry: Entry, on_undelivered: Undelivered | None = None) -> None:
        if self._broken is not None:
            if self._waiting:
                # The messages in flight on the broken connection are reported (at the next
                # serve) before anything goes over a new one: the worker keeps them first.
                raise TransportUnavailable(self._broken)
            self._broken = None  # nothing to report (and no serve may come): connect anew
        if self._sock is None:
            self._connect()
        if len(self._unsent) > _MAX_UNSENT_BYTES:
            self._write()
            if len(self._unsent) > _MAX_UNSENT_BYTES:
                raise TransportUnavailable(f"the relay at {self.path} takes nothing "
                                           f"({len(self._unsent):,} bytes unsent)")
        self._last_id += 1
        topic, key, value = entry
        self._waiting[self._last_id] = (entry, time.monotonic(), on_undelivered)
        self._write(frames.entry(self._last_id, topic, key, value))
        if self._broken is not None:  # this write found the connection broken
            del self._waiting[self._last_id]
            raise TransportUnavailable(self._broken)

    def send_values(self, topic: str, key: bytes, item: tuple, encode: Encode) -> bool:
        """Send a log call's checked values (``deferred.queued``'s item) for the relay to
        write as JSON; False where they do not go so (a relay that does not write them, a
        layout that does not fit, a connection that broke): the caller sends the entry."""
        if not self._takes_values or self._broken is not None:
            return False
        kind, envelope, when, id_prefix, id_number, names = item[:VALUES_AT]
        values = item[VALUES_AT:]
        shape = (topic, key, kind, envelope, id_prefix, names)
        layout = self._layouts.get(shape, False)
        if layout is False:
            layout = self._lay_out(shape, values)
        if layout is None or len(self._unsent) > _MAX_UNSENT_BYTES:
            return False
        layout_id, packer = layout
        entry_id = self._last_id + 1
        try:
            frame = packer.pack(packer.size - 4, frames.VALUES, entry_id, layout_id, when, id_number, *values)
        except struct.error:  # (an int past 64 bits: its JSON goes)
            return False
        self._last_id = entry_id
        self._waiting[entry_id] = (_Values(topic, key, item, encode), time.monotonic(), None)
        self._write(frame)
        if self._broken is not None:  # this write found the connection broken
            del self._waiting[entry_id]
            return False
        return True

    def _lay_out(self, shape: tuple, values: tuple) -> tuple[int, struct.Struct] | None:
        """Declare a call's layout to the relay (frames.layout); None where its values go as
        JSON."""
        if len(self._layouts) >= frames.MAX_LAYOUTS:
            return None
        topic, key, kind, envelope, id_prefix, names = shape
        spec = frames.layout_spec(topic, key, kind, envelope, id_prefix, names, values)
        layout_id = len(self._layouts) + 1
        try:
            frame = None if spec is None else frames.layout(layout_id, spec)
        except (TypeError, ValueError):  # an envelope value JSON does not hold
            frame = None
        if frame is None or len(frame) + 32 * len(values) + 4096 > self._max_layout_bytes:
            self._layouts[shape] = None
            return None
        self._write(frame)
        layout = self._layouts[shape] = (layout_id, frames.values_packer(spec["codes"]))
        return layout

    def serve(self, timeout: float = 0.0) -> None:
        """Collect the relay's answers (waiting up to ``timeout`` for some while messages are
        in flight); a failed message goes to its failure handler. Failures are reported
        here only, never from ``send`` (as librdkafka reports them from its poll)."""
        if self._broken is not None:
            self._lost(self._broken)
        if self._sock is not None:
            if self._unsent:
                self._write()
            if timeout > 0 and self._waiting and self._broken is None:
                # poll, not select: a training process may well hold 1,024 descriptors
                # (loaders, NCCL, datasets), past which select refuses the socket's.
                waiting = select.poll()
                waiting.register(self._sock, select.POLLIN)
                waiting.poll(timeout * 1000)
            self._read()
        if self._broken is not None:
            self._lost(self._broken)
        if self._waiting:
            self._give_up_on_old()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if self._waiting and self._takes_flush and self._broken is None:
            # The relay passes answers on with its next window (within frames.ANSWERS_DUE_S) unless asked.
            self._write(frames.flush())
        while self._waiting and time.monotonic() < deadline:
            self.serve(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self._waiting

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        self._lost(self._broken or "the producer closed with messages unanswered")

    # -- the connection --------------------------------------------------------------------

    def _connect(self) -> None:
        sock = None
        try:
            # (socket() itself fails where the process is out of descriptors: EMFILE.)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)  # a relay whose backlog is full refuses (EAGAIN), never blocks
            sock.connect(self.path)
        except OSError as exc:
            if sock is not None:
                sock.close()
            if not self._said_away:
                self._said_away = True
                log.warning("trainmon: no relay at %s (%s); records wait in the spill file until "
                            "it answers", self.path, exc)
            raise TransportUnavailable(f"no relay at {self.path}: {exc}") from exc
        from ..schemas import schema_fingerprint

        self._sock = sock
        self._takes_values, self._layouts = False, {}  # (until this relay answers the hello)
        self._unsent += frames.hello(schema_fingerprint())
        if self._said_away:
            self._said_away = False
            log.info("trainmon: the relay at %s answers again", self.path)

    def _write(self, frame: bytes = b"") -> None:
        """Write what waits unsent, then ``frame`` (frames.write)."""
        if self._sock is None:
            return
        try:
            frames.write(self._sock, self._unsent, frame)
        except OSError as exc:
            self._break(f"writing to the relay failed: {exc}")

    def _read(self) -> None:
        gone = None  # why the connection ended, once its answers so far are taken
        while self._sock is not None:
            try:
                data = self._sock.recv(frames.READ_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                gone = f"reading from the relay failed: {exc}"
                break
            if not data:
                gone = "the relay closed the connection"
                break
            self._received += data
            if len(data) < frames.READ_BYTES:
                # All the socket held: another recv would only raise EAGAIN, an exception
                # that costs a log call microseconds with cold caches (1 step/s).
                break
        try:
            answered = frames.take_answers(self._received)
        except frames.FrameError as exc:
            self._break(f"the relay sent what is not an answer: {exc}")
            return
        for entry_id, status in answered:
            item = self._waiting.pop(entry_id, None)
            if item is None:  # given up on already (and kept by the worker), or the hello
                if entry_id == frames.HELLO_ID:
                    if status == frames.TAKES_FLUSH:
                        self._takes_flush = True
                    else:
                        self._takes_values = status == frames.TAKES_VALUES
                continue
            if status == frames.OK:
                if self.on_ack is not None:
                    self.on_ack()
            else:
                self._report(item, too_large=status == frames.TOO_LARGE)
        if gone is not None:
            # After the answers that came before it went (a relay that stops answers what
            # Kafka took, then closes): those messages are not sent again.
            self._break(gone)

    def _give_up_on_old(self) -> None:
        if self._waiting:
            _, sent_at, _ = next(iter(self._waiting.values()))
            if time.monotonic() - sent_at > self._answer_within_s:
                self._lost(f"the relay did not answer within {self._answer_within_s:.0f} s")

    def _break(self, reason: str) -> None:
        """Close the connection; its messages in flight are reported at the next serve."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._unsent.clear()
        self._received.clear()
        # Values only over a connection whose relay said it writes them: until the next
        # one's hello is answered, a log call's values go as JSON (whose send connects).
        self._takes_values = self._takes_flush = False
        self._broken = reason

    def _lost(self, reason: str) -> None:
        """Drop the connection; every message in flight goes to its failure handler, in order."""
        self._break(reason)
        self._broken = None
        waiting, self._waiting = self._waiting, {}
        if not waiting:
            return
        log.warning("trainmon: %s; %d message(s) kept to send again", reason, len(waiting))
        for item in waiting.values():
            self._report(item)

    def _report(self, waiting: tuple[Entry | _Values, float, Undelivered | None], too_large: bool = False) -> None:
        """A message that failed, to its failure handler (values written as JSON first).
        One the relay's Kafka client refused by itself as too large (``too_large``) would be
        refused again at every resend: as where a rank's own client refuses one
        (confluent_transport.py), its records go back one per message, and a single record
        is dropped and counted."""
        message, _, on_undelivered = waiting
        if type(message) is _Values:
            message = message.entry()
            if message is None:
                return
        if too_large:
            self.dropped += split_or_drop(message, on_undelivered or self._on_undelivered,
                                          "the relay's Kafka client refused it")
            return
        (on_undelivered or self._on_undelivered)([message])
