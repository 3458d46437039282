"""Speed rules: steps several times slower than the run's own, throughput dropping."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig, Severity
from ..stats import RollingMedian
from .base import history
from .baseline import BaselineRule
from .codec import window, windows


class IterationTimeSpike(RuleConfig):
    severity: Severity = "info"
    factor: float = Field(3.0, gt=1)  # step time > factor x median of the last `window`
    window: int = Field(50, ge=2)
    # The first steps of a run (compilation, allocator and data-loader warm-up, ranks
    # settling into lockstep) are no steady state to compare with.
    min_samples: int = Field(10, ge=1)
    fire_after: int = Field(3, ge=1)


@dataclass(slots=True)
class StepTimes:
    window: RollingMedian = window("window")
    batch: Optional[int] = None  # the global batch size of the latest step that logged one


class IterationTimeSpikeRule(BaselineRule, name="iteration_time_spike", config=IterationTimeSpike):
    """Step time against the run's own. A batch-size schedule makes steps slower by design
    (4x the batch, some 4x the step time): steps of another batch size are no baseline,
    and a slow step kept out of the window would hold the incident open for the rest of
    the run. When the logged global batch size changes, the baseline starts again."""

    field, what = "duration_ms", "iteration time spike"
    restarts_with_steps = True  # (base.Rule)
    skip_inf = False  # an infinite step time is judged
    rank_state = StepTimes
    fires_when = ("step time > {factor} x the median of the last {window} steps before the slow "
                  "ones (from {min_samples}: the first steps of a run are warm-up) on "
                  "{fire_after.value} steps in a row; stays open while the steps stay slow; a "
                  "change of the logged `global_batch_size` starts the baseline again")
    catches = "steps several times slower, for a while"
    checked_on = ("silent on nanogpt-tinystories-50m-healthy.log (a 12 s eval/checkpoint iteration "
                  "every 250 of 0.6 s)")

    def observe(self, r, t, run, rank):
        batch = r.global_batch_size
        if batch and r.duration_ms is not None:
            st = rank.slot(self)
            if st.batch is not None and batch != st.batch:  # another batch: another step time
                st.window = RollingMedian(self.cfg.window)
            st.batch = batch
        return super().observe(r, t, run, rank)

    def judge(self, duration, w):
        med, n = w.median, len(w.values)
        if n < self.cfg.min_samples:
            return None
        if med <= 0:
            return False  # all-zero durations: nothing to compare with, healthy
        if duration > self.cfg.factor * med:
            return self.cfg.factor * med, (
                f"{duration:.0f} ms is {duration / med:.1f}x the median {med:.0f} ms of {history(n)} "
                f"before the slow steps, on {self.cfg.fire_after} steps in a row (limit "
                f"{self.cfg.factor:g}x)"), False
        return False


class ThroughputDrop(RuleConfig):
    # tokens/s, else TFLOP/s, else samples (global batch) / step time, < (1 - drop) x the
    # median of the last `window` records measured the same way.
    drop: float = Field(0.25, gt=0, lt=1)
    window: int = Field(50, ge=2)
    min_samples: int = Field(3, ge=1)
    fire_after: int = Field(2, ge=1)
    fire_after_s: float = Field(60.0, ge=0)


@dataclass(slots=True)
class Throughputs:
    by_measure: dict[str, RollingMedian] = windows("window")  # "tokens/s", ... -> its baseline


class ThroughputDropRule(BaselineRule, name="throughput_drop", config=ThroughputDrop):
    """Throughput by what the job logs: tokens/s, else TFLOP/s per GPU, else samples/s (the
    global batch over the step time). Step time alone is not throughput: a batch-size
    schedule makes steps slower while the job goes faster (iteration_time_spike watches it).
    Each measure, and each batch size, has its own baseline."""

    what = "throughput drop"
    restarts_with_steps = True  # (base.Rule)
    worse_when_higher = False
    rank_state = Throughputs
    fires_when = ("tokens/s, else TFLOP/s per GPU, else samples/s (`global_batch_size` / step "
                  "time) < (1 - {drop}) x the median of its last {window} records measured the same "
                  "way (from {min_samples}), for {fire_after.value} records and {fire_after_s} s; "
                  "step time alone is not judged")
    catches = "the job getting slower: a sick node, thermal throttling, a slow input pipeline"
    checked_on = ("megatron-llm-slow-iterations-two-excerpts.log (1,024 samples in 127 s instead of "
                  "88 s from iteration 182: fires at 183); silent on "
                  "modded-nanogpt-baseline-2026-batch-schedule-healthy.log, whose steps go 33 -> 59 "
                  "-> 85 ms by its batch-size schedule")

    @staticmethod
    def measure(r) -> tuple[str, float] | None:
        if r.tokens_per_second is not None:
            return "tokens/s", r.tokens_per_second
        if r.tflops_per_gpu is not None:
            return "TFLOP/s per GPU", r.tflops_per_gpu
        ms = r.duration_ms
        if r.global_batch_size and ms is not None and 0 < ms < math.inf:
            return f"samples/s (global batch {r.global_batch_size})", r.global_batch_size * 1000.0 / ms
        return None

    def observe(self, r, t, run, rank):
        got = self.measure(r)
        if got is None:
            return None
        unit, value = got
        if not math.isfinite(value):
            return None
        windows = rank.slot(self).by_measure
        window = windows.get(unit)
        if window is None:
            window = windows[unit] = RollingMedian(self.cfg.window)
        self.unit = unit
        return self.judge_into(window, value, r, t, run, rank)

    def judge(self, value, w):
        med, n = w.median, len(w.values)
        if n < self.cfg.min_samples or med <= 0:
            return None
        limit = (1.0 - self.cfg.drop) * med
        if value < limit:
            return limit, (f"{value:,.4g} {self.unit} is {100 * (1 - value / med):.0f}% below the "
                           f"median {med:,.4g} of {history(n)} before the drop, for "
                           f"{self.cfg.fire_after} records and {self.cfg.fire_after_s:g} s (limit "
                           f"-{100 * self.cfg.drop:g}%)"), False
        return False
