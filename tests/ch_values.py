"""One form for a value read by any ClickHouse client, so rows read through different
clients (clickhouse-connect over HTTP or on chDB, the clickhouse-go program in
tests/chgo) compare equal when they hold the same data: numbers as floats, NaN / Inf as
"nan" / "inf" / "-inf", times as {"us": microseconds since the epoch}, containers as
lists and dicts; rows of a result as a sorted list (a query without ORDER BY may return
its rows in any order)."""

from __future__ import annotations

import calendar
import json
import math
from datetime import date, datetime, timezone
from decimal import Decimal


def value(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float, Decimal)):
        f = float(v)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return f
    if isinstance(v, datetime):
        if v.tzinfo is not None:
            v = v.astimezone(timezone.utc)
        return {"us": calendar.timegm(v.utctimetuple()) * 10**6 + v.microsecond}
    if isinstance(v, date):
        return {"us": calendar.timegm(v.timetuple()) * 10**6}
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, (list, tuple)):
        return [value(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"us"}:  # a time as the Go program writes it
            return v
        return {_key(k): value(x) for k, x in v.items()}
    return str(v)  # UUID, IP addresses


def _key(k) -> str:
    k = value(k)
    if isinstance(k, float) and k.is_integer():
        return str(int(k))
    return str(k)


def rows(result_rows) -> list:
    """The rows of a result, each value in the one form, sorted."""
    out = [[value(v) for v in row] for row in result_rows]
    return sorted(out, key=lambda row: json.dumps(row, sort_keys=True))


def go_result(result: dict) -> dict:
    """A result of tests/chgo (its values already in JSON) in the one form."""
    if "error" in result:
        return result
    return {"columns": result["columns"], "rows": rows(result["rows"])}
