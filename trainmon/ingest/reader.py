"""Where the lines come from: a finished file, a growing file (``tail -F``), a pipe.

Each source yields lines as ``str`` (without their newline) and ``None`` whenever the
input has been quiet for ``idle_s``, so the session can send what it holds while a
live job is between two log lines.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterator

CHUNK = 1 << 16
log = logging.getLogger("trainmon.ingest")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def read_file(path: Path) -> Iterator[str]:
    """A finished log, line by line."""
    with open(path, "rb") as f:
        for raw in f:
            yield _decode(raw).rstrip("\r\n")


class _Lines:
    """Splits a byte stream into lines, keeping an unfinished last line for later."""

    def __init__(self) -> None:
        self._rest = b""

    def push(self, data: bytes) -> list[str]:
        data = self._rest + data
        *complete, rest = data.split(b"\n")
        # A progress bar redraws over itself with carriage returns and writes its newline
        # only when it closes (a whole epoch): each draw before the last "\r" is complete
        # (the session reads every draw as a line of its own). A final "\r" may be the
        # first half of "\r\n", and the draw after the last one may still be written.
        cut = rest.rfind(b"\r", 0, len(rest) - 1)
        if cut > 0:
            complete.append(rest[:cut])
            rest = rest[cut:]
        self._rest = rest
        return [_decode(line).rstrip("\r") for line in complete]

    def drain(self) -> list[str]:
        rest, self._rest = self._rest, b""
        return [_decode(rest).rstrip("\r")] if rest else []


def follow(path: Path, *, idle_s: float = 0.1, poll_s: float = 0.02,
           stop: threading.Event | None = None) -> Iterator[str | None]:
    """A growing file, like ``tail -F``: from its start, then whatever is appended; a
    file truncated in place is read again from its start, and a file renamed away
    (rotated) is read to its end before the new file at ``path`` is opened."""
    stop = stop or threading.Event()
    f: BinaryIO | None = None
    lines = _Lines()
    quiet_since = time.monotonic()
    idle_sent = True
    try:
        while not stop.is_set():
            if f is None:
                try:
                    f = open(path, "rb")
                except FileNotFoundError:
                    stop.wait(poll_s)
                    continue
            data = f.read(CHUNK)
            if data:
                yield from lines.push(data)
                quiet_since, idle_sent = time.monotonic(), False
                continue
            if _replaced(path, f):
                log.info("trainmon ingest: %s was replaced (rotated); reading the new file", path)
                # What the job wrote to the old file since the read above (it still has
                # it open): read to its end before the new one.
                while data := f.read(CHUNK):
                    yield from lines.push(data)
                yield from lines.drain()  # the old file's last line, unterminated
                f.close()
                f = None
                continue
            if not idle_sent and time.monotonic() - quiet_since >= idle_s:
                idle_sent = True
                yield None
            stop.wait(poll_s)
    finally:
        if f is not None:
            f.close()


def _replaced(path: Path, f: BinaryIO) -> bool:
    """True when ``path`` is now another file (rotated) or was truncated below where
    this reader is (then it rewinds and reads the file again from its start)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False  # rotated, and the new file is not there yet: keep the old one
    mine = os.fstat(f.fileno())
    if (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
        return True
    if now.st_size < f.tell():
        f.seek(0)
    return False


def pipe(source: BinaryIO, passthrough: BinaryIO | None, *,
         idle_s: float = 0.1) -> Iterator[str | None]:
    """A pipe (``train.py | trainmon ingest -``): every byte is written on to
    ``passthrough`` as it arrives and unchanged, like ``tee``, before it is parsed."""
    fd = source.fileno()
    lines = _Lines()
    while True:
        ready, _, _ = select.select([fd], [], [], idle_s)
        if not ready:
            yield None
            continue
        data = os.read(fd, CHUNK)
        if not data:
            break
        if passthrough is not None:
            try:
                passthrough.write(data)
                passthrough.flush()
            except BrokenPipeError:
                # Whoever read our output is gone ("| head"); keep reading the job's
                # output so the job never blocks on a full pipe, and keep parsing it.
                passthrough = None
        yield from lines.push(data)
    yield from lines.drain()
