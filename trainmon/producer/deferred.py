"""Records the sender thread builds: a quick check on the training thread, pydantic behind.

Building and validating a pydantic record is the costliest part of a log call, and at
training rates it runs with cold caches (a step every 100 ms or more), where it costs tens
of times its warm price. Most calls pass plain Python ints and floats to number fields
(and maps of names to them: Megatron's timers, a loss per name); for those,
``checked_values`` decides on the training thread, from the model's own field
declarations, that the schema will take the values (and converts them as pydantic
would), and the record is written as JSON without pydantic (``encode``). Any other
call -- a value of another type, a field with a type or validator the check does not
model, a missing or unknown argument -- is validated on the training thread as before,
so every call the check does not vouch for gets pydantic's verdict at once.

The check is conservative: it passes only values it can prove valid (a number's type is
exactly ``int`` or ``float``; ``ge`` / ``le`` / ``gt`` / ``lt`` bounds; a field's own
``AfterValidator`` functions, called). Models with before / wrap validators are never
checked quickly. A model's after-validators (derived fields) run on the sender thread;
one that raised there would reject the record there (counted in ``rejected``, logged).

``encode`` writes such a record's JSON without building the model: the values are known
to be valid, so all pydantic would add is converting ints in float fields and the fields'
own validators (the quick check did both), and the model's after-validators (derived
fields), which it runs itself. Cold, building and serializing a step record with pydantic
costs ~150 µs of CPU (its validator's code is out of the caches between steps), the JSON
written here a fraction. The record is pydantic's, written by pydantic's own JSON writer
in the model's field order: the same bytes.
"""

from __future__ import annotations

import math
import typing
from datetime import datetime, timezone
from functools import lru_cache

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

    __slots__ = ("model", "envelope", "time", "id_prefix", "id_number", "fields", "values")

    def __init__(self, model: type[Record], envelope: dict, time: float, id_prefix: str,
                 id_number: int, fields: dict, values: dict | None = None):
        self.model = model
        self.envelope = envelope
        self.time = time
        self.id_prefix = id_prefix
        self.id_number = id_number
        self.fields = fields  # as the call gave them, for build()
        self.values = values  # as the record holds them (checked_values), for encode()

    @property
    def kind(self) -> str:
        return self.model.kind

    def build(self) -> Record:
        # The checked values over the call's: a map in them is a copy taken at the call.
        fields = self.fields if self.values is None else {**self.fields, **self.values}
        return self.model(**self.envelope, time=datetime.fromtimestamp(self.time, UTC),
                          event_id=f"{self.id_prefix}-{self.id_number}", **fields)

    def encode(self) -> bytes:
        """The JSON of ``build()``, byte for byte as ``schemas.encode`` writes it, without
        pydantic."""
        values = self.values if self.values is not None else checked_values(self.model, self.fields)
        defaults, fields_class, derive, order = _layout(self.model)
        written = {**self.envelope, "time": datetime.fromtimestamp(self.time, UTC),
                   "event_id": f"{self.id_prefix}-{self.id_number}",
                   "schema_version": SCHEMA_VERSION, **defaults, **values}
        if derive:
            record = fields_class()
            record.__dict__ = written  # what the validators set is written
            for validator in derive:
                validator(record)
        # The model's field order, as pydantic writes it (a derived field comes last
        # otherwise, or a Megatron field before it): for 300,000 step rows whose keys came
        # out of their columns' order, the ClickHouse loader's insert thread took 1.1-1.3 s
        # against 0.9-1.0 (alternating runs; 2.1 against 1.0 in a slow spell), and the
        # drain 134-149k against 158-174k records/s. A derived field left unset (None) is
        # not written.
        written = {name: written[name] for name in sorted(written, key=order.__getitem__)
                   if written[name] is not None}
        # pydantic's own JSON writer, on plain values: its spelling of floats, NaN / inf
        # and times (ser_json_inf_nan="constants").
        return to_json(written, inf_nan_mode="constants")


