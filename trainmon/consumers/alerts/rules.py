"""The per-record rules: each looks at one record of one rank and reports an observation.

A rule keeps what it needs per rank (a rolling window) in ``rank.slots[rule.name]`` and
tells the incident book whether the record is bad or healthy; the book decides whether
that fires or resolves an incident. Cross-rank rules (straggler, rank mismatch, stall)
live in ranks.py; plain threshold rules are data (thresholds.py) run by ``ThresholdRule``.

Rules that compare a value with the run's own history (``BaselineRule``) judge from the
first records on: the median of what there is (and, from ``min_samples`` points, a robust
z-score from its MAD), with a guard for order-of-magnitude jumps that needs a single
earlier record. A value judged bad is kept out of the baseline, so a spike or a slow
stretch never becomes the new normal: the incident stays open while the condition holds.
Messages say how much history the verdict had.

A field the record does not carry (None: the framework did not log it) is no data: the
rule says nothing about that record, neither bad nor healthy, and keeps its window as it
was. NaN is data (logged, not finite): the non-finite rule judges it, the others skip it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from ...schemas import AlertRecord
from .config import RuleConfig
from .incidents import IncidentBook
from .state import RankState, RunState
from .stats import RollingMedian, TwoHalves
from .thresholds import BY_NAME, OPS

RUN = "run"  # subject of an incident that concerns the whole run
_INFS = (math.inf, -math.inf)
OP_WORDS = {">": "above", ">=": "at or above", "<": "below", "<=": "at or below", "==": "is"}


class Rule:
    name: str = ""
    kinds: tuple[str, ...] = ()
    whole_run = False  # observed for the run as a whole (tick rules), not per rank
    lasting = False  # its incidents outlive the run's end (resolved when the run starts again)
    worse_when_higher = True  # for escalations: which way a value gets worse

    def __init__(self, name: str, cfg: RuleConfig, book: IncidentBook):
        self.name = name
        self.cfg = cfg
        self.book = book

    def observe(self, record, t: float, run: RunState, rank: RankState):
        """An AlertRecord, a list of them, or None."""
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
            subject: str = RUN, severity: str | None = None, fire_now: bool = False,
            check_stale: bool = True):
        return self.book.bad(self.cfg, self.name, run.run_id, subject, rank.rank, step=step, time=t,
                             value=value, threshold=threshold, message=message,
                             world_size=rank.world_size, host=rank.host, severity=severity,
                             fire_now=fire_now, check_stale=check_stale,
                             escalates=self._escalation(value))

    def good(self, run: RunState, rank: RankState, *, step, t, value=None,
             subject: str = RUN) -> AlertRecord | None:
        if (self.name, run.run_id, subject) not in self.book.keys:
            return None  # the common case: nothing pending, nothing open
        return self.book.good(self.cfg, self.name, run.run_id, subject, rank.rank, step=step,
                              time=t, value=value)

    def _escalation(self, value):
        """Whether ``value`` is ``escalate_factor`` times worse than an open incident's."""
        factor = self.cfg.escalate_factor
        if factor is None or value is None or not (0 < value < math.inf):
            return None
        higher = self.worse_when_higher

        def escalates(alert: AlertRecord) -> bool:
            fired = alert.value
            if fired is None or not (0 < fired < math.inf):
                return False
            return value >= factor * fired if higher else value <= fired / factor
        return escalates


def _g(x: float) -> str:
    return f"{x:.4g}"


def history(n: int) -> str:
    """How much history a verdict had, for the message."""
    return "its 1 earlier record" if n == 1 else f"its last {n} records"


# -- baselines of the run's own values ------------------------------------------------------

