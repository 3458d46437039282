"""A config value JSON cannot hold must not kill the producer's sender thread.

Before the fix, ``run_start(config={"dtype": torch.bfloat16})`` returned True, the sender
thread died encoding the record, no later record reached Kafka and ``flush()`` was False."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np
import pytest
import torch

from trainmon.producer import encoding as encoding_module
from trainmon.producer.deferred import DeferredRecord
from trainmon.schemas import RunRecord, decode, encode
from trainmon.schemas.jsonsafe import CIRCULAR, TOO_DEEP, json_safe

from .conftest import read_records


def circular() -> dict:
    loop: dict = {"name": "loop"}
    loop["self"] = loop
    return loop


def test_odd_config_values_arrive_as_text_and_later_records_still_go(make_producer, bootstrap, topic_prefix):
    producer = make_producer()
    config = {"dtype": torch.bfloat16, "mask": np.array([1, 2, 3]), "thing": object(), "loop": circular(),
              "lr": 3e-4, "layers": [1, 2], "nan": math.nan, "steps": np.int64(7)}
    assert producer.run_start(config=config, name="odd-config")
    for step in range(10):
        assert producer.log_step(step, step_tokens=10, duration_ms=5, loss=1.0, norm=1.0, lr=1e-3)
    assert producer.flush(30)
    assert producer.rejected == {}

    [run] = read_records(bootstrap, topic_prefix, "run", 1)
    steps = read_records(bootstrap, topic_prefix, "step", 10)
    assert sorted(s.step for s in steps) == list(range(10))
    got = run.config
    assert got["dtype"] == "torch.bfloat16"
    assert got["mask"] == "[1 2 3]"
    assert isinstance(got["thing"], str) and got["thing"].startswith("<object object at")
    assert got["loop"] == {"name": "loop", "self": CIRCULAR}
    assert got["lr"] == 3e-4 and got["layers"] == [1, 2] and math.isnan(got["nan"]) and got["steps"] == 7
    assert config["dtype"] is torch.bfloat16  # the caller's dict is left alone


def test_a_record_that_cannot_be_encoded_is_rejected_alone(make_producer, bootstrap, topic_prefix, monkeypatch):
    real_encode = encoding_module.encode

    def encode_failing_step_3(record):
        if getattr(record, "step", None) == 3:
            raise RuntimeError("cannot encode step 3")
        return real_encode(record)

    monkeypatch.setattr(encoding_module, "encode", encode_failing_step_3)
    # Records of plain numbers are written without pydantic (DeferredRecord.encode).
    real_deferred_encode = DeferredRecord.encode
    def deferred_encode_failing_step_3(record):
        if dict(zip(record.names, record.values))["step"] == 3:
            raise RuntimeError("cannot encode step 3")
        return real_deferred_encode(record)

    monkeypatch.setattr(DeferredRecord, "encode", deferred_encode_failing_step_3)
    producer = make_producer()
    for step in range(6):
        producer.log_step(step, step_tokens=10, duration_ms=5, loss=1.0, norm=1.0, lr=1e-3)
    assert producer.flush(30)
    assert producer.rejected == {"step": 1}
    steps = read_records(bootstrap, topic_prefix, "step", 5)
    assert sorted(s.step for s in steps) == [0, 1, 2, 4, 5]


def test_json_safe():
    assert json_safe({"a": [1, 2.5, None, True, "x"], "n": math.inf}) == {"a": [1, 2.5, None, True, "x"],
                                                                        "n": math.inf}
    assert json_safe({1: "one", None: "none", (1, 2): "pair"}) == {"1": "one", "null": "none",
                                                                   "(1, 2)": "pair"}
    assert json_safe((1, {3, 2})) == [1, [2, 3]]
    assert json_safe(np.float32(1.5)) == 1.5 and type(json_safe(np.int64(3))) is int
    assert json_safe(torch.bfloat16) == "torch.bfloat16"
    shared = [1]
    assert json_safe({"a": shared, "b": shared}) == {"a": [1], "b": [1]}  # shared is not circular
    looped: list = [1]
    looped.append(looped)
    assert json_safe(looped) == [1, CIRCULAR]

    class Unprintable:
        def __str__(self):
            raise ValueError

        __repr__ = __str__

    assert json_safe(Unprintable()) == "<Unprintable>"
    deep: list = []
    cursor = deep
    for _ in range(100_000):
        cursor.append([])
        cursor = cursor[0]
    cut = json_safe(deep)
    depth = 0
    while isinstance(cut, list):
        cut, depth = cut[0], depth + 1
    assert cut == TOO_DEEP and depth == 100


@pytest.mark.parametrize("levels", [250, 100_000])
def test_a_config_nested_too_deep_still_decodes(levels):
    deep: list = []
    cursor = deep
    for _ in range(levels):
        cursor.append([])
        cursor = cursor[0]
    record = RunRecord(run_id="r", rank=0, world_size=1, host="h", time=datetime.now(timezone.utc),
                       event_id="e", event="start", config={"deep": deep, "lr": 0.1})
    safe, value = encoding_module.encode_safely(record)
    assert decode("run", value).config["lr"] == 0.1
    plain = RunRecord(run_id="r", rank=0, world_size=1, host="h", time=record.time, event_id="e",
                      event="start", config={"lr": 0.1})
    assert encoding_module.encode_safely(plain)[1] == encode(plain)
