import json
import math
import random
import subprocess
import sys
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from trainmon.schemas import (RECORD_TYPES, DecodeError, EvalRecord, StepRecord, count, decode, encode,
                              pack, unpack)

ENVELOPE = dict(run_id="r", rank=0, world_size=2, host="h", time=datetime.now(timezone.utc),
                event_id="e-1")


def step(**fields):
    base = dict(step=1, epoch=0.0, step_tokens=1000, duration_ms=500.0, loss=2.0, norm=1.0, lr=1e-4)
    return StepRecord(**ENVELOPE, **{**base, **fields})


def test_nan_and_inf_survive_json_unchanged():
    record = step(loss=math.nan, norm=math.inf, params_norm=-math.inf, losses={"aux": math.nan})
    wire = encode(record)
    assert b"NaN" in wire and b"Infinity" in wire
    back = decode("step", wire)
    assert math.isnan(back.loss) and back.norm == math.inf and back.params_norm == -math.inf
    assert math.isnan(back.losses["aux"])
    assert encode(back) == wire


def test_derived_fields():
    assert step(step_tokens=1000, duration_ms=500.0).tokens_per_second == 2000.0
    ev = EvalRecord(**ENVELOPE, step=1, epoch=0, eval_tokens=10, duration_ms=100.0, loss=math.log(5))
    assert ev.perplexity == pytest.approx(5.0) and ev.tokens_per_second == 100.0
    assert EvalRecord(**ENVELOPE, step=1, epoch=0, eval_tokens=1, duration_ms=1, loss=1e6).perplexity == math.inf


def test_durations_are_kept_to_the_microsecond():
    record = step(duration_ms=716.5456161059574, timers={"forward-backward": 644.8910544953617, "optimizer": 71})
    assert record.duration_ms == 716.546
    assert record.timers == {"forward-backward": 644.891, "optimizer": 71.0}
    assert b'"duration_ms":716.546,' in encode(record)
    assert step(duration_ms=math.nan).duration_ms != step(duration_ms=math.nan).duration_ms
    assert step(duration_ms=math.inf).duration_ms == math.inf
    assert EvalRecord(**ENVELOPE, step=1, loss=1.0, duration_ms=0.0004).duration_ms == 0.0
    assert step(duration_ms=1e300).duration_ms == 1e300  # no digits past the microsecond there
    rng = random.Random(5)
    for _ in range(2000):
        kept = step(duration_ms=rng.uniform(0, 1e6) * rng.choice([1e-6, 1e-3, 1])).duration_ms
        assert len(repr(kept).partition(".")[2]) <= 3 or "e" in repr(kept), kept
        assert step(duration_ms=kept).duration_ms == kept  # read back and validated again: the same


def test_a_derived_rate_is_written_only_when_it_is_not_the_derived_one():
    derived = step(step_tokens=524288, duration_ms=716.5456161059574)
    assert b"tokens_per_second" not in encode(derived)
    assert decode("step", encode(derived)).tokens_per_second == derived.tokens_per_second == 524288000 / 716.546
    given = step(step_tokens=524288, duration_ms=716.5, tokens_per_second=700000.0)
    assert b'"tokens_per_second":700000.0' in encode(given)
    assert decode("step", encode(given)).tokens_per_second == 700000.0
    evaluated = EvalRecord(**ENVELOPE, step=1, eval_tokens=10, duration_ms=3.0, loss=1.0)
    assert b"tokens_per_second" not in encode(evaluated) and b"perplexity" in encode(evaluated)
    assert decode("eval", encode(evaluated)) == evaluated


@pytest.mark.parametrize("fields, field_name", [
    ({"loss": "not a number"}, "loss"),
    ({"step": -1}, "step"),
    ({"step_tokens": -5}, "step_tokens"),
    ({"num_zeros": -1}, "num_zeros"),
    ({"lossy": 1.0}, "lossy"),
])
def test_bad_input_names_the_field(fields, field_name):
    with pytest.raises(ValidationError) as info:
        step(**fields)
    assert field_name in str(info.value)


def test_unknown_split_names_the_value():
    with pytest.raises(ValidationError) as info:
        RECORD_TYPES["dataset"](**ENVELOPE, split="validation", files=1, tokens=1)
    assert "split" in str(info.value) and "'train'" in str(info.value)


def test_decode_errors_say_why():
    with pytest.raises(DecodeError, match="not JSON"):
        decode("step", b"\x00garbage")
    with pytest.raises(DecodeError, match="step_tokens"):
        decode("step", encode(step()).replace(b'"step_tokens":1000', b'"step_tokens":-3'))
    with pytest.raises(DecodeError, match="unsupported schema_version 7"):
        decode("step", encode(step()).replace(b'"schema_version":1', b'"schema_version":7'))
    with pytest.raises(DecodeError, match="unknown record kind"):
        decode("nope", b"{}")


