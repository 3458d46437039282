"""What the engine remembers per run and per rank: latest steps, when each step was first
reached, and each rule's own per-rank state."""

from __future__ import annotations

import bisect
import math
from typing import Any

from .stats import RollingMedian

MAX_SEEN_STEPS = 100_000


class RankState:
    __slots__ = ("rank", "host", "world_size", "last_step", "last_time", "ended", "ended_at", "slots")

    def __init__(self, rank: int, host: str, world_size: int):
        self.rank = rank
        self.host = host
        self.world_size = world_size
        self.last_step: int | None = None
        self.last_time: float | None = None
        self.ended = False
        self.ended_at = 0.0  # record time of its run end
        self.slots: dict[str, Any] = {}

    def slot(self, rule) -> Any:
        state = self.slots.get(rule.name)
        if state is None:
            state = self.slots[rule.name] = rule.new_state()
        return state


class RunState:
    def __init__(self, run_id: str, world_size: int):
        self.run_id = run_id
        self.world_size = world_size
        self.ranks: dict[int, RankState] = {}
        self.clock = 0.0  # latest record time seen for this run
        self.max_step = -1
        self.last_progress: float | None = None  # record time max_step last grew
        self.last_progress_received = 0.0  # and the wall clock when that record arrived
        # Steps in the order the run first reached them, with that record time: how long a
        # rank has been behind is "now" minus when the run first passed its last step.
        self.seen_steps: list[int] = []
        self.seen_times: list[float] = []
        self.seen_received: list[float] = []  # wall clock when the engine first saw each step
        self.step_seconds = RollingMedian(51)
        self.slots: dict[str, Any] = {}  # run-wide rule state (the rules that compare ranks)
        self.ended_count = 0
        self.pending_ends: set[int] = set()  # ranks whose end the incidents have not seen yet
        self.end_status: str | None = None
        self.total_steps: int | None = None  # the planned number of steps, when logged

    def slot(self, rule) -> Any:
        state = self.slots.get(rule.name)
        if state is None:
            state = self.slots[rule.name] = rule.new_run_state()
        return state

    def rank(self, rank: int, host: str, world_size: int) -> RankState:
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.ranks[rank] = RankState(rank, host, world_size)
        return rs

    def set_ended(self, rs: RankState, ended: bool) -> None:
        if rs.ended != ended:
            self.ended_count += 1 if ended else -1
            rs.ended = ended

    def reporting_ranks(self) -> int:
        """Ranks still expected to report each step: an end not yet applied may still have
        records of that rank behind it on other topics."""
        return len(self.ranks) - self.ended_count + len(self.pending_ends)

    def all_ended(self) -> bool:
        """Every rank that trained (reported a step) has ended; in a run without steps,
        every rank. A rank that only printed warnings or sent health records while others
        trained (``trainmon ingest`` starts no run for it) does not hold the run open."""
        trained = [rs for rs in self.ranks.values() if rs.last_step is not None]
        return all(rs.ended for rs in trained or self.ranks.values())

    def active_ranks(self) -> list[RankState]:
        return [rs for rs in self.ranks.values() if not rs.ended and rs.last_step is not None]

    def on_step(self, rs: RankState, step: int, t: float, duration_ms: float | None,
                received: float, total_steps: int | None = None) -> bool:
        """Take in a rank's step; True when it went back (resumed from a checkpoint): the
        run's step counts start over."""
        if total_steps:
            self.total_steps = total_steps
        rewound = rs.last_step is not None and step < rs.last_step
        if rewound:
            self.rewind()
        rs.last_step = step
        rs.last_time = t
        if step > self.max_step:
            self.max_step = step
            self.last_progress = t
            self.last_progress_received = received
            self.seen_steps.append(step)
            self.seen_times.append(t)
            self.seen_received.append(received)
            if duration_ms is not None and math.isfinite(duration_ms):  # else: no data
                self.step_seconds.push(duration_ms / 1000.0)
            if len(self.seen_steps) > MAX_SEEN_STEPS:
                del self.seen_steps[:MAX_SEEN_STEPS // 2]
                del self.seen_times[:MAX_SEEN_STEPS // 2]
                del self.seen_received[:MAX_SEEN_STEPS // 2]
        return rewound

    @property
    def finished_steps(self) -> bool:
        """It reached its planned last step (a job that ends without a run-end record)."""
        return bool(self.total_steps) and self.max_step >= self.total_steps

    def rewind(self) -> None:
        self.max_step = -1
        self.seen_steps.clear()
        self.seen_times.clear()
        self.seen_received.clear()
        for rs in self.ranks.values():
            rs.last_step = None

    def behind_since(self, step: int) -> tuple[float, float | None]:
        """When the run first reported a step after ``step``: its record time, and the
        wall clock at which the engine received it (None if unknown)."""
        i = bisect.bisect_right(self.seen_steps, step)
        if i < len(self.seen_times):
            return self.seen_times[i], self.seen_received[i]
        return self.clock, None

    def forget_steps_up_to(self, step: int) -> None:
        i = bisect.bisect_right(self.seen_steps, step)
        if i:
            del self.seen_steps[:i]
            del self.seen_times[:i]
            del self.seen_received[:i]

    # -- checkpoint ---------------------------------------------------------------------

    def dump(self, rules: dict) -> dict:
        return {
            "run_id": self.run_id, "world_size": self.world_size, "clock": self.clock,
            "max_step": self.max_step, "last_progress": self.last_progress,
            "last_progress_received": self.last_progress_received,
            "seen": [self.seen_steps, self.seen_times, self.seen_received], "step_seconds": self.step_seconds.dump(),
            "pending_ends": sorted(self.pending_ends), "end_status": self.end_status,
            "total_steps": self.total_steps,
            "slots": {name: rules[name].dump_run_state(s) for name, s in self.slots.items() if name in rules},
            "ranks": [{
                "rank": rs.rank, "host": rs.host, "world_size": rs.world_size,
                "last_step": rs.last_step, "last_time": rs.last_time, "ended": rs.ended,
                "ended_at": rs.ended_at,
                "slots": {name: rules[name].dump_state(s) for name, s in rs.slots.items() if name in rules},
            } for rs in self.ranks.values()],
        }

    @classmethod
    def load(cls, data: dict, rules: dict) -> "RunState":
        run = cls(data["run_id"], data["world_size"])
        run.clock = data["clock"]
        run.max_step = data["max_step"]
        run.last_progress = data["last_progress"]
        run.last_progress_received = data["last_progress_received"]
        run.seen_steps, run.seen_times, run.seen_received = data["seen"]
        run.step_seconds = RollingMedian(51, data["step_seconds"])
        run.pending_ends = set(data["pending_ends"])
        run.end_status = data["end_status"]
        run.total_steps = data.get("total_steps")
        run.slots = {n: rules[n].load_run_state(s) for n, s in data["slots"].items() if n in rules}
        for r in data["ranks"]:
            rs = run.rank(r["rank"], r["host"], r["world_size"])
            rs.last_step, rs.last_time, rs.ended_at = r["last_step"], r["last_time"], r["ended_at"]
            run.set_ended(rs, r["ended"])
            rs.slots = {n: rules[n].load_state(s) for n, s in r["slots"].items() if n in rules}
        return run
