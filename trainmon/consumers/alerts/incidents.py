"""Incidents: a condition observed bad fires once, observed healthy again resolves once.

An incident is keyed by (rule, run, subject): subject "run" for a condition of the whole
run (loss, grad norm, mismatch), "rank3" or "rank3/gpu0" for one rank or one GPU. Rules
report observations; the book turns them into firing / resolved AlertRecords, debounced
(``fire_after``, ``fire_after_s``, ``clear_after``), de-duplicated (one open incident per
key), cooled down after resolving (``cooldown_s``) and rate limited per run. An
escalation (an observation much worse than the one the open incident fired with, or more
severe) resolves the open incident as superseded and fires the next one of its key, so
it notifies again. The incidents of lasting rules (a failed run) outlive the run's end.

Every state change of an incident is an AlertRecord, and ``apply`` is the only place that
changes it, so the book can be rebuilt by replaying the alert topic. Ids are deterministic:
``<run>/<rule>/<subject>#<n>`` for the n-th incident of a key, and the event id is a hash
of the incident id and state, so an alert emitted again after a restart is recognizably
the same event.
"""

from __future__ import annotations

import hashlib
import socket
from collections import deque
from datetime import datetime, timezone
from typing import Callable, Iterable

from ...schemas import AlertRecord
from .rule_config import RuleConfig

UTC = timezone.utc
WHOLE_RUN = -1  # rank key of observations made for the run as a whole (mismatch, stall)
Key = tuple  # (rule, run_id, subject)
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
# An alert's message is cut to this: an alert is one Kafka message, 1 MB at most, and one
# naming every rank's reason (a failed run of thousands of ranks) would be refused for good.
MAX_MESSAGE_CHARS = 8000


