"""The training thread's quick check never vouches for values the schema refuses, and
vouches for the plain numbers a training loop logs (no broker needed)."""

import math
import random
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from trainmon.producer.deferred import (DeferredRecord, checked_values, field_rules, passes_quick_check, queued,
                                       utc_text)
from pydantic_core import to_json
from trainmon.schemas import Record, StepRecord, decode, encode

ENVELOPE = {"run_id": "quick", "rank": 0, "world_size": 1, "host": "h"}
ODD_VALUES = [0, 1, -1, 7, 2**53, 2**53 + 1, -2**63, 2**63 - 1, 2**63, 2**70, 0.0, -0.0, 0.5, -0.5,
              1.5, 100.0, 101.0, 1e300, -1e300, math.nan, math.inf, -math.inf, True, False, None,
              "1", b"1", [1.0], {"a": 1.0}, object(),
              # for the maps of names to numbers (timers, losses)
              {}, {"a": 1}, {"a": 1.0, "b": -2.5}, {"a": math.nan}, {"a": math.inf}, {1: 1.0},
              {"a": "1"}, {"a": True}, {"a": None}, {"a": 2**53 + 1}, {"a": [1.0]}]


def schema_takes(model, fields) -> bool:
    try:
        model(**ENVELOPE, time=datetime.now(timezone.utc), event_id="e", **fields)
    except (ValidationError, TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("model", list(Record.registry.values()), ids=lambda m: m.kind)
def test_the_quick_check_passes_nothing_the_schema_refuses(model):
    checks = field_rules(model)
    rng = random.Random(model.kind)
    for name in checks:  # every odd value in every checked field, the others left out
        for value in ODD_VALUES:
            fields = {name: value}
            if passes_quick_check(model, fields):
                assert schema_takes(model, fields) or _required_missing(model, fields), (name, value)
    required = {n: 1 for n, f in model.model_fields.items() if f.is_required() and n in checks}
    for _ in range(3000):  # random mixes over all checked fields, required ones included
        fields = dict(required)
        for name in rng.sample(sorted(checks), k=rng.randint(0, len(checks))):
            fields[name] = rng.choice(ODD_VALUES)
        if passes_quick_check(model, fields):
            assert schema_takes(model, fields) or _required_missing(model, fields), fields


def _required_missing(model, fields) -> bool:
    # The quick check judges the values given; a required field left out is the log
    # call's to catch (its MISSING default fails the check), not the check's.
    return any(f.is_required() and n not in fields and n not in ENVELOPE
               and n not in ("time", "event_id") for n, f in model.model_fields.items())


def test_a_training_loops_step_is_checked_quickly_and_built_the_same():
    fields = dict(step=12, epoch=0.5, step_tokens=524288, duration_ms=812.0, loss=2.25, norm=0.9,
                  lr=3e-4, loss_scale=65536.0, skipped=0)
    assert passes_quick_check(StepRecord, fields)
    deferred = DeferredRecord(StepRecord, ENVELOPE, 1.7e9, "prefix", 7, *checked_values(StepRecord, fields))
    record = deferred.build()
    assert record.event_id == "prefix-7" and record.time.timestamp() == 1.7e9
    assert record.tokens_per_second == pytest.approx(524288 / 0.812)  # derived, as ever
    assert record == StepRecord(**ENVELOPE, time=record.time, event_id="prefix-7", **fields)


@pytest.mark.parametrize("fields", [
    dict(step=1, loss="two"), dict(step=-1, loss=1.0), dict(step=1, loss=1.0, duration_ms=-1.0),
    dict(step=2**63, loss=1.0), dict(step=1, loss=1.0, host="x"), dict(step=1, loss=1.0, bogus=1),
    dict(step=1.0, loss=1.0), dict(step=True, loss=1.0), dict(step=1, loss=1.0, losses={"a": "1"}),
    dict(step=1, loss=1.0, timers={1: 1.0}), dict(step=1, loss=1.0, timers={"a": math.nan}),
    dict(step=1, loss=1.0, timers=[("a", 1.0)]), dict(step=1, loss=1.0, timers={"a": True}),
])
def test_anything_else_goes_to_pydantic_on_the_callers_thread(fields):
    assert not passes_quick_check(StepRecord, fields)


def test_every_number_field_of_a_step_is_checked_quickly():
    numbers = [n for n, f in StepRecord.model_fields.items() if n not in Record.model_fields]
    assert sorted(field_rules(StepRecord)) == sorted(numbers)  # the timers and losses maps too


def test_a_map_is_taken_as_it_was_at_the_call():
    """A loop may reuse its timers dict for the next step: the record holds the values
    of the call, ints in a float map as floats, as pydantic copies them."""
    timers = {"forward": 80, "backward": 160.5}
    deferred = DeferredRecord(StepRecord, ENVELOPE, 1.7e9, "prefix", 7,
                              *checked_values(StepRecord, dict(step=1, loss=1.0, timers=timers)))
    timers.clear()
    timers["optimizer"] = 5.0
    assert decode("step", deferred.encode()).timers == {"forward": 80.0, "backward": 160.5}
    assert deferred.build().timers == {"forward": 80.0, "backward": 160.5}


def _all_numbers_may_do(model) -> bool:
    """A record of this kind can be logged with numbers only (so checked quickly)."""
    checks = field_rules(model)
    return bool(checks) and not any(f.is_required() and n not in checks and n not in Record.model_fields
                                    for n, f in model.model_fields.items())


@pytest.mark.parametrize("model", [m for m in Record.registry.values() if _all_numbers_may_do(m)],
                         ids=lambda m: m.kind)
def test_a_quickly_checked_record_is_written_as_pydantic_writes_it(model):
    """DeferredRecord.encode (no pydantic) writes the bytes the built record's JSON has: ints in
    float fields become floats, defaults and derived fields are there, None is not."""
    written = 0
    for number, fields, when in quickly_checked_calls(model, random.Random(model.kind)):
        deferred = DeferredRecord(model, ENVELOPE, when, "prefix", number, *checked_values(model, fields))
        # The same bytes, whatever order the fields were given in (ClickHouse parses a row
        # whose keys come in its columns' order much faster).
        assert deferred.encode() == encode(deferred.build()), fields
        written += 1
    assert written > 100


def quickly_checked_calls(model, rng: random.Random, calls: int = 3000):
    """(number, fields, time) of the random calls among ``calls`` that the quick check
    vouches for: odd values in random fields, the required ones given."""
    checks = field_rules(model)
    required = {n: 1 for n, f in model.model_fields.items() if f.is_required() and n in checks}
    for number in range(calls):
        fields = dict(required)
        for name in rng.sample(sorted(checks), k=rng.randint(0, len(checks))):
            fields[name] = rng.choice(ODD_VALUES)
        if passes_quick_check(model, fields) and not _required_missing(model, fields):
            yield number, fields, 1.7e9 + rng.choice([0, 0.5, 0.000001, 0.123456, 1 / 128])


@pytest.mark.parametrize("fields", [
    dict(step=12, epoch=0.5, step_tokens=524288, duration_ms=812, loss=2.25, norm=0.9, lr=0.5),
    # no tokens: the derived rate stays None, left out as pydantic leaves it out
    dict(step=12, epoch=None, duration_ms=812.0, loss=2.25, norm=None, lr=0.5),
    # Megatron's timers and a loss per name, ints among them, given out of the model's
    # order, with a derived field (tokens_per_second) declared before them
    dict(timers={"forward": 80, "backward": 160.0}, step=12, step_tokens=4096, duration_ms=250.0,
         loss=2.0, losses={"lm": 1.5, "aux": 0.25}, skipped=0),
    # durations as timers measure them, kept to the microsecond (the rate from that)
    dict(step=3, step_tokens=524288, duration_ms=716.5456161059574, loss=2.0,
         timers={"forward-backward": 644.8910544953617, "optimizer": 71.65456161059574}),
])
def test_a_training_loops_step_is_written_byte_for_byte_as_pydantic_writes_it(fields):
    for when in (1.7e9, 1.7e9 + 0.25):
        deferred = DeferredRecord(StepRecord, ENVELOPE, when, "prefix", 7, *checked_values(StepRecord, fields))
        assert deferred.encode() == encode(deferred.build())
        # as a log call queues it, and the sender thread takes it
        item = queued(StepRecord, tuple(ENVELOPE.items()), when, "prefix", 7, checked_values(StepRecord, fields))
        assert DeferredRecord.from_queued(item).encode() == encode(deferred.build())


def test_a_records_time_is_written_as_pydantic_writes_the_datetime():
    """utc_text spells a time as pydantic's JSON spells datetime.fromtimestamp(t, UTC):
    microseconds rounded half to even (a half that rounds up to the next second), none
    written when 0, across minutes, days and leap days."""
    rng = random.Random(30)
    times = [1.7e9 + rng.uniform(-1.5e9, 2e9) for _ in range(50_000)]
    times += [1.7e9 + k / 1e6 for k in range(2_000)]  # every microsecond's spelling
    times += [1.7e9 + j / 128 for j in range(128)]  # j / 128 s: 7812.5 us for odd j, a tie
    times += [1.7e9 + 0.9999995, 1.7e9 + 59.9999996, 1.7e9 + 0.0000005, 1.7e9 + 0.0000015,
              951782399.9999999, 951782400.0, 0.5, 1.25]  # halves, a minute's end, 2000-02-29
    for when in times:
        assert utc_text(when) == to_json(datetime.fromtimestamp(when, timezone.utc)).decode()[1:-1], when


def test_a_value_left_out_is_only_one_whose_default_is_none():
    """The record's JSON leaves out None; a field whose default is not None, given None,
    would read back as its default, so such a call goes to pydantic."""
    from typing import Optional

    class WithDefault(StepRecord):
        kind = "test_with_default"
        scale: Optional[float] = 1.0

    try:
        assert checked_values(WithDefault, dict(step=1, loss=1.0, scale=2.0)) is not None
        assert checked_values(WithDefault, dict(step=1, loss=1.0, scale=None)) is None
        assert checked_values(WithDefault, dict(step=1, loss=None)) == (("step",), (1,))
    finally:
        Record.registry.pop("test_with_default", None)
