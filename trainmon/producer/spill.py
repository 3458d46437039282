"""The local spill file: a write-ahead log of the records Kafka has not acknowledged.

Each producer owns one file, locked with flock while the process lives. Records go in at
the end; the sender reads from the front *without removing anything* and, only once
Kafka has acknowledged what it read, drops that part. So a record is on disk from the
moment it is spilled until Kafka has it, and a process killed at any moment (kill -9
while a retry is in flight included) leaves it in the file. A producer that starts later
claims files whose lock is free (their owner exited or was killed) and sends what they
hold, so records outlive the process that logged them. A kill can at worst leave a
record both in Kafka and in the file: it is sent twice, and every consumer keeps one row
per event id.

Dropping an acknowledged part frees its blocks in place (Linux's ``fallocate``
punching a hole at the front; it then reads as zeros, which a claimer skips), so a resend
after a long outage costs nothing per batch but the read: rewriting the rest of the file
after each 8 MiB batch, as before, copied S**2 / 16 MiB bytes to send S (a 1 GiB spill:
~64 GiB). Where the filesystem cannot punch holes, the rest is rewritten into a new file
as before.

A full disk: an append that does not fit is taken back whole (the file is cut to where
it ended), so the file never holds a torn record and the caller keeps the records
elsewhere. A rewrite may not fit either: then the file stays as it is and only its read
position moves past the acknowledged part (``head``), until a later rewrite fits; a
claimer after a kill sends that part again (twice, never lost). (Punching a hole needs
no room.) Writes are not fsync'd: a killed process loses nothing the kernel holds, a
machine that loses power can lose the file's last seconds.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Callable

from ..kafka_client.transport import Entry
from ..schemas import count

log = logging.getLogger("trainmon.producer")

SUFFIX = ".spill"
_COPY_CHUNK_BYTES = 8 << 20  # a rewrite copies the rest of the file this much at a time
_COMPACTING = ".compacting"  # a file being rewritten; never claimed (its data is also in the .spill)


def _libc_fallocate():
    """libc's fallocate(2), or None (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int
    return call


_FALLOCATE = _libc_fallocate()
# fallocate(2)'s FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: free a range's blocks, the
# file's size unchanged; the range then reads as zeros (partial blocks are zeroed).
_PUNCH_HOLE = 0x02 | 0x01


def punch_front(fd: int, length: int) -> bool:
    """Free the file's first ``length`` bytes in place; False where the OS or the
    filesystem cannot (then nothing changed)."""
    if _FALLOCATE is None:
        return False
    return _FALLOCATE(fd, _PUNCH_HOLE, 0, length) == 0


def _dump(entries: list[Entry]) -> str:
    return "".join(json.dumps([t, k.decode(), v.decode()]) + "\n" for t, k, v in entries)


def _load(data: bytes) -> list[Entry]:
    entries, skipped = [], 0
    for line in data.splitlines():
        # Line by line, decoding included: a torn last line from a crash mid-write, or a
        # corrupt one (bytes that are not UTF-8 after a power loss, JSON that is not a
        # record), is skipped, and the rest is still good. (Decoding the whole chunk at
        # once, a bad byte raised out of the claim and stopped the sender thread.)
        try:
            t, k, v = json.loads(line.decode())
            entries.append((t, k.encode(), v.encode()))
        except (ValueError, TypeError, AttributeError):
            skipped += 1
    if skipped:
        log.warning("trainmon: skipped %d torn or corrupt line(s) of a spill file", skipped)
    return entries


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class SpillFile:
    def __init__(self, directory: Path, name: str):
        self.directory = Path(directory)
        self.path = self.directory / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{SUFFIX}"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.count = 0  # records waiting in the file
        self.head = 0  # bytes at the front of the file already acknowledged (freed, or not yet cut off)
        self._read_end = 0  # where in the file the last read ended
        self._read_records = 0

    def _open(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # (BlockingIOError: a claimer holds it this moment; later)
                    os.close(fd)
                    raise
                if os.fstat(fd).st_nlink:
                    self._fd = fd
                    break
                # Between its creation and the lock, a starting producer found the file
                # unlocked and empty, and removed it as an orphan's: records appended to
                # this descriptor would go nowhere. A new file at the same path.
                os.close(fd)
            else:
                raise OSError(f"the spill file {self.path} was removed as soon as it was made, three times")
        return self._fd

    def append(self, entries: list[Entry]) -> None:
        """At the end of the file; raises OSError (nothing written) where it cannot be."""
        if not entries:
            return
        with self._lock:
            self._open()  # an unusable directory fails here, before anything is encoded
        data = _dump(entries).encode()
        with self._lock:
            fd = self._open()
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, data)  # a full disk can take part of a write: all of it, or none
            except OSError:
                os.ftruncate(fd, start)
                raise
            self.count += sum(count(value) for _, _, value in entries)

    def has_room(self, nbytes: int) -> bool:
        """Whether the directory's filesystem has about ``nbytes`` free (True where it
        cannot tell: the append will)."""
        try:
            stat = os.statvfs(self.directory)
        except OSError:
            return True
        return stat.f_bavail * stat.f_frsize >= nbytes

    def read(self, max_bytes: int) -> list[Entry]:
        """The oldest entries, about max_bytes of them (at least one), left in the file
        until :meth:`acknowledge`."""
        with self._lock:  # (only the reads: a log call appending must not wait for parsing)
            self._read_end = self._read_records = 0
            if self._fd is None or self.count == 0:
                return []
            data = b""
            while True:  # until a whole line is in hand (a line may exceed max_bytes)
                chunk = os.pread(self._fd, max_bytes if not data else 1 << 16, self.head + len(data))
                data += chunk
                end = data.rfind(b"\n") + 1
                if end or not chunk:
                    break
        entries = _load(data[:end])
        self._read_end = self.head + end  # (only the sender thread reads and acknowledges)
        self._read_records = sum(count(value) for _, _, value in entries)
        return entries

    def acknowledge(self) -> None:
        """Kafka has everything the last read returned: drop it from the file."""
        with self._lock:
            if not self._read_end or self._fd is None:
                return
            size = os.fstat(self._fd).st_size
            if self._read_end >= size:
                os.ftruncate(self._fd, 0)  # the usual case: everything was sent
                self.count = self.head = 0
            else:
                # (All but the newline that ends the last record: a claimer of an earlier
                # trainmon, which does not skip the zeros, reads them as one corrupt
                # line, which it skips, not as the start of the first record after it.)
                if punch_front(self._fd, self._read_end - 1):
                    self.head = self._read_end  # (the front now reads as zeros)
                else:
                    try:
                        self._keep_only_after(self._read_end, size)
                        self.head = 0
                    except OSError:  # no room for the rewrite (a full disk): cut it off later
                        self.head = self._read_end
                self.count = max(0, self.count - self._read_records)
            self._read_end = self._read_records = 0

    def _keep_only_after(self, offset: int, size: int) -> None:
        """Rewrite the file as its bytes from offset on (records spilled while the read
        ones were in flight), atomically: a new file, locked, renamed over the old one.
        A kill before the rename leaves the old file, which sends the acknowledged part
        again; never a file without the rest."""
        temp = self.path.with_name(self.path.name + _COMPACTING)
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A chunk at a time, until all of it is copied: a read may return less than
            # asked (Linux's at most 2 GiB - 4 KiB, and the rest after a long outage can be
            # larger), and the rest would be renamed over the file without it.
            while offset < size:
                chunk = os.pread(self._fd, min(size - offset, _COPY_CHUNK_BYTES), offset)
                if not chunk:
                    raise OSError(errno.EIO, f"the spill file {self.path} ended at {offset} of {size} bytes")
                _write_all(fd, chunk)
                offset += len(chunk)
            os.replace(temp, self.path)
        except OSError:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(self._fd)  # (a claimer waiting on the old file finds it unlinked)
        self._fd = fd

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
        """In a forked child: the parent's file is the parent's. The child's copy of its
        descriptor is closed: a flock belongs to the open file, which the child shares, so
        while the child held it, the file stayed locked after the parent exited and no
        later producer claimed its records. (Not under self._lock: another thread of the
        parent may have held it at the fork, and no thread releases it in the child.)"""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None
        self.count = self.head = 0


