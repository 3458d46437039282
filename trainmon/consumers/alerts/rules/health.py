"""Rules over the rest of an operator's checklist: GPU error counters, checkpoints and the
disk they go to, warnings a log printed.

Plain limits on one field (uncorrected ECC errors, a failed row remapping, critical XIDs,
too little free disk) are data in thresholds.py. These need history: a rate over the
GPU's health records, the run's own checkpoint cadence and save time, a projection of
the disk filling at the run's checkpoint size, a count of warnings within a window.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import Field, field_validator

from ..incidents import duration_text
from ..rule_config import RuleConfig
from .base import Rule, TickRule
from .baseline import BaselineRule

GiB = float(1 << 30)


class EccCorrectedRising(RuleConfig):
    # Corrected (single-bit) ECC errors at >= max_per_hour, measured over the GPU's health
    # records of the last `window_s` once they span `min_span_s`: memory going bad, usually
    # before the uncorrected error that ends the job.
    max_per_hour: float = Field(100.0, gt=0)
    window_s: float = Field(3600.0, gt=0)
    min_span_s: float = Field(300.0, gt=0)
    cooldown_s: float = Field(3600.0, ge=0)


@dataclass(slots=True)
class EccCounts:
    by_gpu: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # GPU -> (time, count)


class EccCorrectedRisingRule(Rule, name="ecc_corrected_rising", config=EccCorrectedRising):
    """Corrected ECC errors one at a time are routine; many an hour are memory going bad,
    usually before the uncorrected error that ends the job. The volatile counter is
    cumulative since the driver loaded, so the rate is its growth over the GPU's health
    records of the last ``window_s`` (a counter that went down: the driver reloaded)."""

    kinds = ("gpu_health",)
    rank_state = EccCounts
    fires_when = ("a GPU's volatile corrected ECC count grows by >= {max_per_hour} an hour, "
                  "measured over its gpu_health records of the last {window_s} s once they span "
                  "{min_span_s} s (a counter that went down: the driver reloaded, start again); "
                  "per GPU")
    catches = "memory going bad, usually before the uncorrected error that ends the job"
    checked_on = "tests/test_alerts_rules.py (NVML values; no GPU was lent to this project yet)"

    def observe(self, r, t, run, rank):
        count = r.ecc_volatile_corrected
        if count is None:
            return None  # ECC off, or a GPU without it
        samples = rank.slot(self).by_gpu.setdefault(r.id, [])
        if samples and count < samples[-1][1]:
            samples.clear()
        samples.append((t, count))
        while len(samples) > 2 and samples[1][0] <= t - self.cfg.window_s:
            samples.pop(0)
        span = t - samples[0][0]
        if span < self.cfg.min_span_s:
            return None  # too short a span for a rate
        per_hour = (count - samples[0][1]) / span * 3600
        subject = f"rank{rank.rank}/gpu{r.id}"
        if per_hour < self.cfg.max_per_hour:
            return self.good(run, rank, step=r.step, t=t, value=per_hour, subject=subject)
        return self.bad(run, rank, step=r.step, t=t, value=per_hour, threshold=self.cfg.max_per_hour,
                        subject=subject, message=(
                            f"corrected ECC errors rising on GPU {r.id} of rank {rank.rank} on "
                            f"{rank.host} (run {run.run_id}, step {r.step}): {per_hour:,.0f} an hour "
                            f"over the last {duration_text(span)} ({count - samples[0][1]:,} new, "
                            f"{count:,} since the driver loaded; limit {self.cfg.max_per_hour:g} an "
                            f"hour): memory going bad, plan to drain the GPU"))


class CheckpointOverdue(RuleConfig):
    # No checkpoint saved for more than `max_steps` steps or `max_minutes` of record time
    # (either, when set), else for more than `factor` x the run's own median interval in
    # steps between its saves (learned from its first two saves on).
    max_steps: Optional[int] = Field(None, ge=1)
    max_minutes: Optional[float] = Field(None, gt=0)
    factor: float = Field(2.0, gt=1)
    cooldown_s: float = Field(600.0, ge=0)


@dataclass(slots=True)
class Saves:
    step: Optional[int] = None  # the latest save's step
    t: Optional[float] = None  # and its record time
    intervals: list[int] = field(default_factory=list)  # steps between the last saves


class CheckpointOverdueRule(TickRule, name="checkpoint_overdue", config=CheckpointOverdue):
    """No checkpoint saved for longer than configured (steps or minutes), or than
    ``factor`` x the run's own interval between saves where it saves on a fixed cadence
    (``regular_interval``). Judged on the engine's tick, which the service runs only once
    every partition is read: a save still unread on the checkpoint topic while the step
    topic is ahead is no missing save."""

    kinds = ("checkpoint",)
    run_state = Saves
    fires_when = ("no checkpoint saved for more than `max_steps` steps or `max_minutes` of record "
                  "time when either is set; else, for a run that saves on a fixed cadence (its last "
                  "three intervals within 10 % of each other), for more than {factor} x that "
                  "interval in steps; judged on the engine's tick, once every partition is read, so "
                  "a save still unread on its topic is not missing")
    catches = ("a job that stopped saving (a failed save path, a config that dropped "
               "`--save-interval`): hours of training at risk")
    checked_on = ("tests/test_alerts_rules.py (also: steps read ahead of an unread save fire "
                  "nothing); silent on nanogpt-tinystories-50m-healthy.log, whose archive saves at "
                  "steps 0, 1, 2, 4, 8, ... are no fixed cadence (a median-interval version fired "
                  "there three times)")

    def observe(self, r, t, run, rank):
        if r.event != "saved":
            return None
        st = run.slot(self)
        if st.step is not None and r.step > st.step:
            st.intervals = (st.intervals + [r.step - st.step])[-10:]
        if st.step is None or r.step >= st.step:
            st.step, st.t = r.step, t
        return None

    def tick(self, run, wall):
        if run.max_step < 0 or run.last_progress is None:
            return None
        cfg = self.cfg
        st = run.slots.get(self.name)
        saved = st is not None and st.step is not None
        if saved and run.max_step < st.step:
            return None  # resumed from an earlier checkpoint; the run's steps catch up
        if saved:
            since, since_t, what = st.step, st.t, f"since the save at step {st.step}"
        elif (cfg.max_steps or cfg.max_minutes) and run.seen_steps:
            since, since_t, what = run.seen_steps[0], run.seen_times[0], "since the run's first step"
        else:
            return None  # no save yet and no configured limit: nothing says how often it saves
        steps = run.max_step - since
        seconds = run.last_progress - since_t
        limits = []
        if cfg.max_steps and steps > cfg.max_steps:
            limits.append(f"limit {cfg.max_steps} steps")
        if cfg.max_minutes and seconds > 60 * cfg.max_minutes:
            limits.append(f"limit {cfg.max_minutes:g} min")
        usual = regular_interval(st.intervals) if saved else None
        if not (cfg.max_steps or cfg.max_minutes) and usual:
            if steps > cfg.factor * usual:
                limits.append(f"{steps / usual:.1f}x the run's usual {usual:g} steps between saves, "
                              f"limit {cfg.factor:g}x")
        if not limits:
            return self.good_run(run, run.last_progress)
        return self.bad_run(run, [], step=run.max_step, time=run.last_progress, value=float(steps),
                            threshold=None, message=(
                                f"no checkpoint saved on run {run.run_id} {what}: {steps} steps and "
                                f"{duration_text(seconds)} of training at risk ({'; '.join(limits)})"))


def regular_interval(intervals: list[int]) -> float | None:
    """The run's interval between saves when it saves on a fixed cadence (its last three
    intervals within 10 % of each other: Megatron's --save-interval, the HF Trainer's
    save_steps); None otherwise. Saves on a growing schedule (nanoGPT's archive at steps
    0, 1, 2, 4, 8, ...) or only when the eval improved are no cadence to be late for."""
    last = intervals[-3:]
    if len(last) < 3 or max(last) > 1.1 * min(last):
        return None
    return statistics.median(last)


class CheckpointSlow(RuleConfig):
    # A save that took >= factor x the median duration of the run's last `window` saves
    # (from `min_samples` saves) and at least `min_extra_s` longer than it.
    factor: float = Field(3.0, gt=1)
    min_extra_s: float = Field(30.0, ge=0)
    window: int = Field(20, ge=2)
    min_samples: int = Field(2, ge=1)


class CheckpointSlowRule(BaselineRule, name="checkpoint_slow", config=CheckpointSlow):
    """A save much slower than the run's usual: a filesystem in trouble, or a node whose
    writes hold up every rank (synchronous saves block training)."""

    kinds = ("checkpoint",)
    field, what = "duration_ms", "slow checkpoint save"
    fires_when = ("a save's `duration_ms` >= {factor} x the median of the run's last {window} saves "
                  "(from {min_samples} saves) and at least {min_extra_s} s longer")
    catches = "a filesystem in trouble, or one node's slow writes holding up a synchronous save"
    checked_on = "tests/test_alerts_rules.py"

    def judge(self, ms, w):
        cfg, med, n = self.cfg, w.median, len(w.values)
        if n < cfg.min_samples or med <= 0:
            return None
        if ms >= cfg.factor * med and ms - med >= cfg.min_extra_s * 1000:
            return cfg.factor * med, (f"took {duration_text(ms / 1000)}, {ms / med:.1f}x the median "
                                      f"{duration_text(med / 1000)} of its last {n} saves (limit "
                                      f"{cfg.factor:g}x)"), False
        return False


class CheckpointDiskFilling(RuleConfig):
    # The checkpoint filesystem has room for fewer than `min_saves_left` more checkpoints
    # of the run's latest size; the message projects the time to full at its cadence.
    min_saves_left: float = Field(3.0, gt=0)
    cooldown_s: float = Field(3600.0, ge=0)


@dataclass(slots=True)
class CheckpointSizes:
    bytes: Optional[int] = None  # the latest checkpoint's size
    saves: list[float] = field(default_factory=list)  # record times of the last saves


class CheckpointDiskFillingRule(Rule, name="checkpoint_disk_filling", config=CheckpointDiskFilling):
    """Free space on the checkpoint filesystem for fewer than ``min_saves_left`` more saves
    of the run's latest checkpoint size, with the time to full at the run's cadence: the
    save that fails comes after hours of training since the previous one."""

    kinds = ("checkpoint", "disk")
    run_state = CheckpointSizes
    fires_when = ("free space on the checkpoint filesystem (disk records, or a checkpoint record's "
                  "`free_bytes`) holds fewer than {min_saves_left} more checkpoints of the run's "
                  "latest size; the message gives the time to full at the run's cadence")
    catches = "the save that will fail for lack of space, while there is still time to clean up"
    checked_on = "tests/test_alerts_rules.py"

    def observe(self, r, t, run, rank):
        st = run.slot(self)
        if r.kind == "checkpoint":
            if r.event != "saved":
                return None
            if r.bytes:
                st.bytes = r.bytes
            st.saves = (st.saves + [t])[-10:]
            if r.free_bytes is None:
                return None
        size = st.bytes
        if not size:
            return None  # no checkpoint size known: nothing to project
        where = r.path if r.kind == "disk" else "the checkpoint filesystem"
        subject = f"{rank.host}:{r.path if r.kind == 'disk' else 'checkpoint'}"
        saves_left = r.free_bytes / size
        if saves_left >= self.cfg.min_saves_left:
            return self.good(run, rank, step=r.step, t=t, value=saves_left, subject=subject)
        gaps = [b - a for a, b in zip(st.saves, st.saves[1:])]
        cadence = statistics.median(gaps) if gaps else None
        full = (f", full in about {duration_text(saves_left * cadence)} at one save every "
                f"{duration_text(cadence)}" if cadence else "")
        return self.bad(run, rank, step=r.step, t=t, value=saves_left, threshold=self.cfg.min_saves_left,
                        subject=subject, message=(
                            f"checkpoint disk filling on {rank.host} (run {run.run_id}, step {r.step}): "
                            f"{r.free_bytes / GiB:,.1f} GiB free in {where} holds {saves_left:.1f} more "
                            f"checkpoints of {size / GiB:,.1f} GiB (limit {self.cfg.min_saves_left:g})"
                            f"{full}"))


class NcclWarningBurst(RuleConfig):
    # >= max_warnings warning / error lines of `sources` on one rank within `window_s` of
    # record time (log_event counts: the ingest parsers aggregate repeats).
    max_warnings: int = Field(10, ge=1)
    window_s: float = Field(600.0, gt=0)
    sources: list[str] = Field(default_factory=lambda: ["nccl"])
    cooldown_s: float = Field(600.0, ge=0)

    @field_validator("sources", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


@dataclass(slots=True)
class Warnings:
    counts: dict[str, int] = field(default_factory=dict)  # message signature -> its count so far
    at: dict[str, float] = field(default_factory=dict)  # message signature -> time of that count
    recent: list[tuple[float, int, str]] = field(default_factory=list)  # (time, new lines, text)


class NcclWarningBurstRule(Rule, name="nccl_warning_burst", config=NcclWarningBurst):
    """Many NCCL warnings or errors on one rank in a short time: a flaky link or NIC, a
    peer in trouble; often what a hang or a watchdog timeout on that rank comes from. The
    log_event records carry running counts per message signature, so the rule adds up
    their growth within ``window_s``."""

    kinds = ("log_event",)
    rank_state = Warnings
    fires_when = (">= {max_warnings} warning / error lines of {sources} on one rank within "
                  "{window_s} s of record time (the growth of the log_event counts per signature)")
    catches = ("a flaky link or NIC, a peer in trouble: what hangs and watchdog timeouts on that "
               "rank often come from")
    checked_on = ("tests/test_alerts_rules.py. In "
                  "megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log rank 0 "
                  "prints 14 NCCL error lines (its watchdog's dump), but they come with the crash, "
                  "after the ranks' ends, where `run_failed` reports it")

    def observe(self, r, t, run, rank):
        if r.source not in self.cfg.sources:
            return None
        st = rank.slot(self)
        before, since = st.counts.get(r.signature, 0), st.at.get(r.signature)
        if r.count < before:
            if since is not None and t <= since:
                return None  # an earlier record sent again (at least once): nothing new
            new, since = r.count, None  # a new process's count (the job restarted): from 1 again
        else:
            new = r.count - before
        # Counts come at 1, 2, 4, 8, ...: the growth since the signature's previous record
        # was printed over the time between the two, of which window_s counts.
        if new > 0 and since is not None and t - since > self.cfg.window_s:
            new = round(new * self.cfg.window_s / (t - since))
        st.counts[r.signature], st.at[r.signature] = r.count, t
        if new > 0:
            st.recent.append((t, new, r.text[:200]))
        st.recent = [x for x in st.recent if x[0] > t - self.cfg.window_s]
        total = sum(x[1] for x in st.recent)
        step = r.last_step if r.last_step is not None else r.first_step
        subject = f"rank{rank.rank}"
        if total < self.cfg.max_warnings:
            return self.good(run, rank, step=step, t=t, value=float(total), subject=subject)
        worst = max(st.recent, key=lambda x: x[1])
        return self.bad(run, rank, step=step, t=t, value=float(total), threshold=float(self.cfg.max_warnings),
                        subject=subject, check_stale=False, message=(
                            f"{total} {'/'.join(self.cfg.sources).upper()} warnings on rank {rank.rank} "
                            f"({rank.host}) of run {run.run_id} within {duration_text(self.cfg.window_s)}"
                            f"{f' up to step {step}' if step is not None else ''} (limit "
                            f"{self.cfg.max_warnings}); the most frequent: {worst[2]!r}"))
