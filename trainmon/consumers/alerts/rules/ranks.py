"""Rules that compare the ranks of a run: straggler, rank iteration mismatch, stall.

Mismatch and stall are evaluated on ticks, not on records, because their evidence is the
absence of records. Their clock is record time (so a replay decides the same way), pushed
forward by the wall clock only for live runs and only when the service has read every
partition to its end: a partition read later than another must not look like a silent rank.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from pydantic import Field

from ..rule_config import RuleConfig, Severity
from ..state import RankState, RunState
from .base import Rule, TickRule
from .codec import transient


class Straggler(RuleConfig):
    factor: float = Field(1.3, gt=1)  # step time > factor x median of all ranks at that step
    min_ranks: int = Field(3, ge=2)
    timer: Optional[str] = None  # compare timers[timer] instead of duration_ms
    # A step still missing ranks this long (record time) after its first report is judged
    # with the ranks it has; the missing ones are not waited for until they report again.
    wait_s: float = Field(30.0, gt=0)
    # An open incident resolves once the rank's step time is back within clear_factor x
    # the median (None: halfway between 1 and factor, 1.15 for 1.3): no flapping on jitter.
    clear_factor: Optional[float] = Field(None, gt=1)
    fire_after: int = Field(5, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


@dataclass(slots=True)
class PendingSteps:
    """The straggler rule's run-wide state: step times of the steps not judged yet, and
    the ranks no longer waited for. ``seq`` counts the step times observed for the run, so
    ``heard`` (a rank's latest) and ``opened`` (a step's first) say who reported what
    after what, in the order the engine read them. That arrival bookkeeping is not saved:
    after a restore a step past wait_s gives up on the ranks that have reported nothing
    since the restore."""

    # step -> rank -> (step time, record time), in the order the steps were first reported
    steps: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)  # step -> record time of its first report
    absent: set[int] = field(default_factory=set)  # ranks given up on; waited for again once they report
    unseen_absent: int = 0  # ranks never seen, no longer waited for
    opened: dict[int, int] = transient(default_factory=dict)  # step -> seq of its first report
    seq: int = transient(default=0)
    heard: dict[int, int] = transient(default_factory=dict)  # rank -> seq of its latest step time
    recheck: int = transient(default=0)  # the seq from which a step past wait_s is looked at again
    looked: int = transient(default=0)  # the seq when a step past wait_s was last found still waited for
    judged: dict[int, int] = transient(default_factory=dict)  # rank -> the newest step it had a verdict at
    top: int = transient(default=-1)  # the run's highest step so far (lower again: its steps started over)
    # The newest step-record time: wait_s runs on it, not on the run's clock, which GPU
    # or MoE records read ahead of the step topic (a replay, a warm-up) would push on.
    clock: float = transient(default=0.0)

    def on_load(self) -> None:
        self.opened = dict.fromkeys(self.steps, 0)
        self.clock = max((t for got in self.steps.values() for _, t in got.values()), default=0.0)

    def open(self, step: int, t: float) -> dict:
        self.steps[step] = got = {}
        self.since[step] = t
        self.opened[step] = self.seq
        return got

    def pop(self, step: int) -> dict:
        self.since.pop(step, None)
        self.opened.pop(step, None)
        return self.steps.pop(step)


class StragglerRule(Rule, name="straggler", config=Straggler):
    """A rank whose step time exceeds ``factor`` x the median of all ranks at that step.

    Ranks sit on different partitions, which are not read in lockstep, so a step is judged
    once every rank expected has reported it. A step still missing ranks ``wait_s`` of
    record time after its first report gives up on those that have reported no step time
    since (silent, or not logging one) and on ranks never seen, and is judged without them;
    they are not waited for again until they report. A rank that keeps reporting, behind
    the others (its partition read later, its producer late), is still waited for, up to
    MAX_PENDING_STEPS steps. So one silent rank of 1,024 does not hold every later step
    back, and a partition read behind the others is still judged with its peers."""

    kinds = ("step",)
    run_state = PendingSteps
    fires_when = ("a rank's step time > {factor} x the median of all ranks at that step (needs "
                  "{min_ranks}; `timer`: compare `timers[timer]` instead of `duration_ms`); open "
                  "until the rank is back within `clear_factor` x the median (default halfway, "
                  "1.15: a rank near the limit does not resolve and fire again on jitter). A step is "
                  "judged once every rank has reported it, or {wait_s} s of step-record time (other "
                  "kinds read ahead do not count) after its first report with the ranks it has; "
                  "ranks it lacked (silent, far behind) are not waited for again until they report")
    catches = "one slow rank holding up the others"
    checked_on = ("tests (the corpus logs print one rank); benchmarks/scale.py (1,024 ranks, a 20 % "
                  "straggler with `factor` 1.15, one rank silent before it)")
    MAX_PENDING_STEPS = 256  # a memory bound: past it the oldest step is judged as it is

    def observe(self, r, t, run, rank):
        value = r.duration_ms if self.cfg.timer is None else (r.timers or {}).get(self.cfg.timer)
        if value is None or math.isnan(value):
            return None  # not logged (or NaN): this rank has no time to compare at this step
        p = run.slot(self)
        p.seq += 1
        p.heard[rank.rank] = p.seq
        p.clock = max(p.clock, t)
        if run.max_step < p.top:  # resumed from a checkpoint: step numbers start over
            p.judged.clear()
        p.top = run.max_step
        if p.absent and rank.rank in p.absent:
            p.absent.discard(rank.rank)  # back: it is waited for again
        by_rank = p.steps.get(r.step)
        if by_rank is None:
            by_rank = p.open(r.step, t)
        by_rank[rank.rank] = (value, t)
        out = []
        if len(by_rank) >= self._expected(run, p):
            out.extend(self._judge(run, r.step, p.pop(r.step), p))
        # Steps are pending in the order they were first reported: the oldest waits longest.
        while p.steps:
            oldest = next(iter(p.steps))
            gave_up = False
            if len(p.steps) <= self.MAX_PENDING_STEPS:
                if p.clock - p.since[oldest] <= self.cfg.wait_s or p.seq < p.recheck:
                    break
                waiting, gave_up = self._give_up_on_silent(run, p, oldest)
                if waiting:
                    p.looked = p.seq
                    p.recheck = p.seq + len(run.ranks)  # (a pass over the ranks: once a step's worth)
                    break
            out.extend(self._judge(run, oldest, p.pop(oldest), p))
            if gave_up:  # steps that lacked only those ranks are complete now
                expected = self._expected(run, p)
                for step in [s for s, got in p.steps.items() if len(got) >= expected]:
                    out.extend(self._judge(run, step, p.pop(step), p))
        return out

    @staticmethod
    def _expected(run: RunState, p: PendingSteps) -> int:
        """Ranks a step waits for: those still reporting, less those given up on; ranks not
        seen yet (their partition is read later) are still expected, or the straggler's own
        values could be judged with no peers at all."""
        absent = sum(1 for rid in p.absent if (rs := run.ranks.get(rid)) is not None and not rs.ended) \
            if p.absent else 0
        unseen = max(0, run.world_size - len(run.ranks) - p.unseen_absent)
        return run.reporting_ranks() + unseen - absent

    @staticmethod
    def _give_up_on_silent(run: RunState, p: PendingSteps, step: int) -> tuple[bool, bool]:
        """For a step past wait_s: give up on the ranks it lacks that have not reached it
        and reported no step time since it was first reported or since the last look (a
        pass over the ranks ago), and on the ranks never seen. Returns (still waiting for
        ranks that report, behind it; gave up on any).

        "Since the last look" too: a rank whose last record came just after another rank's
        first of the next step (two senders a moment apart) had reported "since" that step
        opened, and was waited for ever after it went silent, holding every later step up
        to MAX_PENDING_STEPS (a straggler after it never fired, benchmarks/scale.py --quick
        on a busy machine). A rank that keeps reporting, however far behind, reports again
        within a pass."""
        values = p.steps[step]
        heard_after = max(p.opened[step], p.looked)
        waiting, gave_up = False, False
        for rid, rs in run.ranks.items():
            if rid in values or rs.ended or rid in p.absent or (rs.last_step is not None and rs.last_step >= step):
                continue  # reported it, finished, given up on, or past it without a time there
            if p.heard.get(rid, 0) > heard_after:
                waiting = True
            else:
                p.absent.add(rid)
                gave_up = True
        unseen = max(0, run.world_size - len(run.ranks))
        if unseen > p.unseen_absent:
            p.unseen_absent = unseen
            gave_up = True
        return waiting and len(values) < StragglerRule._expected(run, p), gave_up

    def _judge(self, run: RunState, step: int, values: dict, p: PendingSteps):
        if len(values) < self.cfg.min_ranks:
            return []
        median = statistics.median(v for v, _ in values.values())
        limit = self.cfg.factor * median
        # Hysteresis: an open incident resolves only once the rank is back within
        # clear_factor x the median; a step between the two limits leaves it as it is, so
        # a rank 20 % slow against a 15 % limit does not resolve and fire again on jitter.
        clear = self.cfg.clear_factor if self.cfg.clear_factor is not None else (1 + self.cfg.factor) / 2
        clear_limit = min(clear, self.cfg.factor) * median
        out = []
        what = f"timer {self.cfg.timer!r}" if self.cfg.timer else "step time"
        judged = p.judged
        for rank_id, (value, t) in values.items():
            if judged.get(rank_id, -1) >= step:
                continue  # judged already (a resend), or out of order (a step judged late):
                # "in a row" is about the newer ones
            judged[rank_id] = step
            rs = run.ranks[rank_id]
            subject = f"rank{rank_id}"
            if median > 0 and value > clear_limit and value <= limit:
                ks = self.book.keys.get((self.name, run.run_id, subject))
                if ks is not None and ks.open is not None:
                    continue  # still slow, if less: neither bad nor healthy for an open incident
            if median > 0 and value > limit:
                a = self.bad(run, rs, step=step, t=t, value=value, threshold=limit, subject=subject,
                             message=(f"straggler on run {run.run_id}: rank {rank_id} ({rs.host}) "
                                      f"{what} {value:.0f} ms is {value / median:.2f}x the median "
                                      f"{median:.0f} ms of {len(values)} ranks at step {step} "
                                      f"({self.cfg.fire_after} steps in a row)"))
            else:
                a = self.good(run, rs, step=step, t=t, value=value, subject=subject)
            if a is not None:
                out.append(a)
        return out

    def load_run_state(self, data):
        """Also the shapes of older checkpoints: a list of pending steps (before wait_s) and
        engine state version 2's ``{"steps": [[step, since, [[rank, v, t], ...]], ...]}``."""
        if isinstance(data, list):
            data = {"steps": [[step, None, got] for step, got in data]}
        if isinstance(data.get("steps"), list):
            steps = data["steps"]
            data = {"steps": {step: {rank: (v, t) for rank, v, t in got} for step, _, got in steps},
                    "since": {step: since if since is not None else min((t for _, _, t in got), default=0.0)
                              for step, since, got in steps},
                    "absent": data.get("absent", ()), "unseen_absent": data.get("unseen_absent", 0)}
        return super().load_run_state(data)


