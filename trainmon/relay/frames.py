"""The relay's wire format on its Unix socket: length-prefixed frames, in both directions.

A frame is a 4-byte big-endian length, then that many bytes: a type byte and its body.

- ``H`` hello (rank -> relay, first): the schema fingerprint of the rank's records, which
  the relay puts in the schema header of the Kafka messages that carry them.
- ``E`` entry (rank -> relay): an id (the rank's own, 8 bytes), the topic and key lengths
  (2 bytes each), the topic, the key, then the value (one record or packed ones).
- ``A`` answers (relay -> rank): ids with a status byte each, ``OK`` once Kafka stored the
  entry, ``FAILED`` once it gave up on it (the rank keeps the entry and sends it again).
"""

from __future__ import annotations

import struct

HELLO, ENTRY, ANSWERS = b"H", b"E", b"A"
OK, FAILED = 0, 1

_LENGTH = struct.Struct(">I")
READ_BYTES = 1 << 16  # what one recv on the socket takes, either side
_ENTRY = struct.Struct(">QHH")
_ANSWER = struct.Struct(">QB")


class FrameError(ValueError):
    """Bytes on the socket that are not a frame of this format."""


def hello(fingerprint: bytes) -> bytes:
    return _LENGTH.pack(1 + len(fingerprint)) + HELLO + fingerprint


def entry(entry_id: int, topic: str, key: bytes, value: bytes) -> bytes:
    name = topic.encode()
    key = key or b""
    return b"".join((_LENGTH.pack(1 + _ENTRY.size + len(name) + len(key) + len(value)), ENTRY,
                     _ENTRY.pack(entry_id, len(name), len(key)), name, key, value))


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
    OSError other than a full socket is the caller's to handle."""
    if unsent:
        unsent += frame
        frame = unsent
    if not frame:
        return
    try:
        written = sock.send(frame)
    except (BlockingIOError, InterruptedError):
        written = 0
    if frame is unsent:
        del unsent[:written]
    elif written < len(frame):
        unsent += frame[written:]
