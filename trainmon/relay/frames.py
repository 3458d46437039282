"""The relay's wire format on its Unix socket: length-prefixed frames, in both directions.

A frame is a 4-byte big-endian length, then that many bytes: a type byte and its body.

- ``H`` hello (rank -> relay, first): the schema fingerprint of the rank's records, which
  the relay puts in the schema header of the Kafka messages that carry them.
- ``E`` entry (rank -> relay): an id (the rank's own, 8 bytes), the topic and key lengths
  (2 bytes each), the topic, the key, then the value (one record or packed ones).
- ``A`` answers (relay -> rank): ids with a status byte each, ``OK`` once Kafka stored the
  entry, ``FAILED`` once it gave up on it (the rank keeps the entry and sends it again),
  ``TOO_LARGE`` where the relay's Kafka client refused the entry by itself as over its
  message size (the rank splits it into its records, or drops a single record: sent again
  it would be refused again). A rank of an earlier version takes any status but ``OK`` for
  ``FAILED``, as before; an earlier relay never sends it.
  The hello is answered too, as id 0 (``HELLO_ID``): ``TAKES_FLUSH`` (the relay takes
  frame ``F``), then ``TAKES_VALUES`` where the relay's schema is the rank's own: the relay
  then writes records from their values. (A rank of an earlier version takes the last
  status for whether values go, and ``TAKES_FLUSH`` comes first.)
- ``F`` flush (rank -> relay, no body; only to a relay whose hello answer said
  ``TAKES_FLUSH``): the rank waits for its answers. The relay passes on Kafka's answers at
  its next window's end, at the latest ``ANSWERS_DUE_S`` after their message went; after
  an ``F``, as soon as Kafka's come.
- ``L`` layout (rank -> relay): a layout's id (2 bytes), then, as JSON, what the records
  of one log call's shape share: topic, key, kind, envelope, event id prefix, field
  names, and the ``struct`` codes of the values (``q`` an int, ``d`` a float).
- ``V`` values (rank -> relay): an id (8 bytes), a layout id (2), the record's time (a
  double), its event id number (8), then its values as the layout's codes say; the relay
  writes the record's JSON from them (relay/values.py).

A layout and its values exist because at training rates a log call runs with cold caches:
packing a record's numbers into a frame costs it a fraction of writing their JSON (36
against 225 µs of CPU, measured on a slow shared machine), which the relay, warm, does
for every rank of the node.
"""

from __future__ import annotations

import json
import socket
import struct

HELLO, ENTRY, ANSWERS, LAYOUT, VALUES, FLUSH = b"H", b"E", b"A", b"L", b"V", b"F"
OK, FAILED, TAKES_VALUES, TOO_LARGE, TAKES_FLUSH = 0, 1, 2, 3, 4
HELLO_ID = 0  # (a rank numbers its entries from 1)
# The relay passes Kafka's answers on at its next window's end, at the latest this long
# after their message went (after an F, as soon as Kafka's come).
ANSWERS_DUE_S = 2.0

_LENGTH = struct.Struct(">I")
READ_BYTES = 1 << 16  # what one recv on the socket takes, either side
# No frame is longer (a rank's largest message is Kafka's, a megabyte or a few): a length
# past it is not of the format, and a connection's buffer never grows past it.
MAX_FRAME_BYTES = 64 << 20
_ENTRY = struct.Struct(">QHH")
_ANSWER = struct.Struct(">QB")
_LAYOUT_ID = struct.Struct(">H")
_VALUES_HEAD = "QHdq"  # id, layout id, time, event id number; then the values
_VALUES_IDS = struct.Struct(">QH")
VALUE_CODES = {int: "q", float: "d"}
MAX_LAYOUTS = 256  # per connection: a training loop logs a few shapes (past this, JSON goes)


class FrameError(ValueError):
    """Bytes on the socket that are not a frame of this format."""


def hello(fingerprint: bytes) -> bytes:
    return _LENGTH.pack(1 + len(fingerprint)) + HELLO + fingerprint


def flush() -> bytes:
    return _LENGTH.pack(1) + FLUSH


def entry(entry_id: int, topic: str, key: bytes, value: bytes) -> bytes:
    name = topic.encode()
    key = key or b""
    return b"".join((_LENGTH.pack(1 + _ENTRY.size + len(name) + len(key) + len(value)), ENTRY,
                     _ENTRY.pack(entry_id, len(name), len(key)), name, key, value))


def layout_spec(topic: str, key: bytes, kind: str, envelope: tuple, id_prefix: str, names: tuple,
                values: tuple) -> dict | None:
    """What an ``L`` frame says of a log call's shape (``values``: one call's, for their
    types); None where a value has no code."""
    codes = "".join(VALUE_CODES.get(type(value), "?") for value in values)
    if "?" in codes:
        return None
    return {"topic": topic, "key": (key or b"").hex(), "kind": kind, "envelope": envelope, "id_prefix": id_prefix,
            "names": names, "codes": codes}


def layout(layout_id: int, spec: dict) -> bytes:
    """An ``L`` frame (TypeError / ValueError: a spec JSON does not hold)."""
    body = _LAYOUT_ID.pack(layout_id) + json.dumps(spec, separators=(",", ":")).encode()
    return _LENGTH.pack(1 + len(body)) + LAYOUT + body


