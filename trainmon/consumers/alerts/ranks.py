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


class StragglerRule(Rule):
    """A rank whose step time exceeds ``factor`` x the median of all ranks at that step."""

    kinds = ("step",)
    # Ranks sit on different partitions, which are not read in lockstep: a step waits until
    # every rank reported it; past this many waiting steps the oldest is judged as it is.
    MAX_PENDING_STEPS = 256

    def observe(self, r, t, run, rank):
        value = r.duration_ms if self.cfg.timer is None else (r.timers or {}).get(self.cfg.timer)
        if value is None or math.isnan(value):
            return None  # not logged (or NaN): this rank has no time to compare at this step
        pending = run.slots.get(self.name)
        if pending is None:
            pending = run.slots[self.name] = {}
        by_rank = pending.get(r.step)
        if by_rank is None:
            by_rank = pending[r.step] = {}
        by_rank[rank.rank] = (value, t)
        out = []
        # Ranks not seen yet (their partition is read later) are still expected: judging
        # without them could leave the straggler's own values with no peers at all.
        if len(by_rank) >= run.reporting_ranks() + max(0, run.world_size - len(run.ranks)):
            out.extend(self._judge(run, r.step, pending.pop(r.step)))
        while len(pending) > self.MAX_PENDING_STEPS:
            oldest = min(pending)
            out.extend(self._judge(run, oldest, pending.pop(oldest)))
        return out

    def _judge(self, run: RunState, step: int, values: dict):
        if len(values) < self.cfg.min_ranks:
            return []
        median = statistics.median(v for v, _ in values.values())
        limit = self.cfg.factor * median
        out = []
        what = f"timer {self.cfg.timer!r}" if self.cfg.timer else "step time"
        for rank_id, (value, t) in values.items():
            rs = run.ranks[rank_id]
            subject = f"rank{rank_id}"
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

    def dump_run_state(self, pending):
        return [[step, [[rank, v, t] for rank, (v, t) in got.items()]] for step, got in pending.items()]

    def load_run_state(self, data):
        return {step: {rank: (v, t) for rank, v, t in got} for step, got in data}


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
        active = run.active_ranks()
        if len(active) < 2:
            return self.good_run(run, now)
        # A rank with no step yet (its partition read later, e.g. when a producer's packed
        # messages arrive rank by rank) still needs the times of the steps it is behind.
        if sum(rs.last_step is not None for rs in run.ranks.values()) >= run.world_size:
            run.forget_steps_up_to(min(rs.last_step for rs in active))
        lagging, worst = [], 0.0
        for rs in active:
            if run.max_step - rs.last_step >= self.cfg.min_steps_behind:
                behind = self.behind_for(run, rs.last_step, wall)
                if behind > self.cfg.grace_s:
                    lagging.append(rs)
                    worst = max(worst, behind)
        if not lagging:
            return self.good_run(run, now)
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
        active = run.active_ranks()
        if not active or run.last_progress is None or run.finished_steps:
            return self.good_run(run, now)  # a run at its planned last step is done, not stalled
        limit = max(self.cfg.min_s, self.cfg.factor * run.step_seconds.median)
        idle = now - run.last_progress
        if idle <= limit or (wall is not None and wall < run.last_progress_received):
            return self.good_run(run, now)
        behind = sorted((rs for rs in active if rs.last_step < run.max_step),
                        key=lambda rs: (rs.last_step, rs.rank))
        return self.bad_run(run, behind, step=run.max_step, time=now, value=idle, threshold=limit,
                            message=(f"run {run.run_id} stalled: no new step for {idle:.0f} s "
                                     f"(limit {limit:.0f} s) and no run end: hung, or died without "
                                     f"saying so; {rank_summary(active, behind)}"))


def rank_summary(active: list[RankState], named: list[RankState], max_listed: int = 16) -> str:
    """NCCL RAS style: "14 ranks at step 1234, 2 ranks at step 1233 (ranks 3, 7)"."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for rs in active:
        by_step[rs.last_step].append(rs.rank)
    named_ids = {rs.rank for rs in named}
    parts = []
    for step in sorted(by_step, reverse=True):
        ranks = sorted(by_step[step])
        n = len(ranks)
        part = f"{n} rank{'s' if n != 1 else ''} at step {step}"
        listed = [r for r in ranks if r in named_ids]
        if listed:
            shown = ", ".join(map(str, listed[:max_listed]))
            more = f", +{len(listed) - max_listed} more" if len(listed) > max_listed else ""
            part += f" ({'ranks' if len(listed) != 1 else 'rank'} {shown}{more})"
        parts.append(part)
    if len(active) == len(by_step.get(max(by_step, default=0), ())):
        return f"all {len(active)} ranks at step {max(by_step)}"
    return ", ".join(parts)