class BaselineRule(Rule):
    """A field judged against the median of its own recent accepted values (the run's own
    scale). ``judge`` returns None (no verdict), False (healthy) or (limit, detail,
    fire_now). Values before ``min_samples`` all enter the window (a baseline still
    forming is no scale to hold a value out of); after that a bad one does not."""

    kinds = ("step",)
    field, what = "", ""
    skip_inf = True  # an infinite value is not judged (non_finite's business)

    def new_state(self):
        return RollingMedian(self.cfg.window)

    def dump_state(self, state):
        return state.dump()

    def load_state(self, data):
        return RollingMedian(self.cfg.window, data)

    def __init__(self, name: str, cfg: RuleConfig, book: IncidentBook):
        super().__init__(name, cfg, book)
        self.forming = getattr(cfg, "min_samples", 3)

    def observe(self, r, t, run, rank):
        value = getattr(r, self.field)
        if value is None or value != value or (self.skip_inf and value in _INFS):
            return None  # not logged, NaN, or (skip_inf) infinite
        window = rank.slots.get(self.name)
        if window is None:
            window = rank.slot(self)
        return self.judge_into(window, value, r, t, run, rank)

    def judge_into(self, window: RollingMedian, value: float, r, t, run, rank):
        verdict = self.judge(value, window) if window.values else None
        if not verdict:
            if value not in _INFS:
                window.push(value)
            if verdict is None:
                return None
            return self.good(run, rank, step=r.step, t=t, value=value)
        if len(window.values) < self.forming and value not in _INFS:
            window.push(value)
        limit, detail, fire_now = verdict
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, fire_now=fire_now,
                        message=f"{self.what} on run {run.run_id}, rank {rank.rank}, step {r.step}: {detail}")

    def judge(self, value: float, window: RollingMedian):
        raise NotImplementedError


class GradSpikeRule(BaselineRule):
    field, what = "norm", "grad norm spike"

    def judge(self, norm, w):
        cfg, med, n = self.cfg, w.median, len(w.values)
        if med <= 0:
            return None
        ratio = norm / med
        if ratio >= cfg.jump:
            return cfg.jump * med, (f"{_g(norm)} is {ratio:.1f}x the median {_g(med)} of {history(n)} "
                                    f"(an order-of-magnitude jump: limit {cfg.jump:g}x)"), False
        if n >= cfg.min_samples and ratio >= cfg.factor:
            z = w.robust_z(norm)
            if z >= cfg.min_z:
                return cfg.factor * med, (f"{_g(norm)} is {ratio:.1f}x the median {_g(med)} of "
                                          f"{history(n)}, robust z {z:.1f} (limits {cfg.factor:g}x "
                                          f"and z {cfg.min_z:g})"), False
        return False


class ExplodingGradRule(BaselineRule):
    field, what = "norm", "exploding gradients"

    def judge(self, norm, w):
        med = w.median
        if med <= 0:
            return None
        if norm >= self.cfg.factor * med:
            return self.cfg.factor * med, (
                f"grad norm {_g(norm)} is {norm / med:.0f}x the run's own scale (median {_g(med)} of "
                f"{history(len(w))}) on {self.cfg.fire_after} records in a row (limit "
                f"{self.cfg.factor:g}x)"), False
        return False


class LossSpikeRule(BaselineRule):
    field, what = "loss", "loss spike"

    def judge(self, loss, w):
        cfg, med, n = self.cfg, w.median, len(w.values)
        if med <= 0:
            return None  # a loss that can be negative has no ratio to judge
        ratio = loss / med
        if ratio >= 1.0 + cfg.jump:
            return (1.0 + cfg.jump) * med, (
                f"{_g(loss)} is {ratio:.1f}x the median {_g(med)} of {history(n)} (a jump: limit "
                f"+{100 * cfg.jump:g}%)"), True
        if n >= cfg.min_samples and ratio >= 1.0 + cfg.rise:
            z = w.robust_z(loss)
            if z >= cfg.min_z:
                return (1.0 + cfg.rise) * med, (
                    f"{_g(loss)} is {100 * (ratio - 1):.0f}% above the median {_g(med)} of "
                    f"{history(n)}, robust z {z:.1f}, on {cfg.fire_after} records in a row (limits "
                    f"+{100 * cfg.rise:g}% and z {cfg.min_z:g})"), False
        return False


class IterationTimeSpikeRule(BaselineRule):
    field, what = "duration_ms", "iteration time spike"
    skip_inf = False  # an infinite step time is judged

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


class ThroughputDropRule(BaselineRule):
    """Throughput by what the job logs: tokens/s, else TFLOP/s per GPU, else samples/s (the
    global batch over the step time). Step time alone is not throughput: a batch-size
    schedule makes steps slower while the job goes faster (iteration_time_spike watches it).
    Each measure, and each batch size, has its own baseline."""

    what = "throughput drop"
    worse_when_higher = False

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

    def new_state(self):
        return {}

    def dump_state(self, state):
        return {unit: w.dump() for unit, w in state.items()}

    def load_state(self, data):
        return {unit: RollingMedian(self.cfg.window, values) for unit, values in data.items()}

    def observe(self, r, t, run, rank):
        got = self.measure(r)
        if got is None:
            return None
        unit, value = got
        if not math.isfinite(value):
            return None
        windows = rank.slot(self)
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


