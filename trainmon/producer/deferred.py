"""Records the sender thread builds: a quick check on the training thread, pydantic behind.

Building and validating a pydantic record is the costliest part of a log call, and at
training rates it runs with cold caches (a step every 100 ms or more), where it costs tens
of times its warm price. Most calls pass plain Python ints and floats to number fields
(and maps of names to them: Megatron's timers, a loss per name); for those,
``checked_values`` decides on the training thread, from the model's own field
declarations, that the schema will take the values (and converts them as pydantic
would), and the record is written as JSON without pydantic (``encode``). Any other
call -- a value of another type, a field with a type or validator the check does not
model, an empty map, a missing or unknown argument -- is validated on the training
thread as before, so every call the check does not vouch for gets pydantic's verdict at
once.

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
import time
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
    """A log call's checked values; ``build()`` makes the record, ``encode()`` its JSON
    (on the sender thread).

    ``names`` and ``values`` are as :func:`checked_values` gives them. A log call queues
    not this object but its :func:`queued` form, which ``from_queued`` takes.
    """

    __slots__ = ("model", "envelope", "time", "id_prefix", "id_number", "names", "values")

    def __init__(self, model: type[Record], envelope: dict, time: float, id_prefix: str,
                 id_number: int, names: tuple, values: tuple):
        self.model = model
        self.envelope = envelope
        self.time = time
        self.id_prefix = id_prefix
        self.id_number = id_number
        self.names = names
        self.values = values

    @classmethod
    def from_queued(cls, item: tuple) -> "DeferredRecord":
        # (The model is the one its kind is declared by: log calls are of declared kinds.)
        kind, envelope, time, id_prefix, id_number, names = item[:VALUES_AT]
        return cls(Record.registry[kind], dict(envelope), time, id_prefix, id_number, names, item[VALUES_AT:])

    @property
    def kind(self) -> str:
        return self.model.kind

    def _fields(self) -> dict:
        """Field name -> value, each map a dict again."""
        fields = {}
        for name, value in zip(self.names, self.values):
            if "\0" in name:
                field, key = name.split("\0", 1)
                if field in fields:
                    fields[field][key] = value
                else:
                    fields[field] = {key: value}
            else:
                fields[name] = value
        return fields

    def build(self) -> Record:
        return self.model(**self.envelope, time=datetime.fromtimestamp(self.time, UTC),
                          event_id=f"{self.id_prefix}-{self.id_number}", **self._fields())

    def encode(self) -> bytes:
        """The JSON of ``build()``, byte for byte as ``schemas.encode`` writes it, without
        pydantic."""
        template, has_maps = _template(self.model, self.names)
        # The template's keys come in the model's field order, as pydantic writes them, and
        # setting a key keeps its place: for 300,000 step rows whose keys came out of their
        # columns' order, the ClickHouse loader's insert thread took 1.1-1.3 s against
        # 0.9-1.0 (alternating runs), and the drain 134-149k against 158-174k records/s.
        written = template.copy()
        written.update(self.envelope)
        written["time"] = utc_text(self.time)
        written["event_id"] = f"{self.id_prefix}-{self.id_number}"
        written.update(self._fields() if has_maps else zip(self.names, self.values))
        _, fields_class, derive, order = _layout(self.model)  # (the defaults: in the template)
        if derive:
            derived = self.model.derived
            given = derived.keys() & written.keys()  # (a None is not in written)
            record = fields_class()
            record.__dict__ = written  # what the validators set is written
            for validator in derive:
                validator(record)
            # A derived field holding what readers derive is left out, as encode() leaves
            # it out (schemas.envelope.holding_derived): one the call did not give holds
            # it (the validators set it), so only one given is computed again and compared.
            for name in derived:
                if name not in given or written[name] == derived[name].compute(record):
                    written.pop(name, None)
            if not written.keys() <= template.keys() or None in written.values():
                # A validator set a field the template does not hold (appended last), or
                # None (not written): in the model's order again, without the None.
                written = {name: written[name] for name in sorted(written, key=order.__getitem__)
                           if written[name] is not None}
        # pydantic's own JSON writer, on plain values: its spelling of floats, NaN / inf
        # and times (ser_json_inf_nan="constants").
        return to_json(written, inf_nan_mode="constants")


def utc_text(timestamp: float) -> str:
    """A Unix time as pydantic writes ``datetime.fromtimestamp(timestamp, UTC)`` in JSON
    (its microseconds rounded half to even, as datetime rounds them; no fraction when
    they are 0), without making the datetime: with cold caches, making it and having
    pydantic write it cost more than this (tests/test_producer_quick_check.py)."""
    seconds = int(timestamp)
    micros = round((timestamp - seconds) * 1e6)
    if micros == 1_000_000:
        seconds, micros = seconds + 1, 0
    minute, second = divmod(seconds, 60)
    if micros:
        return f"{_minute_text(minute)}{second:02d}.{micros:06d}Z"
    return f"{_minute_text(minute)}{second:02d}Z"


@lru_cache(maxsize=4)
def _minute_text(minute: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:", time.gmtime(minute * 60))


# Where a queued item's values start: queued(...)[:VALUES_AT] is (kind, envelope, time,
# id_prefix, id_number, names), queued(...)[VALUES_AT:] the values.
VALUES_AT = 6


def queued(model: type[Record], envelope: tuple, time: float, id_prefix: str, id_number: int,
           checked: tuple[tuple, tuple]) -> tuple:
    """What a log call queues for the sender thread (``checked``: from checked_values;
    ``envelope``: the envelope's items, one tuple the producer made once): the kind, the
    envelope, the time, the event id's prefix and number, the names (a tuple shared by
    every call of them, see _NAMES), then the values, each an item of this tuple (one
    object held per waiting record, not two). The worker's queue item is
    ``(topic, key, *this)``, as flat.

    Why: CPython's cyclic garbage collector stops tracking a tuple whose items it tracks
    no more, one level of nesting per pass over it, and never a tuple that holds a dict
    or an object. Kept as objects and dicts, records waiting for the sender thread stayed
    tracked and made the collector's full passes ever longer: a producer logging steps
    flat out spent a third of its CPU there (8 full passes, 0.8 of 2.3 CPU-s for 150,000
    records, measured)."""
    return (model.kind, envelope, time, id_prefix, id_number, checked[0], *checked[1])


@lru_cache(maxsize=1024)
def _template(model: type[Record], names: tuple) -> tuple[dict, bool]:
    """The record's keys for a log call of these fields (a training loop logs the same ones
    at every step), in the model's field order: the envelope, time, id and schema version,
    the defaults that are not None (with their values), the call's fields (a map's entries
    under its field's name); and whether the call logged a map. Keys whose values each
    record sets hold None here, and every one of them is set."""
    defaults, _, _, order = _layout(model)
    keys = {*Record.model_fields, *defaults, *(name.split("\0", 1)[0] for name in names)}
    template = {name: None for name in sorted(keys, key=order.__getitem__)}
    template.update(defaults, schema_version=SCHEMA_VERSION)
    return template, any("\0" in name for name in names)


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
    mapping: bool = False  # a dict of str -> number (no bounds; validators for each value)


def checked_values(model: type[Record], fields: dict) -> tuple[tuple, tuple] | None:
    """The values as the record will hold them (an int in a float field as a float,
    validators applied, None left out), when the schema is sure to take them (see the
    module's docstring); else None. As two flat tuples, names and values, a map's
    entries among them as ``field<NUL>name`` (see :func:`queued` for why flat). One flat
    loop: it runs on the training thread, with cold caches at training rates, where every
    bytecode and call counts."""
    rules = _RULES.get(model)
    if rules is None:
        rules = _RULES[model] = field_rules(model)
    if not rules:
        return None
    names, values = [], []
    try:
        for name, value in fields.items():
            number, nullable, low, high, validators, mapping = rules[name]  # (KeyError: not a number field)
            if value is None:
                if nullable:
                    continue  # not logged: left out of the record's JSON
                return None
            if mapping:
                if not _checked_map(name, value, number, validators, names, values):
                    return None
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
            names.append(name)
            values.append(value)
    except Exception:  # a field the check does not model, or a validator's refusal
        return None
    names = tuple(names)
    return _NAMES.get(names) or _kept_names(names), tuple(values)


# A call's names, one tuple per set of them (a training loop logs the same ones at every
# step): a queued record holds the shared one, and the fresh copy is freed at once. Each
# object a record holds while it waits counts towards the next pass of CPython's cyclic
# collector (every 700 net allocations), which a log call then pays for: with the names
# and the values each a tuple of their own, 84 passes in 20,000 log calls back to back,
# 55 with the names shared, 28 with the values in the queued tuple too (measured).
_NAMES: dict[tuple, tuple] = {}
_NAMES_MAX = 1024


def _kept_names(names: tuple) -> tuple:
    if len(_NAMES) >= _NAMES_MAX:
        # Names that change from call to call (a map whose keys do): start over, so the
        # sets a loop settles on are shared again, and memory stays bounded.
        _NAMES.clear()
    _NAMES[names] = names
    return names


def _checked_map(field: str, value, number: type, validators: tuple, names: list, values: list) -> bool:
    """Append a map of names to numbers as the record will hold it (a copy: the caller
    may reuse its dict for the next step; each value through the validators of the map's
    value type); False where pydantic must judge it."""
    if type(value) is not dict or not value:  # (an empty map has no entries to write here)
        return False
    for key, item in value.items():
        if type(key) is not str:
            return False
        if not key.isascii():
            try:
                key.encode()
            except UnicodeEncodeError:  # a lone surrogate: to_json refuses what pydantic writes
                return False
        if type(item) is not number:
            if not (type(item) is int and number is float and -_EXACT_FLOAT_INT <= item <= _EXACT_FLOAT_INT):
                return False
            item = float(item)
        if item != item:  # NaN: pydantic judges it, as for a number field
            return False
        for validate in validators:
            item = validate(item)
        names.append(f"{field}\0{key}")
        values.append(item)
    return True


def passes_quick_check(model: type[Record], fields: dict) -> bool:
    return checked_values(model, fields) is not None


_RULES: dict[type[Record], dict[str, _Rule]] = {}


def rules_for(model: type[Record]) -> dict[str, _Rule]:
    """field_rules(model), made once per model (it reads the model's declarations)."""
    rules = _RULES.get(model)
    if rules is None:
        rules = _RULES[model] = field_rules(model)
    return rules


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
        # (a required field given None goes to pydantic)
        nullable = not info.is_required() and info.default is None
        annotation = args[0] if args[1] is type(None) else args[1]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for item in extra:  # Field(ge=..) inside Annotated carries its own metadata
            constraints.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    if typing.get_origin(annotation) is dict:
        key, number = typing.get_args(annotation)
        validators = []
        if typing.get_origin(number) is typing.Annotated:  # e.g. dict[str, Milliseconds]
            number, *extra = typing.get_args(number)
            for item in extra:
                if isinstance(item, AfterValidator):
                    validators.append(item.func)
                elif not (isinstance(item, FieldInfo) and not item.metadata):  # (a description)
                    return None  # a bound on the values: pydantic's
        if key is str and number in (int, float) and not constraints:
            return _Rule(number, nullable, -math.inf, math.inf, tuple(validators), mapping=True)
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
