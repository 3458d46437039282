"""Values and settings at the edges, each once lost or ignored: a bound a type alias
overrode, a map key or config string JSON cannot hold as it is, a misspelt or non-finite
producer setting, a NaN MoE ratio. In memory (MemoryBroker)."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.deferred import DeferredRecord, checked_values
from trainmon.schemas import LogEventRecord, StepRecord, decode, encode, unpack

ENVELOPE = {"run_id": "odd-inputs", "rank": 0, "world_size": 1, "host": "h"}
NOW = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)


def _producer(tmp_path, broker: MemoryBroker, **settings) -> Producer:
    return Producer(ProducerConfig(run_id="odd-inputs", spill_dir=tmp_path / "spill",
                                   health_interval_s=0, **settings), transport=broker.transport)


def _records(broker: MemoryBroker, kind: str) -> list[bytes]:
    return [r for value in broker.values(f"trainmon.{kind}") for r in unpack(value)]


# -- LogEventRecord.count: its ge=1 is overridden by Count's ge=0 --------------------

def test_a_log_event_with_count_zero_is_refused():
    """``count: Count = Field(ge=1)``: the Annotated Count's own Ge(0) comes after Ge(1) in
    the field's metadata and wins, so a count of 0 (or -0 occurrences) is accepted."""
    with pytest.raises(ValidationError, match="count"):
        LogEventRecord(**ENVELOPE, time=NOW, event_id="e", level="error", source="nccl",
                       signature="s", text="t", count=0)


def test_log_event_with_count_zero_is_a_rejected_call(tmp_path):
    broker = MemoryBroker()
    producer = _producer(tmp_path, broker)
    try:
        assert producer.log_event("warning", "nccl", "NCCL WARN x", count=0) is False
        assert producer.rejected == {"log_event": 1}
    finally:
        producer.close(timeout=2)


# -- A map key the quick path vouches for but cannot write -----------------------------

LONE = "fwd\udcff"  # a timer name decoded with surrogateescape (non-UTF-8 bytes)


def test_the_quick_path_writes_a_map_key_pydantic_writes():
    """The quick check takes any ``str`` key; pydantic takes it too and writes it (as
    U+FFFD), but DeferredRecord.encode's to_json raises on it: the record is lost on the
    sender thread after the log call returned True."""
    fields = dict(step=1, loss=1.0, timers={LONE: 5.0})
    record = StepRecord(**ENVELOPE, time=datetime.fromtimestamp(1.7e9, timezone.utc), event_id="p-1", **fields)
    expected = encode(record)  # pydantic writes it
    checked = checked_values(StepRecord, fields)
    if checked is None:  # (deferred to pydantic: fine, as long as pydantic's bytes go out)
        return
    assert DeferredRecord(StepRecord, ENVELOPE, 1.7e9, "p", 1, *checked).encode() == expected


def test_a_step_with_such_a_timer_name_is_delivered_with_or_without_a_log_file(tmp_path):
    for log_file in (None, str(tmp_path / "steps.jsonl")):
        broker = MemoryBroker()
        producer = _producer(tmp_path, broker, log_file=log_file)
        try:
            assert producer.log_step(1, loss=1.0, timers={LONE: 5.0, "bwd": 7.0}) is True
            assert producer.flush(5)
            assert producer.rejected == {}, log_file
            [step] = _records(broker, "step")
            assert decode("step", step).timers["bwd"] == 7.0
        finally:
            producer.close(timeout=2)


# -- A run's config holding a str JSON cannot hold loses the run record -----------------

def test_a_config_value_with_undecodable_bytes_does_not_lose_the_run_start(tmp_path):
    """json_safe keeps every str as it is, including one with lone surrogates (a path from
    sys.argv or os.listdir with non-UTF-8 bytes); pydantic takes it into config (Any), the
    log call returns True, and encode_safely raises on the sender thread: the run start is
    rejected there and never reaches Kafka."""
    broker = MemoryBroker()
    producer = _producer(tmp_path, broker)
    try:
        assert producer.run_start(config={"data": "/data/caf\udce9.bin", "lr": 3e-4}) is True
        assert producer.flush(5)
        assert producer.rejected == {}
        [run] = _records(broker, "run")
        assert decode("run", run).config["lr"] == 3e-4
    finally:
        producer.close(timeout=2)


