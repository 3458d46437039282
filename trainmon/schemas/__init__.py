"""Record schemas: one pydantic model per record type, and their wire encoding.

``RECORD_TYPES`` maps a kind ("step", "eval", ...) to its model; each kind has its own
Kafka topic. The wire format is the model's JSON (NaN / Infinity kept as constants),
and one Kafka message carries one or more records of one kind from one rank as JSON
Lines (``pack`` / ``unpack``). Kafka's per-message cost in kafka-python (~30 µs of CPU
to send, ~10 µs to fetch) is far above a record's own, so producers pack what they
have ready into one message, as OTLP exporters do with spans.

Adding a kind: a model in records.py with its ``kind`` and, where they apply, the class
variables ``low_cardinality`` (string fields ClickHouse should dictionary-encode) and
``stream_fields`` (what tells its records of one rank and step apart), and its sample in
tests/samples.py (tests/test_record_kinds.py fails until it has one). Its topic, table,
columns, W&B / Aim / TensorBoard names and forwarder stream derive from the model; a log
call for it in producer/logger.py is the one more line, for kinds jobs log themselves.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import cache

from pydantic import ValidationError

from .envelope import SCHEMA_VERSION, Record, holding_derived
from .records import (
    AlertRecord,
    AllocatorRecord,
    AllocatorSegment,
    CheckpointRecord,
    DatasetRecord,
    DiskRecord,
    EvalRecord,
    GpuHealthRecord,
    GpuModelRecord,
    GpuRecord,
    LogEventRecord,
    MoeRecord,
    ProducerHealthRecord,
    RunRecord,
    StepRecord,
)

log = logging.getLogger("trainmon.schemas")

# kind -> model, every model of records.py in its order (each registers itself).
RECORD_TYPES: dict[str, type[Record]] = dict(Record.registry)
# The kinds whose records are one training step's (metric points).
STEP_KINDS: tuple[str, ...] = tuple(kind for kind, model in RECORD_TYPES.items() if model.per_step())


class DecodeError(ValueError):
    """A message that is not a valid record; ``reason`` says why in one line."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


def encode(record: Record) -> bytes:
    """A record's JSON: the fields that hold something, a derived field only when it holds
    something else than what every reader derives (see envelope.Derived)."""
    if record.derived:
        left_out = holding_derived(record, record.derived)
        if left_out:
            return record.model_dump_json(exclude_none=True, exclude=left_out).encode()
    return record.model_dump_json(exclude_none=True).encode()


# Producers put up to this many records of one (topic, key) into one message; the bytes
# bound keeps a message well under Kafka's 1 MB default message.max.bytes.
MAX_RECORDS_PER_MESSAGE = 500
MAX_MESSAGE_BYTES = 256 * 1024


def pack(encoded: list[bytes]) -> bytes:
    """One message value from encoded records. Compact JSON never holds a raw newline
    (one inside a string is escaped), so the newline separates records safely."""
    return b"\n".join(encoded)


def unpack(value: bytes) -> list[bytes]:
    """The records of one message value. Blank lines are skipped; a value with nothing
    else comes back whole, so it is reported as not JSON rather than dropped."""
    lines = [line for line in value.splitlines() if line.strip()]
    return lines or [value]


def count(value: bytes) -> int:
    """How many records a message value produced by ``pack`` holds."""
    return value.count(b"\n") + 1


def decode(kind: str, data: bytes) -> Record:
    """Parse one message of topic ``kind``; raises DecodeError naming what is wrong, and
    nothing else: whatever one message holds (e.g. 100,000 nested brackets, which make
    Python's json raise RecursionError) must cost that message only, never the consumer."""
    model = RECORD_TYPES.get(kind)
    if model is None:
        raise DecodeError(kind, f"unknown record kind {kind!r}")
    try:
        # What model_validate_json calls, without its Python frame and the five keyword
        # arguments it passes on as None: ~0.4 us less a record (3.4 -> 3.0 us for a step
        # record), on the path every record a consumer reads takes.
        return model.__pydantic_validator__.validate_json(data)
    except ValidationError as exc:
        # Only records that fail the strict check get here: the common path pays nothing.
        try:
            obj = _json_object(data)
            version = obj.get("schema_version") if obj is not None else None
            if version is not None and version != SCHEMA_VERSION:
                raise DecodeError(kind, _unsupported(version)) from exc
            unknown = [e["loc"] for e in exc.errors(include_url=False) if e["type"] == "extra_forbidden"]
            if unknown and obj is not None:
                return _without_unknown_fields(model, kind, obj, unknown)
        except DecodeError:
            raise
        except Exception as again:  # noqa: BLE001 -- as below: odd input costs its record only
            raise DecodeError(kind, f"cannot decode: {type(again).__name__}: {again}"[:500]) from exc
        raise DecodeError(kind, _one_line(exc)) from exc
    except Exception as exc:  # a validator or the parser itself failing on odd input
        raise DecodeError(kind, f"cannot decode: {type(exc).__name__}: {exc}"[:500]) from exc


