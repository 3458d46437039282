"""The engine's state on disk: one JSON file, replaced atomically, with the input offsets
it corresponds to and the end of the alert topic at that moment."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("trainmon.alerts")
VERSION = 1


@dataclass
class Checkpoint:
    engine: dict
    offsets: dict[str, int]  # "topic:partition" -> next offset to read
    alert_offsets: dict[int, int]  # alert topic partition -> its end when this was written
    saved_at: float = field(default_factory=time.time)


def checkpoint_path(state_dir: Path, group_id: str, topic_prefix: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{group_id}@{topic_prefix}")
    return Path(state_dir) / f"{safe}.json"


def save(path: Path, checkpoint: Checkpoint) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data = {"version": VERSION, "saved_at": checkpoint.saved_at, "offsets": checkpoint.offsets,
            "alert_offsets": {str(p): o for p, o in checkpoint.alert_offsets.items()},
            "engine": checkpoint.engine}
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
                      saved_at=data["saved_at"])
