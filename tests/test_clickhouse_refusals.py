"""A batch ClickHouse refuses for good must not stall the loader.

Before the fix, any server-side refusal (a DatabaseError, not the client's DataError) was
retried forever, up to ~26 s apart, with no dead letter, and no other topic loaded
meanwhile: e.g. TOO_MANY_PARTS for a batch spanning more than 100 months, or a row
violating a CHECK constraint."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError
from pydantic import ValidationError

from trainmon import topics
from trainmon.consumers.clickhouse.refusals import blames_rows, month_of, month_runs, partition_limit
from trainmon.schemas import SCHEMA_HEADER, EvalRecord, StepRecord, encode, pack, schema_fingerprint

from .clickhouse_service import ClickHouseService, run_trainmon
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .conftest import read_topic, send_raw

START = datetime(2010, 1, 15, 12, 0, tzinfo=timezone.utc)


def months_later(months: int) -> datetime:
    return START.replace(year=START.year + months // 12, month=1 + months % 12)


def step(i: int, when: datetime, rank: int = 0, **fields) -> StepRecord:
    base = dict(step=i, epoch=0, step_tokens=1, duration_ms=1, loss=1.0, norm=1, lr=1)
    return StepRecord(run_id="months", rank=rank, world_size=2, host="h", time=when,
                      event_id=f"s-{rank}-{i}", **{**base, **fields})


def evals(n: int) -> list[EvalRecord]:
    return [EvalRecord(run_id="months", rank=0, world_size=2, host="h", time=START + timedelta(minutes=i),
                       event_id=f"e-{i}", step=i, epoch=0, eval_tokens=1, duration_ms=1, loss=1.0)
            for i in range(n)]


def send(bootstrap: str, messages: list[tuple[str, int, bytes]], headers=None) -> None:
    send_raw(bootstrap, [(topic, b"months", value, partition) for topic, partition, value in messages],
             headers=headers)


# Sent as any writer would, or marked as a trainmon producer's (stored as JSON first).
@pytest.mark.parametrize("headers", [None, [(SCHEMA_HEADER, schema_fingerprint())]], ids=["plain", "marked"])
def test_a_batch_over_150_months_loads_and_absurd_times_are_dead_lettered(
        kafka_broker, bootstrap, topic_prefix, tmp_path, headers):
    kafka_broker.create_topics(topics.all_topics(topic_prefix))
    step_topic, eval_topic = topics.topic_for("step", topic_prefix), topics.topic_for("eval", topic_prefix)
    # Partition 0: 150 messages of one record each, in 150 different months.
    spread = [step(i, months_later(i)) for i in range(150)]
    # Partition 1: one packed message alone spanning 120 months.
    packed = [step(i, months_later(i), rank=1) for i in range(120)]
    # A clock at 1970 (sent raw: the producer refuses it now).
    absurd = encode(step(999, START)).replace(b'"time":"2010-', b'"time":"1970-')
    send(bootstrap, [(step_topic, 0, encode(r)) for r in spread[:75]] + [(step_topic, 0, absurd)]
         + [(step_topic, 0, encode(r)) for r in spread[75:]]
         + [(step_topic, 1, pack([encode(r) for r in packed]))]
         + [(eval_topic, 0, encode(r)) for r in evals(3)], headers)

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log")
    service.start("--batch-ms", "3000")  # everything above in one batch per partition
    try:
        service.wait_for_log(lambda log: "receiving records" in log)
        send(bootstrap, [(eval_topic, 1, encode(r)) for r in evals(5)[3:]])  # while step loads
        service.wait_for("SELECT count() FROM trainmon.eval", 5)
        service.wait_for("SELECT count() FROM trainmon.step", 270)
        assert service.rows("SELECT rank, count() AS n, uniqExact(toYYYYMM(time)) AS months "
                            "FROM trainmon.step GROUP BY rank ORDER BY rank") == \
            [{"rank": 0, "n": 150, "months": 150}, {"rank": 1, "n": 120, "months": 120}]
        [letter] = [json.loads(m.value) for m in
                    read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 1)]
        assert base64.b64decode(letter["value_base64"]) == absurd
        assert "time" in letter["error"] and "1970" in letter["error"] and "2000-2200" in letter["error"]
    finally:
        assert service.stop() == 0
    log = service.log.read_text()
    assert "spans more than 100 months: inserting it in 2 runs" in log, log[-3000:]
    assert "retrying" not in log, log[-3000:]


def test_a_row_the_server_refuses_is_dead_lettered_and_the_rest_loads(bootstrap, topic_prefix, tmp_path):
    """A CHECK constraint (a server-side DatabaseError, code 469) refuses one row: it is
    dead-lettered, its batch and the other topics load."""
    path = tmp_path / "chdb"
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    done = run_trainmon(bootstrap, "sql", "--path", str(path),
                        "ALTER TABLE trainmon.step ADD CONSTRAINT sane_loss CHECK loss < 100")
    assert done.returncode == 0, done.stderr
    step_topic, eval_topic = topics.topic_for("step", topic_prefix), topics.topic_for("eval", topic_prefix)
    rows = [step(i, START + timedelta(seconds=i), loss=1000.0 if i == 2 else 1.0) for i in range(5)]
    send(bootstrap, [(step_topic, 0, pack([encode(r) for r in rows]))]
         + [(eval_topic, 0, encode(r)) for r in evals(2)])

    service = ClickHouseService(bootstrap, topic_prefix, path, tmp_path / "svc.log").start()
    try:
        service.wait_for("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)",
                         [0, 1, 3, 4])
        service.wait_for("SELECT count() FROM trainmon.eval", 2)
        [letter] = [json.loads(m.value) for m in
                    read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 1)]
        assert letter["index"] == 2 and "sane_loss" in letter["error"]
        assert base64.b64decode(letter["value_base64"]) == encode(rows[2])
    finally:
        assert service.stop() == 0


def test_times_outside_2000_to_2200_are_rejected_naming_field_and_value():
    for year in (1970, 2201, 9999):
        with pytest.raises(ValidationError) as info:
            step(0, START.replace(year=year))
        text = str(info.value)
        assert "time" in text and str(year) in text and "2000-2200" in text
    step(0, START.replace(year=2000, month=1, day=1, hour=0))
    step(0, START.replace(year=2200, month=12, day=31))


def test_which_errors_blame_the_rows():
    def server(code: int, text: str = "") -> DatabaseError:
        return DatabaseError(f"Code: {code}. DB::Exception: {text}", code=code)

    retry = [OperationalError("Network Error: connection refused"),
             server(241, "Memory limit (total) exceeded"), server(202, "Too many simultaneous queries"),
             server(159, "Timeout exceeded"), server(209, "Timeout exceeded while reading from socket"),
             server(252, "Too many parts (3001) in all partitions in total. Merges are processing "
                         "significantly slower than inserts"),
             server(60, "Table trainmon.step does not exist"), server(497, "Not enough privileges"),
             DatabaseError("The ClickHouse server returned an error")]
    rows = [DataError("Unable to write Int64 value 2**70"), server(469, "Constraint `c` is violated"),
            server(6, "Cannot parse input"), server(321, "Value out of range"), OverflowError("int too big")]
    assert [blames_rows(e) for e in retry] == [False] * len(retry)
    assert [blames_rows(e) for e in rows] == [True] * len(rows)
    too_many = server(252, "Too many partitions for single INSERT block (more than 100). The limit is ...")
    assert partition_limit(too_many) == 100 and not blames_rows(too_many)
    assert partition_limit(server(252, "Too many partitions for single INSERT block (more than 7)")) == 7
    assert partition_limit(retry[5]) is None


@dataclass
class Msg:
    offset: int
    record: object


def test_month_runs_cut_between_messages_in_offset_order():
    def msg(offset: int, month: int) -> Msg:
        return Msg(offset, step(offset, months_later(month)))

    messages = [msg(0, 0), msg(1, 1), msg(1, 2), msg(2, 2), msg(3, 3), msg(4, 0), msg(5, 4)]
    runs = month_runs(messages, 3)
    assert [[m.offset for m in run] for run in runs] == [[0, 1, 1, 2], [3, 4, 5]]
    assert all(len({month_of(m.record.time) for m in run}) <= 3 for run in runs)
    one_big_message = [msg(7, m) for m in range(5)]
    assert month_runs(one_big_message, 3) == [one_big_message]
    # toYYYYMM is in UTC: 23:30 on Jan 31 at UTC-5 is already February.
    assert month_of(datetime(2020, 1, 31, 23, 30, tzinfo=timezone(timedelta(hours=-5)))) == 202002