class RankMismatch(RuleConfig):
    severity: Severity = "critical"
    grace_s: float = Field(60.0, gt=0)
    min_steps_behind: int = Field(1, ge=1)


class RankMismatchRule(TickRule, name="rank_mismatch", config=RankMismatch):
    """Ranks of one run at different latest steps for longer than ``grace_s``, e.g. one
    rank stopped reporting while the others advance."""

    fires_when = ("ranks of a run at different latest steps, some behind (by >= {min_steps_behind}) "
                  "for longer than {grace_s}; names the lagging ranks and their steps")
    catches = "one rank hung while the others wait in a collective"
    checked_on = "tests, the demo"

    # Judged also while the service is behind (engine.tick_behind): its evidence is the
    # step records alone, all on the run's one partition of the step topic, read in order.
    judges_while_behind = True

    def tick(self, run, wall, clock: float | None = None):
        """``clock``: the record time to judge at; default the run's latest of any kind.
        While the service is behind, the time the run first reached its latest step: the
        step topic's own clock, which another kind's partition read ahead cannot move.
        Then it only fires: an incident the wall clock opened (a hang, no steps at all)
        resolves on the full tick, not on a clock that stands still while nothing comes."""
        while_behind = clock is not None
        latest = run.clock if clock is None else clock
        now = latest if wall is None else max(latest, wall)
        # One pass over the ranks, grouped by their latest step: ranks at one step are
        # behind by the same time, so that is looked up once per step, not once per rank
        # (mid-step, half of 1,024 ranks are a step behind the first to report).
        at_step: dict[int, list[RankState]] = {}
        stepped = 0
        for rs in run.ranks.values():
            if rs.last_step is None:
                continue
            stepped += 1
            if not rs.ended:
                group = at_step.get(rs.last_step)
                if group is None:
                    at_step[rs.last_step] = [rs]
                else:
                    group.append(rs)
        if sum(len(group) for group in at_step.values()) < 2:
            return None if while_behind else self.good_run(run, now)
        # A rank with no step yet (its partition read later, e.g. when a producer's packed
        # messages arrive rank by rank) still needs the times of the steps it is behind.
        if stepped >= run.world_size:
            run.forget_steps_up_to(min(at_step))
        lagging, worst = [], 0.0
        for step, group in at_step.items():
            if run.max_step - step >= self.cfg.min_steps_behind:
                behind = self.behind_for(run, step, wall, clock)
                if behind > self.cfg.grace_s:
                    lagging.extend(group)
                    worst = max(worst, behind)
        if not lagging:
            return None if while_behind else self.good_run(run, now)
        active = [rs for group in at_step.values() for rs in group]
        lagging.sort(key=lambda rs: (rs.last_step, rs.rank))
        return self.bad_run(run, lagging, step=lagging[0].last_step, time=now, value=worst,
                            threshold=self.cfg.grace_s, message=(
                                f"rank iteration mismatch on run {run.run_id}: "
                                f"{rank_summary(active, lagging)}; behind for {worst:.0f} s "
                                f"(grace {self.cfg.grace_s:g} s)"))

    @staticmethod
    def behind_for(run: RunState, step: int, wall: float | None, clock: float | None = None) -> float:
        """Seconds since the run first passed ``step``: by the other ranks' record times,
        and for a live run by the wall clock. Either counts only once the engine has held
        that evidence for the slack itself, so a burst (a replay, a producer's spill, a
        batch still on its way to another partition) is not mistaken for a silent rank."""
        since, received = run.behind_since(step)
        if clock is not None:
            # While behind: the step records' clock alone (the engine's wall clock runs
            # ahead of records it has not read), counted once held for the slack, as below:
            # the full tick that follows must not resolve what this one fired.
            if wall is not None and received is not None and wall < received:
                return 0.0
            return clock - since
        by_records = run.clock - since
        if wall is None or received is None:
            return by_records
        if wall < received:
            return 0.0
        return max(by_records, min(wall - since, wall - received))


