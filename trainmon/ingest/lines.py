"""One console line taken apart: the launcher's rank prefix, a timestamp, the text.

Launchers and loggers put their own tags in front of a job's output: torchrun's
``--tee``/``--log-dir`` (``[default7]:``), PyTorch's rank prefix (``[rank3]:``), Open
MPI's ``--tag-output`` (``[1,3]<stdout>:``), ``srun --label`` (``3: ``), pdsh (the
DeepSpeed launcher's multi-node runs: ``node-12: ``), and most frameworks a timestamp. Every format parser sees the text with these removed, and
the rank and time they carried.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

_RANK_PREFIX = re.compile(
    r"^\s*(?:\[(?:default|rank)(\d+)\]:|\[1,(\d+)\]<std(?:out|err)>:|(\d{1,5}): )")
# 2024-05-01 12:00:00[,.]123456 with optional brackets, as Megatron-Core, NeMo,
# torchtitan and Python's logging print it at the start of a line.
# pdsh's host prefix. Only names shaped like hosts (a hyphen and a digit, or lower-case
# letters then digits, localhost, an IPv4 address), so "RuntimeError: ..." or "INFO: ..." are never taken for one.
_HOST_PREFIX = re.compile(
    r"^([A-Za-z][\w]*(?:[-.]\w+)*-\w*\d[\w.-]*|[a-z]+\d+|localhost|\d{1,3}(?:\.\d{1,3}){3}): ")
_TIMESTAMP = re.compile(
    r"^\s*(?:\[titan\]\s*)?\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,6}))?\]?\s?")
# Megatron's print_datetime: "[after megatron is initialized] datetime: 2026-04-10 16:34:09".
_MEGATRON_DATETIME = re.compile(r"^\[[^\]]+\] datetime: (\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)()")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass(frozen=True, slots=True)
class Line:
    text: str            # the line without prefixes, trailing newline or colour codes
    rank: int | None     # from a rank prefix, None when the line has none
    time: datetime | None  # from a leading timestamp, None when the line has none
    host: str | None = None  # from a pdsh prefix


def split_line(raw: str) -> Line:
    text = raw.rstrip("\r\n")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    rank = host = None
    m = _HOST_PREFIX.match(text)
    if m is not None:
        host, text = m.group(1), text[m.end():]
    # Prefixes nest ("[default7]:[rank7]: ..."): peel them all, the innermost rank wins.
    while True:
        m = _RANK_PREFIX.match(text)
        if m is None:
            break
        rank = int(next(g for g in m.groups() if g is not None))
        text = text[m.end():]
        if text[:1] == " ":
            # The space after "[rank4]:" belongs to the prefix: what follows keeps its own
            # indentation (a traceback's frames are indented, its exception line is not).
            text = text[1:]
    when = None
    if text[:1] in "[ " or text[:1].isdigit():
        m = _TIMESTAMP.match(text)
        if m is not None:
            when = _timestamp(m)
            if when is not None:
                text = text[m.end():]
    if when is None and text[:1] == "[" and "] datetime: " in text:
        m = _MEGATRON_DATETIME.match(text)
        if m is not None:
            when = _timestamp(m)  # the text stays whole: it is a line of its own
    return Line(text, rank, when, host)


def _timestamp(m: re.Match) -> datetime | None:
    year, month, day, hour, minute, second, frac = m.groups()
    try:
        micros = int((frac or "0").ljust(6, "0"))
        # Logs print local time without a zone; it is taken as UTC (the usual cluster
        # setting), so times stay deterministic when the same log is read again.
        return datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                        micros, tzinfo=timezone.utc)
    except ValueError:
        return None
