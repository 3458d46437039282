"""Training-loss rules: a spike against the run's own level, a sustained rise (divergence),
a plateau, a loss that stopped changing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig, Severity
from ..stats import TwoHalves
from .base import Rule, history, sig4
from .baseline import BaselineRule
from .codec import window
from .frozen import FrozenValueRule


class LossSpike(RuleConfig):
    # loss >= (1 + rise) x the median of the last `window` accepted losses (from
    # `min_samples` on) with a robust z-score >= min_z, on `fire_after` records in a row;
    # or >= (1 + jump) x that median on one record, from the first earlier record on.
    rise: float = Field(0.2, gt=0)
    jump: float = Field(1.0, gt=0)
    min_z: float = Field(3.5, ge=0)
    window: int = Field(50, ge=3)
    min_samples: int = Field(3, ge=1)
    fire_after: int = Field(2, ge=1)


class LossSpikeRule(BaselineRule, name="loss_spike", config=LossSpike):
    field, what = "loss", "loss spike"
    restarts_with_steps = True  # (base.Rule)
    fires_when = ("loss >= (1 + {rise}) x the median of its last {window} accepted losses with a "
                  "robust z >= {min_z} (from {min_samples} records) on {fire_after.value} records in "
                  "a row, or >= (1 + {jump}) x that median on one record, from the second record on")
    catches = ("a jump of the loss that lasts; one noisy batch that recovers on the next step does "
               "not fire")
    checked_on = ("silent on modded-nanogpt-valueembed-record-train-loss-healthy.log (single-step "
                  "outliers 4.82 at 918 and 5.07 at 946 among 3.5-4.0; the old rule fired at 918)")

    def judge(self, loss, w):
        cfg, med, n = self.cfg, w.median, len(w.values)
        if med <= 0:
            return None  # a loss that can be negative has no ratio to judge
        ratio = loss / med
        if ratio >= 1.0 + cfg.jump:
            return (1.0 + cfg.jump) * med, (
                f"{sig4(loss)} is {ratio:.1f}x the median {sig4(med)} of {history(n)} (a jump: limit "
                f"+{100 * cfg.jump:g}%)"), True
        if n >= cfg.min_samples and ratio >= 1.0 + cfg.rise:
            z = w.robust_z(loss)
            if z >= cfg.min_z:
                return (1.0 + cfg.rise) * med, (
                    f"{sig4(loss)} is {100 * (ratio - 1):.0f}% above the median {sig4(med)} of "
                    f"{history(n)}, robust z {z:.1f}, on {cfg.fire_after} records in a row (limits "
                    f"+{100 * cfg.rise:g}% and z {cfg.min_z:g})"), False
        return False


class LossJump(RuleConfig):
    # loss >= (1 + rise / sqrt(k)) x the previous record's, k the steps between them (at
    # most `max_interval`), from step `after_step` on.
    rise: float = Field(1.0, gt=0)
    max_interval: int = Field(100, ge=1)
    after_step: int = Field(100, ge=0)


@dataclass(slots=True)
class Previous:
    step: Optional[int] = None
    loss: Optional[float] = None


class LossJumpRule(Rule, name="loss_jump", config=LossJump):
    """A rise of the loss from one logged record to the next, measured against the logging
    interval: Megatron and the HF Trainer log the average over the interval's k steps,
    whose noise shrinks as 1/sqrt(k), so a rise that is noise between two single steps is
    a change of level between two 100-step averages. Two records suffice: it judges the
    first records of a follow started mid-run, where ``loss_spike`` has no baseline yet."""

    kinds = ("step",)
    rank_state = Previous
    fires_when = ("loss >= (1 + {rise} / sqrt(k)) x the previous record's, k the steps between the "
                  "two (up to {max_interval}: +10 % between 100-step averages, +100 % between "
                  "consecutive steps), from step {after_step} on (a fresh run's loss bounces)")
    catches = ("a jump of the loss level between two logged records, from the second record a "
               "follow sees")
    checked_on = ("tests/test_alerts_first_records.py; silent on the corpus (llamafactory +14 % "
                  "between 10-step averages, the modded-nanogpt single-step outliers +45 %) and "
                  "the controls, whole and from their middle")

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        st = rank.slot(self)
        before, since = st.loss, st.step
        st.step, st.loss = r.step, loss
        if before is None or since is None or r.step <= since or before <= 0:
            return None  # the first record, a step logged again (a restart), or no ratio
        if r.step < self.cfg.after_step:
            return None
        k = min(r.step - since, self.cfg.max_interval)
        limit = (1.0 + self.cfg.rise / math.sqrt(k)) * before
        if loss < limit:
            return self.good(run, rank, step=r.step, t=t, value=loss)
        return self.bad(run, rank, step=r.step, t=t, value=loss, threshold=limit, message=(
            f"loss jump on run {run.run_id}, rank {rank.rank}, step {r.step}: {sig4(loss)} is "
            f"{100 * (loss / before - 1):.0f}% above {sig4(before)} at step {since}, {r.step - since} "
            f"step{'s' * (r.step - since > 1)} before (limit +{100 * (limit / before - 1):.0f}% for "
            f"that interval)"))


class LossDivergence(RuleConfig):
    # The median of the newer half of the last `window` losses is >= (1 + rise) x the lowest
    # such median of the run so far, and above the older half's: a sustained rise.
    rise: float = Field(0.1, gt=0)
    window: int = Field(20, ge=4)
    clear_after: int = Field(5, ge=1)
    cooldown_s: float = Field(600.0, ge=0)


@dataclass(slots=True)
class Divergence:
    halves: TwoHalves = window("window")
    best: Optional[float] = None  # the lowest newer-half median so far
    diverging: bool = False


class LossDivergenceRule(Rule, name="loss_divergence", config=LossDivergence):
    """A sustained rise: the median of the newer half of the last ``window`` losses is
    ``rise`` above the run's best such median and above the older half's. Medians make it
    blind to single spikes, so it still sees a rise that follows an explosion. Once
    diverging, it stays so until the loss comes back near its best or clearly falls."""

    kinds = ("step",)
    rank_state = Divergence
    restarts_with_steps = True  # (base.Rule)
    fires_when = ("over the last {window} losses, the median of the newer half >= (1 + {rise}) x "
                  "the run's lowest such median and above the older half's; it stays diverging "
                  "until the loss is back near its best or clearly falls")
    catches = ("training that diverges: a sustained rise over tens of records, also one right "
               "after an explosion (medians do not see the spike)")
    checked_on = "tests/test_alerts_rules.py; silent on every healthy corpus log (up to 6,000 steps)"

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
            f"{sig4(newer)} over the last {half} records is {100 * (newer / best - 1):.0f}% above the "
            f"run's best {sig4(best)} (limit +{100 * rise:g}%) and not falling ({sig4(older)} over "
            f"the {half} before)"))


class LossPlateau(RuleConfig):
    severity: Severity = "info"
    window: int = Field(1000, ge=4)  # compares the median of its newer half with its older
    min_decrease: float = Field(0.0, ge=0)  # fraction the loss must fall by, half to half
    fire_after: int = Field(50, ge=1)
    clear_after: int = Field(50, ge=1)
    cooldown_s: float = Field(3600.0, ge=0)


@dataclass(slots=True)
class Plateau:
    halves: TwoHalves = window("window")


class LossPlateauRule(Rule, name="loss_plateau", config=LossPlateau):
    kinds = ("step",)
    rank_state = Plateau
    restarts_with_steps = True  # (base.Rule)
    fires_when = ("over the last {window} steps, the median of the newer half >= (1 - "
                  "{min_decrease}) x the median of the older half: flat or rising")
    catches = "a run that stopped learning"
    checked_on = "silent on the healthy corpus logs"

    def observe(self, r, t, run, rank):
        loss = r.loss
        if loss is None or not math.isfinite(loss):
            return None
        halves = rank.slot(self).halves
        halves.push(loss)
        if not halves.full:
            return None
        older, newer = halves.older_median, halves.newer_median
        limit = older * (1.0 - self.cfg.min_decrease)
        if newer >= limit:
            trend = "rising" if newer > older else "flat"
            return self.bad(run, rank, step=r.step, t=t, value=newer, threshold=limit, message=(
                f"loss {trend} on run {run.run_id} (rank {rank.rank}): median {sig4(newer)} over the "
                f"last {halves.half} steps vs {sig4(older)} over the {halves.half} before, "
                f"up to step {r.step}"))
        return self.good(run, rank, step=r.step, t=t, value=newer)


class FrozenLoss(RuleConfig):
    severity: Severity = "critical"
    repeats: int = Field(8, ge=2)  # the same non-zero loss on this many new steps in a row


class FrozenLossRule(FrozenValueRule, name="frozen_loss", config=FrozenLoss):
    field, label = "loss", "training loss"
    fires_when = "the same non-zero training loss on {repeats} new steps in a row"
    catches = "a constant loss: not computed, or a model that no longer changes"
    checked_on = "tests/test_alerts_rules.py"
