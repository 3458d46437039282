"""The local spill file: where records wait while the broker is unreachable.

Each producer owns one file, locked with flock while the process lives. A producer that
starts later claims files whose lock is free (their owner exited or was killed) and
sends what they hold, so records outlive the process that logged them.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from pathlib import Path

from ..schemas import count

Entry = tuple[str, bytes, bytes]  # topic, key, message value (one or more records)

SUFFIX = ".spill"


def _dump(entries: list[Entry]) -> str:
    return "".join(json.dumps([t, k.decode(), v.decode()]) + "\n" for t, k, v in entries)


def _load(text: str) -> list[Entry]:
    entries = []
    for line in text.splitlines():
        try:
            t, k, v = json.loads(line)
        except ValueError:
            continue  # a torn last line from a crash mid-write: the rest is still good
        entries.append((t, k.encode(), v.encode()))
    return entries


class SpillFile:
    def __init__(self, directory: Path, name: str):
        self.directory = Path(directory)
        self.path = self.directory / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{SUFFIX}"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.count = 0  # records waiting in the file

    def _open(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return self._fd

    def append(self, entries: list[Entry]) -> None:
        if not entries:
            return
        data = _dump(entries).encode()
        with self._lock:
            fd = self._open()
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # a full disk can take part of a write: all of it, or none
                    view = view[os.write(fd, view):]
            except OSError:
                os.ftruncate(fd, start)
                raise
            self.count += sum(count(value) for _, _, value in entries)

    def take(self) -> list[Entry]:
        """Everything waiting, in order; the file is emptied."""
        with self._lock:
            if self._fd is None or self.count == 0:
                return []
            os.lseek(self._fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(self._fd, 1 << 20):
                chunks.append(chunk)
            os.ftruncate(self._fd, 0)
            self.count = 0
        return _load(b"".join(chunks).decode())

    def close(self) -> None:
        """Release the file; an empty one is removed, a non-empty one is left for later."""
        with self._lock:
            if self._fd is None:
                return
            if self.count == 0:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def forget_after_fork(self) -> None:
        # The child shares the parent's open file and lock; it must not touch either.
        self._fd = None
        self.count = 0


def claim_orphans(directory: Path, own: Path | None = None) -> list[Entry]:
    """Read and delete spill files whose owner is gone (their flock is free)."""
    entries: list[Entry] = []
    directory = Path(directory)
    if not directory.is_dir():
        return entries
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        if own is not None and path == own:
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live producer owns it
        try:
            if os.fstat(fd).st_nlink == 0:
                continue  # another producer claimed it while we waited
            with open(fd, "rb", closefd=False) as f:
                entries.extend(_load(f.read().decode()))
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return entries