# An orphan is handed over this much at a time: after a long outage it may hold gigabytes.
CLAIM_CHUNK_BYTES = 8 << 20


def claim_orphans(directory: Path, keep: Callable[[list[Entry]], bool], own: Path | None = None,
                  chunk_bytes: int = CLAIM_CHUNK_BYTES,
                  unreadable: Callable[[Path, OSError], None] | None = None) -> bool:
    """Hand the records of spill files whose owner is gone (their flock is free) to
    ``keep``, about ``chunk_bytes`` at a time, and delete each file once ``keep`` says all
    its records are on disk again (in the caller's own spill file). A file whose records
    could only be kept in memory stays, so that a kill now still loses nothing (at worst
    its records are sent twice). A rewrite's temporary file whose owner is gone is
    removed (its records are in its .spill file). A file that cannot be opened or read
    (a disk error, another user's file) goes to ``unreadable`` and is passed over: the
    others are still claimed. True where a file was left that a later try may claim: one
    whose owner still lives (it may be exiting: a rank restarted before the old one was
    gone), or one that could not be read."""
    directory = Path(directory)
    left = False
    if not directory.is_dir():
        return left
    for temp in directory.glob(f"*{SUFFIX}{_COMPACTING}"):
        _remove_if_unlocked(temp)
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        if own is not None and path == own:
            continue
        try:
            left |= _claim(path, keep, chunk_bytes)
        except OSError as exc:
            left = True
            if unreadable is not None:
                unreadable(path, exc)
    return left


def _claim(path: Path, keep: Callable[[list[Entry]], bool], chunk_bytes: int) -> bool:
    """One orphan (see claim_orphans); True where its owner still lives."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # a live producer owns it
        if os.fstat(fd).st_nlink == 0:
            return False  # another producer claimed it, or its owner rewrote it, while we waited
        with open(fd, "rb", closefd=False) as f:
            f.seek(_data_start(fd))
            while lines := f.readlines(chunk_bytes):  # (whole lines, about chunk_bytes)
                entries = _load(b"".join(lines))
                if entries and not keep(entries):
                    return False  # (what was kept so far is sent twice, after a later claim)
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


def _data_start(fd: int) -> int:
    """Where a spill file's records start: past the front its owner freed (punch_front),
    which reads as zeros and may be gigabytes long, found without reading it where the
    filesystem tells where its data is (SEEK_DATA), the rest of it (a partial block)
    skipped by reading, and past the newline kept after it (SpillFile.acknowledge)."""
    try:
        position = os.lseek(fd, 0, os.SEEK_DATA) if hasattr(os, "SEEK_DATA") else 0
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data at all: all of it was freed
            return os.fstat(fd).st_size
        position = 0  # (a filesystem that cannot tell: read it all)
    while chunk := os.pread(fd, 1 << 16, position):
        data = chunk.lstrip(b"\0\n")  # (a record's line starts with "[")
        position += len(chunk) - len(data)
        if data:
            break
    return position


def _remove_if_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
    except OSError:  # (BlockingIOError: its owner is rewriting it now)
        pass
    finally:
        os.close(fd)