def cut(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    if len(message) <= limit:
        return message
    tail = f" ... [{len(message) - limit:,} more characters cut]"
    return message[:limit - len(tail)] + tail


def incident_id(run_id: str, rule: str, subject: str, ordinal: int) -> str:
    return f"{run_id}/{rule}/{subject}#{ordinal}"


def event_id(incident: str, state: str) -> str:
    return f"alert-{hashlib.sha256(incident.encode()).hexdigest()[:32]}-{state}"


def parse_incident_id(alert: AlertRecord) -> tuple[Key, int] | None:
    prefix = f"{alert.run_id}/{alert.rule}/"
    if not alert.incident_id.startswith(prefix):
        return None
    subject, _, ordinal = alert.incident_id[len(prefix):].rpartition("#")
    if not subject or not ordinal.isdigit():
        return None
    return (alert.rule, alert.run_id, subject), int(ordinal)


class Streak:
    __slots__ = ("bad", "since", "good")

    def __init__(self, bad: int = 0, since: float | None = None, good: int = 0):
        self.bad = bad
        self.since = since
        self.good = good


class Incident:
    __slots__ = ("alert", "bad", "ranks", "opened_at")

    def __init__(self, alert: AlertRecord, bad: Iterable[int], ranks: Iterable[int]):
        self.alert = alert  # the firing event
        self.bad = set(bad)  # rank keys observed bad and not yet healthy again
        self.ranks = set(ranks)  # every rank involved, for the resolved event
        self.opened_at = alert.time.timestamp()


class KeyState:
    __slots__ = ("ordinal", "open", "closed_at", "closed_step", "streaks")

    def __init__(self):
        self.ordinal = 0
        self.open: Incident | None = None
        self.closed_at: float | None = None
        self.closed_step: int | None = None
        self.streaks: dict[int, Streak] = {}


class IncidentBook:
    def __init__(self, rate_limit_per_minute: int, whole_run_rules: Iterable[str] = (),
                 lasting_rules: Iterable[str] = ()):
        self.rate_limit = rate_limit_per_minute
        self.whole_run_rules = set(whole_run_rules)
        # Rules whose incidents outlive the run's end (a failed run stays failed until it
        # starts again).
        self.lasting_rules = frozenset(lasting_rules)
        self.keys: dict[Key, KeyState] = {}
        self.by_run: dict[str, set[Key]] = {}
        self.fired: dict[str, deque[float]] = {}
        self.suppressed = 0  # firings held back by the rate limit
        self.emit = True  # False while warming up: streaks update, incidents stay as they are
        self.host = socket.gethostname()

    # -- observations ------------------------------------------------------------------

    def bad(self, cfg: RuleConfig, rule: str, run_id: str, subject: str, rank_key: int, *,
            step: int | None, time: float, value: float | None, threshold: float | None,
            message: str, world_size: int, host: str, ranks: list[int] | None = None,
            check_stale: bool = True, severity: str | None = None, fire_now: bool = False,
            escalates: Callable[[AlertRecord], bool] | None = None) -> AlertRecord | list[AlertRecord] | None:
        """A bad observation. ``severity`` overrides the rule's for this observation;
        ``fire_now`` fires without waiting for ``fire_after`` / ``fire_after_s`` (an
        order-of-magnitude jump); ``escalates(open alert)`` says whether this observation is
        much worse than the one the open incident fired with: then the open incident
        resolves as superseded and a new one fires (a higher severity escalates too)."""
        key = (rule, run_id, subject)
        ks = self.keys.get(key)
        if ks is None:
            ks = self._new_key(key)
        inc = ks.open
        if inc is None and check_stale and step is not None and ks.closed_step is not None \
                and step <= ks.closed_step:
            return None  # a late record from before the incident resolved
        st = ks.streaks.get(rank_key)
        if st is None:
            st = ks.streaks[rank_key] = Streak()
        st.good = 0
        st.bad += 1
        if st.since is None:
            st.since = time
        ranks = [rank_key] if ranks is None else ranks
        severity = severity or cfg.severity
        if inc is not None:
            inc.bad.add(rank_key)
            inc.ranks.update(ranks)
            if self.emit and (SEVERITY_RANK[severity] > SEVERITY_RANK[inc.alert.severity]
                              or (escalates is not None and escalates(inc.alert))):
                return self._escalate(ks, inc, rule, run_id, subject, rank_key, step=step, time=time,
                                      value=value, threshold=threshold, message=message,
                                      world_size=world_size, host=host, ranks=ranks, severity=severity)
            return None
        if not self.emit:
            return None
        if not fire_now and (st.bad < cfg.fire_after or time - st.since < cfg.fire_after_s):
            return None
        if ks.closed_at is not None and time - ks.closed_at < cfg.cooldown_s:
            return None
        # A lasting rule's observation (a run's failure) is made once, not again on the next
        # record: held back by the rate limit, it would never fire.
        if rule not in self.lasting_rules and not self._within_rate(run_id, time):
            self.suppressed += 1
            return None
        alert = self._fire(ks, rule, run_id, subject, step=step, time=time, value=value,
                           threshold=threshold, message=message, world_size=world_size, host=host,
                           ranks=ranks, severity=severity)
        ks.open.bad = {rank_key}
        return alert

    def _fire(self, ks: KeyState, rule: str, run_id: str, subject: str, *, step, time, value,
              threshold, message, world_size, host, ranks, severity) -> AlertRecord:
        iid = incident_id(run_id, rule, subject, ks.ordinal + 1)
        alert = AlertRecord(
            run_id=run_id, rank=ranks[0] if ranks else 0, world_size=world_size, host=host,
            time=_dt(time), event_id=event_id(iid, "firing"), rule=rule, severity=severity,
            state="firing", incident_id=iid, ranks=sorted(ranks), step=step, value=value,
            threshold=threshold, message=cut(message))
        self.apply(alert)
        return alert

    def _escalate(self, ks: KeyState, inc: Incident, rule: str, run_id: str, subject: str,
                  rank_key: int, *, step, time, value, threshold, message, world_size, host, ranks,
                  severity) -> list[AlertRecord] | None:
        if rule not in self.lasting_rules and not self._within_rate(run_id, time):
            self.suppressed += 1
            return None
        old = inc.alert
        bad, involved = set(inc.bad), set(inc.ranks) | set(ranks)
        resolved = self._resolve(ks, inc, step, time, value, f"escalated, superseded by #{ks.ordinal + 1}")
        was = f"{old.value:.4g}" if old.value is not None else old.severity
        where = f" at step {old.step}" if old.step is not None else ""
        fired = self._fire(ks, rule, run_id, subject, step=step, time=time, value=value,
                           threshold=threshold, world_size=world_size, host=host,
                           ranks=sorted(involved), severity=severity,
                           message=f"{cut(message, MAX_MESSAGE_CHARS - 200)} [escalated from {was}{where}, "
                                   f"incident #{ks.ordinal}]")
        ks.open.bad = bad | {rank_key}
        return [resolved, fired]

    def good(self, cfg: RuleConfig, rule: str, run_id: str, subject: str, rank_key: int, *,
             step: int | None, time: float, value: float | None = None,
             check_stale: bool = True) -> AlertRecord | None:
        ks = self.keys.get((rule, run_id, subject))
        if ks is None:
            return None
        inc = ks.open
        if inc is None:
            ks.streaks.pop(rank_key, None)
            if not ks.streaks and not ks.ordinal:
                self._drop_key((rule, run_id, subject))  # a blip that never fired: forget it
            return None
        if check_stale and step is not None and inc.alert.step is not None and step < inc.alert.step:
            return None  # a late record from before the incident fired
        st = ks.streaks.get(rank_key)
        if st is None:
            st = ks.streaks[rank_key] = Streak()
        st.bad = 0
        st.since = None
        st.good += 1
        if rank_key in inc.bad and st.good >= cfg.clear_after:
            inc.bad.discard(rank_key)
        if inc.bad or not self.emit:
            return None
        return self._resolve(ks, inc, step, time, value, "healthy again")

    # -- run lifecycle ------------------------------------------------------------------

    def end_rank(self, run_id: str, rank: int, time: float, step: int | None) -> list[AlertRecord]:
        """A rank finished: it is no longer bad, and its own incidents resolve (those of
        the lasting rules, a failed run, stay open)."""
        out = []
        own = (f"rank{rank}", f"rank{rank}/")
        for key in list(self.by_run.get(run_id, ())):
            if key[0] in self.lasting_rules:
                continue
            ks = self.keys[key]
            ks.streaks.pop(rank, None)
            inc = ks.open
            if inc is None:
                continue
            if key[2] == own[0] or key[2].startswith(own[1]):
                inc.bad.clear()
            else:
                inc.bad.discard(rank)
            if not inc.bad and self.emit:
                out.append(self._resolve(ks, inc, step, time, None, f"rank {rank} finished"))
        return out

    def end_run(self, run_id: str, time: float, step: int | None, reason: str,
                keep: Iterable[str] = ()) -> list[AlertRecord]:
        """The run is gone: its incidents resolve, except those of the lasting rules and
        of the rules in ``keep`` (a stall when the run is forgotten for its silence)."""
        out = []
        keep = self.lasting_rules.union(keep)
        for key in list(self.by_run.get(run_id, ())):
            ks = self.keys[key]
            if key[0] in keep:
                continue
            ks.streaks.clear()
            if ks.open is not None and self.emit:
                out.append(self._resolve(ks, ks.open, step, time, None, reason))
        return out

    def resolve_rules(self, run_id: str, rules: Iterable[str], time: float, step: int | None,
                      reason: str) -> list[AlertRecord]:
        """Resolve the open incidents of ``rules`` of a run (a failed run that restarted)."""
        out = []
        rules = set(rules)
        for key in list(self.by_run.get(run_id, ())):
            ks = self.keys[key]
            if key[0] in rules and ks.open is not None and self.emit:
                ks.streaks.clear()
                out.append(self._resolve(ks, ks.open, step, time, None, reason))
        return out

    def steps_start_over(self, run_id: str) -> None:
        """The run's step count went back (resumed from an earlier checkpoint): a step at or
        below where an incident resolved is no longer a late record from before it."""
        for key in self.by_run.get(run_id, ()):
            self.keys[key].closed_step = None

    def forget_run(self, run_id: str) -> None:
        """Drop everything about a run long gone (its incident numbering included)."""
        for key in self.by_run.pop(run_id, set()):
            del self.keys[key]
        self.fired.pop(run_id, None)

    def open_incidents(self, run_id: str | None = None) -> list[AlertRecord]:
        keys = self.keys if run_id is None else self.by_run.get(run_id, ())
        return [self.keys[k].open.alert for k in keys if self.keys[k].open is not None]

    # -- the one state transition ------------------------------------------------------

    def apply(self, alert: AlertRecord) -> None:
        """Take a firing / resolved event into account (ours, or replayed from the topic).
        Applying an event again changes nothing: the service reads the alert topic back
        (at a rebalance, at each checkpoint) and meets its own events there too."""
        parsed = parse_incident_id(alert)
        if parsed is None:
            return  # not an incident of this engine's making
        key, ordinal = parsed
        ks = self.keys.get(key)
        if ks is None:
            ks = self._new_key(key)
        t = alert.time.timestamp()
        if alert.state == "firing":
            # Only a newer incident opens: the same one again, or one it superseded, must
            # not reopen what has resolved since (nor count twice against the rate limit).
            if ordinal > ks.ordinal:
                ks.ordinal = ordinal
                bad = [WHOLE_RUN] if key[0] in self.whole_run_rules else (alert.ranks or [alert.rank])
                ks.open = Incident(alert, bad, alert.ranks)
                window = self.fired.setdefault(alert.run_id, deque())
                window.append(t)
            return
        ks.ordinal = max(ks.ordinal, ordinal)
        if ks.open is not None and ks.open.alert.incident_id == alert.incident_id:
            ks.open = None
            ks.closed_at = t
            ks.closed_step = alert.step
            ks.streaks.clear()

    def drop_streaks(self, run_id: str) -> None:
        """Forget the run's observations in progress, not its incidents: another engine
        observes the run now, and should it come back here, its records are replayed."""
        for key in self.by_run.get(run_id, ()):
            self.keys[key].streaks.clear()

    # -- internals ----------------------------------------------------------------------

    def _new_key(self, key: Key) -> KeyState:
        ks = self.keys[key] = KeyState()
        self.by_run.setdefault(key[1], set()).add(key)
        return ks

    def _drop_key(self, key: Key) -> None:
        del self.keys[key]
        keys = self.by_run.get(key[1])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.by_run[key[1]]

    def _within_rate(self, run_id: str, time: float) -> bool:
        window = self.fired.get(run_id)
        if window is None:
            return True
        while window and window[0] <= time - 60.0:
            window.popleft()
        return len(window) < self.rate_limit

    def _resolve(self, ks: KeyState, inc: Incident, step, time: float, value, reason: str) -> AlertRecord:
        fired = inc.alert
        time = max(time, inc.opened_at)
        where = f" at step {step}" if step is not None else ""
        message = (f"resolved ({reason}){where}, {duration_text(time - inc.opened_at)} after it fired"
                   f"{f' at step {fired.step}' if fired.step is not None else ''}: {fired.message}")
        alert = AlertRecord(
            run_id=fired.run_id, rank=fired.rank, world_size=fired.world_size, host=fired.host,
            time=_dt(time), event_id=event_id(fired.incident_id, "resolved"), rule=fired.rule,
            severity=fired.severity, state="resolved", incident_id=fired.incident_id,
            ranks=sorted(inc.ranks), step=step, value=value, threshold=fired.threshold,
            message=cut(message))
        self.apply(alert)
        return alert

    # -- checkpoint ---------------------------------------------------------------------

    def dump(self) -> dict:
        keys = []
        for (rule, run_id, subject), ks in self.keys.items():
            if not ks.ordinal and not ks.streaks:
                continue
            keys.append({
                "key": [rule, run_id, subject], "ordinal": ks.ordinal, "closed_at": ks.closed_at,
                "closed_step": ks.closed_step,
                "streaks": [[rk, s.bad, s.since, s.good] for rk, s in ks.streaks.items()],
                "open": None if ks.open is None else {
                    "alert": ks.open.alert.model_dump(mode="json"), "bad": sorted(ks.open.bad),
                    "ranks": sorted(ks.open.ranks)},
            })
        return {"keys": keys, "fired": {r: list(w) for r, w in self.fired.items() if w},
                "suppressed": self.suppressed}

    def load(self, state: dict) -> None:
        for item in state.get("keys", []):
            ks = self._new_key(tuple(item["key"]))
            ks.ordinal = item["ordinal"]
            ks.closed_at = item["closed_at"]
            ks.closed_step = item["closed_step"]
            ks.streaks = {rk: Streak(bad, since, good) for rk, bad, since, good in item["streaks"]}
            if item["open"]:
                o = item["open"]
                ks.open = Incident(AlertRecord.model_validate(o["alert"]), o["bad"], o["ranks"])
        self.fired = {r: deque(w) for r, w in state.get("fired", {}).items()}
        self.suppressed = state.get("suppressed", 0)


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def duration_text(seconds: float) -> str:
    """A span for a message: "45 s", "12 min", "3.5 h"."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
