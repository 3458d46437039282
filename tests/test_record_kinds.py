"""What a record kind means is declared on its model: which string fields ClickHouse
stores dictionary-encoded, which fields tell its records of one rank and step apart for
the forwarders; and the samples registry has one full record of every kind."""

from __future__ import annotations

from trainmon.consumers.clickhouse.ddl import field_columns
from trainmon.consumers.metric_names import stream_key
from trainmon.schemas import RECORD_TYPES, GpuRecord, Record, StepRecord

from .samples import SAMPLES, envelope, one_of_each


def test_the_samples_registry_has_every_kind_with_every_field_set():
    assert list(SAMPLES) == list(RECORD_TYPES)
    envelope_fields = set(Record.model_fields)
    for kind, model in RECORD_TYPES.items():
        unset = set(model.model_fields) - envelope_fields - set(SAMPLES[kind])
        assert not unset, f"tests/samples.py: {kind} sets no {sorted(unset)}"
    records = one_of_each()
    assert [type(r) for r in records] == list(RECORD_TYPES.values())
    assert len({r.event_id for r in records}) == len(records)


def test_a_kind_with_several_records_per_rank_and_step_names_what_tells_them_apart():
    class FanRecord(Record):  # a new kind: one record per fan of a node, every step
        kind = "test_fans"
        stream_fields = ("fan",)
        step: int
        fan: str
        rpm: float

    try:
        front, back = (FanRecord(**envelope(i, rank=2), step=3, fan=fan, rpm=900.0)
                       for i, fan in enumerate(("front", "back")))
        assert stream_key(front) == "2/test_fans/front"
        assert stream_key(front) != stream_key(back)  # the forwarders keep both
    finally:
        del Record.registry["test_fans"]
    assert stream_key(StepRecord(**envelope(1, rank=2), step=3, loss=1.0)) == "2/step"


def test_low_cardinality_strings_are_the_envelopes_and_those_the_kind_adds():
    assert Record.low_cardinality == {"run_id", "host"}
    assert StepRecord.low_cardinality == {"run_id", "host"}
    assert GpuRecord.low_cardinality == {"run_id", "host", "throttle"}

    class TaggedGpuRecord(GpuRecord):  # derived kinds keep what their base declared
        kind = "test_tagged_gpu"
        low_cardinality = frozenset({"tag"})
        tag: str
        note: str = ""

    try:
        assert TaggedGpuRecord.low_cardinality == {"run_id", "host", "throttle", "tag"}
        assert field_columns(TaggedGpuRecord, "tag").definition == "`tag` LowCardinality(String)"
        assert field_columns(TaggedGpuRecord, "throttle").definition == "`throttle` LowCardinality(String)"
        assert field_columns(TaggedGpuRecord, "note").definition == "`note` String"
    finally:
        del Record.registry["test_tagged_gpu"]