# -- ProducerConfig: overrides and interval env vars -----------------------------------

def test_a_misspelt_producer_setting_is_an_error_not_silently_ignored():
    """``Producer(stirct=True)`` / a framework callback's settings go through
    ProducerConfig.from_env(**overrides), which setattr()s any name: a typo is ignored and
    the producer runs with the default (here: not strict)."""
    with pytest.raises(TypeError, match="stirct"):
        ProducerConfig.from_env({}, stirct=True)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_pack_window_does_not_crash_the_producer(value):
    """TRAINMON_PACK_WINDOW_MS=inf: int(float('inf')) raises OverflowError in from_env, so
    Producer() raises, and with it the first module-level tm.log_step of the job."""
    cfg = ProducerConfig.from_env({"TRAINMON_PACK_WINDOW_MS": value})
    assert cfg.pack_window_ms == ProducerConfig.pack_window_ms == 500


@pytest.mark.parametrize("var", ["TRAINMON_DISK_INTERVAL_S", "TRAINMON_PRODUCER_HEALTH_INTERVAL_S"])
def test_an_infinite_interval_is_not_taken(var):
    """An interval of inf starts the thread, whose Event.wait(inf) raises OverflowError:
    the disk / health thread dies with a traceback at once (no disk record after a
    checkpoint, no health records), though the variable was 'set'."""
    cfg = ProducerConfig.from_env({var: "inf"})
    assert math.isfinite(cfg.disk_interval_s) and math.isfinite(cfg.health_interval_s)


# -- MoE: a NaN utilization / imbalance refuses the whole record ----------------------

def test_a_nan_moe_ratio_is_data_not_a_rejected_record(tmp_path):
    """expert_utilization (ge=0, le=1) and load_imbalance (ge=1) refuse NaN, so a step whose
    router saw no tokens (0 / 0) loses its aux and z losses too; every other float of the
    schemas keeps NaN as data (records.py: NonNegativeOrNonFinite, for this very reason)."""
    broker = MemoryBroker()
    producer = _producer(tmp_path, broker)
    try:
        assert producer.log_moe_stats(3, aux_loss=0.01, z_loss=0.002, expert_utilization=math.nan,
                                      load_imbalance=math.nan) is True
        assert producer.log_moe_stats(4, aux_loss=0.01, z_loss=0.002, expert_utilization=1.5,
                                      load_imbalance=1.0) is False  # a finite value out of range still is refused
        assert producer.flush(5)
        [moe] = [decode("moe", r) for r in _records(broker, "moe")]
        assert moe.aux_loss == 0.01 and math.isnan(moe.expert_utilization) and math.isnan(moe.load_imbalance)
    finally:
        producer.close(timeout=2)


def test_a_callback_given_a_misspelt_setting_says_so_when_it_is_made():
    """Before training starts, not at every step behind the callback's guard."""
    from trainmon.integrations.lightning import TrainmonLogger

    with pytest.raises(TypeError, match="stirct"):
        TrainmonLogger(stirct=True)


def test_a_misspelt_kafka_client_is_named_not_taken_silently(caplog):
    from trainmon.kafka_client.transport_choice import CONFLUENT, KAFKA_PYTHON, choose_client

    assert choose_client({"TRAINMON_KAFKA_CLIENT": " Kafka-Python "}) == KAFKA_PYTHON
    assert choose_client({}) == CONFLUENT and not caplog.records
    with caplog.at_level("WARNING", logger="trainmon.producer"):
        assert choose_client({"TRAINMON_KAFKA_CLIENT": "kafka_python"}) == CONFLUENT
    assert "TRAINMON_KAFKA_CLIENT='kafka_python' is neither" in caplog.text
