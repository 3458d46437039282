"""The rule contract: one class per rule, registered with its name and settings model when
it is defined, its memory in dataclasses that codec.py saves and loads.

    @dataclass(slots=True)
    class Seen:
        count: int = 0

    class LossWobble(RuleConfig):
        limit: float = Field(3.0, gt=0)

    class LossWobbleRule(Rule, name="loss_wobble", config=LossWobble):
        kinds = ("step",)
        rank_state = Seen
        fires_when = "the loss wobbles more than {limit}"  # the docs table, generated
        ...

A rule looks at one record of one rank and reports an observation: ``bad`` or ``good``
tells the incident book, which decides whether that fires or resolves an incident. What
it keeps per rank is ``rank.slot(rule)``, a ``rank_state``; per run (the rules that compare
ranks), ``run.slot(rule)``, a ``run_state``. Rules whose evidence is the absence of
records (a stall, a rank behind) are ``TickRule``s, evaluated on the engine's tick.

A field the record does not carry (None: the framework did not log it) is no data: the
rule says nothing about that record, neither bad nor healthy, and keeps its state as it
was. NaN is data (logged, not finite): the non-finite rule judges it, the others skip it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

from ....schemas import AlertRecord
from ..incidents import WHOLE_RUN, IncidentBook
from ..rule_config import RuleConfig
from ..state import RankState, RunState
from . import codec

RUN = "run"  # subject of an incident that concerns the whole run


class Registered(NamedTuple):
    rule: type["Rule"]
    config: type[RuleConfig]


# Every rule by name, in the order its family modules are imported (rules/__init__.py):
# the order of config.Rules, the docs and the engine's evaluation of one record.
RULES: dict[str, Registered] = {}


def register(name: str, rule: type["Rule"], config: type[RuleConfig]) -> None:
    if name in RULES:
        raise ValueError(f"alert rule {name!r} is defined twice ({RULES[name].rule.__qualname__} "
                         f"and {rule.__qualname__})")
    if not (isinstance(config, type) and issubclass(config, RuleConfig)):
        raise TypeError(f"alert rule {name!r}: config must be a RuleConfig model, got {config!r}")
    RULES[name] = Registered(rule, config)


class Rule:
    name: str = ""
    kinds: tuple[str, ...] = ()
    whole_run = False  # observed for the run as a whole (tick rules), not per rank
    lasting = False  # its incidents outlive the run's end (resolved when the run starts again)
    worse_when_higher = True  # for escalations: which way a value gets worse
    # Its rank state follows the run's course (a loss level, a trend, the step time): a
    # run whose steps go back (resumed from an earlier checkpoint) retraces that course
    # from there, so the state starts again rather than judge it against where it got to.
    restarts_with_steps = False
    rank_state: ClassVar[type | None] = None  # a dataclass: what it keeps per rank
    run_state: ClassVar[type | None] = None  # a dataclass: what it keeps per run
    # The docs table (docs.py): ``{setting}`` shows as `setting`=default, ``{setting.value}``
    # as the default alone.
    fires_when: ClassVar[str] = ""
    catches: ClassVar[str] = ""
    checked_on: ClassVar[str] = ""

    def __init_subclass__(cls, name: str | None = None, config: type[RuleConfig] | None = None, **kw):
        """``class XRule(Rule, name="x", config=X)`` registers the rule; a base of other
        rules names none."""
        super().__init_subclass__(**kw)
        if name is not None:
            register(name, cls, config)

    def __init__(self, name: str, cfg: RuleConfig, book: IncidentBook):
        self.name = name
        self.cfg = cfg
        self.book = book

    def observe(self, record, t: float, run: RunState, rank: RankState):
        """An AlertRecord, a list of them, or None."""
        raise NotImplementedError

    # -- state: created lazily by rank.slot / run.slot, saved by the codec ----------------

    def new_state(self) -> Any:
        return codec.new(self.rank_state, self.cfg)

    def dump_state(self, state: Any) -> Any:
        return codec.dump(state)

    def load_state(self, data: Any) -> Any:
        return codec.load(self.rank_state, data, self.cfg)

    def new_run_state(self) -> Any:
        return codec.new(self.run_state, self.cfg)

    def dump_run_state(self, state: Any) -> Any:
        return codec.dump(state)

    def load_run_state(self, data: Any) -> Any:
        return codec.load(self.run_state, data, self.cfg)

    # -- observations -------------------------------------------------------------------

    def bad(self, run: RunState, rank: RankState, *, step, t, value, threshold, message,
            subject: str = RUN, severity: str | None = None, fire_now: bool = False,
            check_stale: bool = True):
        return self.book.bad(self.cfg, self.name, run.run_id, subject, rank.rank, step=step, time=t,
                             value=value, threshold=threshold, message=message,
                             world_size=rank.world_size, host=rank.host, severity=severity,
                             fire_now=fire_now, check_stale=check_stale,
                             escalates=self._escalation(value))

    def good(self, run: RunState, rank: RankState, *, step, t, value=None,
             subject: str = RUN) -> AlertRecord | None:
        if (self.name, run.run_id, subject) not in self.book.keys:
            return None  # the common case: nothing pending, nothing open
        return self.book.good(self.cfg, self.name, run.run_id, subject, rank.rank, step=step,
                              time=t, value=value)

    def _escalation(self, value):
        """Whether ``value`` is ``escalate_factor`` times worse than an open incident's."""
        factor = self.cfg.escalate_factor
        if factor is None or value is None or not (0 < value < math.inf):
            return None
        higher = self.worse_when_higher

        def escalates(alert: AlertRecord) -> bool:
            fired = alert.value
            if fired is None or not (0 < fired < math.inf):
                return False
            return value >= factor * fired if higher else value <= fired / factor
        return escalates


class TickRule(Rule):
    """A rule over the absence of records (a stall, a rank behind, an overdue save): the
    engine calls ``tick`` for each run; its incidents are the whole run's."""

    kinds = ()
    whole_run = True
    # Whether engine.tick_behind runs it: only a rule whose evidence lies on one partition
    # (read in order) can judge while other partitions are still unread.
    judges_while_behind = False

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


def sig4(x: float) -> str:
    """A value for a message: four significant digits."""
    return f"{x:.4g}"


def history(n: int) -> str:
    """How much history a verdict had, for the message."""
    return "its 1 earlier record" if n == 1 else f"its last {n} records"
