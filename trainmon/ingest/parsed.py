"""What a format parser yields: a record kind and its fields, before the envelope."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(slots=True)
class Parsed:
    kind: str                     # a key of trainmon.schemas.RECORD_TYPES
    fields: dict[str, Any]        # the record's own fields (no envelope)
    rank: int | None = None       # None: rank 0 (the line had no rank prefix)
    time: datetime | None = None  # None: no timestamp in the log; the session uses now
    host: str | None = None       # None: the host of the line that completed the record