@lru_cache(maxsize=None)
def _layout(model: type[Record]) -> tuple[dict, type, tuple, dict]:
    """The model's own defaults that are not None (written too); a class whose instances
    read as the model's fields (a field not in an instance's dict reads as its default, so
    an after-validator reading ``self.loss`` of a loss not logged gets None); the model's
    after-validators (which derive fields from the others; they read and set only the
    model's own fields); and each field's place in the model."""
    defaults = {name: default for name in model.model_fields if name not in Record.model_fields
                and (default := model.model_fields[name].get_default(call_default_factory=True))
                is not None}
    fields_class = type(f"{model.__name__}Fields", (), {
        name: None if info.is_required() else info.get_default(call_default_factory=True)
        for name, info in model.model_fields.items()})
    derive = tuple(d.func for d in model.__pydantic_decorators__.model_validators.values())
    order = {name: place for place, name in enumerate(model.model_fields)}
    return defaults, fields_class, derive, order


class _Rule(typing.NamedTuple):
    """What a number field takes: its type, None or not, inclusive bounds, validators;
    or, for a map of names to numbers (``timers``, ``losses``), the type of its values."""

    number: type  # int or float
    nullable: bool  # None passes (and is left out of the record's JSON)
    low: float
    high: float
    validators: tuple
    mapping: bool = False  # a dict of str -> number (no bounds, no validators)


def checked_values(model: type[Record], fields: dict) -> dict | None:
    """The values as the record will hold them (an int in a float field as a float,
    validators applied), when the schema is sure to take them (see the module's
    docstring); else None. One flat loop: it runs on the training thread, with cold
    caches at training rates, where every bytecode and call counts."""
    rules = _RULES.get(model)
    if rules is None:
        rules = _RULES[model] = field_rules(model)
    if not rules:
        return None
    values = {}
    try:
        for name, value in fields.items():
            number, nullable, low, high, validators, mapping = rules[name]  # (KeyError: not a number field)
            if value is None:
                if nullable:
                    continue  # not logged: left out of the record's JSON
                return None
            if mapping:
                value = _checked_map(value, number)
                if value is None:
                    return None
                values[name] = value
                continue
            if type(value) is not number:
                if not (type(value) is int and number is float
                        and -_EXACT_FLOAT_INT <= value <= _EXACT_FLOAT_INT):
                    return None
                value = float(value)
            if not low <= value <= high:  # (NaN is within no bounds: pydantic judges it)
                return None
            if validators:
                for validate in validators:
                    value = validate(value)
            values[name] = value
    except Exception:  # a field the check does not model, or a validator's refusal
        return None
    return values


def _checked_map(value, number: type) -> dict | None:
    """A copy of a map of names to numbers as the record will hold it (the caller may
    reuse its dict for the next step), or None where pydantic must judge it."""
    if type(value) is not dict:
        return None
    checked = {}
    for key, item in value.items():
        if type(key) is not str:
            return None
        if type(item) is not number:
            if not (type(item) is int and number is float and -_EXACT_FLOAT_INT <= item <= _EXACT_FLOAT_INT):
                return None
            item = float(item)
        if item != item:  # NaN: pydantic judges it, as for a number field
            return None
        checked[key] = item
    return checked


def passes_quick_check(model: type[Record], fields: dict) -> bool:
    return checked_values(model, fields) is not None


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
    """The rule of an int or float field, or of a plain map of names to ints or floats
    (optionally None), or None for any other."""
    annotation, constraints = info.annotation, list(info.metadata)
    nullable = False
    if typing.get_origin(annotation) is typing.Union:
        args = typing.get_args(annotation)
        if len(args) != 2 or type(None) not in args:
            return None
        # None left out of the JSON reads back as the default: only where that is None
        nullable = info.is_required() or info.default is None
        annotation = args[0] if args[1] is type(None) else args[1]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for item in extra:  # Field(ge=..) inside Annotated carries its own metadata
            constraints.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    if typing.get_origin(annotation) is dict:
        key, number = typing.get_args(annotation)
        if key is str and number in (int, float) and not constraints:
            return _Rule(number, nullable, -math.inf, math.inf, (), mapping=True)
        return None
    if annotation not in (int, float):
        return None
    low, high, validators = -math.inf, math.inf, []
    for item in constraints:
        if isinstance(item, annotated_types.Ge):
            low = max(low, item.ge)
        elif isinstance(item, annotated_types.Le):
            high = min(high, item.le)
        elif isinstance(item, AfterValidator):
            validators.append(item.func)  # (called with the value as the field holds it)
        else:
            return None  # a constraint the quick check does not model (gt, lt, ...): pydantic's
    return _Rule(annotation, nullable, low, high, tuple(validators))
