"""Rules that judge a value against the run's own recent values (its baseline).

They judge from the first records on: the median of what there is (and, from
``min_samples`` points, a robust z-score from its MAD), with a guard for
order-of-magnitude jumps that needs a single earlier record. A value judged bad is kept
out of the baseline, so a spike or a slow stretch never becomes the new normal: the
incident stays open while the condition holds. Messages say how much history the verdict
had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..stats import RollingMedian
from .base import Rule
from .codec import window

INFINITIES = (math.inf, -math.inf)


@dataclass(slots=True)
class Baseline:
    window: RollingMedian = window("window")


class BaselineRule(Rule):
    """A field judged against the median of its own recent accepted values (the run's own
    scale). ``judge`` returns None (no verdict), False (healthy) or (limit, detail,
    fire_now). Values before ``min_samples`` all enter the window (a baseline still
    forming is no scale to hold a value out of); after that a bad one does not."""

    kinds = ("step",)
    field, what = "", ""
    skip_inf = True  # an infinite value is not judged (non_finite's business)
    rank_state = Baseline

    def __init__(self, name, cfg, book):
        super().__init__(name, cfg, book)
        self.forming = getattr(cfg, "min_samples", 3)

    def observe(self, r, t, run, rank):
        value = getattr(r, self.field)
        if value is None or value != value or (self.skip_inf and value in INFINITIES):
            return None  # not logged, NaN, or (skip_inf) infinite
        st = rank.slots.get(self.name)
        if st is None:
            st = rank.slot(self)
        return self.judge_into(st.window, value, r, t, run, rank)

    def judge_into(self, window: RollingMedian, value: float, r, t, run, rank):
        verdict = self.judge(value, window) if window.values else None
        if not verdict:
            if value not in INFINITIES:
                window.push(value)
            if verdict is None:
                return None
            return self.good(run, rank, step=r.step, t=t, value=value)
        if len(window.values) < self.forming and value not in INFINITIES:
            window.push(value)
        limit, detail, fire_now = verdict
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, fire_now=fire_now,
                        message=f"{self.what} on run {run.run_id}, rank {rank.rank}, step {r.step}: {detail}")

    def judge(self, value: float, window: RollingMedian):
        raise NotImplementedError


class MedianRiseRule(BaselineRule):
    """Bad at ``(1 + rise)`` x the median of the window, once it holds ``min_samples``
    values: a level that rises (an eval loss, a router loss) rather than spikes."""

    def judge(self, value, w):
        med, n = w.median, len(w.values)
        if n < self.cfg.min_samples or med <= 0:
            return None
        limit = (1.0 + self.cfg.rise) * med
        if value >= limit:
            return limit, self.rise_detail(value, med, n), False
        return False

    def rise_detail(self, value: float, median: float, n: int) -> str:
        """The message's account of a rise, after "<what> on run R, rank K, step S: "."""
        raise NotImplementedError
