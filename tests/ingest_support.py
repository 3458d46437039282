"""What the ingest tests share: the real-log corpus (tests/data/logs, see PROVENANCE.md)
and a Session run in memory, as ``trainmon ingest`` would run it."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import yaml

from trainmon.ingest import Session

LOGS = Path(__file__).parent / "data" / "logs"
LABELS = yaml.safe_load((LOGS / "LABELS.yaml").read_text())
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def raw_lines(name: str) -> list[str]:
    """A corpus log's lines (``name`` may hold wildcards, for one file), as
    reader.read_file gives them: split on "\\n" only, carriage returns left to the session
    (progress bars)."""
    (path,) = LOGS.glob(name)
    return path.read_bytes().decode("utf-8", errors="replace").split("\n")


def ingest(lines, fmt: str = "auto") -> tuple[Session, list]:
    """The records a Session makes of these lines, and the session (format, counts)."""
    records: list = []
    session = Session("test-run", records.append, fmt=fmt, host="test-host", clock=lambda: NOW)
    for line in lines:
        session.feed(line)
    session.finish()
    return session, records


def by_step(records, kind: str) -> dict:
    return {r.step: r for r in records if r.kind == kind}


def of_kind(records, kind: str) -> list:
    return [r for r in records if r.kind == kind]
