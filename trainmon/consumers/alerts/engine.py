"""The rules engine: records in, AlertRecords out. No Kafka here, so it can be driven by a
test or a benchmark directly, and its state is plain JSON for a checkpoint.

    engine = AlertEngine(load_config())
    alerts = engine.process(record)      # per record, record time only
    alerts += engine.tick(time.time())   # rules that notice missing records (mismatch, stall)
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from ...schemas import RECORD_TYPES, AlertRecord, Record
from .config import AlertsConfig
from .incidents import IncidentBook
from .rules import RULES, TickRule
from .state import RunState
from .thresholds import THRESHOLD_RULES

# Every rule by name, in the order the engine runs them on one record (rules/__init__.py).
RULE_CLASSES = {name: entry.rule for name, entry in RULES.items()}
# The kinds the service reads: the engine's own (run lifecycle, step progress) and every
# rule's, in the models' order; a rule over a new kind adds it here by naming it.
INPUT_KINDS = tuple(kind for kind in RECORD_TYPES if kind in {
    "run", "step", *(k for cls in RULE_CLASSES.values() for k in cls.kinds),
    *(spec.kind for spec in THRESHOLD_RULES)})
SILENCE_RULES = ("stalled",)  # stay open when a silent run is forgotten: it is still silent
MAX_TOMBSTONES = 10_000
STATE_VERSION = 3  # 3: the rules' state saved by field name (rules/codec.py); 2: robust baselines


def _add(out: list, found) -> None:
    if found:
        if isinstance(found, list):
            out.extend(found)
        else:
            out.append(found)


class AlertEngine:
    def __init__(self, config: AlertsConfig):
        self.config = config
        self.book = IncidentBook(config.rate_limit_per_minute,
                                 whole_run_rules=[n for n, c in RULE_CLASSES.items() if c.whole_run],
                                 lasting_rules=[n for n, c in RULE_CLASSES.items() if c.lasting])
        self.rules = {name: cls(name, getattr(config.rules, name), self.book)
                      for name, cls in RULE_CLASSES.items() if getattr(config.rules, name).enabled}
        self._by_kind: dict[str, list] = defaultdict(list)
        for rule in self.rules.values():
            for kind in rule.kinds:
                self._by_kind[kind].append(rule)
        self._tick_rules = [r for r in self.rules.values() if isinstance(r, TickRule)]
        self._behind_rules = [r for r in self._tick_rules if r.judges_while_behind]
        self._restarting = tuple(name for name, r in self.rules.items() if r.restarts_with_steps)
        self.runs: dict[str, RunState] = {}
        # Runs whose every rank ended, with when: late records of theirs change nothing.
        self.ended_runs: OrderedDict[str, float] = OrderedDict()
        self.processed = 0

    @property
    def warming_up(self) -> bool:
        return not self.book.emit

    @warming_up.setter
    def warming_up(self, value: bool) -> None:
        """While warming up (replaying records already judged before a restart) the rules
        update their windows but no incident fires or resolves."""
        self.book.emit = not value

    def process(self, record: Record, received: float | None = None) -> list[AlertRecord]:
        """Run the rules on one record. ``received`` is the wall clock when it arrived (the
        service passes it; None: its record time), used only to keep the wall-clock part of
        the tick rules from mistaking a burst of old records for silence."""
        self.processed += 1
        kind = record.kind
        t = record.time.timestamp()
        run = self.runs.get(record.run_id)
        out: list[AlertRecord] = []
        if run is None:
            ended = self.ended_runs.get(record.run_id)
            if ended is not None and t <= ended:
                return []
            run = self.runs[record.run_id] = RunState(record.run_id, record.world_size)
            if record.run_id in self.book.by_run:  # back after its end or a long silence
                out.extend(self._restarted(record, t, "records again after its end"))
        rs = run.ranks.get(record.rank)
        if rs is None:
            rs = run.rank(record.rank, record.host, record.world_size)
        if t > run.clock:
            run.clock = t
        if kind == "run":
            out.extend(self._lifecycle(record, t, run, rs))
            return out
        if rs.ended and t > rs.ended_at:
            run.set_ended(rs, False)  # records after its end: the rank is back (resumed)
            run.pending_ends.discard(rs.rank)
        if kind == "step" and run.on_step(rs, record.step, t, record.duration_ms,
                                          t if received is None else received, record.total_steps):
            # Resumed from a checkpoint: the rules that judge steps start over too.
            self.book.steps_start_over(record.run_id)
            for other in run.ranks.values():
                for name in self._restarting:
                    other.slots.pop(name, None)
        for rule in self._by_kind.get(kind, ()):
            found = rule.observe(record, t, run, rs)
            if found:  # mostly None: no call for it
                _add(out, found)
        return out

    def tick(self, now: float | None = None) -> list[AlertRecord]:
        """Evaluate the rules that look for missing records. ``now`` (wall clock, epoch s)
        moves a live run's clock forward past its last record; None: record time only."""
        out: list[AlertRecord] = []
        cfg = self.config
        for run in list(self.runs.values()):
            if run.pending_ends:
                out.extend(self._apply_ends(run))
                if run.run_id not in self.runs:
                    continue
            wall = None
            if now is not None:
                if now - run.clock > cfg.live_run_max_age_s:
                    # Its windows go; a stall stays open (the run is still silent) until the
                    # run reports again or ends.
                    out.extend(self._forget_run(run, run.clock + cfg.live_run_max_age_s,
                                                f"no records for {cfg.live_run_max_age_s / 3600:g} h",
                                                keep=SILENCE_RULES))
                    continue
                wall = now - cfg.wall_clock_slack_s
            for rule in self._tick_rules:
                _add(out, rule.tick(run, wall))
        return out

    def tick_behind(self, now: float | None = None) -> list[AlertRecord]:
        """While the service is behind (partitions not read to their end): the tick rules
        that judge on one partition's records alone (``judges_while_behind``: a rank
        behind the others' steps), at the step topic's own clock; ``now`` (wall clock)
        only holds back evidence received less than the slack ago, as ``tick`` does. Ends
        are not applied and nothing is forgotten here: other kinds may still be unread."""
        out: list[AlertRecord] = []
        wall = None if now is None else now - self.config.wall_clock_slack_s
        for run in self.runs.values():
            if run.last_progress is not None:
                for rule in self._behind_rules:
                    _add(out, rule.tick(run, wall, clock=run.last_progress))
        return out

    def _lifecycle(self, record, t: float, run: RunState, rs) -> list[AlertRecord]:
        if record.world_size:
            run.world_size = record.world_size
        if record.event == "start":
            run.set_ended(rs, False)
            run.pending_ends.discard(rs.rank)
            out = self._restarted(record, t, "started again")
            for rule in self._by_kind.get("run", ()):  # starts too: a rule may read the config
                _add(out, rule.observe(record, t, run, rs))
            return out
        # Other topics may still hold this rank's last records: the end takes effect on
        # the next tick, which the service runs only once every partition is read.
        run.set_ended(rs, True)
        rs.ended_at = t
        run.pending_ends.add(rs.rank)
        run.end_status = record.status
        out: list[AlertRecord] = []
        for rule in self._by_kind.get("run", ()):
            _add(out, rule.observe(record, t, run, rs))
        return out

    def _restarted(self, record, t: float, why: str) -> list[AlertRecord]:
        """A run that failed (or went silent) reports again: those incidents resolve."""
        self.book.steps_start_over(record.run_id)  # it may resume from an earlier step
        if record.run_id not in self.book.by_run:
            return []
        step = getattr(record, "step", None)
        return self.book.resolve_rules(record.run_id, self.book.lasting_rules, t, step, f"the run {why}")

    def _apply_ends(self, run: RunState) -> list[AlertRecord]:
        out: list[AlertRecord] = []
        failed = self.rules.get("run_failed")
        if failed is not None:
            _add(out, failed.on_ends(run, sorted(run.pending_ends)))
        for rank in sorted(run.pending_ends):
            rs = run.ranks[rank]
            out.extend(self.book.end_rank(run.run_id, rank, rs.ended_at, rs.last_step))
        run.pending_ends.clear()
        if run.all_ended():
            end = max(rs.ended_at for rs in run.ranks.values())
            out.extend(self._forget_run(run, end, f"run ended ({run.end_status})"))
        return out

    def _forget_run(self, run: RunState, t: float, reason: str, keep=()) -> list[AlertRecord]:
        out = self.book.end_run(run.run_id, t, run.max_step if run.max_step >= 0 else None, reason, keep)
        del self.runs[run.run_id]
        self.ended_runs[run.run_id] = max(run.clock, t)
        while len(self.ended_runs) > MAX_TOMBSTONES:
            gone, _ = self.ended_runs.popitem(last=False)
            self.book.forget_run(gone)
        return out

    def release_runs(self, run_ids) -> None:
        """Runs another engine of the group judges now (a rebalance moved their partition):
        their windows go, so no rule here acts on them, not even a tick noticing their
        silence. Their incidents stay in the book, which the service keeps current from
        the alert topic: should a run come back, an incident still open is not fired again
        and a new one is not numbered like an old one."""
        for run_id in run_ids:
            self.runs.pop(run_id, None)
            self.book.drop_streaks(run_id)

    # -- checkpoint -----------------------------------------------------------------------

    def dump(self) -> dict:
        return {"version": STATE_VERSION, "runs": [run.dump(self.rules) for run in self.runs.values()],
                "ended_runs": list(self.ended_runs.items()), "book": self.book.dump(),
                "processed": self.processed}

    def load(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"engine state version {state.get('version')!r}, expected {STATE_VERSION}")
        self.runs = {}
        for data in state["runs"]:
            run = RunState.load(data, self.rules)
            self.runs[run.run_id] = run
        self.ended_runs = OrderedDict((r, t) for r, t in state["ended_runs"])
        self.book.load(state["book"])
        self.processed = state.get("processed", 0)