def eval_set(st, step: int) -> int:
    """Which eval set an eval record is, by its order within its step: a job with several
    eval sets (HF Trainer's ``eval_<name>_loss``) evaluates them in the same order each
    time, and their losses are not comparable with each other. ``st`` has ``step``, ``i``."""
    if st.step == step:
        st.i += 1
    else:
        st.step, st.i = step, 0
    return st.i


class EvalSets:
    __slots__ = ("step", "i", "sets")

    def __init__(self, step=None, i=0, sets=None):
        self.step, self.i, self.sets = step, i, sets or {}


class EvalLossSpikeRule(BaselineRule):
    """Eval loss against the median of the recent evals of the same eval set."""

    kinds = ("eval",)
    field, what = "loss", "eval loss spike"

    def new_state(self):
        return EvalSets()

    def dump_state(self, st):
        return [st.step, st.i, [[i, w.dump()] for i, w in st.sets.items()]]

    def load_state(self, data):
        step, i, sets = data
        return EvalSets(step, i, {k: RollingMedian(self.cfg.window, v) for k, v in sets})

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        st = rank.slot(self)
        i = eval_set(st, r.step)
        window = st.sets.get(i)
        if window is None:
            window = st.sets[i] = RollingMedian(self.cfg.window)
        self.which = f" (eval set {i + 1} of the step)" if i or len(st.sets) > 1 else ""
        return self.judge_into(window, loss, r, t, run, rank)

    def judge(self, loss, w):
        med, n = w.median, len(w.values)
        if n < self.cfg.min_samples or med <= 0:
            return None
        limit = (1.0 + self.cfg.rise) * med
        if loss >= limit:
            return limit, (f"eval loss {_g(loss)}{self.which} is {100 * (loss / med - 1):.0f}% above "
                           f"the median {_g(med)} of its last {n} evals (limit "
                           f"+{100 * self.cfg.rise:g}%)"), False
        return False


class MoeRouterLossRule(BaselineRule):
    kinds = ("moe",)

    def judge(self, value, w):
        med, n = w.median, len(w.values)
        if n < self.cfg.min_samples or med <= 0:
            return None
        limit = (1.0 + self.cfg.rise) * med
        if value >= limit:
            return limit, (f"{_g(value)} is {100 * (value / med - 1):.0f}% above the median {_g(med)} "
                           f"of {history(n)}, on {self.cfg.fire_after} records in a row (limit "
                           f"+{100 * self.cfg.rise:g}%)"), False
        return False


class MoeAuxLossRule(MoeRouterLossRule):
    field, what = "aux_loss", "MoE aux (load-balancing) loss rising"


class MoeZLossRule(MoeRouterLossRule):
    field, what = "z_loss", "MoE router z-loss rising"


# -- trends and repeats ----------------------------------------------------------------------

class DivergenceState:
    __slots__ = ("halves", "best", "diverging")

    def __init__(self, window: int, values=(), best=None, diverging=False):
        self.halves = TwoHalves(window, values)
        self.best = best
        self.diverging = diverging


class LossDivergenceRule(Rule):
    """A sustained rise: the median of the newer half of the last ``window`` losses is
    ``rise`` above the run's best such median and above the older half's. Medians make it
    blind to single spikes, so it still sees a rise that follows an explosion. Once
    diverging, it stays so until the loss comes back near its best or clearly falls."""

    kinds = ("step",)

    def new_state(self):
        return DivergenceState(self.cfg.window)

    def dump_state(self, st):
        return [st.halves.dump(), st.best, st.diverging]

    def load_state(self, data):
        values, best, diverging = data
        return DivergenceState(self.cfg.window, values, best, diverging)

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        st = rank.slot(self)
        st.halves.push(loss)
        if not st.halves.full:
            return None
        older, newer = st.halves.older_median, st.halves.newer_median
        if st.best is None or newer < st.best:
            st.best = newer
        best, rise = st.best, self.cfg.rise
        if best <= 0:
            return None
        limit = (1.0 + rise) * best
        if st.diverging:
            st.diverging = newer >= limit and newer >= older * (1.0 - rise)
        else:
            st.diverging = newer >= limit and newer > older
        if not st.diverging:
            return self.good(run, rank, step=r.step, t=t, value=newer)
        half = st.halves.half
        return self.bad(run, rank, step=r.step, t=t, value=newer, threshold=limit, message=(
            f"loss diverging on run {run.run_id}, rank {rank.rank}, step {r.step}: median "
            f"{_g(newer)} over the last {half} records is {100 * (newer / best - 1):.0f}% above the "
            f"run's best {_g(best)} (limit +{100 * rise:g}%) and not falling ({_g(older)} over "
            f"the {half} before)"))


