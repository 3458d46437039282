"""Free space on the filesystem holding the checkpoints, measured off the training thread.

With ``TRAINMON_CHECKPOINT_DIR`` set, the producer of local rank 0 (one per host) starts a
daemon thread that measures that directory with ``shutil.disk_usage`` every
``TRAINMON_DISK_INTERVAL_S`` seconds (60; 0 turns it off), and once more right after each
``log_checkpoint``, and sends a ``disk`` record (free, used and total bytes, the latest
step logged). A directory not made yet is measured at its nearest existing parent: the
filesystem it will be on.

Why a ``disk`` record of its own rather than free space in the checkpoint record: free
space belongs to the filesystem, not to a save. It shrinks between saves (other jobs,
logs, caches), saves may be hours apart, and the save that fails for want of space may
never log its record, so a rule that should warn before the disk is full needs a steady
series. ``statvfs`` on a hung network filesystem can block for minutes: on this thread
that delays the next disk record, never a training step, and an error (a directory
that cannot be read) is said once and the thread goes on. The checkpoint record still
carries ``free_bytes`` / ``total_bytes`` when the caller passes them.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("trainmon.producer")

DEFAULT_INTERVAL_S = 60.0


def measured_path(path: str | Path) -> Path:
    """``path``, or its nearest existing parent when it does not exist (yet)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_fields(path: str | Path, usage: Callable[[Any], Any] = shutil.disk_usage) -> dict[str, Any]:
    """DiskRecord fields (without step) of the filesystem holding ``path``."""
    total, used, free = usage(measured_path(path))
    return {"path": str(path), "free_bytes": int(free), "total_bytes": int(total),
            "used_bytes": int(used)}


class DiskSampler:
    """``send(fields)`` gets DiskRecord fields (step included) every ``interval_s`` and
    after each ``nudge``; ``step()`` is the latest step logged."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], path: str | Path,
                 interval_s: float = DEFAULT_INTERVAL_S, *, step: Callable[[], int] = lambda: 0,
                 usage: Callable[[Any], Any] | None = None):
        self.path = str(path)
        self.interval_s = interval_s
        self.samples = 0
        self._send = send
        self._step = step
        self._usage = usage if usage is not None else shutil.disk_usage
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending_step: int | None = None
        self._failed = False
        self._thread: threading.Thread | None = None

    def start(self) -> "DiskSampler":
        self._thread = threading.Thread(target=self._run, name="trainmon-disk", daemon=True)
        self._thread.start()
        return self

    def nudge(self, step: int | None = None) -> None:
        """Measure now (a checkpoint was just saved); the record carries ``step``. Saves
        logged faster than the thread wakes share one measurement, at the latest step."""
        self._pending_step = step
        self._wake.set()

    def sample(self) -> bool:
        """Measure once and send; never raises. False when nothing was sent."""
        step, self._pending_step = self._pending_step, None
        try:
            fields = disk_fields(self.path, self._usage)
            fields["step"] = self._step() if step is None else step
            sent = bool(self._send(fields))
        except Exception as exc:  # a permission error, a vanished mount: say it once
            if not self._failed:
                log.warning("trainmon: cannot measure the free space of %s (further failures "
                            "are silent): %s", self.path, exc)
                self._failed = True
            return False
        self.samples += 1
        return sent

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
