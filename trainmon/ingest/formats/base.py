"""The contract of a log format: recognise a line, turn lines into records."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ..lines import Line
from ..parsed import Parsed


class FormatParser:
    """One instance per log being read; it may keep state across lines (a step held
    until its timer lines arrive, a hard-wrapped line being joined).

    ``feed`` returns what a line completes; ``flush`` returns whatever is still held
    (called when the log goes quiet while following it, and at its end). Run-level
    facts a log prints (the world size, the arguments) go into ``world_size`` and
    ``config``; the session puts them into the envelope and the run start record.
    """

    name: ClassVar[str] = "plain"  # the base reads no records: only how the run ended
    description: ClassVar[str] = "any log: run endings only"

    def __init__(self) -> None:
        self.world_size: int | None = None
        self.config: dict[str, Any] = {}
        self.finished = False  # the log said training completed normally
        # The last line fed was one of the format's own data lines (an iteration, a timer):
        # the session then spares it the scans for warnings and failures, which such a
        # line never is (most of a log's lines, so most of the time of a backfill).
        self.claimed = False

    @classmethod
    def detect(cls, line: Line) -> bool:
        """True when this line is unmistakably of this format."""
        raise NotImplementedError

    def feed(self, line: Line) -> list[Parsed]:
        return []

    def flush(self) -> list[Parsed]:
        return []


def number(text: str) -> float:
    """A float as logs print it: '1.5E-05', 'nan', '-inf', '1,234.5'."""
    try:
        return float(text)  # surrounding spaces are fine; the common case, so tried first
    except ValueError:
        return float(text.replace(",", ""))


def integer(text: str) -> int | None:
    value = number(text)
    return int(value) if math.isfinite(value) else None


def try_number(text: str) -> float | None:
    """number(), or None for text that is not a number (a field the parser skips)."""
    try:
        return number(text)
    except ValueError:
        return None


def try_integer(text: str) -> int | None:
    value = try_number(text)
    return int(value) if value is not None and math.isfinite(value) else None