class FrozenState:
    __slots__ = ("step", "value", "count", "since")

    def __init__(self, step=None, value=None, count=0, since=None):
        self.step, self.value, self.count, self.since = step, value, count, since


class FrozenValueRule(Rule):
    """The same value, bit for bit, on ``repeats`` new steps in a row: a number that is no
    longer computed (a stale logger, a frozen graph). Zero is left to the zero rules."""

    kinds = ("step",)
    field, label = "", ""

    def new_state(self):
        return FrozenState()

    def dump_state(self, st):
        return [st.step, st.value, st.count, st.since]

    def load_state(self, data):
        return FrozenState(*data)

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


class FrozenGradNormRule(FrozenValueRule):
    field, label = "norm", "grad norm"


class FrozenLossRule(FrozenValueRule):
    field, label = "loss", "training loss"


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


class LossPlateauRule(Rule):
    kinds = ("step",)

    def new_state(self):
        return TwoHalves(self.cfg.window)

    def dump_state(self, state):
        return state.dump()

    def load_state(self, data):
        return TwoHalves(self.cfg.window, data)

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


class EvalState(EvalSets):
    __slots__ = ("train",)

    def __init__(self, window: int, train=(), step=None, i=0, sets=None):
        super().__init__(step, i, sets)
        self.train = RollingMedian(window, train)  # sets: i -> [best, best_step, train_at_best]


class EvalDivergenceRule(Rule):
    """Eval loss rising above its best while the training loss keeps falling: overfitting
    (or an eval set that drifted from the training data). Each eval set on its own."""

    kinds = ("step", "eval")

    def new_state(self):
        return EvalState(self.cfg.train_window)

    def dump_state(self, st):
        return [st.train.dump(), st.step, st.i, [[i, v] for i, v in st.sets.items()]]

    def load_state(self, data):
        train, step, i, sets = data
        return EvalState(self.cfg.train_window, train, step, i, {k: v for k, v in sets})

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        st = rank.slot(self)
        if r.kind == "step":
            st.train.push(loss)
            return None
        i = eval_set(st, r.step)
        train = st.train.median if len(st.train.values) else None
        best = st.sets.get(i)
        if best is None or loss < best[0]:
            st.sets[i] = [loss, r.step, train]
            return self.good(run, rank, step=r.step, t=t, value=loss)
        best_loss, best_step, train_at_best = best
        if train is None or train_at_best is None or best_loss <= 0:
            return None
        limit = (1.0 + self.cfg.rise) * best_loss
        if loss >= limit and train < train_at_best:
            which = f" (eval set {i + 1} of the step)" if i or len(st.sets) > 1 else ""
            return self.bad(run, rank, step=r.step, t=t, value=loss, threshold=limit, message=(
                f"eval loss rising while the training loss falls on run {run.run_id}, rank "
                f"{rank.rank}, step {r.step}: eval {_g(loss)}{which} is "
                f"{100 * (loss / best_loss - 1):.1f}% above its best {_g(best_loss)} at step {best_step} "
                f"(limit +{100 * self.cfg.rise:g}%, {self.cfg.fire_after} evals in a row) while the "
                f"training loss fell from {_g(train_at_best)} to {_g(train)} (median of the last "
                f"{len(st.train.values)} steps): overfitting?"))
        return self.good(run, rank, step=r.step, t=t, value=loss)


# -- fp16 loss scaling, skipped iterations ----------------------------------------------------

class ScaleState:
    __slots__ = ("fp16", "recent")

    def __init__(self, fp16=False, recent=()):
        self.fp16 = fp16
        self.recent: deque = deque(tuple(x) for x in recent)  # (step, value)