def parse_layout(frame: bytes) -> tuple[int, dict]:
    """An ``L`` frame -> (layout id, its spec as sent)."""
    if len(frame) < 1 + _LAYOUT_ID.size:
        raise FrameError(f"a layout frame of {len(frame)} bytes is too short")
    (layout_id,) = _LAYOUT_ID.unpack_from(frame, 1)
    try:
        spec = json.loads(frame[1 + _LAYOUT_ID.size:])
    except (ValueError, RecursionError) as exc:  # (RecursionError: brackets nested deeper than Python's stack)
        raise FrameError(f"layout {layout_id}: not JSON ({type(exc).__name__})") from None
    if type(spec) is not dict:
        raise FrameError(f"layout {layout_id}: not a JSON object")
    return layout_id, spec


def values_packer(codes: str) -> struct.Struct:
    """What a rank packs a ``V`` frame of a layout with these value codes by, whole:
    ``packer.pack(packer.size - 4, VALUES, id, layout id, time, id number, *values)``
    (one call: it runs in a log call, with cold caches)."""
    return struct.Struct(">Ic" + _VALUES_HEAD + codes)


def values_reader(codes: str) -> struct.Struct:
    """What the relay reads a ``V`` frame of a layout with these value codes by, from its
    type byte on."""
    return struct.Struct(">c" + _VALUES_HEAD + codes)


def values_ids(frame: bytes) -> tuple[int, int]:
    """A ``V`` frame's (id, layout id)."""
    if len(frame) < 1 + _VALUES_IDS.size:
        raise FrameError(f"a values frame of {len(frame)} bytes is too short")
    return _VALUES_IDS.unpack_from(frame, 1)


def check_values(frame: bytes, reader: struct.Struct) -> None:
    """FrameError unless ``frame`` is as long as its layout's values make it."""
    if len(frame) != reader.size:
        raise FrameError(f"a values frame of {len(frame)} bytes where its layout's take {reader.size}")


def read_values(frame: bytes, reader: struct.Struct) -> tuple[float, int, tuple]:
    """A ``V`` frame's (time, event id number, values), by its layout's values_reader
    (the frame checked: check_values)."""
    _, _, _, when, id_number, *values = reader.unpack(frame)
    return when, id_number, tuple(values)


def answers(statuses: list[tuple[int, int]]) -> bytes:
    body = b"".join(_ANSWER.pack(entry_id, status) for entry_id, status in statuses)
    return _LENGTH.pack(1 + len(body)) + ANSWERS + body


def split(buffer: bytearray) -> list[bytes]:
    """The whole frames at the start of ``buffer`` (removed from it); a partial one stays."""
    frames, at = [], 0
    while len(buffer) - at >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer, at)
        if length == 0:
            raise FrameError("an empty frame")
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"a frame of {length:,} bytes, past the {MAX_FRAME_BYTES:,} any frame may have")
        if len(buffer) - at - _LENGTH.size < length:
            break
        frames.append(bytes(buffer[at + _LENGTH.size:at + _LENGTH.size + length]))
        at += _LENGTH.size + length
    del buffer[:at]
    return frames


def parse_entry(frame: bytes) -> tuple[int, str, bytes, bytes]:
    """An ``E`` frame -> (id, topic, key, value)."""
    if len(frame) < 1 + _ENTRY.size:
        raise FrameError(f"an entry frame of {len(frame)} bytes is too short")
    entry_id, topic_len, key_len = _ENTRY.unpack_from(frame, 1)
    at = 1 + _ENTRY.size
    if len(frame) < at + topic_len + key_len:
        raise FrameError(f"entry {entry_id}: its topic and key run past the frame")
    topic = frame[at:at + topic_len].decode()
    key = frame[at + topic_len:at + topic_len + key_len]
    return entry_id, topic, key, frame[at + topic_len + key_len:]


def take_answers(buffer: bytearray) -> list[tuple[int, int]]:
    """The (id, status) answers of the whole ``A`` frames at the start of ``buffer``
    (removed from it; a partial frame stays). The frames are read in place, not split
    first: a rank's log call reads its answers, with cold caches at training rates."""
    answered, at, size = [], 0, len(buffer)
    while size - at >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer, at)
        if size - at - _LENGTH.size < length:
            break
        body = at + _LENGTH.size + 1
        if length == 0 or buffer[body - 1] != ANSWERS[0] or (length - 1) % _ANSWER.size:
            raise FrameError(f"a frame of {length} bytes that is not an answers frame")
        answered += _ANSWER.iter_unpack(buffer[body:body + length - 1])
        at = body + length - 1
    del buffer[:at]
    return answered


def write(sock, unsent: bytearray, frame: bytes = b"") -> None:
    """Write ``unsent`` (what the non-blocking ``sock`` did not take before), then
    ``frame``; what the socket does not take stays in ``unsent``. A frame after nothing
    unsent goes to the socket as it is: at training rates that is every send, and
    copying it through the buffer costs a log call microseconds with cold caches. An
    OSError other than a full socket (EPIPE: the peer is gone) is the caller's to handle."""
    if unsent:
        unsent += frame
        frame = unsent
    if not frame:
        return
    try:
        # MSG_NOSIGNAL: a peer gone is EPIPE here, never SIGPIPE, which kills a process
        # whose SIGPIPE is at its default (a training script may set it so).
        written = sock.send(frame, socket.MSG_NOSIGNAL)
    except (BlockingIOError, InterruptedError):
        written = 0
    if frame is unsent:
        del unsent[:written]
    elif written < len(frame):
        unsent += frame[written:]
