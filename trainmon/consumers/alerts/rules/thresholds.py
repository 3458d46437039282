"""Threshold rules: the entries of thresholds.THRESHOLD_RULES (rules as data), each run by
``ThresholdRule`` with settings generated from its entry. The one place a class serves many
rules, so each entry is registered here rather than by a class statement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, create_model

from ..rule_config import RuleConfig, Severity
from ..thresholds import BY_NAME, OPS, THRESHOLD_RULES, ThresholdSpec
from .base import RUN, Rule, register

OP_WORDS = {">": "above", ">=": "at or above", "<": "below", "<=": "at or below", "==": "is"}


@dataclass(slots=True)
class RunningCounts:
    """A running-count entry's previous record per subject (ThresholdSpec.running_count):
    its time and count."""
    last: dict[str, tuple[float, float]] = field(default_factory=dict)


class ThresholdRule(Rule):
    """One entry of thresholds.THRESHOLD_RULES: ``<field> <op> <threshold>``."""

    rank_state = RunningCounts  # (kept by the running-count entries only)

    def __init__(self, name: str, cfg: RuleConfig, book):
        super().__init__(name, cfg, book)
        self.spec = BY_NAME[name]
        self.kinds = (self.spec.kind,)
        self.op = OPS[self.spec.op]
        self.field = None if "/" in self.spec.field else self.spec.field

    def observe(self, r, t, run, rank):
        spec = self.spec
        value = getattr(r, self.field) if self.field else spec.value(r)
        if value is None or value != value:
            return None
        limit = spec.threshold if spec.param is None else getattr(self.cfg, spec.param)
        subject = f"rank{rank.rank}/gpu{r.id}" if spec.per_gpu else RUN
        if spec.running_count:
            counts = rank.slot(self).last
            since, before = counts.get(subject, (-math.inf, 0.0))
            if t <= since:
                return None  # a record read again (delivery is at least once), or an older one
            counts[subject] = (t, value)
            value = value - before if value >= before else value  # (lower: a new process's count)
        if not self.op(value, limit):
            return self.good(run, rank, step=r.step, t=t, value=value, subject=subject)
        if spec.per_gpu:
            where = f"GPU {r.id} of rank {rank.rank} on {rank.host} (run {run.run_id}, step {r.step})"
        else:
            where = f"run {run.run_id}, rank {rank.rank}, step {r.step}"
        than = "" if spec.op == "==" else f" {OP_WORDS[spec.op]} {spec.show(limit)}"
        held = []
        if self.cfg.fire_after > 1:
            held.append(f"{self.cfg.fire_after} records in a row")
        if self.cfg.fire_after_s:
            held.append(f"for {self.cfg.fire_after_s:g} s")
        if spec.detail and (shown := getattr(r, spec.detail, None)) is not None:
            held.insert(0, f"{spec.detail} {shown}")
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=limit, subject=subject,
                        message=(f"{spec.name.replace('_', ' ')} on {where}: {spec.what} "
                                 f"{'is ' if spec.op == '==' else ''}{spec.show(value)}{than}"
                                 f"{' (' + ', '.join(held) + ')' if held else ''}"))


def threshold_config(spec: ThresholdSpec) -> type[RuleConfig]:
    """The settings model of one entry: its debounce and severity, and its threshold under
    the ``param`` name."""
    fields: dict[str, Any] = {
        "severity": (Severity, spec.severity),
        "fire_after": (int, Field(spec.fire_after, ge=1)),
        "fire_after_s": (float, Field(spec.fire_after_s, ge=0)),
        "clear_after": (int, Field(spec.clear_after, ge=1)),
        "cooldown_s": (float, Field(spec.cooldown_s, ge=0)),
    }
    if spec.param:
        kind = int if spec.unit == "bytes" else float
        default = kind(spec.threshold)
        fields[spec.param] = (kind, Field(default, **dict(spec.bounds)))
    name = "".join(part.title() for part in spec.name.split("_"))
    return create_model(name, __base__=RuleConfig, __doc__=spec.catches, **fields)


for _spec in THRESHOLD_RULES:
    register(_spec.name, ThresholdRule, threshold_config(_spec))
