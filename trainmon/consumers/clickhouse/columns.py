"""Records to column batches, and the insert every writer uses.

``insert_records(client, records)`` is the public way to put records into the tables
(tests, demos, backfills): it groups them by kind and inserts one column batch per kind.
The consumer service uses :func:`insert_batch` with Kafka coordinates and a dedup token.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Iterable, Sequence

from ...schemas import RECORD_TYPES, Record
from .client import DEFAULT_DATABASE
from .ddl import BOOKKEEPING, Column, _identity, _or_empty_dict, _or_empty_list, data_columns
from .settings import INSERT_SETTINGS

KAFKA_COLUMNS = ("_topic", "_partition", "_offset")
# Every insert here. optimize_on_insert=0: ClickHouse would otherwise sort-and-merge each
# block by its table's key on the way in (collapse repeats of the ReplacingMergeTree key,
# combine the rollups' aggregate states), which costs the embedded engine about half its
# insert time; the same merge happens in the background anyway, every read that needs one
# row per key says FINAL, and the rollups' views group each block themselves.
_SETTINGS = {**INSERT_SETTINGS, "optimize_on_insert": 0}
# Inserts of records as JSON lines (insert_json). A field the table lacks is an error, not
# a column silently left out; times carry their zone (``Z`` or ``+02:00``, which the
# "basic" format refuses); a batch (~17 MB at 50,000 step records) is parsed in 1 MiB
# chunks on every core, not in one 10 MiB chunk (the default) on one: 20-30 % faster here.
# A field a record leaves out gets its column's DEFAULT: a derived field's is computed
# (ddl.derived_default; ClickHouse's default, said here as the loader relies on it).
_JSON_SETTINGS = {**_SETTINGS, "input_format_skip_unknown_fields": 0,
                  "input_format_defaults_for_omitted_fields": 1,
                  "date_time_input_format": "best_effort",
                  "min_chunk_bytes_for_parallel_parsing": 1 << 20}


@lru_cache(maxsize=None)
def _columns(kind: str) -> tuple[Column, ...]:
    return tuple(data_columns(RECORD_TYPES[kind]))


@lru_cache(maxsize=None)
def _type_names(kind: str) -> tuple[str, ...]:
    """ClickHouse types of the inserted columns, in to_columns order then KAFKA_COLUMNS:
    given to the client, they spare a DESCRIBE TABLE round trip per insert."""
    return (*(c.type for c in _columns(kind)), *(BOOKKEEPING[name] for name in KAFKA_COLUMNS))


def to_columns(kind: str, records: Sequence[Record]) -> tuple[list[str], list[list]]:
    """Column names and column-oriented values for records of one kind."""
    names, values = [], []
    dicts = [r.__dict__ for r in records]
    for column in _columns(kind):
        names.append(column.name)
        field, extract = column.field, column.extract
        if extract.__name__ == "_identity":
            values.append([d[field] for d in dicts])
        else:
            values.append([extract(d[field]) for d in dicts])
    return names, values


def insert_batch(client, kind: str, records: Sequence[Record], *, database: str = DEFAULT_DATABASE,
                 kafka: tuple[str, int, Sequence[int]] | None = None,
                 dedup_token: str | None = None, table: str | None = None,
                 settings: dict | None = None) -> None:
    """Insert records of one kind as one column batch.

    ``kafka`` = (topic, partition, offsets) fills the bookkeeping columns. ``dedup_token``
    makes a retry of the identical batch a no-op (MergeTree insert deduplication).
    ``table`` overrides the kind's own table (``database.kind``); ``settings`` are added
    to the insert's query settings.
    """
    if not records:
        return
    names, values = to_columns(kind, records)
    n = len(records)
    topic, partition, offsets = kafka if kafka else ("", -1, [-1] * n)
    names += KAFKA_COLUMNS
    values += [[topic] * n, [partition] * n, list(offsets)]
    settings = {**_SETTINGS, **(settings or {})}
    if dedup_token:
        settings["insert_deduplication_token"] = dedup_token
    client.insert(table or f"{database}.{kind}", values, column_names=names,
                  column_type_names=_type_names(kind), column_oriented=True, settings=settings)


@lru_cache(maxsize=None)
def json_ready(kind: str) -> bool:
    """Whether ClickHouse reads a record of this kind from its JSON encoding (``encode``)
    exactly as :func:`insert_batch` writes it: every column holds its field as it is, an
    absent (None) field being the column's NULL / empty default. Not so for kinds with
    Nested sub-records or free-form JSON text columns."""
    plain = (_identity, _or_empty_dict, _or_empty_list)
    return all(c.extract in plain for c in _columns(kind))


def json_body(kafka: tuple[str, int, Sequence[int]], values: Sequence[bytes]) -> bytes | None:
    """The body of a :func:`insert_json`: records of a :func:`json_ready` kind in their
    JSON encoding, as they came from Kafka, each with its Kafka coordinates put in front
    (nothing else is built in Python). ``values[i]``, at offset ``offsets[i]``, holds one
    record per line, each line a JSON object (``{...}``): a Kafka message's value as
    ``schemas.pack`` writes it, its records sharing its offset. None when a line does not
    start a JSON object (a blank one, say): those records are decoded one by one instead.

    (A bytes method per message, a list of lines, one join: ~250 ns per record, where a
    search-and-replace of each line's start took ~900 with its check.)"""
    topic, partition, offsets = kafka
    fields = b'"_topic":%s,"_partition":%d,"_offset":' % (json.dumps(topic).encode(), partition)
    parts = []
    for offset, value in zip(offsets, values):
        lines = value.split(b"\n")
        for line in lines:
            if line[:1] != b"{":
                return None
        front = b"{%s%d," % (fields, offset)  # replaces each line's "{"
        parts.append(front + (b"\n" + front).join([line[1:] for line in lines]))
    return b"\n".join(parts)


def insert_json(client, kind: str, body: bytes, *, database: str, dedup_token: str,
                settings: dict | None = None) -> None:
    """Insert a :func:`json_body` of ``kind`` records: ClickHouse parses them."""
    client.raw_insert(f"{database}.{kind}", None, body, fmt="JSONEachRow",
                      settings={**_JSON_SETTINGS, **(settings or {}), "insert_deduplication_token": dedup_token})


def insert_records(client, records: Iterable[Record], database: str = DEFAULT_DATABASE) -> int:
    """Insert records of any kinds (no Kafka coordinates: ``_partition`` = -1).

    Call ``create_all(client, database)`` first. Returns the number of rows inserted.
    """
    by_kind: dict[str, list[Record]] = {}
    for record in records:
        by_kind.setdefault(record.kind, []).append(record)
    for kind, batch in by_kind.items():
        insert_batch(client, kind, batch, database=database)
    return sum(len(b) for b in by_kind.values())