class Stalled(RuleConfig):
    severity: Severity = "critical"
    factor: float = Field(10.0, gt=1)  # no new step for factor x median step time ...
    min_s: float = Field(300.0, gt=0)  # ... and at least this long


class StalledRule(TickRule, name="stalled", config=Stalled):
    """No rank of a live run reported a new step for ``factor`` x its median step time, and
    no run end came: the job hangs, or died without a word (kill -9, a lost node). It stays
    open while the run is silent, also once the engine forgets the run's windows after
    ``live_run_max_age_s``; a new step or the run's end resolves it."""

    fires_when = ("no rank of a live run reported a new step for {factor} x its median step time "
                  "and at least {min_s} s, no run end came, and the run is not at its planned last "
                  "step (`total_steps`); stays open while the run is silent, also past "
                  "`live_run_max_age_s`")
    catches = "a job that hangs, or died without a run end (kill -9, a lost node)"
    checked_on = ("megatron-deepspeed-v100-2node-log-stops-iter8.log (ends after iteration 8 of "
                  "20); silent on nanogpt-tinystories-50m-healthy.log (ends at iteration 6000 of "
                  "6000 without a run end)")

    def tick(self, run, wall):
        now = run.clock if wall is None else max(run.clock, wall)
        if run.last_progress is None or run.finished_steps:
            return self.good_run(run, now)  # a run at its planned last step is done, not stalled
        limit = max(self.cfg.min_s, self.cfg.factor * run.step_seconds.median)
        idle = now - run.last_progress
        if idle <= limit or (wall is not None and wall < run.last_progress_received):
            return self.good_run(run, now)
        active = run.active_ranks()  # (only now: a pass over every rank, per tick)
        if not active:
            return self.good_run(run, now)
        behind = sorted((rs for rs in active if rs.last_step < run.max_step),
                        key=lambda rs: (rs.last_step, rs.rank))
        return self.bad_run(run, behind, step=run.max_step, time=now, value=idle, threshold=limit,
                            message=(f"run {run.run_id} stalled: no new step for {idle:.0f} s "
                                     f"(limit {limit:.0f} s) and no run end: hung, or died without "
                                     f"saying so; {rank_summary(active, behind)}"))


