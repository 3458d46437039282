"""The engine's state on disk: one gzipped JSON file, replaced atomically, with the input
offsets it corresponds to, the partition each of its runs is read from, and how far into the
alert topic its incident book is.

At 16,384 ranks the state is some 100 MB of JSON and takes seconds to write out. The
service therefore writes it from a forked child (``Writer``), as Redis writes its
snapshots: the child holds a copy-on-write image of the engine as it was at the fork,
consistent with the offsets taken at that moment, while the engine goes on judging. The
JSON is gzipped (zlib, in the standard library): its windows of numbers shrink about 3x,
and ``zcat`` still reads it.

A checkpoint is a consistent snapshot of the runs of the partitions in its offsets, so
whoever loads it uses it only for the partitions it is assigned: the service drops the
runs of the others (another engine of the group judges them) and replays those partitions
without a snapshot from their topics. Each member of a group writes its own file
(``checkpoint_path``'s ``member``): two engines sharing a ``state_dir`` would otherwise
keep overwriting each other's, which would cost warm windows, not correctness.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...filenames import safe_name
from ...process_lifetime import end_with_parent

log = logging.getLogger("trainmon.alerts")
VERSION = 2  # 2: with the partition of each run (version 1 came from rank-keyed records)
SUFFIX = ".json.gz"  # (an older engine's plain .json is not read: the state is rebuilt)


@dataclass
class Checkpoint:
    engine: dict
    offsets: dict[str, int]  # "topic:partition" -> next offset to read
    alert_offsets: dict[int, int]  # alert topic partition -> how far the book has read it
    run_partitions: dict[str, int]  # run -> the partition number its records are read from
    saved_at: float = field(default_factory=time.time)


def checkpoint_path(state_dir: Path, group_id: str, topic_prefix: str, member: str | None = None) -> Path:
    """``member``: the consumer's static instance id (unique in its group). None (a dynamic
    member) shares the group's file."""
    name = f"{group_id}@{topic_prefix}" + (f"@{member}" if member else "")
    # (Spelled by filenames.safe_name since the state's version 3: an older checkpoint,
    # under its old name, is rebuilt from the topics as a version 2 one would be.)
    return Path(state_dir) / f"{safe_name(name)}{SUFFIX}"


def save(path: Path, checkpoint: Checkpoint) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One temporary file per writer: two engines in one process (a test) may share a path.
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    data = {"version": VERSION, "saved_at": checkpoint.saved_at, "offsets": checkpoint.offsets,
            "alert_offsets": {str(p): o for p, o in checkpoint.alert_offsets.items()},
            "run_partitions": checkpoint.run_partitions, "engine": checkpoint.engine}
    with open(tmp, "wb") as f:
        # (mtime 0: the same state writes the same bytes)
        f.write(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), compresslevel=6, mtime=0))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> Checkpoint | None:
    """The checkpoint, or None (with a warning saying why) when there is none to trust."""
    try:
        data = json.loads(gzip.decompress(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as exc:  # (gzip.BadGzipFile is an OSError)
        log.warning("trainmon alerts: ignoring unreadable checkpoint %s (%s); rebuilding from the topics",
                    path, exc)
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        log.warning("trainmon alerts: ignoring checkpoint %s of another version; rebuilding from the topics",
                    path)
        return None
    return Checkpoint(engine=data["engine"], offsets=data["offsets"],
                      alert_offsets={int(p): o for p, o in data["alert_offsets"].items()},
                      run_partitions=data["run_partitions"], saved_at=data["saved_at"])


class Writer:
    """Writes checkpoints without stopping the engine: ``write`` forks, the child builds
    the checkpoint from its copy of the state, saves it and exits; the parent goes on at
    once. One write at a time: ``busy`` says whether the last is still going (and reports a
    failed one). The child dies with its parent (``PR_SET_PDEATHSIG``), so a stopped or
    killed engine leaves no writer behind to replace a newer checkpoint with an older one.
    Off Linux (no fork), or when a fork fails, the write happens in the caller."""

    def __init__(self):
        self.pid: int | None = None
        self.written = 0  # checkpoints saved (counted when the child is seen to succeed)
        self.failed = 0
        self.last_s = 0.0  # how long the last write took, fork to exit
        self._started = 0.0

    def busy(self) -> bool:
        if self.pid is None:
            return False
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return True
        self._reaped(status)
        return False

    def wait(self) -> None:
        """Until the write in progress (if any) is done."""
        if self.pid is not None:
            _, status = os.waitpid(self.pid, 0)
            self._reaped(status)

    def write(self, path: Path, make: Callable[[], Checkpoint]) -> None:
        """Save ``make()`` to ``path``; ``make`` runs in the child (where the state is the
        fork's snapshot), so it may take seconds."""
        self.wait()
        self._started = time.monotonic()
        if hasattr(os, "fork"):
            arm = end_with_parent(signal.SIGKILL)
            try:
                pid = os.fork()
            except OSError as exc:  # (no memory or process slots for a child: write it here)
                log.warning("trainmon alerts: cannot fork a checkpoint writer (%s); writing it in the service",
                            exc)
            else:
                if pid == 0:
                    _write_and_exit(path, make, arm)
                self.pid = pid
                return
        save(path, make())
        self.written += 1
        self.last_s = time.monotonic() - self._started

    def _reaped(self, status: int) -> None:
        code, self.pid = os.waitstatus_to_exitcode(status), None
        self.last_s = time.monotonic() - self._started
        if code == 0:
            self.written += 1
        else:
            self.failed += 1
            log.warning("trainmon alerts: the checkpoint writer exited with %s; the next one is "
                        "due in an interval", code)


def _write_and_exit(path: Path, make: Callable[[], Checkpoint], arm: Callable[[], None] | None) -> None:
    """The forked writer's whole life. No logging: its locks may be held by a thread that
    is not in the child."""
    code = 1
    try:
        if arm is not None:
            arm()
        save(path, make())
        code = 0
    except BaseException as exc:
        try:
            sys.stderr.write(f"trainmon alerts: checkpoint {path} not written: {exc!r}\n")
        except BaseException:
            pass
    finally:
        os._exit(code)
