"""Dates a log's step lines that carry no timestamp of their own from the log's clock.

Megatron-DeepSpeed prints its iteration lines without a time, and around them lines that
have one (``[before the start of training step] datetime: 2026-04-10 17:04:40``, a
launcher's ``[2026-04-10 17:10:41,749] [INFO] ...``). The first step after a timestamp is
dated at it plus its iteration time (``elapsed time per iteration`` x the iterations the
line covers); each later one at the step before plus its own. So a backfill keeps the
run's own timeline -- what the goodput views measure -- instead of the moment the log
was read. A step whose number goes back (a restart in the same log) starts again from
the latest timestamp.

Later timestamps do not move a running sequence: a parser holds a step until its timer
lines are read, so a step can reach the session after a timestamped line printed after
it ("[after training is done] datetime: ..."), and would be dated past it. The price: a
stall between two undated steps does not show (one before a run's end does: the end is
dated at the log's latest timestamp). A step without a step time, or before any
timestamp, is left undated (the session dates it when read).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta


class StepClock:
    def __init__(self) -> None:
        self._anchor: datetime | None = None  # the latest timestamp the log printed
        self._last: tuple[int, datetime] | None = None  # the step dated last, and its time

    def saw_time(self, when: datetime) -> None:
        self._anchor = when

    def date(self, step: object, duration_ms: object) -> datetime | None:
        if self._anchor is None or type(step) is not int or not isinstance(duration_ms, (int, float)) \
                or not math.isfinite(duration_ms) or duration_ms < 0:
            return None
        if self._last is None or step <= self._last[0]:
            # the first step read, or the first of a restart: one iteration after the
            # latest timestamp (a log interval of 10 would print its 10th first: not known)
            when = max(self._anchor, self._last[1]) if self._last else self._anchor
            when += timedelta(milliseconds=duration_ms)
        else:
            when = self._last[1] + timedelta(milliseconds=(step - self._last[0]) * duration_ms)
        self._last = (step, when)
        return when
