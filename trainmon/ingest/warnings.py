"""NCCL, CUDA, PyTorch and Python warnings and errors read from a log, counted per rank.

Format-independent, like failures.py: every line of every format passes through one
``WarningWatcher`` (after the launcher's rank / host / timestamp prefixes are taken off).
It picks up:

- NCCL's own warnings, ``host:pid:tid [0] misc/socket.cc:72 NCCL WARN socketProgress: ...``
  (source "nccl", level "warning");
- PyTorch's c10 log lines, ``[W328 16:19:30.667854656 ProcessGroupNCCL.cpp:1524] Warning: ...``
  or ``[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout``:
  W a warning, E / F an error; source "nccl" from a file with NCCL in its name, else "torch";
- NCCL errors (``NCCL error``, ``ncclUnhandledCudaError``, ``ncclSystemError``, ...): "nccl", error;
- the kernel driver's ``NVRM: Xid (PCI:0000:3b:00): 79, ...``: "xid", error;
- CUDA errors (``CUDA error: ...``, ``CUDA out of memory``, ``CUBLAS_STATUS_*``,
  ``CUDNN_STATUS_*``): "cuda", error;
- Python warnings as the warnings module prints them, ``/path/train.py:218: FutureWarning: ...``
  (any ``*Warning`` category): "python", warning.

Without flooding: repeats are counted per (rank, source, signature), the signature being
the message with numbers and hex addresses masked (an XID's is its code). A log_event
record goes out when a signature first appears on a rank and again when its count
reaches 2, 4, 8, 16, ..., each with the count so far, and once more at the end of the
log with the final count (when that was not just sent): a warning printed a million
times gives 21 records. Emission depends only on the lines and their order, never on
time, and each record's event id is derived from its rank, signature and count, so
reading a log again sends the same records with the same ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .parsed import Parsed

MAX_TEXT = 500        # the first occurrence's text, cut (LogEventRecord allows 2000)
MAX_SIGNATURE = 200
MAX_SIGNATURES = 10_000  # per log; further new signatures are not tracked (a bound for odd logs)

# (pattern, source, level, where the text starts), most specific first.
_C10 = re.compile(r"\[([WEF])(?:\d{3,4} [\d:.]+ | )([\w./-]+\.(?:cpp|cc|cu|h|hpp)):\d+\]\s*(.*)")
_NCCL_WARN = re.compile(r"\bNCCL WARN\s+(.*)")
_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
_NCCL_ERROR = re.compile(r"NCCL error|NCCL ERROR|nccl(?:InternalError|UnhandledCudaError|SystemError|"
                         r"RemoteError|InvalidUsage|InvalidArgument)")
_CUDA = re.compile(r"CUDA error\b|CUDA out of memory|CUBLAS_STATUS_[A-Z_]+|CUDNN_STATUS_[A-Z_]+")
_PY_WARNING = re.compile(r"(?:^|\s)\S+\.py:\d+: ([A-Z]\w*Warning): (.*)")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!x\?)")  # not in a name (FSDP2, v100x16) nor 0x?


def _maybe(text: str) -> bool:
    """A cheap test that a line may be one of the above (most lines are not): plain
    substring searches, a fraction of a regex search on a long line. A JSON record
    (trainmon's own log file, read back) is data, not a console line."""
    return ("NCCL" in text or "nccl" in text or "CU" in text or "Warning" in text or "Xid" in text
            or ".c" in text) and not text.startswith('{"')


@dataclass(frozen=True, slots=True)
class Found:
    source: str
    level: str
    text: str       # from where the warning starts (a launcher's or logger's prefix left out)
    signature: str


def signature(text: str) -> str:
    """The text with hex addresses and numbers masked (not digits inside a name),
    spaces collapsed, cut."""
    masked = _NUMBER.sub("N", _HEX.sub("0x?", text))
    return " ".join(masked.split())[:MAX_SIGNATURE]


def classify(text: str) -> Found | None:
    """What warning or error a line is, or None."""
    if not _maybe(text):
        return None
    if (m := _C10.search(text)) is not None:
        level = "warning" if m.group(1) == "W" else "error"
        source = "nccl" if "NCCL" in m.group(2) or "nccl" in m.group(2) else "torch"
        return Found(source, level, text[m.start():], signature(f"{m.group(2)}: {m.group(3)}"))
    if (m := _NCCL_WARN.search(text)) is not None:
        return Found("nccl", "warning", text[m.start():], signature(m.group(0)))
    if (m := _XID.search(text)) is not None:
        return Found("xid", "error", text[m.start():], f"Xid {m.group(2)}")
    if (m := _NCCL_ERROR.search(text)) is not None:
        return Found("nccl", "error", text[m.start():], signature(text[m.start():]))
    if (m := _CUDA.search(text)) is not None:
        return Found("cuda", "error", text[m.start():], signature(text[m.start():]))
    if (m := _PY_WARNING.search(text)) is not None:
        return Found("python", "warning", text[m.start():].strip(),
                     signature(f"{m.group(1)}: {m.group(2)}"))
    return None


@dataclass(slots=True)
class _Seen:
    found: Found
    count: int
    first_step: int | None
    last_step: int | None
    last_time: datetime | None
    host: str | None  # of the latest occurrence (pdsh's prefix), None: the session's
    sent: int = 0  # the count last sent


class WarningWatcher:
    """Feed it every line; ``feed`` and ``finish`` return the log_event records due, each
    with the key its event id is derived from (``key``)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str, str], _Seen] = {}

    def feed(self, text: str, rank: int, time: datetime | None, step: int | None,
             host: str | None = None) -> list[Parsed]:
        if not _maybe(text):  # most lines: one call, a few substring searches
            return []
        found = classify(text)
        if found is None:
            return []
        key = (rank, found.source, found.signature)
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= MAX_SIGNATURES:
                return []
            seen = self._seen[key] = _Seen(found, 0, step, step, time, host)
        seen.count += 1
        seen.last_step, seen.last_time, seen.host = step, time or seen.last_time, host
        if seen.count & (seen.count - 1):  # not a power of two
            return []
        return [self._record(rank, seen)]

    def finish(self) -> list[Parsed]:
        """The final counts not sent yet (the end of the log)."""
        return [self._record(rank, seen) for (rank, _, _), seen in self._seen.items()
                if seen.sent != seen.count]

    @staticmethod
    def _record(rank: int, seen: _Seen) -> Parsed:
        seen.sent = seen.count
        found = seen.found
        fields: dict[str, Any] = {"level": found.level, "source": found.source,
                                  "signature": found.signature, "text": found.text[:MAX_TEXT],
                                  "count": seen.count}
        if seen.first_step is not None:
            fields["first_step"] = seen.first_step
        if seen.last_step is not None:
            fields["last_step"] = seen.last_step
        return Parsed("log_event", fields, rank, seen.last_time, seen.host)


def event_key(p: Parsed) -> str:
    """What a log_event record's event id is derived from: its source, signature and count."""
    f = p.fields
    return f"{f['source']}\0{f['signature']}\0{f['count']}"
