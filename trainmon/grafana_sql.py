"""The SQL of the Grafana dashboards, as the ClickHouse data source would send it.

Grafana's ClickHouse plugin (grafana-clickhouse-datasource) rewrites a panel's SQL in two
places: the browser applies ``$__conditionalAll`` and the template variables, then the
plugin backend expands the time macros (pkg/macros/macros.go of the plugin). This module
does the same, so dashboard queries can be run against chDB or a server without Grafana
(the dashboard tests, ``trainmon sql``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Union

ALL = "$__all"  # Grafana's value for a variable set to "All"
Value = Union[str, int, Sequence[Union[str, int]]]

_FUNCTION_MACRO = re.compile(r"\$__(\w+)\(([^()]*)\)")
_BARE_MACRO = re.compile(r"\$__(fromTime_ms|toTime_ms|fromTime|toTime|interval_s)\b")
_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(?!__)(\w+)")


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime
    interval_s: int = 60


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    sql: str


def _conditional_all(sql: str, variables: Mapping[str, Value]) -> str:
    """$__conditionalAll(condition, $var): "1=1" when var is All, else the condition."""
    out, i = [], 0
    token = "$__conditionalAll("
    while (start := sql.find(token, i)) >= 0:
        depth, j = 1, start + len(token)
        while depth:
            if j >= len(sql):
                raise ValueError(f"unbalanced $__conditionalAll in: {sql}")
            depth += {"(": 1, ")": -1}.get(sql[j], 0)
            j += 1
        condition, _, var = sql[start + len(token):j - 1].rpartition(",")
        name = var.strip().lstrip("$").strip("{}").split(":")[0]
        if name not in variables:
            raise ValueError(f"$__conditionalAll names unknown variable {name!r}")
        out += [sql[i:start], "1=1" if variables[name] == ALL else condition.strip()]
        i = j
    return "".join(out) + sql[i:]


def _format(name: str, value: Value, fmt: str | None) -> str:
    if value == ALL:
        raise ValueError(f"variable {name!r} is All outside $__conditionalAll")
    values = [value] if isinstance(value, (str, int)) else list(value)
    if fmt == "csv" or (fmt is None and len(values) == 1):
        return ",".join(str(v) for v in values)
    if fmt in ("singlequote", None, "sqlstring"):
        return ",".join("'" + str(v).replace("'", "''") + "'" for v in values)
    raise ValueError(f"variable format {fmt!r} of {name!r} is not supported here")


def _variables(sql: str, variables: Mapping[str, Value]) -> str:
    def replace(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name not in variables:
            raise ValueError(f"unknown template variable ${name}")
        return _format(name, variables[name], m.group(2))

    return _VARIABLE.sub(replace, sql)


def _macros(sql: str, time: TimeRange) -> str:
    start, end = time.start.timestamp(), time.end.timestamp()
    interval = max(int(time.interval_s), 1)

    def function(m: re.Match) -> str:
        name, column = m.group(1), m.group(2).strip()
        if name == "timeFilter":
            return f"{column} >= toDateTime({int(start)}) AND {column} <= toDateTime({int(end)})"
        if name == "timeFilter_ms":
            return (f"{column} >= fromUnixTimestamp64Milli({int(start * 1000)}) AND "
                    f"{column} <= fromUnixTimestamp64Milli({int(end * 1000)})")
        if name == "timeInterval":
            return f"toStartOfInterval(toDateTime({column}), INTERVAL {interval} second)"
        if name == "timeInterval_ms":
            return f"toStartOfInterval(toDateTime64({column}, 3), INTERVAL {interval * 1000} millisecond)"
        raise ValueError(f"unknown macro $__{name}({column})")

    bare = {"fromTime": f"toDateTime({int(start)})", "toTime": f"toDateTime({int(end)})",
            "fromTime_ms": f"fromUnixTimestamp64Milli({int(start * 1000)})",
            "toTime_ms": f"fromUnixTimestamp64Milli({int(end * 1000)})",
            "interval_s": str(interval)}
    sql = _FUNCTION_MACRO.sub(function, sql)
    sql = _BARE_MACRO.sub(lambda m: bare[m.group(1)], sql)
    if "$__" in sql:
        raise ValueError(f"unexpanded macro in: {sql}")
    return sql


def expand(sql: str, time: TimeRange, variables: Mapping[str, Value] | None = None) -> str:
    """A panel's SQL as ClickHouse receives it from Grafana."""
    variables = variables or {}
    return _macros(_variables(_conditional_all(sql, variables), variables), time)


def dashboard_queries(dashboard: dict) -> Iterator[PanelQuery]:
    """Every SQL a dashboard runs: panel targets, annotations and variable queries."""
    title = dashboard["title"]
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            yield PanelQuery(title, panel["title"], target["refId"], target["rawSql"])
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "target" in annotation and "rawSql" in annotation["target"]:
            yield PanelQuery(title, f"annotation {annotation['name']}", "annotation",
                             annotation["target"]["rawSql"])
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            yield PanelQuery(title, f"variable {variable['name']}", "variable", variable["query"])


def load_dashboards(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]
