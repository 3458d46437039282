"""Static consumer-group membership: a restarted consumer gets its partitions back at once.

A dynamic member killed with -9 never leaves its group: its partitions stay with the dead
member until the broker's session timeout (45 s with kafka-python's defaults) ends it, and
a restarted process waits that long, or longer, for its first assignment. A static member
(KIP-345, ``group.instance.id``) that rejoins under the same instance id simply replaces
its dead self, within a second or two.

kafka-python 3.0.12 supports it (JoinGroup v5-v7 carry ``group_instance_id``, a static
member sends no LeaveGroup on close, a fenced duplicate gets FencedInstanceIdError). The
price: an instance id must be unique within its group, or the broker fences one of two
processes sharing it, and a static member that stops for good keeps its partitions until
the session timeout.

The id defaults to ``<group>-<hostname>`` (``trainmon-clickhouse-node7``), stable across
restarts; ``TRAINMON_KAFKA_GROUP_INSTANCE_ID`` replaces it (``off`` for dynamic
membership). A second process of the same group on the same host -- two services, a test
running two in one group -- takes ``<id>-2`` (then ``-3`` ...): each id is held by a file
lock (``flock``, released by the kernel even on kill -9) in the system temp directory, so
a restarted process gets the lowest free id, normally its own old one.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
from pathlib import Path

log = logging.getLogger("trainmon.consumers")

ENV = "TRAINMON_KAFKA_GROUP_INSTANCE_ID"
OFF = {"off", "none", "0", "false", "no"}
MAX_SLOTS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class InstanceId:
    """One claimed instance id; ``release()`` (or process exit) frees it for the next."""

    def __init__(self, value: str | None, fd: int | None = None):
        self.value = value
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def base_id(group_id: str, env: dict | None = None) -> str | None:
    """The instance id this process would like in ``group_id``; None for dynamic membership."""
    env = os.environ if env is None else env
    configured = env.get(ENV)
    if configured is not None:
        configured = configured.strip()
        if configured.lower() in OFF:
            return None
        if configured:
            return _safe(configured)
    return _safe(f"{group_id}-{socket.gethostname()}")


def claim(group_id: str, env: dict | None = None, lock_dir: Path | None = None) -> InstanceId:
    """The lowest free instance id of ``group_id`` on this host, held until release."""
    base = base_id(group_id, env)
    if base is None:
        return InstanceId(None)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one process per group and host, please
        return InstanceId(base)
    directory = lock_dir or Path(tempfile.gettempdir()) / "trainmon-group-members"
    try:
        directory.mkdir(exist_ok=True)
        try:
            os.chmod(directory, 0o1777)  # shared by every user of this host, like /tmp
        except OSError:
            pass
    except OSError as exc:
        log.warning("trainmon: cannot create %s (%s); using instance id %s unguarded",
                    directory, exc, base)
        return InstanceId(base)
    for slot in range(1, MAX_SLOTS + 1):
        value = base if slot == 1 else f"{base}-{slot}"
        path = directory / _safe(f"{group_id}--{value}.lock")
        try:
            # Read-only is enough for flock, and opens another user's lock file too.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if slot > 1:
            log.info("trainmon: instance id %s is in use on this host; this process is %s",
                     base, value)
        return InstanceId(value, fd)
    log.warning("trainmon: %d instance ids of group %s are in use on this host; joining as a "
                "dynamic member", MAX_SLOTS, group_id)
    return InstanceId(None)


def _safe(text: str) -> str:
    """Kafka takes [A-Za-z0-9._-] in a group.instance.id, 249 characters at most."""
    return _UNSAFE.sub("_", text)[:200]
