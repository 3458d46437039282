"""Table definitions generated from the record schemas, so schema and DDL cannot drift.

Every field of every model in :data:`trainmon.schemas.RECORD_TYPES` becomes a column (a
list of sub-models becomes a ``Nested`` group of columns); a field whose type has no
mapping here raises, so a new kind of field cannot be added without deciding its column.
Type mapping:

=========================  ===========================================================
schema                     ClickHouse
=========================  ===========================================================
int / float / bool         Int64 / Float64 (NaN and +-Inf kept) / Bool
str                        String; LowCardinality(String) for the model's low_cardinality
Literal["a", "b"]          LowCardinality(String)
datetime                   DateTime64(6, 'UTC')
Optional[scalar]           Nullable(...)  (None is NULL)
dict[str, float|str]       Map(String, Float64|String)   (None reads back as {})
dict[str, Any]             String holding the JSON text (read with JSONExtract*)
list[int|float|str]        Array(...)                    (None reads back as [])
list[SubModel]             Nested(...) : one Array column per sub-field
=========================  ===========================================================

Each table also has the bookkeeping columns ``_topic``, ``_partition``, ``_offset``
(where the row came from in Kafka: the consumer resumes from them) and
``_inserted_at`` (when the row was written; latency is ``_inserted_at - time``).

Pure: SQL text and column plans from the models, no client. :mod:`.schema_setup` runs
the statements against a database.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel

from ...schemas import RECORD_TYPES, Record
from .settings import settings_sql

BOOKKEEPING = {
    "_topic": "LowCardinality(String)",
    "_partition": "Int32",
    "_offset": "Int64",
    "_inserted_at": "DateTime64(6, 'UTC') DEFAULT now64(6)",
}


@dataclass(frozen=True)
class Column:
    name: str              # column name as DESCRIBE shows it ("stats.name" for Nested)
    type: str              # ClickHouse type
    field: str             # the schema field it stores
    extract: Callable[[Any], Any]  # field value -> column value


@dataclass(frozen=True)
class FieldColumns:
    """The column definition of one schema field (one line of CREATE TABLE)."""

    field: str
    definition: str        # e.g. "loss Float64" or "stats Nested(name String, ...)"
    columns: tuple[Column, ...]


def _identity(value):
    return value


def _or_empty_dict(value):
    return {} if value is None else value


def _or_empty_list(value):
    return [] if value is None else value


def _json_text(value):
    return "" if value is None else json.dumps(value, separators=(",", ":"), default=str)


def _bare(annotation):
    """The type under ``Annotated[...]`` (bounds such as the schemas' Int64 / Count)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def unwrap_optional(annotation) -> tuple[Any, bool]:
    annotation = _bare(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return _bare(args[0]), True
    return annotation, False


_SCALARS = {int: "Int64", float: "Float64", bool: "Bool", str: "String",
            datetime: "DateTime64(6, 'UTC')"}


def _repeating(model: type[BaseModel]) -> frozenset[str]:
    """The model's string fields whose values repeat a lot (dictionary-encoded columns):
    what the model declares in ``low_cardinality`` (a sub-model may declare it too)."""
    return getattr(model, "low_cardinality", frozenset())


def _scalar_type(annotation, field: str, where: str, repeating: frozenset[str]) -> str | None:
    annotation = _bare(annotation)
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        if all(isinstance(v, str) for v in values):
            return "LowCardinality(String)"
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return "Int64"
        raise TypeError(f"{where}.{field}: Literal mixing types has no ClickHouse column")
    ch = _SCALARS.get(annotation)
    if ch == "String" and field in repeating:
        return "LowCardinality(String)"
    return ch


def field_columns(model: type[BaseModel], field: str) -> FieldColumns:
    """How one schema field is stored; TypeError naming the field when it cannot be."""
    where = model.__name__
    annotation, optional = unwrap_optional(model.model_fields[field].annotation)
    scalar = _scalar_type(annotation, field, where, _repeating(model))
    if scalar is not None:
        if optional:
            scalar = ("LowCardinality(Nullable(String))" if scalar == "LowCardinality(String)"
                      else f"Nullable({scalar})")
        return FieldColumns(field, f"`{field}` {scalar}{derived_default(model, field)}",
                            (Column(field, scalar, field, _identity),))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and args and args[0] is str:
        item = _bare(args[1])  # (e.g. Milliseconds)
        value = _SCALARS.get(item) if item in (float, str, int) else None
        if value is not None:
            ch = f"Map(String, {value})"
            return FieldColumns(field, f"`{field}` {ch}", (Column(field, ch, field, _or_empty_dict),))
        if args[1] is Any:
            return FieldColumns(field, f"`{field}` String", (Column(field, "String", field, _json_text),))
    if origin is list and args:
        item = args[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            return _nested(item, field, where)
        item_type = _scalar_type(item, field, where, _repeating(model))
        if item_type is not None:
            ch = f"Array({item_type})"
            return FieldColumns(field, f"`{field}` {ch}", (Column(field, ch, field, _or_empty_list),))
    raise TypeError(f"{where}.{field}: no ClickHouse column type for {annotation!r}; "
                    "add a mapping in trainmon/consumers/clickhouse/ddl.py")


def derived_default(model: type[BaseModel], field: str) -> str:
    """`` DEFAULT <sql>`` for a field the record derives (envelope.Derived): a record
    leaves it out of its JSON when it holds the derived value, and ClickHouse computes it
    then, as the record's validator would."""
    derived = getattr(model, "derived", {}).get(field)
    return f" DEFAULT {derived.sql}" if derived else ""


def _nested(sub: type[BaseModel], field: str, where: str) -> FieldColumns:
    parts, columns = [], []
    for name in sub.model_fields:
        item, optional = unwrap_optional(sub.model_fields[name].annotation)
        ch = _scalar_type(item, name, f"{where}.{field}", _repeating(sub))
        if ch is None or optional:
            raise TypeError(f"{where}.{field}.{name}: Nested sub-fields must be plain scalars")
        parts.append(f"`{name}` {ch}")
        columns.append(Column(f"{field}.{name}", f"Array({ch})", field,
                              lambda segs, n=name: [getattr(s, n) for s in segs or ()]))
    return FieldColumns(field, f"`{field}` Nested({', '.join(parts)})", tuple(columns))


def table_fields(model: type[Record]) -> list[FieldColumns]:
    return [field_columns(model, name) for name in model.model_fields]


def data_columns(model: type[Record]) -> list[Column]:
    return [c for f in table_fields(model) for c in f.columns]


def order_by(model: type[Record]) -> str:
    """Per-run time-series reads: run, rank, then step; event_id last so the
    ReplacingMergeTree collapses a record sent twice. The key holds only what a resent
    record keeps: a record read again from a log by ``trainmon ingest`` has the same id
    but, where the log prints no timestamps, a new time, so kinds without a step (run,
    alert, dataset, gpu_model: a few rows per run) are keyed by the id alone."""
    fields = model.model_fields
    step_is_key = "step" in fields and not unwrap_optional(fields["step"].annotation)[1]
    return "(run_id, rank, step, event_id)" if step_is_key else "(run_id, rank, event_id)"


def create_table_sql(kind: str, database: str) -> str:
    model = RECORD_TYPES[kind]
    lines = [f.definition for f in table_fields(model)]
    lines += [f"`{name}` {ch}" for name, ch in BOOKKEEPING.items()]
    body = ",\n    ".join(lines)
    return (f"CREATE TABLE IF NOT EXISTS {database}.{kind} (\n    {body}\n)\n"
            f"ENGINE = ReplacingMergeTree\n"
            f"PARTITION BY toYYYYMM(time)\n"
            f"ORDER BY {order_by(model)}\n"
            f"SETTINGS {settings_sql()}")


def nullable_of(ch: str) -> str | None:
    """The Nullable spelling of a plain scalar column type (None if there is none)."""
    if ch == "LowCardinality(String)":
        return "LowCardinality(Nullable(String))"
    if ch.startswith(("Nullable(", "LowCardinality(", "Array(", "Map(", "Nested(")):
        return None
    return f"Nullable({ch})"