def _trim(recent: deque, step: int, window: int) -> None:
    """Keep the entries of the last ``window`` iterations before ``step``, and always the
    latest (a log interval longer than the window still compares with the record before)."""
    if recent and step < recent[-1][0]:
        recent.clear()  # the step count went back: a restart from a checkpoint
    while len(recent) > 1 and recent[0][0] <= step - window:
        recent.popleft()


class LossScaleCollapseRule(Rule):
    """fp16 dynamic loss scaling collapsing: repeated overflows halve the scale step after
    step. Only a run whose loss scale was ever other than 1.0 is fp16: bf16 and fp32 runs
    print a constant 1.0 (Megatron), which never alerts."""

    kinds = ("step",)
    worse_when_higher = False

    def new_state(self):
        return ScaleState()

    def dump_state(self, st):
        return [st.fp16, [list(x) for x in st.recent]]

    def load_state(self, data):
        return ScaleState(*data)

    def observe(self, r, t, run, rank):
        scale = r.loss_scale
        if scale is None or math.isnan(scale):
            return None
        st = rank.slot(self)
        if scale != 1.0:
            st.fp16 = True
        if not st.fp16:
            return None
        cfg = self.cfg
        if r.step <= cfg.warmup_steps:
            return None  # the scaler calibrates from its initial scale: skipped_iterations says so
        _trim(st.recent, r.step, cfg.window_steps)
        before = max((v for _, v in st.recent), default=None)
        st.recent.append((r.step, scale))
        if scale <= cfg.min_scale:
            return self.bad(run, rank, step=r.step, t=t, value=scale, threshold=cfg.min_scale, message=(
                f"fp16 loss scale collapsed on run {run.run_id}, rank {rank.rank}, step {r.step}: "
                f"{scale:g} <= {cfg.min_scale:g} (repeated overflows)"))
        if before is not None and before > 0 and scale <= before / cfg.drop_factor:
            return self.bad(run, rank, step=r.step, t=t, value=scale, threshold=before / cfg.drop_factor,
                            message=(f"fp16 loss scale collapsing on run {run.run_id}, rank {rank.rank}, "
                                     f"step {r.step}: {scale:g} is {before / scale:.0f}x below {before:g} "
                                     f"within the last {cfg.window_steps} iterations (limit "
                                     f"{cfg.drop_factor:g}x: an overflow cascade)"))
        return self.good(run, rank, step=r.step, t=t, value=scale)


class SkippedIterationsRule(Rule):
    """Iterations the optimizer skipped (fp16 overflows, NaN/inf gradients): Megatron's
    ``skipped`` counter per logged interval, or 1 per skipped step."""

    kinds = ("step",)

    def new_state(self):
        return deque()

    def dump_state(self, recent):
        return [list(x) for x in recent]

    def load_state(self, data):
        return deque(tuple(x) for x in data)

    def observe(self, r, t, run, rank):
        if r.skipped is None:
            return None
        cfg = self.cfg
        recent = rank.slot(self)
        if recent and recent[-1][0] == r.step:
            recent.pop()  # the same step again
        _trim(recent, r.step, cfg.window_steps)
        recent.append((r.step, r.skipped))
        warmup = r.step <= cfg.warmup_steps
        # After the warm-up, its skipped iterations no longer count.
        since = r.step - cfg.window_steps if warmup else max(r.step - cfg.window_steps, cfg.warmup_steps)
        total = sum(n for s, n in recent if s > since)
        if total < cfg.max_skipped:
            return self.good(run, rank, step=r.step, t=t, value=float(total))
        scale = f", loss scale {r.loss_scale:g}" if r.loss_scale is not None else ""
        why = ("; at the start of the run: the fp16 loss scale calibrating (info)" if warmup
               else ": overflows in a row (fp16) or non-finite gradients")
        return self.bad(run, rank, step=r.step, t=t, value=float(total), threshold=float(cfg.max_skipped),
                        severity="info" if warmup else None, message=(
                            f"{total} iterations skipped on run {run.run_id}, rank {rank.rank} in "
                            f"the last {cfg.window_steps} up to step {r.step} (limit {cfg.max_skipped}"
                            f"{scale}){why}"))


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


# -- run records ----------------------------------------------------------------------------

