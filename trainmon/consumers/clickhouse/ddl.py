"""Table definitions generated from the record schemas, so schema and DDL cannot drift.

Every field of every model in :data:`trainmon.schemas.RECORD_TYPES` becomes a column (a
list of sub-models becomes a ``Nested`` group of columns); a field whose type has no
mapping here raises, so a new kind of field cannot be added without deciding its column.
Type mapping:

=========================  ===========================================================
schema                     ClickHouse
=========================  ===========================================================
int / float / bool         Int64 / Float64 (NaN and +-Inf kept) / Bool
str                        String; LowCardinality(String) for names in LOW_CARDINALITY
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

# String fields whose values repeat a lot (dictionary-encoded).
LOW_CARDINALITY = {"run_id", "host", "throttle", "name", "project", "rule",
                   "cuda_driver", "cuda_runtime", "source"}
BOOKKEEPING = {
    "_topic": "LowCardinality(String)",
    "_partition": "Int32",
    "_offset": "Int64",
    "_inserted_at": "DateTime64(6, 'UTC') DEFAULT now64(6)",
}
# Identical insert blocks (same dedup token) within this many recent blocks are dropped.
DEDUP_WINDOW = 10_000
# A part (the rows of one insert, until merges join parts) smaller than this, uncompressed,
# is written "compact": all its columns in one file instead of two or three files per
# column. ClickHouse's default limit, 10 MB, is below one 50,000-row batch of step records
# (~15 MB): each insert made ~150 files for the step table and its rollups, and creating
# them (ext4 looking for free inodes) took as much of the loader's insert thread as
# ClickHouse's own work. Draining 300,000 step records, alternating runs: insert thread
# 1.7-2.0 s against 1.05-1.1; benchmarks/pipeline_throughput.py's service alone 109-116k
# against 155-167k records/s (measured).
# Merged parts above it are written wide, as ever.
COMPACT_PART_BYTES = 256 << 20
TABLE_SETTINGS = {"non_replicated_deduplication_window": DEDUP_WINDOW,
                  "min_bytes_for_wide_part": COMPACT_PART_BYTES}


def settings_sql() -> str:
    """The SETTINGS of every MergeTree table here (record tables and rollups)."""
    return ", ".join(f"{name} = {value}" for name, value in TABLE_SETTINGS.items())


def apply_table_settings(client, table: str) -> None:
    """Give a table made by an older version the settings of a new one."""
    client.command(f"ALTER TABLE {table} MODIFY SETTING {settings_sql()}")


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


def _scalar_type(annotation, field: str, where: str) -> str | None:
    annotation = _bare(annotation)
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        if all(isinstance(v, str) for v in values):
            return "LowCardinality(String)"
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return "Int64"
        raise TypeError(f"{where}.{field}: Literal mixing types has no ClickHouse column")
    ch = _SCALARS.get(annotation)
    if ch == "String" and field in LOW_CARDINALITY:
        return "LowCardinality(String)"
    return ch


def field_columns(model: type[BaseModel], field: str) -> FieldColumns:
    """How one schema field is stored; TypeError naming the field when it cannot be."""
    where = model.__name__
    annotation, optional = unwrap_optional(model.model_fields[field].annotation)
    scalar = _scalar_type(annotation, field, where)
    if scalar is not None:
        if optional:
            scalar = (f"LowCardinality(Nullable(String))" if scalar == "LowCardinality(String)"
                      else f"Nullable({scalar})")
        return FieldColumns(field, f"`{field}` {scalar}",
                            (Column(field, scalar, field, _identity),))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and args and args[0] is str:
        value = _SCALARS.get(args[1]) if args[1] in (float, str, int) else None
        if value is not None:
            ch = f"Map(String, {value})"
            return FieldColumns(field, f"`{field}` {ch}", (Column(field, ch, field, _or_empty_dict),))
        if args[1] is Any:
            return FieldColumns(field, f"`{field}` String", (Column(field, "String", field, _json_text),))
    if origin is list and args:
        item = args[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            return _nested(item, field, where)
        item_type = _scalar_type(item, field, where)
        if item_type is not None:
            ch = f"Array({item_type})"
            return FieldColumns(field, f"`{field}` {ch}", (Column(field, ch, field, _or_empty_list),))
    raise TypeError(f"{where}.{field}: no ClickHouse column type for {annotation!r}; "
                    "add a mapping in trainmon/consumers/clickhouse/ddl.py")


def _nested(sub: type[BaseModel], field: str, where: str) -> FieldColumns:
    parts, columns = [], []
    for name in sub.model_fields:
        item, optional = unwrap_optional(sub.model_fields[name].annotation)
        ch = _scalar_type(item, name, f"{where}.{field}")
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


def create_probe_table(client, kind: str, database: str) -> str:
    """A Null-engine twin of a kind's table (stores nothing): inserting a record there
    tells whether ClickHouse can take it without writing it. Returns its name."""
    name = f"{database}._probe_{kind}"
    client.command(f"DROP TABLE IF EXISTS {name}")  # fresh, in case the table was migrated
    client.command(f"CREATE TABLE {name} AS {database}.{kind} ENGINE = Null")
    return name


def existing_columns(client, database: str, table: str) -> list[str]:
    return list(column_types(client, database, table))


def column_types(client, database: str, table: str) -> dict[str, str]:
    """Column name -> ClickHouse type, in table order."""
    result = client.query("SELECT name, type FROM system.columns WHERE database = {db:String} "
                          "AND table = {t:String} ORDER BY position",
                          parameters={"db": database, "t": table})
    return {row[0]: row[1] for row in result.result_rows}


def _nullable_of(ch: str) -> str | None:
    """The Nullable spelling of a plain scalar column type (None if there is none)."""
    if ch == "LowCardinality(String)":
        return "LowCardinality(Nullable(String))"
    if ch.startswith(("Nullable(", "LowCardinality(", "Array(", "Map(", "Nested(")):
        return None
    return f"Nullable({ch})"


def migrate_table(client, kind: str, database: str) -> list[str]:
    """Add columns for schema fields the table lacks, and make a column Nullable whose
    field became optional (e.g. ``step.norm``); returns the fields added or widened.

    Otherwise a field whose type changed, or that was removed, keeps its old column
    (ClickHouse cannot rewrite a column's type in place cheaply). Widening to Nullable is
    the one retyping done: old rows keep their values, and without it a record lacking
    the field could not be inserted at all.
    """
    have = column_types(client, database, kind)
    changed = []
    for f in table_fields(RECORD_TYPES[kind]):
        if not any(c.name in have for c in f.columns):
            client.command(f"ALTER TABLE {database}.{kind} ADD COLUMN IF NOT EXISTS {f.definition}")
            changed.append(f.field)
            continue
        old = have.get(f.field) if len(f.columns) == 1 else None
        if old is not None and old != f.columns[0].type and _nullable_of(old) == f.columns[0].type:
            from .rollups import drop_views

            drop_views(client, database)  # a column a view reads cannot be retyped; recreated next
            client.command(f"ALTER TABLE {database}.{kind} MODIFY COLUMN {f.definition}")
            changed.append(f.field)
    return changed


def create_all(client, database: str = "trainmon") -> None:
    """Create (or migrate) the database, one table per record kind, the rollups
    (pre-aggregated tables the dashboards read, see :mod:`.rollups`) and the views.

    Safe to call at every start: existing tables only gain missing columns (and Nullable
    where a field became optional) and this version's TABLE_SETTINGS, and the views are
    replaced (``CREATE OR REPLACE``), so a view that gained a column has it after the next
    start.
    """
    from .rollups import create_rollups
    from .views import create_views

    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    for kind in RECORD_TYPES:
        client.command(create_table_sql(kind, database))
        apply_table_settings(client, f"{database}.{kind}")
        migrate_table(client, kind, database)
    create_rollups(client, database)
    create_views(client, database)
