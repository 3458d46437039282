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

from .incidents import WHOLE_RUN
from .rules import RUN, Rule
from .state import RankState, RunState


class _Pending:
    """The straggler rule's run-wide state: step times of the steps not judged yet, and
    the ranks no longer waited for. ``seq`` counts the step times observed for the run, so
    ``heard`` (a rank's latest) and ``opened`` (a step's first) say who reported what
    after what, in the order the engine read them."""

    __slots__ = ("steps", "since", "opened", "absent", "unseen_absent", "seq", "heard", "recheck",
                 "judged", "top", "clock")

    def __init__(self):
        self.steps: dict[int, dict[int, tuple[float, float]]] = {}  # step -> rank -> (value, t)
        self.since: dict[int, float] = {}  # step -> record time of its first report
        self.opened: dict[int, int] = {}  # step -> seq of its first report
        self.absent: set[int] = set()  # ranks given up on; waited for again once they report
        self.unseen_absent = 0  # ranks never seen, no longer waited for
        self.seq = 0
        self.heard: dict[int, int] = {}  # rank -> seq of its latest step time
        self.recheck = 0  # the seq from which a step past wait_s is looked at again
        self.judged: dict[int, int] = {}  # rank -> the newest step it had a verdict at
        self.top = -1  # the run's highest step so far (lower again: its steps started over)
        # The newest step-record time: wait_s runs on it, not on the run's clock, which GPU
        # or MoE records read ahead of the step topic (a replay, a warm-up) would push on.
        self.clock = 0.0

    def open(self, step: int, t: float) -> dict:
        self.steps[step] = got = {}
        self.since[step] = t
        self.opened[step] = self.seq
        return got

    def pop(self, step: int) -> dict:
        self.since.pop(step, None)
        self.opened.pop(step, None)
        return self.steps.pop(step)


class StragglerRule(Rule):
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
    MAX_PENDING_STEPS = 256  # a memory bound: past it the oldest step is judged as it is

    def observe(self, r, t, run, rank):
        value = r.duration_ms if self.cfg.timer is None else (r.timers or {}).get(self.cfg.timer)
        if value is None or math.isnan(value):
            return None  # not logged (or NaN): this rank has no time to compare at this step
        p = run.slots.get(self.name)
        if p is None:
            p = run.slots[self.name] = _Pending()
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
                    p.recheck = p.seq + len(run.ranks)  # (a pass over the ranks: once a step's worth)
                    break
            out.extend(self._judge(run, oldest, p.pop(oldest), p))
            if gave_up:  # steps that lacked only those ranks are complete now
                expected = self._expected(run, p)
                for step in [s for s, got in p.steps.items() if len(got) >= expected]:
                    out.extend(self._judge(run, step, p.pop(step), p))
        return out

    @staticmethod
    def _expected(run: RunState, p: _Pending) -> int:
        """Ranks a step waits for: those still reporting, less those given up on; ranks not
        seen yet (their partition is read later) are still expected, or the straggler's own
        values could be judged with no peers at all."""
        absent = sum(1 for rid in p.absent if (rs := run.ranks.get(rid)) is not None and not rs.ended) \
            if p.absent else 0
        unseen = max(0, run.world_size - len(run.ranks) - p.unseen_absent)
        return run.reporting_ranks() + unseen - absent

    @staticmethod
    def _give_up_on_silent(run: RunState, p: _Pending, step: int) -> tuple[bool, bool]:
        """For a step past wait_s: give up on the ranks it lacks that have not reached it
        and reported no step time since it was first reported, and on the ranks never seen.
        Returns (still waiting for ranks that report, behind it; gave up on any)."""
        values, opened = p.steps[step], p.opened[step]
        waiting, gave_up = False, False
        for rid, rs in run.ranks.items():
            if rid in values or rs.ended or rid in p.absent or (rs.last_step is not None and rs.last_step >= step):
                continue  # reported it, finished, given up on, or past it without a time there
            if p.heard.get(rid, 0) > opened:
                waiting = True
            else:
                p.absent.add(rid)
                gave_up = True
        unseen = max(0, run.world_size - len(run.ranks))
        if unseen > p.unseen_absent:
            p.unseen_absent = unseen
            gave_up = True
        return waiting and len(values) < StragglerRule._expected(run, p), gave_up

    def _judge(self, run: RunState, step: int, values: dict, p: _Pending):
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

    def dump_run_state(self, p):
        # The arrival bookkeeping (seq, heard, opened) is not kept: after a restore a step
        # past wait_s gives up on the ranks that have reported nothing since the restore.
        return {"steps": [[step, p.since.get(step), [[rank, v, t] for rank, (v, t) in got.items()]]
                          for step, got in p.steps.items()],
                "absent": sorted(p.absent), "unseen_absent": p.unseen_absent}

    def load_run_state(self, data):
        p = _Pending()
        if isinstance(data, list):  # before wait_s: [[step, [[rank, v, t], ...]], ...]
            data = {"steps": [[step, None, got] for step, got in data]}
        for step, since, got in data["steps"]:
            p.open(step, since if since is not None else min((t for _, _, t in got), default=0.0))
            p.steps[step].update((rank, (v, t)) for rank, v, t in got)
        p.absent = set(data.get("absent", ()))
        p.unseen_absent = data.get("unseen_absent", 0)
        p.clock = max((t for _, _, got in data["steps"] for _, _, t in got), default=0.0)
        return p


