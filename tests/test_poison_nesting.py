"""A message nested too deeply for any JSON parser is one dead letter, not a crash loop.

Python's json raises RecursionError (not ValueError) on 100,000 nested brackets; before
the fix that escaped ``decode`` and both consumer services exited on the message, and
again on every restart."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone

import pytest

from trainmon import topics
from trainmon.consumers import stream as stream_module
from trainmon.consumers.stream import RecordStream
from trainmon.schemas import DecodeError, StepRecord, decode, encode, pack

from .clickhouse_service import ClickHouseService
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .conftest import read_topic, send_raw

DEEP = b"[" * 100_000
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def good_step(i: int) -> StepRecord:
    return StepRecord(run_id="deep-run", rank=0, world_size=1, host="h", time=T0 + timedelta(seconds=i),
                      event_id=f"ev-{i}", step=i, epoch=0, step_tokens=1, duration_ms=1, loss=1, norm=1, lr=1)


@pytest.mark.parametrize("value", [DEEP, b'{"a":' * 100_000, b'{"run_id":' + DEEP, DEEP.decode()])
def test_decode_raises_only_decode_error(value):
    with pytest.raises(DecodeError):
        decode("step", value)


def test_any_exception_while_decoding_dead_letters_that_record_only(bootstrap, topic_prefix, monkeypatch):
    """Whatever decode raises for one record (here a stand-in RuntimeError), the stream
    dead-letters that record and hands out the others of the same message."""
    real_decode = stream_module.decode

    def flaky(kind, value):
        if b'"step":1,' in value:
            raise RuntimeError("boom")
        return real_decode(kind, value)

    monkeypatch.setattr(stream_module, "decode", flaky)
    step_topic = topics.topic_for("step", topic_prefix)
    send_raw(bootstrap, [(step_topic, b"k", pack([encode(good_step(i)) for i in range(3)]), None)])
    stream = RecordStream(f"{topic_prefix}deep", ["step"], topic_prefix=topic_prefix,
                          env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    try:
        got = []
        for _ in range(60):
            got += stream.poll(timeout_ms=500)
            if len(got) >= 2:
                break
        stream.commit_polled()
    finally:
        stream.close()
    assert [m.record.step for m in got] == [0, 2]
    [letter] = [json.loads(m.value) for m in
                read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 1)]
    assert letter["index"] == 1 and "RuntimeError: boom" in letter["error"]


def test_deeply_nested_message_is_dead_lettered_and_the_service_goes_on(bootstrap, topic_prefix, tmp_path):
    step_topic = topics.topic_for("step", topic_prefix)
    raw = []
    for value in [encode(good_step(0)), DEEP, encode(good_step(1)), pack([encode(good_step(2)), DEEP])]:
        raw.append((step_topic, b"deep-run/0", value, 0))
    send_raw(bootstrap, raw)

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log").start()
    try:
        service.wait_for("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)",
                         [0, 1, 2])
        letters = [json.loads(m.value) for m in
                   read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 2)]
        assert [base64.b64decode(b["value_base64"]) for b in letters] == [DEEP, DEEP]
        assert [(b["offset"], b["index"]) for b in letters] == [(1, 0), (3, 1)]
        assert all("recursion" in b["error"] for b in letters), letters[0]["error"]
        assert service.running()
    finally:
        assert service.stop() == 0
    assert "Traceback" not in service.log.read_text()
