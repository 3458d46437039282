"""The delivered-state file: what was already delivered, so that a replay of the alert
topic (a restart after kill -9, a rebalance, a group reset) does not deliver it again.

An append-only JSON-lines log, fsync'd line by line, written right after each delivery
succeeded (and before an action runs: an action runs at most once). Keys name the
channel and the event (``json://h#alert-...-firing``). It also keeps the incidents
firing at Alertmanager, which it must re-post until they resolve -- across restarts,
since their firing events are behind the committed offsets. Rewritten compactly when it
grows.

What it cannot close: a delivery that succeeded and a kill -9 before its line is written
is delivered again at the restart. Every message carries the event ids, so a receiver
can drop that one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("trainmon.notify")

COMPACT_AFTER_LINES = 20_000
KEEP_DELIVERED = 10_000  # the newest keys kept at compaction: replays reach only so far back


class DeliveredLog:
    def __init__(self, path: Path):
        self.path = path
        self.delivered: dict[str, None] = {}  # ordered: compaction keeps the newest
        self.firing: dict[str, dict] = {}  # incident id -> the alert posted to Alertmanager
        self.lines = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if path.exists():
            torn = self._load()
        self._file = open(path, "a", encoding="utf-8")
        if torn:  # end the torn line: the next entry must not be appended onto it
            self._file.write("\n")
            self._file.flush()

    def _load(self) -> bool:
        """Whether the file ends in a torn line (no newline)."""
        text = self.path.read_text(encoding="utf-8")
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                log.warning("trainmon notify: %s ends in a torn line (a kill mid-write); ignored", self.path)
                continue
            self._apply(entry)
            self.lines += 1
        return bool(text) and not text.endswith("\n")

    def _apply(self, entry: dict) -> None:
        if "delivered" in entry:
            self.delivered.update(dict.fromkeys(entry["delivered"]))
        elif "firing" in entry:
            self.firing[entry["firing"]["incident_id"]] = entry["firing"]
        elif "ended" in entry:
            self.firing.pop(entry["ended"], None)

    def __contains__(self, key: str) -> bool:
        return key in self.delivered

    def mark(self, keys: list[str]) -> None:
        """These deliveries done, in one line: a message's events are marked all or none."""
        self._write({"delivered": list(keys)})

    def set_firing(self, alert: dict) -> None:
        self._write({"firing": alert})

    def end_firing(self, incident_id: str) -> None:
        self._write({"ended": incident_id})

    def _write(self, entry: dict) -> None:
        self._apply(entry)
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.lines += 1
        if self.lines > COMPACT_AFTER_LINES:
            self.compact()

    def compact(self) -> None:
        """Rewrite the log as what it holds now (atomically: a crash leaves the old one)."""
        keys = list(self.delivered)[-KEEP_DELIVERED:]
        self.delivered = dict.fromkeys(keys)
        entries = [{"delivered": keys}] + [{"firing": a} for a in self.firing.values()]
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(e) + "\n" for e in entries)
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self.lines = len(entries)

    def close(self) -> None:
        self._file.close()
