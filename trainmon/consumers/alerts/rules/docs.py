"""The rules tables of docs/alerts.md, generated from the rules themselves: each row is a
rule's ``fires_when`` / ``catches`` / ``checked_on`` with the defaults of its settings
model filled in, so a changed default cannot leave the docs behind. The threshold rules'
table comes from thresholds.THRESHOLD_RULES. ``python -m trainmon.consumers.alerts``
prints the tables, ``--write docs/alerts.md`` puts them in place; a test checks the docs
are current."""

from __future__ import annotations

import re
from typing import Any, Iterable

from ..thresholds import markdown_table as threshold_table
from .base import RULES, Registered

HEADER = ("| rule | fires when (defaults) | severity | fire / clear / cooldown | catches | checked on |\n"
          "| --- | --- | --- | --- | --- | --- |")
_SETTING = re.compile(r"\{(\w+)(\.value)?\}")


def family(entry: Registered) -> str:
    """The module a rule is defined in: grad, loss, ..., health; thresholds for the data rules."""
    return entry.rule.__module__.rsplit(".", 1)[-1]


def show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return "none" if value is None else str(value)


def fires_when(entry: Registered) -> str:
    """The rule's condition with its defaults: ``{factor}`` -> `factor`=3, ``{factor.value}`` -> 3."""
    fields = entry.config.model_fields

    def setting(m: re.Match) -> str:
        name, bare = m.group(1), m.group(2)
        if name not in fields:
            raise KeyError(f"{entry.rule.__name__}.fires_when names {name!r}, which "
                           f"{entry.config.__name__} does not have")
        value = show(fields[name].get_default(call_default_factory=True))
        return value if bare else f"`{name}`={value}"
    return _SETTING.sub(setting, entry.rule.fires_when)


def row(name: str, entry: Registered) -> str:
    cfg = entry.config()
    debounce = f"{cfg.fire_after} / {cfg.clear_after} / {cfg.cooldown_s:g} s"
    return (f"| `{name}` | {fires_when(entry)} | {cfg.severity} | {debounce} | {entry.rule.catches} | "
            f"{entry.rule.checked_on} |")


def markdown_table(families: Iterable[str]) -> str:
    """The rows of the rules defined in ``families``, in the registry's order."""
    wanted = set(families)
    return "\n".join([HEADER] + [row(name, entry) for name, entry in RULES.items()
                                 if family(entry) in wanted])


def class_rule_families() -> list[str]:
    """The families of rules with logic of their own, in the registry's order."""
    return list(dict.fromkeys(family(e) for e in RULES.values() if family(e) != "thresholds"))


def tables() -> dict[str, str]:
    """Each generated table by the heading of docs/alerts.md it sits under."""
    logic = [f for f in class_rule_families() if f != "health"]
    return {"### Rules with logic of their own": markdown_table(logic),
            "### GPU health, checkpoints, warnings in the log": markdown_table(["health"]),
            "### Threshold rules": threshold_table()}


def update(doc: str) -> str:
    """``doc`` with the first table after each heading replaced by the generated one."""
    for heading, table in tables().items():
        start = doc.index("\n| rule |", doc.index(heading)) + 1
        end = doc.find("\n\n", start)
        doc = doc[:start] + table + (doc[end:] if end >= 0 else "\n")
    return doc
