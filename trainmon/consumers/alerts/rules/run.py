"""Run records: a run that ended failed or aborted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rule_config import RuleConfig, Severity
from ..state import RunState
from .base import RUN, Rule


class RunFailed(RuleConfig):
    severity: Severity = "critical"  # an aborted run (cancelled): warning


@dataclass(slots=True)
class Failure:
    status: str  # failed or aborted
    reason: str
    t: float  # record time of the rank's end


@dataclass(slots=True)
class Failures:
    by_rank: dict[int, Failure] = field(default_factory=dict)  # the ranks that ended failed


class RunFailedRule(Rule, name="run_failed", config=RunFailed):
    """A run end with status failed (or aborted: warning), with its reason. Other topics
    may still hold the rank's last records when its end arrives, so the failure is noted
    here and judged when the engine applies the ends (``on_ends``, on its next tick, once
    every partition is read): the alert then knows the last step, and names every rank that
    failed by then with its reason (the first failure, usually the cause, first). The
    incident stays open after the run's end and resolves when the run starts again."""

    kinds = ("run",)
    lasting = True
    run_state = Failures
    fires_when = ("a run end with status failed (aborted: warning), its reason in the message; "
                  "stays open after the run's end and resolves when the run starts again")
    catches = ("crashes: tracebacks, CUDA OOM, NCCL errors and watchdog timeouts (a hang the "
               "watchdog ended), Slurm time limits")
    checked_on = ("megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log (rank 4's "
                  "FileNotFoundError, then rank 0's NCCL watchdog timeout after 600 s), "
                  "megatron-lm-4gpu-second-iteration-nccl-watchdog-timeout.log")

    def observe(self, r, t, run, rank):
        if r.event != "end":
            return None
        failures = run.slot(self).by_rank
        if r.status in ("failed", "aborted"):
            failures[rank.rank] = Failure(r.status, (r.reason or "no reason given")[:1000], t)
        else:
            failures.pop(rank.rank, None)
        return None

    def on_ends(self, run: RunState, ranks: list[int]):
        st = run.slots.get(self.name)
        failures = st.by_rank if st is not None else {}
        ended = sorted((failures[rk].t, rk) for rk in ranks if rk in failures)
        if not ended:
            return None
        first = run.ranks[ended[0][1]]
        statuses = {failures[rk].status for _, rk in ended}
        status = "failed" if "failed" in statuses else "aborted"
        by_reason: dict[str, list[int]] = {}
        for _, rk in ended:
            by_reason.setdefault(failures[rk].reason, []).append(rk)
        parts = [f"{rank_list(rks)}{f' ({run.ranks[rks[0]].host})' if len(rks) == 1 else ''}: {reason}"
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


def rank_list(ranks: list[int]) -> str:
    """"rank 3", or "ranks 0-3, 7" for sorted rank numbers."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return f"ranks {', '.join(spans)}"
