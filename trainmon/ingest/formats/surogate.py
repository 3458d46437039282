"""Surogate's JSON log, trainmon's own ``TRAINMON_LOG_FILE`` and ``trainmon ingest
--dry-run``: one object per record, ``log`` naming its kind::

    [
      {"log": "option", "time": "2026-01-15 10:29:58.1", "step": 0, "name": "lr", "value": 0.0002},
      {"log": "step", "time": "2026-01-15 10:30:00.123456789", "step": 100, "epoch": 1.25, "step_tokens": 16384, "duration_ms": 156, "norm": "nan", "loss": 2.3456, "lr": 0.0002},
      {"log": "eval", "time": "2026-01-15 10:31:00.5", "step": 100, "epoch": 1.25, "eval_tokens": 4096, "duration_ms": 20, "loss": 2.4}
    ]

Surogate keeps its file a JSON array (an object per line, ``[`` and ``]`` around);
trainmon writes JSON lines; a pretty-printed array spreads an object over many lines:
objects are read wherever their braces close. Fields the record model does not know
are dropped, and of the envelope only ``rank`` and ``time`` are kept (the session makes
its own). NaN and Infinity, as JSON constants or Surogate's strings, are kept.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

from ...schemas import RECORD_TYPES
from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser

# Surogate's kinds that are not trainmon records: options and the command line go into
# the run's config, the others (sol, info, abs-maxes, ...) are dropped.
_ALIASES = {"gpu-model": "gpu_model"}
_KINDS = {*RECORD_TYPES, *_ALIASES, "option", "cmd", "sol", "info", "abs-maxes"}
_ONE_LINE = re.compile(r'^\s*[\[,]?\s*\{.*"log"\s*:\s*"([\w-]+)"')
_PRETTY = re.compile(r'^\s*"log"\s*:\s*"([\w-]+)"\s*,?\s*$')
_TIME = re.compile(r"^(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?$")
_ENVELOPE = {"run_id", "rank", "world_size", "host", "time", "event_id", "schema_version"}
_MAX_OBJECT = 4 * 1024 * 1024  # characters; a brace that never closes is given up on


class SurogateParser(FormatParser):
    name = "surogate"
    description = "Surogate's JSON log, TRAINMON_LOG_FILE, trainmon ingest --dry-run"

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[str] = []   # the object being read, up to the current line
        self._size = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._line: Line | None = None  # the line the object started on

    @classmethod
    def detect(cls, line: Line) -> bool:
        m = _ONE_LINE.match(line.text) or _PRETTY.match(line.text)
        return m is not None and m.group(1) in _KINDS

    def feed(self, line: Line) -> list[Parsed]:
        out: list[Parsed] = []
        text, start = line.text, 0
        if self._depth > 0 and _ONE_LINE.match(text):
            # A new record while one is still open: the open one was cut off (a writer
            # killed mid-line); drop it rather than everything after it.
            self._reset()
        if self._depth == 0:
            start = _object_start(text, 0)
            if start is None:
                return out
            self._line = line
        i = start
        while i < len(text):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._parts.append(text[start:i + 1])
                    out += self._object("".join(self._parts))
                    self._parts, self._size = [], 0
                    # More objects may follow on the line: "}, {" or a one-line array.
                    nxt = _object_start(text, i + 1)
                    if nxt is None:
                        return out
                    start, i = nxt, nxt
                    continue
            i += 1
        self._parts.append(text[start:] + "\n")
        self._size += len(text) - start
        if self._size > _MAX_OBJECT:
            self._reset()
        return out

    def _reset(self) -> None:
        self._parts, self._size, self._depth = [], 0, 0
        self._in_string = self._escaped = False

    def _object(self, text: str) -> list[Parsed]:
        try:
            obj = json.loads(text)  # NaN, Infinity and -Infinity are accepted
        except (ValueError, RecursionError):
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("log"), str):
            return []
        kind = _ALIASES.get(obj["log"], obj["log"])
        if kind == "option" and isinstance(obj.get("name"), str):
            self.config[obj["name"]] = obj.get("value")
            return []
        if kind == "cmd":
            self.config["cmd"] = obj.get("cmd")
            return []
        if kind not in RECORD_TYPES:
            return []
        world = obj.get("world_size")
        if isinstance(world, int) and not isinstance(world, bool) and world > (self.world_size or 0):
            self.world_size = world
        rank = obj.get("rank")
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None
        line = self._line
        when = _time(obj.get("time")) or (line.time if line else None)
        rank = rank if rank is not None else (line.rank if line else None)
        known = RECORD_TYPES[kind].model_fields
        fields = {k: v for k, v in obj.items() if k in known and k not in _ENVELOPE}
        if kind == "run" and fields.get("event") == "start":
            # The session sends its own run start, with the parser's config: merge into it.
            if isinstance(fields.get("config"), dict):
                self.config.update(fields["config"])
            return []
        return [Parsed(kind, fields, rank, when)]


def _object_start(text: str, i: int) -> int | None:
    """Where the next object starts, skipping the array's own punctuation."""
    while i < len(text) and text[i] in " \t[],":
        i += 1
    return i if i < len(text) and text[i] == "{" else None


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    m = _TIME.match(value.strip())
    if m is None:
        return None
    day, clock, fraction, zone = m.groups()
    # fmt prints C++ clocks in nanoseconds; datetime keeps microseconds.
    text = f"{day}T{clock}" + (f".{fraction[:6].ljust(6, '0')}" if fraction else "")
    if zone:
        text += "+00:00" if zone == "Z" else zone
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)