class RunFailedRule(Rule):
    """A run end with status failed (or aborted: warning), with its reason. Other topics
    may still hold the rank's last records when its end arrives, so the failure is noted
    here and judged when the engine applies the ends (``on_ends``, on its next tick, once
    every partition is read): the alert then knows the last step, and names every rank that
    failed by then with its reason (the first failure, usually the cause, first). The
    incident stays open after the run's end and resolves when the run starts again."""

    kinds = ("run",)
    lasting = True

    def observe(self, r, t, run, rank):
        if r.event != "end":
            return None
        failures = run.slots.setdefault(self.name, {})
        if r.status in ("failed", "aborted"):
            failures[rank.rank] = (r.status, (r.reason or "no reason given")[:1000], t)
        else:
            failures.pop(rank.rank, None)
        return None

    def on_ends(self, run: RunState, ranks: list[int]):
        failures = run.slots.get(self.name) or {}
        ended = sorted((failures[rk][2], rk) for rk in ranks if rk in failures)
        if not ended:
            return None
        first = run.ranks[ended[0][1]]
        statuses = {failures[rk][0] for _, rk in ended}
        status = "failed" if "failed" in statuses else "aborted"
        by_reason: dict[str, list[int]] = {}
        for _, rk in ended:
            by_reason.setdefault(failures[rk][1], []).append(rk)
        parts = [f"{_ranks(rks)}{f' ({run.ranks[rks[0]].host})' if len(rks) == 1 else ''}: {reason}"
                 for reason, rks in by_reason.items()]
        step = run.max_step if run.max_step >= 0 else None
        where = f"after step {step}" if step is not None else "before its first step"
        out = None
        for i, (t, rk) in enumerate(ended):
            found = self.book.bad(self.cfg, self.name, run.run_id, RUN, rk, step=step, time=ended[0][0],
                                  value=None, threshold=None, world_size=first.world_size,
                                  host=first.host, check_stale=False,
                                  severity=None if status == "failed" else "warning",
                                  ranks=[r for _, r in ended] if i == 0 else None,
                                  message=f"run {run.run_id} {status} {where}: " + "; ".join(parts))
            out = out or found
        return out

    def dump_run_state(self, failures):
        return [[rk, status, reason, t] for rk, (status, reason, t) in failures.items()]

    def load_run_state(self, data):
        return {rk: (status, reason, t) for rk, status, reason, t in data}


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return f"ranks {', '.join(spans)}"


# -- threshold rules (thresholds.py) ----------------------------------------------------------

class ThresholdRule(Rule):
    """One entry of thresholds.THRESHOLD_RULES: ``<field> <op> <threshold>``."""

    def __init__(self, name: str, cfg: RuleConfig, book: IncidentBook):
        super().__init__(name, cfg, book)
        self.spec = BY_NAME[name]
        self.kinds = (self.spec.kind,)
        self.op = OPS[self.spec.op]
        self.field = None if "/" in self.spec.field else self.spec.field

    def observe(self, r, t, run, rank):
        spec = self.spec
        value = getattr(r, self.field) if self.field else spec.value(r)
        if value is None or value != value:
            return None
        limit = spec.threshold if spec.param is None else getattr(self.cfg, spec.param)
        subject = f"rank{rank.rank}/gpu{r.id}" if spec.per_gpu else RUN
        if not self.op(value, limit):
            return self.good(run, rank, step=r.step, t=t, value=value, subject=subject)
        if spec.per_gpu:
            where = f"GPU {r.id} of rank {rank.rank} on {rank.host} (run {run.run_id}, step {r.step})"
        else:
            where = f"run {run.run_id}, rank {rank.rank}, step {r.step}"
        than = "" if spec.op == "==" else f" {OP_WORDS[spec.op]} {spec.show(limit)}"
        held = []
        if self.cfg.fire_after > 1:
            held.append(f"{self.cfg.fire_after} records in a row")
        if self.cfg.fire_after_s:
            held.append(f"for {self.cfg.fire_after_s:g} s")
        if spec.detail and (shown := getattr(r, spec.detail, None)) is not None:
            held.insert(0, f"{spec.detail} {shown}")
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, subject=subject,
                        message=(f"{spec.name.replace('_', ' ')} on {where}: {spec.what} "
                                 f"{'is ' if spec.op == '==' else ''}{spec.show(value)}{than}"
                                 f"{' (' + ', '.join(held) + ')' if held else ''}"))


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
