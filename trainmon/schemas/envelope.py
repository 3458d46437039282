"""The envelope every record carries: who sent it, when, and an id to deduplicate by."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The record schemas' major version, sent in every record's ``schema_version``. It changes
# only with a change an older consumer cannot read right: a field removed, renamed,
# retyped, made required or given a new meaning. Additions -- an optional field, a new
# record kind, a wider bound -- keep it: a consumer ignores the fields it does not know
# (``schemas.decode``) and loads the rest, and the new field reaches its tables after it
# is upgraded and replays the topic. A record of a major version newer than the
# consumer's is dead-lettered as parked, with the reason, and stays in its own topic for
# a replay after the upgrade. docs/upgrades.md says the whole policy.
SCHEMA_VERSION = 1
# A record's time must fall in these years. ClickHouse partitions every table by month of
# ``time``: a clock at 1970 or 9999 (an unset RTC, a unit mix-up) would scatter a rank's
# records over hundreds of partitions and, in one insert, over ClickHouse's per-insert
# partition limit; DateTime64 itself ends in 2299.
MIN_YEAR, MAX_YEAR = 2000, 2200


@dataclass(frozen=True)
class Derived:
    """A field a record computes from its other fields when the caller leaves it out
    (tokens/s from the step's tokens and duration).

    It is written only when it holds something else (a value the caller gave): every
    reader computes it again, the models' validators in Python and, in ClickHouse, the
    column's DEFAULT ``sql``, which must give the very same value."""

    compute: Callable[[Any], Any]  # the record (anything with its fields) -> the value
    sql: str  # the same over the table's columns


def holding_derived(record, derived: dict[str, Derived]) -> set[str]:
    """The derived fields whose value is the one derived: left out of the JSON."""
    return {name for name, field in derived.items()
            if (value := getattr(record, name)) is not None and value == field.compute(record)}


class Record(BaseModel):
    """Base of all record types. ``kind`` names the record type and its Kafka topic."""

    # NaN and +/-Inf are data here (the alert rules look for them), so JSON keeps them
    # as the NaN / Infinity constants rather than turning them into null. Unknown fields
    # are refused where records are made (a misspelt keyword of a log call is an error);
    # a consumer reading a newer producer's record ignores them (see schemas.decode).
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants", validate_default=False)

    kind: ClassVar[str]
    # Every record kind, in the order the models are declared (records.py): a kind is
    # declared once, by its model; topics, tables, the forwarders' and the alert
    # service's kind lists all derive from here.
    registry: ClassVar[dict[str, type["Record"]]] = {}

    # String fields whose values repeat a lot (a host, a GPU's name, a rule): ClickHouse
    # stores them dictionary-encoded (LowCardinality). A kind lists its own fields; the
    # envelope's and those of the kinds it derives from are added to them.
    low_cardinality: ClassVar[frozenset[str]] = frozenset({"run_id", "host"})
    # The fields that tell apart this kind's records of one rank and one step (a GPU's
    # id, a checkpoint's event). The forwarders keep one ordered stream per rank, kind and
    # these fields, and drop a record whose step is not past its stream's latest as a
    # resend: a kind that logs several records per rank and step must name what tells
    # them apart here, or all but the first of them are dropped.
    stream_fields: ClassVar[tuple[str, ...]] = ()
    # Fields computed from the others when not given, and left out of the JSON when they
    # hold what is computed (see Derived). The kind's after-validator sets them.
    derived: ClassVar[dict[str, Derived]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.low_cardinality = frozenset().union(
            *(vars(base).get("low_cardinality", ()) for base in cls.__mro__))
        kind = cls.__dict__.get("kind")
        if isinstance(kind, str):
            Record.registry[kind] = cls

    @classmethod
    def per_step(cls) -> bool:
        """A record of one training step (it has a required ``step``): a metric point for
        W&B / Aim / TensorBoard. Alerts, run, dataset, GPU-model, log-event records are not."""
        field = cls.model_fields.get("step")
        return field is not None and field.is_required()

    run_id: str = Field(min_length=1, max_length=256)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    host: str
    time: datetime
    # Unique per record and fixed when the record is created, so a resend (retry, spill
    # replay) carries the same id and consumers can drop the duplicate.
    event_id: str = Field(min_length=1, max_length=128)
    schema_version: Literal[1] = SCHEMA_VERSION

    @field_validator("time")
    @classmethod
    def _plausible_time(cls, value: datetime) -> datetime:
        if not MIN_YEAR <= value.year <= MAX_YEAR:
            raise ValueError(f"time {value.isoformat()} is outside the years {MIN_YEAR}-{MAX_YEAR} "
                             "(is this host's clock set?)")
        return value
