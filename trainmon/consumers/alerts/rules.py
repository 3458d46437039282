"""The per-record rules: each looks at one record of one rank and reports an observation.

A rule keeps what it needs per rank (a rolling window) in ``rank.slots[rule.name]`` and
tells the incident book whether the record is bad or healthy; the book decides whether
that fires or resolves an incident. Cross-rank rules (straggler, rank mismatch, stall)
live in ranks.py.

A field the record does not carry (None: the framework did not log it) is no data: the
rule says nothing about that record, neither bad nor healthy, and keeps its window as it
was. NaN is data (logged, not finite): the non-finite rule judges it, the others skip it.
"""

from __future__ import annotations

import math
from typing import Any

from ...schemas import AlertRecord
from .config import RuleConfig
from .incidents import IncidentBook
from .state import RankState, RunState
from .stats import RollingMean, RollingMedian, TwoHalves

RUN = "run"  # subject of an incident that concerns the whole run


class Rule:
    name: str = ""
    kinds: tuple[str, ...] = ()
    whole_run = False  # observed for the run as a whole (tick rules), not per rank

    def __init__(self, name: str, cfg: RuleConfig, book: IncidentBook):
        self.name = name
        self.cfg = cfg
        self.book = book

    def observe(self, record, t: float, run: RunState, rank: RankState) -> AlertRecord | None:
        raise NotImplementedError

    # Per-rank state: created lazily, dumped to / loaded from JSON-able values.
    def new_state(self) -> Any:
        return None

    def dump_state(self, state: Any) -> Any:
        return state

    def load_state(self, data: Any) -> Any:
        return data

    # Run-wide state, for the rules that compare ranks.
    def dump_run_state(self, state: Any) -> Any:
        return state

    def load_run_state(self, data: Any) -> Any:
        return data

    def bad(self, run: RunState, rank: RankState, *, step, t, value, threshold, message,
            subject: str = RUN) -> AlertRecord | None:
        return self.book.bad(self.cfg, self.name, run.run_id, subject, rank.rank, step=step, time=t,
                             value=value, threshold=threshold, message=message,
                             world_size=rank.world_size, host=rank.host)

    def good(self, run: RunState, rank: RankState, *, step, t, value=None,
             subject: str = RUN) -> AlertRecord | None:
        if (self.name, run.run_id, subject) not in self.book.keys:
            return None  # the common case: nothing pending, nothing open
        return self.book.good(self.cfg, self.name, run.run_id, subject, rank.rank, step=step,
                              time=t, value=value)


def _g(x: float) -> str:
    return f"{x:.4g}"


# -- step records ------------------------------------------------------------------------

class WindowRule(Rule):
    """Compares a step field with a rolling statistic of its own recent values."""

    kinds = ("step",)
    window_type = RollingMedian

    def new_state(self):
        return self.window_type(self.cfg.window)

    def dump_state(self, state):
        return state.dump()

    def load_state(self, data):
        return self.window_type(self.cfg.window, data)


class BaselineRule(WindowRule):
    """Judges a step field against a limit set by a baseline (median or mean) of its recent
    values, then adds the value to the window. A rule gives the ``limit`` for a baseline and
    the ``detail`` of its alert (the text after "<what> on run R, rank N, step S: ")."""

    field, what, baseline = "", "", "median"
    above = True  # which side of the limit is bad
    skip_non_finite = True  # a NaN or inf value is neither judged nor kept (NaN never is)
    needs_positive_baseline = True  # a baseline <= 0 would make every value a spike: no verdict

    def observe(self, r, t, run, rank):
        value = getattr(r, self.field)
        if value is None or math.isnan(value) or (self.skip_non_finite and not math.isfinite(value)):
            return None
        window = rank.slot(self)
        out = None
        if len(window) >= self.cfg.min_samples:
            base = getattr(window, self.baseline)
            if base > 0 or not self.needs_positive_baseline:
                limit = self.limit(base)
                if self.breached(value, base, limit):
                    out = self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, message=(
                        f"{self.what} on run {run.run_id}, rank {rank.rank}, step {r.step}: "
                        f"{self.detail(value, base)}"))
                else:
                    out = self.good(run, rank, step=r.step, t=t, value=value)
        window.push(value)
        return out

    def breached(self, value, base, limit) -> bool:
        return (value > limit) if self.above else (value < limit)


class GradSpikeRule(BaselineRule):
    window_type, baseline = RollingMean, "mean"
    field, what = "norm", "grad norm spike"

    def limit(self, mean):
        return self.cfg.factor * mean

    def detail(self, norm, mean):
        return (f"{_g(norm)} is {norm / mean:.1f}x its moving average {_g(mean)} "
                f"(limit {self.cfg.factor:g}x)")