def test_a_message_packs_records_as_json_lines():
    # A newline inside a string is escaped by JSON, so it cannot split a record.
    records = [step(step=i, **({"timers": {"a\nb": 1.0}} if i == 1 else {})) for i in range(3)]
    value = pack([encode(r) for r in records])
    assert count(value) == 3 and value.count(b"\n") == 2
    assert [decode("step", v) for v in unpack(value)] == records
    # Hand-written JSON Lines: CRLF and blank lines are fine; nothing at all is one bad record.
    assert unpack(encode(records[0]) + b"\r\n\r\n" + encode(records[2]) + b"\n") == \
        [encode(records[0]), encode(records[2])]
    assert unpack(b"") == [b""] and unpack(b"\n") == [b"\n"]


def test_schema_command_prints_every_record_type():
    out = subprocess.run([sys.executable, "-m", "trainmon", "schema"], check=True,
                         capture_output=True, text=True).stdout
    schemas = json.loads(out)
    assert set(schemas) == set(RECORD_TYPES)
    assert "loss_scale" in schemas["step"]["properties"]


def test_run_id_is_shared_by_the_ranks_of_one_job():
    from trainmon.producer.config import ProducerConfig

    assert ProducerConfig.from_env({"TRAINMON_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "x"}).run_id == "mine"
    assert ProducerConfig.from_env({"TORCHELASTIC_RUN_ID": "abc"}).run_id == "abc"
    ranks = [ProducerConfig.from_env({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node0",
                                      "MASTER_PORT": "29500", "RANK": str(r), "WORLD_SIZE": "4"})
             for r in range(4)]
    assert len({c.run_id for c in ranks}) == 1 and [c.rank for c in ranks] == [0, 1, 2, 3]
    assert ranks[0].world_size == 4
    assert ProducerConfig.from_env({}).run_id != ProducerConfig.from_env({}).run_id


def test_kafka_security_settings_pass_through():
    from trainmon.producer.config import ProducerConfig

    cfg = ProducerConfig.from_env({"TRAINMON_KAFKA_BOOTSTRAP": "a:1,b:2",
                                   "TRAINMON_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                                   "TRAINMON_KAFKA_SASL_MECHANISM": "PLAIN",
                                   "TRAINMON_KAFKA_SASL_USERNAME": "u",
                                   "TRAINMON_KAFKA_SASL_PASSWORD": "p"})
    assert cfg.bootstrap == "a:1,b:2"
    from trainmon.kafka_client import settings

    rd = settings.librdkafka(cfg.kafka, cfg.bootstrap)
    assert {k: rd[k] for k in ("bootstrap.servers", "security.protocol", "sasl.mechanism",
                                "sasl.username", "sasl.password")} == {
        "bootstrap.servers": "a:1,b:2", "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
        "sasl.username": "u", "sasl.password": "p"}
    assert settings.kafka_python(cfg.kafka, cfg.bootstrap) == {
        "bootstrap_servers": ["a:1", "b:2"], "security_protocol": "SASL_SSL",
        "sasl_mechanism": "PLAIN", "sasl_plain_username": "u", "sasl_plain_password": "p"}


def test_a_record_kind_is_declared_once_by_its_model():
    """Defining a model registers its kind: topics, per-step kinds (what the forwarders
    mirror), W&B / Aim / TensorBoard names and the ClickHouse table derive from it."""
    from trainmon import topics
    from trainmon.consumers.alerts.engine import INPUT_KINDS, RULE_CLASSES
    from trainmon.consumers.clickhouse.ddl import order_by
    from trainmon.consumers.metric_names import scalars
    from trainmon.schemas import RECORD_TYPES, STEP_KINDS, Record

    assert list(RECORD_TYPES) == list(Record.registry)[:len(RECORD_TYPES)]
    assert set(STEP_KINDS) == {"step", "eval", "moe", "gpu", "allocator", "gpu_health", "checkpoint", "disk",
                               "producer_health"}
    assert topics.all_topics("p.") == [f"p.{kind}" for kind in RECORD_TYPES] + ["p.deadletter"]
    read = {k for cls in RULE_CLASSES.values() for k in cls.kinds}
    assert read - {"step"} <= set(INPUT_KINDS) <= set(RECORD_TYPES)

    class FanRecord(Record):  # a new kind, as a contributor would add it to records.py
        kind = "test_fan"
        step: int
        rpm: float
        label: str = "front"

    try:
        assert Record.registry["test_fan"] is FanRecord and FanRecord.per_step()
        fan = FanRecord(run_id="r", rank=1, world_size=2, host="h", time="2026-01-01T00:00:00Z",
                        event_id="e", step=3, rpm=1200.0)
        assert [(s.metric, s.value) for s in scalars(fan)] == [("test_fan/rpm", 1200.0)]
        assert "step" in order_by(FanRecord)
    finally:
        del Record.registry["test_fan"]
