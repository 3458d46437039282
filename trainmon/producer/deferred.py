"""Records the sender thread builds: a quick check on the training thread, pydantic behind.

Building and validating a pydantic record is the costliest part of a log call, and at
training rates it runs with cold caches (a step every 100 ms or more), where it costs tens
of times its warm price. Most calls pass plain Python ints and floats to number fields;
for those, ``passes_quick_check`` decides on the training thread, from the model's own
field declarations, that the schema will take the values, and the record is built (and
validated) by the sender thread with the others queued in the same moment. Any other
call -- a value of another type, a field with a type or validator the check does not
model, a missing or unknown argument -- is validated on the training thread as before,
so every call the check does not vouch for gets pydantic's verdict at once.

The check is conservative: it passes only values it can prove valid (a number's type is
exactly ``int`` or ``float``; ``ge`` / ``le`` / ``gt`` / ``lt`` bounds; a field's own
``AfterValidator`` functions, called). Models with before / wrap validators are never
checked quickly. A model's after-validators (derived fields) run on the sender thread;
one that raised there would reject the record there (counted in ``rejected``, logged).

``encode`` writes such a record's JSON without building the model: the values are known
to be valid, so all pydantic would add is converting ints in float fields, the fields'
own validators and the model's after-validators (derived fields), which it runs itself.
Cold, building and serializing a step record with pydantic costs ~150 µs of CPU (its
validator's code is out of the caches between steps), the JSON written here a fraction.
The record is pydantic's, written by pydantic's own JSON writer; only the order of the
fields may differ (as given, derived ones last).
"""

from __future__ import annotations

import math
import typing
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Callable

import annotated_types
from pydantic import AfterValidator
from pydantic.fields import FieldInfo
from pydantic_core import to_json

from ..schemas import SCHEMA_VERSION, Record
from ..schemas.envelope import MAX_YEAR, MIN_YEAR

UTC = timezone.utc

# The envelope's time must fall in these years (Record._plausible_time); as Unix times.
EARLIEST_TIME = datetime(MIN_YEAR, 1, 1, tzinfo=UTC).timestamp()
LATEST_TIME = datetime(MAX_YEAR + 1, 1, 1, tzinfo=UTC).timestamp()

_EXACT_FLOAT_INT = 2**53  # an int a float field takes without rounding


class DeferredRecord:
    """A log call's checked values; ``build()`` makes the record (on the sender thread)."""

    __slots__ = ("model", "envelope", "time", "id_prefix", "id_number", "fields")

    def __init__(self, model: type[Record], envelope: dict, time: float, id_prefix: str,
                 id_number: int, fields: dict):
        self.model = model
        self.envelope = envelope
        self.time = time
        self.id_prefix = id_prefix
        self.id_number = id_number
        self.fields = fields

    @property
    def kind(self) -> str:
        return self.model.kind

    def build(self) -> Record:
        return self.model(**self.envelope, time=datetime.fromtimestamp(self.time, UTC),
                          event_id=f"{self.id_prefix}-{self.id_number}", **self.fields)

    def encode(self) -> bytes:
        """The JSON of ``build()`` (the same record as ``schemas.encode`` writes; the
        fields in the order given, derived ones last), without pydantic."""
        rules = _RULES[self.model]  # (filled by the quick check that let this record through)
        defaults, derive = _layout(self.model)
        values = _Fields(defaults)
        for name, value in self.fields.items():
            if value is None:
                continue  # not logged: left out, as encode's exclude_none does
            rule = rules[name]
            if rule.number is float:
                value = float(value)
            for validate in rule.validators:
                value = validate(value)
            values[name] = value
        for validator in derive:
            validator(values)
        # pydantic's own JSON writer, on plain values: its spelling of floats, NaN / inf
        # and times (ser_json_inf_nan="constants"), None left out as encode does.
        return to_json({**self.envelope, "time": datetime.fromtimestamp(self.time, UTC),
                        "event_id": f"{self.id_prefix}-{self.id_number}",
                        "schema_version": SCHEMA_VERSION, **values},
                       exclude_none=True, inf_nan_mode="constants")


