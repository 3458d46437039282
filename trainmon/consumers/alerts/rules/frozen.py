"""The shared shape of frozen_grad_norm (grad.py) and frozen_loss (loss.py): the same
value, bit for bit, on ``repeats`` new steps in a row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .base import Rule


@dataclass(slots=True)
class Repeats:
    step: Optional[int] = None  # the latest step judged
    value: Optional[float] = None
    count: int = 0  # steps in a row with ``value``
    since: Optional[int] = None  # the first of them


class FrozenValueRule(Rule):
    """The same value, bit for bit, on ``repeats`` new steps in a row: a number that is no
    longer computed (a stale logger, a frozen graph). Zero is left to the zero rules."""

    kinds = ("step",)
    field, label = "", ""
    rank_state = Repeats

    def observe(self, r, t, run, rank):
        value = getattr(r, self.field)
        if value is None or not math.isfinite(value):
            return None
        st = rank.slot(self)
        if st.step is not None and r.step == st.step:
            return None  # the same step again (resent, or logged by several processes)
        if value == 0.0:
            st.step, st.value, st.count = r.step, None, 0
            return None
        if st.step is not None and r.step > st.step and value == st.value:
            st.count += 1
        else:
            st.value, st.count, st.since = value, 1, r.step
        st.step = r.step
        if st.count < self.cfg.repeats:
            return self.good(run, rank, step=r.step, t=t, value=value)
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=float(self.cfg.repeats),
                        message=(f"{self.label} frozen on run {run.run_id}, rank {rank.rank}: exactly "
                                 f"{value!r} on {st.count} logged steps in a row, steps {st.since}-"
                                 f"{r.step} (limit {self.cfg.repeats}): it is no longer computed"))
