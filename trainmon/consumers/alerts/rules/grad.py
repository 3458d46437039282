"""Gradient rules: non-finite values, a spike or an explosion of the grad norm against the
run's own scale, a norm that stopped changing."""

from __future__ import annotations

import math
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig, Severity
from .base import Rule, history, sig4
from .baseline import BaselineRule
from .frozen import FrozenValueRule


class NonFinite(RuleConfig):
    severity: Severity = "critical"


class NonFiniteRule(Rule, name="non_finite", config=NonFinite):
    kinds = ("step",)
    fires_when = "loss or grad norm is NaN or infinite"
    catches = "a step whose loss or gradients overflowed"
    checked_on = ("nanogpt-shakespeare-char-nan-loss.log (`loss nan` from iter 425), "
                  "megatron-core-bridge-dsv4-fp8mx-gradnorm-nan-wrapped.log (`grad norm: nan`), "
                  "megatron-transformer-xl-fp16-loss-scale-collapse.log (`lm loss NAN` at 700), "
                  "hf-trainer-modernbert-nan-gradnorm-zero-loss.log")

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


class GradSpike(RuleConfig):
    # norm >= factor x the median of the run's last `window` accepted norms (from
    # `min_samples` on) and a robust z-score >= min_z over them; or >= jump x that median
    # from the first earlier record on (an order-of-magnitude jump needs no statistics).
    factor: float = Field(3.0, gt=1)
    jump: float = Field(10.0, gt=1)
    min_z: float = Field(3.5, ge=0)
    window: int = Field(50, ge=3)
    min_samples: int = Field(3, ge=1)
    escalate_factor: Optional[float] = Field(10.0, gt=1)


class GradSpikeRule(BaselineRule, name="grad_spike", config=GradSpike):
    field, what = "norm", "grad norm spike"
    fires_when = ("grad norm >= {factor} x the median of its last {window} accepted norms with a "
                  "robust z >= {min_z} (from {min_samples} records), or >= {jump} x that median "
                  "from the second record on; {escalate_factor}")
    catches = "a sudden jump of the grad norm against the run's own scale"
    checked_on = ("megatron-deepspeed-qwen25-7b-finetune-gradnorm.log (1802 at iteration 6, 4.2x "
                  "the median of 5 records), hf-trainer-swift-gemma4-full-epoch-tail.log (43.3 at "
                  "290, 11x), hf-trainer-unsloth-gemma4-lora-gradnorm-spike.log (92.1 at step 4 "
                  "after 3 records, 9.4x); silent on torchtitan-kimik3-probe-cp2-20steps-healthy.log "
                  "(2.8, 5.8, 12.3 in the first steps)")

    def judge(self, norm, w):
        cfg, med, n = self.cfg, w.median, len(w.values)
        if med <= 0:
            return None
        ratio = norm / med
        if ratio >= cfg.jump:
            return cfg.jump * med, (f"{sig4(norm)} is {ratio:.1f}x the median {sig4(med)} of {history(n)} "
                                    f"(an order-of-magnitude jump: limit {cfg.jump:g}x)"), False
        if n >= cfg.min_samples and ratio >= cfg.factor:
            z = w.robust_z(norm)
            if z >= cfg.min_z:
                return cfg.factor * med, (f"{sig4(norm)} is {ratio:.1f}x the median {sig4(med)} of "
                                          f"{history(n)}, robust z {z:.1f} (limits {cfg.factor:g}x "
                                          f"and z {cfg.min_z:g})"), False
        return False


class ExplodingGrad(RuleConfig):
    severity: Severity = "critical"
    factor: float = Field(10.0, gt=1)  # norm >= factor x the run's own median ...
    window: int = Field(50, ge=1)
    fire_after: int = Field(3, ge=1)  # ... on this many records in a row
    escalate_factor: Optional[float] = Field(10.0, gt=1)


class ExplodingGradRule(BaselineRule, name="exploding_grad", config=ExplodingGrad):
    field, what = "norm", "exploding gradients"
    fires_when = ("grad norm >= {factor} x the run's own median (its last {window} accepted "
                  "norms, from the second record on) on {fire_after.value} records in a row; "
                  "{escalate_factor}")
    catches = "gradients that blow up and stay up, not a one-step spike"
    checked_on = ("silent on megatron-deepspeed-qwen25-7b-finetune-gradnorm.log, whose norms are "
                  "54-2908 (the old absolute limit of 100 fired at iteration 1 and stayed open); "
                  "tests/test_alerts_faults.py (a run at 1e5)")

    def judge(self, norm, w):
        med = w.median
        if med <= 0:
            return None
        if norm >= self.cfg.factor * med:
            return self.cfg.factor * med, (
                f"grad norm {sig4(norm)} is {norm / med:.0f}x the run's own scale (median {sig4(med)} of "
                f"{history(len(w))}) on {self.cfg.fire_after} records in a row (limit "
                f"{self.cfg.factor:g}x)"), False
        return False


class FrozenGradNorm(RuleConfig):
    repeats: int = Field(5, ge=2)  # the same grad norm on this many new steps in a row


class FrozenGradNormRule(FrozenValueRule, name="frozen_grad_norm", config=FrozenGradNorm):
    field, label = "norm", "grad norm"
    fires_when = "the same grad norm, bit for bit, on {repeats} new steps in a row (0 is `dead_gradients`')"
    catches = "a norm that is no longer computed: a stale logger value, a graph that stopped training"
    checked_on = "tests/test_alerts_rules.py (no corpus log has one)"