def _unsupported(version) -> str:
    reason = f"unsupported schema_version {version!r} (this trainmon reads {SCHEMA_VERSION})"
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        # A newer major version (docs/upgrades.md): not a bad record, one this consumer
        # cannot read right. Its topic keeps it; the dead letter says what to do.
        reason += (": parked, a newer producer's record; upgrade this consumer and replay the "
                   "topic to load it")
    return reason


# (kind, dotted field) -> records loaded without that field since the process started:
# fields a newer producer added that this trainmon does not know (docs/upgrades.md).
UNKNOWN_FIELDS: dict[tuple[str, str], int] = {}


def _without_unknown_fields(model: type[Record], kind: str, obj: dict, unknown: list[tuple]) -> Record:
    """The record without the fields this trainmon does not know, each said once."""
    names = []
    for loc in unknown:
        parent = obj
        for part in loc[:-1]:
            parent = parent[part]
        parent.pop(loc[-1], None)
        names.append(".".join(str(part) for part in loc if not isinstance(part, int)))
    try:
        record = model.__pydantic_validator__.validate_python(obj)
    except ValidationError as exc:
        raise DecodeError(kind, _one_line(exc)) from exc
    for name in dict.fromkeys(names):
        seen = UNKNOWN_FIELDS.get((kind, name), 0)
        UNKNOWN_FIELDS[(kind, name)] = seen + 1
        if not seen:
            log.warning("trainmon: %s records carry the field %r, which this trainmon does not know "
                        "(a newer producer's addition): loaded without it; upgrade this consumer and "
                        "replay the topic to keep it (said once per field)", kind, name)
    return record


def _json_object(data: bytes) -> dict | None:
    """``data`` parsed, when it is a JSON object. Only a top-level object is worth
    parsing: anything else (e.g. deeply nested arrays, which would make Python's
    recursive json parser raise RecursionError) is not a record."""
    if data.lstrip()[:1] not in (b"{", "{"):
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _one_line(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return f"not JSON: {errors[0]['msg']}"
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:5]]
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def json_schemas() -> dict[str, dict]:
    return {kind: model.model_json_schema() for kind, model in RECORD_TYPES.items()}


# A Kafka header on the messages trainmon's producer sends: their records are its own JSON
# (``encode``, or a log call's quick-checked numbers written the same way) of records it
# validated against the schemas fingerprinted there, as a schema registry's id says which
# schema a message was written with. A consumer with the same fingerprint may store such
# a message's records as they are, without decoding them again (see the ClickHouse
# loader); any other message it validates.
SCHEMA_HEADER = "trainmon-schema"


@cache
def schema_fingerprint() -> bytes:
    """A digest of every record kind's JSON schema (fields, types, bounds, defaults).

    64 bits tell a handful of schema versions apart; it is sent with every message, where
    its hex digits are incompressible (32 of them cost ~1 byte a record more at 1 step/s)."""
    text = json.dumps([SCHEMA_VERSION, json_schemas()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16].encode()


__all__ = [
    "MAX_MESSAGE_BYTES", "MAX_RECORDS_PER_MESSAGE", "RECORD_TYPES", "SCHEMA_HEADER", "SCHEMA_VERSION",
    "STEP_KINDS", "DecodeError", "Record", "count", "decode", "encode", "json_schemas", "pack",
    "UNKNOWN_FIELDS", "schema_fingerprint", "unpack",
    "StepRecord", "EvalRecord", "MoeRecord", "GpuRecord", "AllocatorRecord", "AllocatorSegment",
    "DatasetRecord", "GpuModelRecord", "RunRecord", "AlertRecord", "GpuHealthRecord",
    "CheckpointRecord", "DiskRecord", "LogEventRecord", "ProducerHealthRecord",
]