class TickRule(Rule):
    kinds = ()
    whole_run = True

    def tick(self, run: RunState, wall: float | None):
        """``wall``: the wall clock (less the slack) for a live run, None to decide on
        record time alone."""
        raise NotImplementedError

    def bad_run(self, run: RunState, ranks: list[RankState], **kw):
        host = ranks[0].host if ranks else next(iter(run.ranks.values())).host
        return self.book.bad(self.cfg, self.name, run.run_id, RUN, WHOLE_RUN,
                             ranks=[rs.rank for rs in ranks], world_size=run.world_size, host=host,
                             check_stale=False, **kw)

    def good_run(self, run: RunState, now: float):
        return self.book.good(self.cfg, self.name, run.run_id, RUN, WHOLE_RUN, step=run.max_step,
                              time=now, check_stale=False)


class RankMismatchRule(TickRule):
    """Ranks of one run at different latest steps for longer than ``grace_s``, e.g. one
    rank stopped reporting while the others advance."""

    def tick(self, run, wall):
        now = run.clock if wall is None else max(run.clock, wall)
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
            return self.good_run(run, now)
        # A rank with no step yet (its partition read later, e.g. when a producer's packed
        # messages arrive rank by rank) still needs the times of the steps it is behind.
        if stepped >= run.world_size:
            run.forget_steps_up_to(min(at_step))
        lagging, worst = [], 0.0
        for step, group in at_step.items():
            if run.max_step - step >= self.cfg.min_steps_behind:
                behind = self.behind_for(run, step, wall)
                if behind > self.cfg.grace_s:
                    lagging.extend(group)
                    worst = max(worst, behind)
        if not lagging:
            return self.good_run(run, now)
        active = [rs for group in at_step.values() for rs in group]
        lagging.sort(key=lambda rs: (rs.last_step, rs.rank))
        return self.bad_run(run, lagging, step=lagging[0].last_step, time=now, value=worst,
                            threshold=self.cfg.grace_s, message=(
                                f"rank iteration mismatch on run {run.run_id}: "
                                f"{rank_summary(active, lagging)}; behind for {worst:.0f} s "
                                f"(grace {self.cfg.grace_s:g} s)"))


    @staticmethod
    def behind_for(run: RunState, step: int, wall: float | None) -> float:
        """Seconds since the run first passed ``step``: by the other ranks' record times,
        and for a live run by the wall clock. Either counts only once the engine has held
        that evidence for the slack itself, so a burst (a replay, a producer's spill, a
        batch still on its way to another partition) is not mistaken for a silent rank."""
        since, received = run.behind_since(step)
        by_records = run.clock - since
        if wall is None or received is None:
            return by_records
        if wall < received:
            return 0.0
        return max(by_records, min(wall - since, wall - received))


class StalledRule(TickRule):
    """No rank of a live run reported a new step for ``factor`` x its median step time, and
    no run end came: the job hangs, or died without a word (kill -9, a lost node). It stays
    open while the run is silent, also once the engine forgets the run's windows after
    ``live_run_max_age_s``; a new step or the run's end resolves it."""

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