def rank_summary(active: list[RankState], named: list[RankState], max_listed: int = 12,
                 max_groups: int = 3) -> str:
    """NCCL RAS style: "14 ranks at step 1234, 2 ranks at step 1233 (ranks 3, 7)". With
    many ranks it stays a line: the ranks not named are one count, however many steps
    they are spread over ("1,020 ranks at steps 1233-1234": mid-step, the ranks that have
    logged the newest step and those about to); the named ones are listed by step, at most
    ``max_listed`` of them (at least one per step) and ``max_groups`` steps, the rest
    counted."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for rs in active:
        by_step[rs.last_step].append(rs.rank)
    if len(by_step) == 1:
        return f"all {len(active)} ranks at step {next(iter(by_step))}"
    named_ids = {rs.rank for rs in named}
    steps = sorted(by_step, reverse=True)
    loud = [s for s in steps if any(r in named_ids for r in by_step[s])]
    loud_set = set(loud)
    quiet = [s for s in steps if s not in loud_set]
    parts: list[tuple[int, str]] = []
    if quiet:
        parts.append((quiet[0], _at(sum(len(by_step[s]) for s in quiet), quiet)))
    budget = max_listed
    groups = [[s] for s in loud[:max_groups - 1]]
    if loud[max_groups - 1:]:
        groups.append(loud[max_groups - 1:])  # the rest, together
    for group in groups:
        listed = sorted(r for s in group for r in by_step[s] if r in named_ids)
        shown = listed[:max(1, budget)]
        budget -= len(shown)
        more = f", +{len(listed) - len(shown)} more" if len(listed) > len(shown) else ""
        names = f" ({'ranks' if len(listed) != 1 else 'rank'} {', '.join(map(str, shown))}{more})"
        parts.append((group[0], _at(sum(len(by_step[s]) for s in group), group) + names))
    parts.sort(key=lambda part: -part[0])
    return ", ".join(text for _, text in parts)


def _at(n: int, steps: list[int]) -> str:
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {min(steps)}-{max(steps)}"
    return f"{n} rank{'s' if n != 1 else ''} at {where}"
