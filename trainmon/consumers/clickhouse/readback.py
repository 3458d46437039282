"""Rows read back from ClickHouse as records again (for checks, exports, tests).

Takes rows as ``trainmon sql --format json`` prints them (JSONEachRow with NaN / Inf
quoted). Maps and lists cannot be NULL in ClickHouse: an optional one that was None is
stored empty and reads back as None (an explicit empty one reads back as None, too).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from ...schemas import RECORD_TYPES, Record
from .ddl import unwrap_optional, table_fields


def record_from_row(kind: str, row: dict) -> Record:
    model = RECORD_TYPES[kind]
    values = {}
    for f in table_fields(model):
        columns = f.columns
        if columns[0].name != f.field:  # Nested: one array per sub-field
            subs = [c.name.split(".", 1)[1] for c in columns]
            arrays = [row[c.name] for c in columns]
            values[f.field] = [dict(zip(subs, items)) for items in zip(*arrays)]
            continue
        value, ch = row[f.field], columns[0].type
        if value is None or (value in ({}, []) and _optional(model, f.field)):
            continue
        if ch.startswith("DateTime64"):
            value = datetime.fromisoformat(value).replace(tzinfo=timezone.utc)
        elif ch == "String" and columns[0].extract.__name__ == "_json_text":
            value = json.loads(value) if value else {}
        values[f.field] = value
    return model.model_validate(values)


def _optional(model, field: str) -> bool:
    return unwrap_optional(model.model_fields[field].annotation)[1]
