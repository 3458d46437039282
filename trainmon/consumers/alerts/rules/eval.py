"""Eval-loss rules: a spike against the recent evals of the same eval set, eval rising
while the training loss falls (overfitting), and the training loss far above the latest
eval (a blow-up judged without a history of training losses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig
from ..stats import RollingMedian
from .base import Rule, sig4
from .baseline import MedianRiseRule
from .codec import window, windows


def eval_set(st, step: int) -> int:
    """Which eval set an eval record is, by its order within its step: a job with several
    eval sets (HF Trainer's ``eval_<name>_loss``) evaluates them in the same order each
    time, and their losses are not comparable with each other. ``st`` has ``step``, ``i``."""
    if st.step == step:
        st.i += 1
    else:
        st.step, st.i = step, 0
    return st.i


class EvalLossSpike(RuleConfig):
    rise: float = Field(0.1, gt=0)  # eval loss >= (1 + rise) x the median of recent evals
    window: int = Field(5, ge=2)
    min_samples: int = Field(2, ge=1)


@dataclass(slots=True)
class EvalSets:
    step: Optional[int] = None  # the step of the latest eval record
    i: int = 0  # its eval set: its order within that step
    sets: dict[int, RollingMedian] = windows("window")  # eval set -> its recent losses


class EvalLossSpikeRule(MedianRiseRule, name="eval_loss_spike", config=EvalLossSpike):
    """Eval loss against the median of the recent evals of the same eval set."""

    kinds = ("eval",)
    field, what = "loss", "eval loss spike"
    restarts_with_steps = True  # (base.Rule)
    rank_state = EvalSets
    fires_when = ("eval loss >= (1 + {rise}) x the median of its last {window} evals (from "
                  "{min_samples} evals); several eval sets logged at one step (HF Trainer's "
                  "`eval_<name>_loss`) are told apart by their order within the step")
    catches = "an eval that got suddenly worse"
    checked_on = ("silent on nanogpt-tinystories-50m-healthy.log and the modded-nanogpt logs (val "
                  "every 125-250 steps)")

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

    def rise_detail(self, loss, med, n):
        return (f"eval loss {sig4(loss)}{self.which} is {100 * (loss / med - 1):.0f}% above "
                f"the median {sig4(med)} of its last {n} evals (limit +{100 * self.cfg.rise:g}%)")


class EvalDivergence(RuleConfig):
    # eval loss >= (1 + rise) x its best so far while the train loss (median of the last
    # `train_window` step losses) is below what it was at that best eval: overfitting.
    rise: float = Field(0.02, gt=0)
    train_window: int = Field(20, ge=1)
    fire_after: int = Field(2, ge=1)  # evals in a row
    clear_after: int = Field(1, ge=1)


@dataclass(slots=True)
class BestEval:
    loss: float
    step: int
    train: Optional[float]  # the training loss (median) at that eval; None: none logged yet


@dataclass(slots=True)
class EvalBests:
    train: RollingMedian = window("train_window")  # the latest training losses
    step: Optional[int] = None  # as in EvalSets
    i: int = 0
    bests: dict[int, BestEval] = field(default_factory=dict)  # eval set -> its best eval


class EvalDivergenceRule(Rule, name="eval_divergence", config=EvalDivergence):
    """Eval loss rising above its best while the training loss keeps falling: overfitting
    (or an eval set that drifted from the training data). Each eval set on its own."""

    kinds = ("step", "eval")
    rank_state = EvalBests
    restarts_with_steps = True  # (base.Rule)
    fires_when = ("eval loss >= (1 + {rise}) x its best so far (per eval set) while the training "
                  "loss (median of its last {train_window} steps) is below what it was at that best "
                  "eval, on {fire_after.value} evals in a row")
    catches = "overfitting: eval rising while the training loss falls"
    checked_on = "tests/test_alerts_rules.py; silent on the corpus logs with evals"

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
        best = st.bests.get(i)
        if best is None or loss < best.loss:
            st.bests[i] = BestEval(loss, r.step, train)
            return self.good(run, rank, step=r.step, t=t, value=loss)
        if train is None or best.train is None or best.loss <= 0:
            return None
        limit = (1.0 + self.cfg.rise) * best.loss
        if loss >= limit and train < best.train:
            which = f" (eval set {i + 1} of the step)" if i or len(st.bests) > 1 else ""
            return self.bad(run, rank, step=r.step, t=t, value=loss, threshold=limit, message=(
                f"eval loss rising while the training loss falls on run {run.run_id}, rank "
                f"{rank.rank}, step {r.step}: eval {sig4(loss)}{which} is "
                f"{100 * (loss / best.loss - 1):.1f}% above its best {sig4(best.loss)} at step "
                f"{best.step} (limit +{100 * self.cfg.rise:g}%, {self.cfg.fire_after} evals in a row) "
                f"while the training loss fell from {sig4(best.train)} to {sig4(train)} (median of "
                f"the last {len(st.train.values)} steps): overfitting?"))
        return self.good(run, rank, step=r.step, t=t, value=loss)


class TrainAboveEval(RuleConfig):
    # train loss >= (1 + rise) x the latest eval loss (the highest of the eval sets of its
    # step) on `fire_after` records in a row.
    rise: float = Field(1.0, gt=0)
    fire_after: int = Field(2, ge=1)


@dataclass(slots=True)
class LatestEval:
    step: Optional[int] = None  # as in EvalSets
    i: int = 0
    loss: Optional[float] = None  # the highest eval loss of the latest eval step


class TrainAboveEvalRule(Rule, name="train_loss_above_eval", config=TrainAboveEval):
    """The training loss against the latest validation loss: the two measure the same model
    on the same kind of data, so a training loss far above the last eval says the model
    changed for the worse since, and needs no baseline of training losses (a follow
    started mid-run, a restarted engine, a resumed run that loaded the wrong weights)."""

    kinds = ("step", "eval")
    rank_state = LatestEval
    restarts_with_steps = True  # (base.Rule)
    fires_when = ("training loss >= (1 + {rise}) x the latest eval loss (the highest of the eval "
                  "sets of its step) on {fire_after.value} records in a row")
    catches = ("a blow-up after the last eval, seen from the first training records after it: "
               "no history of training losses needed")
    checked_on = ("tests/test_alerts_first_records.py; silent on the corpus logs with evals (the "
                  "modded-nanogpt single-step outliers 5.07 at 946 against val 3.4 are 1.5x)")

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        st = rank.slot(self)
        if r.kind == "eval":
            # Several eval sets (HF Trainer's eval_<name>_loss) need not be the training
            # data: the hardest of them is the one a training loss must not be far above.
            if eval_set(st, r.step) == 0 or st.loss is None:
                st.loss = loss
            else:
                st.loss = max(st.loss, loss)
            return None
        latest = st.loss
        if latest is None or latest <= 0:
            return None  # no eval yet, or a loss that can be negative: no ratio to judge
        limit = (1.0 + self.cfg.rise) * latest
        if loss < limit:
            return self.good(run, rank, step=r.step, t=t, value=loss)
        return self.bad(run, rank, step=r.step, t=t, value=loss, threshold=limit, message=(
            f"training loss far above the latest eval on run {run.run_id}, rank {rank.rank}, "
            f"step {r.step}: {sig4(loss)} is {loss / latest:.1f}x the eval loss {sig4(latest)} at "
            f"step {st.step} (limit {1 + self.cfg.rise:g}x, {self.cfg.fire_after} records in a row)"))
