"""The optimizer's step: fp16 loss scaling collapsing, iterations skipped, a learning rate
stuck at 0."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig, Severity
from .base import Rule


def trim(recent: deque, step: int, window: int) -> None:
    """Keep the entries of the last ``window`` iterations before ``step``, and always the
    latest (a log interval longer than the window still compares with the record before)."""
    if recent and step < recent[-1][0]:
        recent.clear()  # the step count went back: a restart from a checkpoint
    while len(recent) > 1 and recent[0][0] <= step - window:
        recent.popleft()


class LossScaleCollapse(RuleConfig):
    # fp16 only (a run whose loss scale was ever other than 1.0; bf16 prints a constant 1.0):
    # the scale fell to <= max over the last `window_steps` iterations / drop_factor, or to
    # <= min_scale; not judged before iteration `warmup_steps` (the scaler calibrates).
    severity: Severity = "critical"
    drop_factor: float = Field(8.0, gt=1)
    window_steps: int = Field(100, ge=1)
    min_scale: float = Field(1.0, gt=0)
    warmup_steps: int = Field(100, ge=0)
    escalate_factor: Optional[float] = Field(10.0, gt=1)


@dataclass(slots=True)
class LossScales:
    fp16: bool = False  # a loss scale other than 1.0 was seen
    recent: deque[tuple[int, float]] = field(default_factory=deque)  # (step, loss scale)


class LossScaleCollapseRule(Rule, name="loss_scale_collapse", config=LossScaleCollapse):
    """fp16 dynamic loss scaling collapsing: repeated overflows halve the scale step after
    step. Only a run whose loss scale was ever other than 1.0 is fp16: bf16 and fp32 runs
    print a constant 1.0 (Megatron), which never alerts."""

    kinds = ("step",)
    worse_when_higher = False
    rank_state = LossScales
    fires_when = ("fp16 only (a loss scale ever other than 1.0, or a skipped step; bf16 and fp32 "
                  "print a constant 1.0, which never alerts): after iteration {warmup_steps}, the "
                  "scale <= its max over the last {window_steps} iterations / {drop_factor} (three "
                  "halvings: an overflow cascade; a skipped step ran at twice the scale reported "
                  "after it), or <= {min_scale}; a skipped step at <= {min_scale} also before; "
                  "{escalate_factor}")
    catches = "dynamic loss scaling collapsing under repeated overflows"
    checked_on = ("megatron-transformer-xl-fp16-loss-scale-collapse.log (64 at 400 -> 8 at 500; 0.1 "
                  "at 800 escalates), hf-trainer-deepspeed-fp16-overflow-loss-scale-collapse.log "
                  "(DeepSpeed's overflow cascade: 8 at 380 against the 64 the skipped step 378 ran "
                  "at; read from its middle, 2 at 382 against the 16 of 380); silent on the bf16 "
                  "Megatron logs (the old rule fired on their first record)")

    def observe(self, r, t, run, rank):
        scale = r.loss_scale
        if scale is None or math.isnan(scale):
            return None
        st = rank.slot(self)
        if scale != 1.0 or r.skipped:
            st.fp16 = True  # bf16 and fp32 print 1.0 and skip nothing for an overflow
        if not st.fp16:
            return None
        cfg = self.cfg
        if r.step <= cfg.warmup_steps and not (scale <= cfg.min_scale and r.skipped):
            # The scaler calibrates from its initial scale (skipped_iterations says so);
            # but one that overflows at its floor (DeepSpeed's "Attempted loss scale: 1,
            # reducing to 1") has nowhere to go: every step is skipped from then on.
            return None
        trim(st.recent, r.step, cfg.window_steps)
        if r.skipped and (not st.recent or scale < st.recent[-1][1]):
            # An overflow skipped the step and the scaler backed off: the step ran at twice
            # the scale reported after it (DeepSpeed's, Megatron's and torch.amp's backoff is
            # 2; DeepSpeed says so: "Attempted loss scale: 16, reducing to 8"). Its first
            # record of a run read from the middle then already shows one halving.
            st.recent.append((r.step, 2.0 * scale))
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


class SkippedIterations(RuleConfig):
    # >= max_skipped iterations skipped within the last `window_steps` iterations;
    # before iteration `warmup_steps` (fp16 loss-scale calibration) at severity info.
    severity: Severity = "critical"
    max_skipped: int = Field(3, ge=1)
    window_steps: int = Field(100, ge=1)
    warmup_steps: int = Field(100, ge=0)


@dataclass(slots=True)
class Skips:
    recent: deque[tuple[int, int]] = field(default_factory=deque)  # (step, iterations skipped)


class SkippedIterationsRule(Rule, name="skipped_iterations", config=SkippedIterations):
    """Iterations the optimizer skipped (fp16 overflows, NaN/inf gradients): Megatron's
    ``skipped`` counter per logged interval, or 1 per skipped step."""

    kinds = ("step",)
    rank_state = Skips
    fires_when = (">= {max_skipped} iterations skipped within the last {window_steps} iterations "
                  "(Megatron's `skipped` count per logged interval, or 1 per skipped step); up to "
                  "iteration {warmup_steps} at severity info (fp16 calibration), whose skips do not "
                  "count after it")
    catches = "overflows in a row, non-finite gradients"
    checked_on = ("megatron-lm-gpt2-2.6b-v100-fp16-loss-scale-warmup.log (every iteration skipped "
                  "at 5 and 10 while the scale falls from 2^28: info)")

    def observe(self, r, t, run, rank):
        if r.skipped is None:
            return None
        cfg = self.cfg
        recent = rank.slot(self).recent
        if recent and recent[-1][0] == r.step:
            recent.pop()  # the same step again
        trim(recent, r.step, cfg.window_steps)
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


class LrZero(RuleConfig):
    after_step: int = Field(100, ge=0)  # warmup: lr may be 0 before this step
    final_fraction: float = Field(0.01, ge=0, lt=1)  # schedules may reach 0 at the very end
    fire_after: int = Field(3, ge=1)


class LrZeroRule(Rule, name="lr_zero", config=LrZero):
    kinds = ("step",)
    fires_when = ("learning rate <= 0 from step {after_step} on (not in the last {final_fraction} "
                  "of `total_steps`)")
    catches = "a schedule stuck at 0"
    checked_on = "silent on hf-trainer-swift-gemma4-full-epoch-tail.log (lr 0 in its last 3 steps)"

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
