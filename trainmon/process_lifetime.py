"""Processes that end with the process they serve, however it ends (kill -9 included).

Two tools, for two kinds of owner:

- :func:`end_with_parent`, a ``preexec_fn`` for children of a long-lived, single-threaded
  loop (the ``trainmon up`` supervisor's services): Linux sends the child a signal when
  its parent dies (``prctl(PR_SET_PDEATHSIG)``). The signal is tied to the *thread* that
  forked the child, not the process: a child forked from a worker thread would be
  signalled when that thread ends. So it is only for parents that fork from the thread
  that lives as long as they do.
- :func:`watch`, for everything else (a broker started by a test session, a benchmark,
  ``trainmon roundtrip``, the demo's stack): a small watchdog process, in a session of
  its own so a terminal's Ctrl-C or a kill of the owner's process group does not take it
  along first, waits on the owner and the watched processes through pidfds (no polling,
  no pid-reuse race) and, once the owner is gone, stops the watched processes in order
  (SIGTERM, then SIGKILL after a grace period), then removes a directory if asked. It
  exits by itself when the watched processes exit first (a normal stop). It does not
  depend on which thread started anything.

The watchdog is this file run as a script (not ``-m trainmon...``), so that it imports
nothing of trainmon's and starts in a few tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def end_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child receive ``sig`` when the forking thread's
    process dies (None off Linux). The parent may die between the fork and the prctl: the
    child then finds itself adopted and signals itself."""
    if _LIBC is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def watch(pids: Iterable[int], *, grace_s: float = 5.0, remove: Path | str | None = None) -> subprocess.Popen | None:
    """Start a watchdog that stops ``pids`` (in this order) once this process is gone,
    each given ``grace_s`` after SIGTERM before SIGKILL, and removes ``remove`` after.
    The returned process exits by itself once every watched process has exited. None
    where there are no pidfds (not Linux 5.3+): nothing is watched there."""
    if not hasattr(os, "pidfd_open"):
        return None
    command = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(grace_s),
               str(remove or ""), *map(str, pids)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _exited(fd: int, timeout_s: float = 0.0) -> bool:
    waiting = select.poll()  # (not select: it refuses descriptors past 1,023)
    waiting.register(fd, select.POLLIN)
    return bool(waiting.poll(timeout_s * 1000))


def _stop(fd: int, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return
        if _exited(fd, wait_s):
            return


def _watchdog(owner: int, grace_s: float, remove: str, pids: list[int]) -> None:
    owner_fd = _pidfd(owner) if os.getppid() == owner else None  # adopted: the owner is gone
    watched = [fd for fd in map(_pidfd, pids) if fd is not None]
    while owner_fd is not None and watched:
        ready = select.select([owner_fd, *watched], [], [])[0]
        watched = [fd for fd in watched if fd not in ready]
        if owner_fd in ready:
            break
    if not watched:
        return  # every watched process ended first: its owner stopped it
    for fd in watched:
        _stop(fd, grace_s)
    if remove:
        time.sleep(0.1)  # let a killed process's files be closed
        shutil.rmtree(remove, ignore_errors=True)


if __name__ == "__main__":
    # Ctrl-C in the owner's terminal reaches its process group; this one has its own
    # session, but ignore the keyboard's signals anyway: only the owner's end counts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _watchdog(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], [int(p) for p in sys.argv[4:]])