@lru_cache(maxsize=None)
def _layout(model: type[Record]) -> tuple[dict, tuple]:
    """The model's defaults that are not None (written too), and its after-validators
    (which derive fields from the others; they read and set only the model's own fields)."""
    defaults = {name: default for name in model.model_fields if name not in Record.model_fields
                and (default := model.model_fields[name].get_default(call_default_factory=True))
                is not None}
    derive = tuple(d.func for d in model.__pydantic_decorators__.model_validators.values())
    return defaults, derive


class _Fields(dict):
    """A record's own values as an after-validator reads and sets them (``self.loss``);
    a field not given reads as None, its default."""

    __getattr__ = dict.get
    __setattr__ = dict.__setitem__


class _Rule(typing.NamedTuple):
    """What a number field takes: its type, None or not, inclusive bounds, validators."""

    number: type  # int or float
    nullable: bool
    low: float
    high: float
    validators: tuple


def passes_quick_check(model: type[Record], fields: dict) -> bool:
    """True when the schema is sure to take these values (see the module's docstring).
    One flat loop: on the training thread, every function call counts."""
    rules = _RULES.get(model)
    if rules is None:
        rules = _RULES[model] = field_rules(model)
    if not rules:
        return False
    for name, value in fields.items():
        rule = rules.get(name)
        if rule is None:
            return False
        if value is None:
            if rule.nullable:
                continue
            return False
        kind = type(value)
        if kind is not rule.number and not (kind is int and rule.number is float
                                            and -_EXACT_FLOAT_INT <= value <= _EXACT_FLOAT_INT):
            return False
        if not rule.low <= value <= rule.high:  # (NaN is within no bounds: pydantic judges it)
            return False
        for validate in rule.validators:
            try:
                validate(value)
            except Exception:
                return False
    return True


_RULES: dict[type[Record], dict[str, _Rule]] = {}


def field_rules(model: type[Record]) -> dict[str, _Rule]:
    """name -> rule, for the fields of ``model`` a caller sets whose declaration the quick
    check models; empty when no call to this model may skip pydantic."""
    decorators = model.__pydantic_decorators__
    if any(d.info.mode != "after" for d in decorators.model_validators.values()):
        return {}
    if model.model_config.get("strict") or model.model_config.get("extra") != "forbid":
        return {}
    validated = {name for d in decorators.field_validators.values() for name in d.info.fields}
    if "*" in validated:
        return {}
    rules = {}
    for name, info in model.model_fields.items():
        if name in Record.model_fields or name in validated:
            continue  # the envelope is the producer's; a field validator is pydantic's to run
        rule = _number_rule(info)
        if rule is not None:
            rules[name] = rule
    return rules


def _number_rule(info: FieldInfo) -> _Rule | None:
    """The rule of an int or float field (optionally None), or None for any other."""
    annotation, constraints = info.annotation, list(info.metadata)
    nullable = False
    if typing.get_origin(annotation) is typing.Union:
        args = typing.get_args(annotation)
        if len(args) != 2 or type(None) not in args:
            return None
        nullable = True
        annotation = args[0] if args[1] is type(None) else args[1]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for item in extra:  # Field(ge=..) inside Annotated carries its own metadata
            constraints.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    if annotation not in (int, float):
        return None
    low, high, validators = -math.inf, math.inf, []
    for item in constraints:
        if isinstance(item, annotated_types.Ge):
            low = max(low, item.ge)
        elif isinstance(item, annotated_types.Le):
            high = min(high, item.le)
        elif isinstance(item, AfterValidator):
            validators.append(_as_float(item.func) if annotation is float else item.func)
        else:
            return None  # a constraint the quick check does not model (gt, lt, ...): pydantic's
    return _Rule(annotation, nullable, low, high, tuple(validators))


def _as_float(validate: Callable[[float], Any]) -> Callable[[float], Any]:
    # pydantic hands a float field's validators the float an int became.
    return lambda value: validate(float(value))