class LossSpikeRule(BaselineRule):
    field, what = "loss", "loss spike"

    def limit(self, median):
        return (1.0 + self.cfg.rise) * median

    def detail(self, loss, median):
        return (f"{_g(loss)} is {100 * (loss / median - 1):.0f}% above the recent median "
                f"{_g(median)} (limit +{100 * self.cfg.rise:g}%)")


class IterationTimeSpikeRule(BaselineRule):
    field, what = "duration_ms", "iteration time spike"
    skip_non_finite = False  # an inf duration is judged (a NaN or absent one is not)
    needs_positive_baseline = False  # a zero median (all-zero durations) reports healthy

    def limit(self, median):
        return self.cfg.factor * median

    def breached(self, duration, median, limit):
        return median > 0 and duration > limit

    def detail(self, duration, median):
        return (f"{duration:.0f} ms is {duration / median:.1f}x the recent median "
                f"{median:.0f} ms (limit {self.cfg.factor:g}x)")


class ThroughputDropRule(BaselineRule):
    field, what, above = "tokens_per_second", "throughput drop", False
    needs_positive_baseline = False  # a zero median gives a limit of 0: judged, so healthy

    def limit(self, median):
        return (1.0 - self.cfg.drop) * median

    def detail(self, tps, median):
        return (f"{tps:,.0f} tokens/s is {100 * (1 - tps / median):.0f}% below the recent "
                f"median {median:,.0f} (limit -{100 * self.cfg.drop:g}%)")


class NonFiniteRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        # An absent grad norm (not logged) is not a non-finite one: only the loss is judged.
        loss_ok = r.loss is None or math.isfinite(r.loss)
        norm_ok = r.norm is None or math.isfinite(r.norm)
        if loss_ok and norm_ok:
            return self.good(run, rank, step=r.step, t=t)
        what = " and ".join(f"{name} is {value}" for name, value, ok in
                            (("loss", r.loss, loss_ok), ("grad norm", r.norm, norm_ok)) if not ok)
        return self.bad(run, rank, step=r.step, t=t, value=r.norm if loss_ok else r.loss,
                        threshold=None, message=(
                            f"non-finite values on run {run.run_id}, rank {rank.rank}, "
                            f"step {r.step}: {what}"))


class ExplodingGradRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        norm, limit = r.norm, self.cfg.threshold
        if norm is None or not math.isfinite(norm):
            return None
        if norm > limit:
            return self.bad(run, rank, step=r.step, t=t, value=norm, threshold=limit, message=(
                f"exploding gradients on run {run.run_id}, rank {rank.rank}, step {r.step}: "
                f"grad norm {_g(norm)} > {_g(limit)}"))
        return self.good(run, rank, step=r.step, t=t, value=norm)


class DeadGradientsRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        if r.norm is None:
            return None
        if r.norm == 0.0:
            return self.bad(run, rank, step=r.step, t=t, value=0.0, threshold=0.0, message=(
                f"dead gradients on run {run.run_id}, rank {rank.rank}: grad norm is 0 at step "
                f"{r.step} ({self.cfg.fire_after} steps in a row)"))
        return self.good(run, rank, step=r.step, t=t, value=r.norm)


class LossPlateauRule(WindowRule):
    window_type = TwoHalves

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        halves = rank.slot(self)
        halves.push(loss)
        if not halves.full:
            return None
        older, newer = halves.older_median, halves.newer_median
        limit = older * (1.0 - self.cfg.min_decrease)
        if newer >= limit:
            trend = "rising" if newer > older else "flat"
            return self.bad(run, rank, step=r.step, t=t, value=newer, threshold=limit, message=(
                f"loss {trend} on run {run.run_id} (rank {rank.rank}): median {_g(newer)} over the "
                f"last {halves.half} steps vs {_g(older)} over the {halves.half} before, "
                f"up to step {r.step}"))
        return self.good(run, rank, step=r.step, t=t, value=newer)


class LrZeroRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        if r.lr is None or r.step < self.cfg.after_step:
            return None
        if r.total_steps and r.step >= r.total_steps * (1.0 - self.cfg.final_fraction):
            return None
        if r.lr <= 0.0:
            return self.bad(run, rank, step=r.step, t=t, value=r.lr, threshold=0.0, message=(
                f"learning rate stuck at {r.lr:g} on run {run.run_id}, rank {rank.rank}, "
                f"step {r.step} (after warmup, step >= {self.cfg.after_step})"))
        return self.good(run, rank, step=r.step, t=t, value=r.lr)


class LossScaleCollapseRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        scale = r.loss_scale
        if scale is None:
            return None
        if scale <= self.cfg.min_scale:
            return self.bad(run, rank, step=r.step, t=t, value=scale, threshold=self.cfg.min_scale,
                            message=(f"loss scale collapsed on run {run.run_id}, rank {rank.rank}, "
                                     f"step {r.step}: {scale:g} <= {self.cfg.min_scale:g} "
                                     f"(repeated fp16 overflows)"))
        return self.good(run, rank, step=r.step, t=t, value=scale)


class NumZerosRule(Rule):
    kinds = ("step",)

    def observe(self, r, t, run, rank):
        if r.num_zeros is None or not r.num_params:
            return None
        fraction = r.num_zeros / r.num_params
        if fraction > self.cfg.max_fraction:
            return self.bad(run, rank, step=r.step, t=t, value=fraction,
                            threshold=self.cfg.max_fraction, message=(
                                f"{100 * fraction:.0f}% of gradients are zero on run {run.run_id}, "
                                f"rank {rank.rank}, step {r.step} ({r.num_zeros:,} of "
                                f"{r.num_params:,}; limit {100 * self.cfg.max_fraction:g}%)"))
        return self.good(run, rank, step=r.step, t=t, value=fraction)


# -- GPU records: one incident per GPU ------------------------------------------------------

class GpuRule(Rule):
    kinds = ("gpu",)

    def observe(self, r, t, run, rank):
        subject = f"rank{rank.rank}/gpu{r.id}"
        problem = self.problem(r)
        if problem is None:
            return self.good(run, rank, step=r.step, t=t, subject=subject)
        value, threshold, text = problem
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=threshold, subject=subject,
                        message=f"GPU {r.id} of rank {rank.rank} on {rank.host} (run {run.run_id}, "
                                f"step {r.step}): {text}")

    def problem(self, r) -> tuple[float, float | None, str] | None:
        raise NotImplementedError


class GpuTemperatureRule(GpuRule):
    def problem(self, r):
        if r.temp_slowdown <= 0:
            return None
        limit = r.temp_slowdown - self.cfg.margin_c
        if r.temperature >= limit:
            return r.temperature, limit, (f"temperature {r.temperature} C at or above "
                                          f"{limit:g} C (slowdown at {r.temp_slowdown} C)")
        return None


class GpuThrottleRule(GpuRule):
    def problem(self, r):
        reasons = [x for x in r.throttle.split(",") if x and x not in self.cfg.ignore]
        if reasons:
            return float(len(reasons)), None, (f"clocks throttled ({', '.join(reasons)}), "
                                               f"{r.clock} of {r.max_clock} MHz")
        return None


class GpuUnderutilizedRule(GpuRule):
    def problem(self, r):
        if r.gpu_util < self.cfg.min_util:
            return float(r.gpu_util), self.cfg.min_util, (
                f"utilization {r.gpu_util}% below {self.cfg.min_util:g}% for at least "
                f"{self.cfg.fire_after_s:g} s")
        return None


class GpuMemoryLowRule(GpuRule):
    def problem(self, r):
        if r.dram_free < self.cfg.min_free_bytes:
            return float(r.dram_free), float(self.cfg.min_free_bytes), (
                f"free memory nearly gone: {r.dram_free / 2**20:,.0f} MiB free "
                f"(limit {self.cfg.min_free_bytes / 2**20:,.0f} MiB)")
        return None


# -- MoE router records ----------------------------------------------------------------------

class MoeRule(Rule):
    kinds = ("moe",)
    field = ""
    above = True
    label = ""

    def observe(self, r, t, run, rank):
        value, limit = getattr(r, self.field), self.cfg.threshold
        if value is None or not math.isfinite(value):
            return None
        if (value > limit) if self.above else (value < limit):
            relation = ">" if self.above else "<"
            return self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, message=(
                f"MoE {self.label} on run {run.run_id}, rank {rank.rank}, step {r.step}: "
                f"{_g(value)} {relation} {_g(limit)}"))
        return self.good(run, rank, step=r.step, t=t, value=value)


class MoeAuxLossRule(MoeRule):
    field, label = "aux_loss", "aux loss high"


class MoeZLossRule(MoeRule):
    field, label = "z_loss", "z-loss high"


class MoeExpertUtilizationRule(MoeRule):
    field, above, label = "expert_utilization", False, "expert utilization low"


class MoeLoadImbalanceRule(MoeRule):
    field, label = "load_imbalance", "load imbalance high"
