"""The engine's state on disk: one JSON file, replaced atomically, with the input offsets
it corresponds to, the partition each of its runs is read from, and how far into the alert
topic its incident book is.

A checkpoint is a consistent snapshot of the runs of the partitions in its offsets, so
whoever loads it uses it only for the partitions it is assigned: the service drops the
runs of the others (another engine of the group judges them) and replays those partitions
without a snapshot from their topics. Each member of a group writes its own file
(``checkpoint_path``'s ``member``): two engines sharing a ``state_dir`` would otherwise
keep overwriting each other's, which would cost warm windows, not correctness.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...filenames import safe_name

log = logging.getLogger("trainmon.alerts")
VERSION = 2  # 2: with the partition of each run (version 1 came from rank-keyed records)


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
    return Path(state_dir) / f"{safe_name(name)}.json"


def save(path: Path, checkpoint: Checkpoint) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One temporary file per writer: two engines in one process (a test) may share a path.
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    data = {"version": VERSION, "saved_at": checkpoint.saved_at, "offsets": checkpoint.offsets,
            "alert_offsets": {str(p): o for p, o in checkpoint.alert_offsets.items()},
            "run_partitions": checkpoint.run_partitions, "engine": checkpoint.engine}
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> Checkpoint | None:
    """The checkpoint, or None (with a warning saying why) when there is none to trust."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
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
