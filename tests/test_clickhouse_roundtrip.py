"""Records through the real broker into chDB: every field of every kind intact."""

from __future__ import annotations

import base64
import json
import re
import time

from trainmon import topics
from trainmon.consumers.clickhouse.readback import record_from_row
from trainmon.kafka_client import Consumer
from trainmon.schemas import RECORD_TYPES, StepRecord, encode, pack

from .clickhouse_service import ClickHouseService, run_trainmon
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .conftest import committed_offsets, end_offsets, read_topic, send_raw
from .samples import envelope, one_of_each


def every_kind() -> list:
    """One record per kind from the samples registry (every field set, NaN / Inf where
    floats go), and a step record whose optional scalars are absent (NULL)."""
    records = one_of_each()
    sparse = StepRecord(**envelope(len(records) + 1), step=8, epoch=0.5, step_tokens=4096, duration_ms=0.0,
                        loss=2.25, norm=0.5, lr=1e-4)
    return records + [sparse]


def test_every_kind_lands_with_every_field_intact(bootstrap, topic_prefix, make_producer, tmp_path):
    records = every_kind()
    assert {r.kind for r in records} == set(RECORD_TYPES)
    producer = make_producer()
    for record in records:
        producer.send_record(record)
    assert producer.flush(30)

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log").start()
    try:
        for kind in RECORD_TYPES:
            expected = sorted((r for r in records if r.kind == kind), key=lambda r: r.event_id)
            service.wait_for(f"SELECT count() FROM trainmon.{kind}", len(expected))
            rows = service.rows(f"SELECT * FROM trainmon.{kind} ORDER BY event_id")
            got = [record_from_row(kind, row) for row in rows]
            assert [encode(r) for r in got] == [encode(r) for r in expected]
            assert all(row["_topic"] == topics.topic_for(kind, topic_prefix) for row in rows)
        # NaN and Inf are real floats in the table, not text or NULL.
        assert service.rows("SELECT isNaN(loss) AS a, isInfinite(norm) AS b, lr < 0 AS c, "
                            "isNull(params_norm) AS d FROM trainmon.step WHERE step = 7") == \
            [{"a": 1, "b": 1, "c": 1, "d": 0}]

        # trainmon sql from another process while the service holds the chDB directory.
        path = str(service.path)
        csv = run_trainmon(bootstrap, "sql", "--path", path, "-f", "csv",
                           "SELECT step, loss, timers FROM step ORDER BY step")
        assert csv.returncode == 0, csv.stderr
        assert csv.stdout == '"step","loss","timers"\n7,nan,"{\'fwd\':100.25,\'bwd\':inf}"\n8,2.25,"{}"\n'
        table = run_trainmon(bootstrap, "sql", "--path", path, "SELECT step, loss FROM step ORDER BY step")
        assert table.returncode == 0, table.stderr
        assert "─step─" in table.stdout and "nan" in table.stdout and "2.25" in table.stdout
        bad = run_trainmon(bootstrap, "sql", "--path", path, "SELECT nope FROM step")
        assert bad.returncode == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        assert service.stop() == 0


def test_poison_messages_are_dead_lettered_and_the_service_goes_on(
        bootstrap, topic_prefix, make_producer, tmp_path):
    step_topic = topics.topic_for("step", topic_prefix)
    good = [StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=1, duration_ms=1,
                       loss=1, norm=1, lr=1) for i in range(3)]
    too_big = good[0].model_copy(update={"event_id": "too-big", "step": 99, "num_params": 2**70})
    newer = json.loads(encode(good[0]))
    newer.update(schema_version=2, event_id="v2")
    poison = [b"{not json", json.dumps({"run_id": "x"}).encode(), json.dumps(newer).encode(),
              encode(too_big)]

    send_raw(bootstrap, [(step_topic, b"rt-run/0", value, 0) for value in
                         [encode(good[0]), *poison[:2], encode(good[1]), *poison[2:], encode(good[2])]])

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log").start()
    try:
        service.wait_for("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)",
                         [0, 1, 2])
        letters = read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 4)
        bodies = [json.loads(m.value) for m in letters]
        assert [base64.b64decode(b["value_base64"]) for b in bodies] == poison
        errors = [b["error"] for b in bodies]
        assert errors[0].startswith("not JSON")
        assert "world_size" in errors[1] and "Field required" in errors[1]
        assert "unsupported schema_version 2" in errors[2]
        assert "num_params" in errors[3]
        assert all(b["topic"] == step_topic for b in bodies)

        # Still consuming after the poison.
        make_producer(run_id="rt-run").log_step(3, step_tokens=1, duration_ms=1, loss=1, norm=1, lr=1)
        service.wait_for("SELECT count() FROM trainmon.step", 4)
    finally:
        assert service.stop() == 0
    log = service.log.read_text()
    assert " 4 dead letters" in log, log[-2000:]


def test_a_bad_record_inside_a_packed_message_is_dead_lettered_alone(bootstrap, topic_prefix, tmp_path):
    """One Kafka message packs five records; the second is not JSON and the fourth is
    beyond Int64 (what ClickHouse stores, so the schema refuses it): those two go to the
    dead-letter topic, the other three land, in one insert, with the message's offset."""
    step_topic = topics.topic_for("step", topic_prefix)
    good = [StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=1, duration_ms=1,
                       loss=1, norm=1, lr=1) for i in range(3)]
    too_big = good[0].model_copy(update={"event_id": "too-big", "step": 99, "num_params": 2**70})
    lines = [encode(good[0]), b"{broken", encode(good[1]), encode(too_big), encode(good[2])]
    [offset] = send_raw(bootstrap, [(step_topic, b"rt-run/0", pack(lines), 0)])

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log").start()
    try:
        service.wait_for("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)",
                         [0, 1, 2])
        letters = [json.loads(m.value) for m in
                   read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 2)]
        assert [(b["offset"], b["index"]) for b in letters] == [(offset, 1), (offset, 3)]
        assert [base64.b64decode(b["value_base64"]) for b in letters] == [lines[1], lines[3]]
        assert letters[0]["error"].startswith("not JSON") and "num_params" in letters[1]["error"]
        assert service.rows("SELECT _offset, count() AS n FROM trainmon.step GROUP BY _offset") == \
            [{"_offset": offset, "n": 3}]
    finally:
        assert service.stop() == 0


def test_a_backlogs_last_batch_goes_in_once_read_not_after_the_batch_wait(bootstrap, topic_prefix, tmp_path):
    """A catch-up's last batch (here 600 of at most 1,000 rows) is inserted once its
    partition is read to the end, not --batch-ms (ten minutes here) after its first row."""
    step_topic = topics.topic_for("step", topic_prefix)
    records = [encode(StepRecord(**envelope(i, rank=0), step=i, loss=1.0)) for i in range(600)]
    send_raw(bootstrap, [(step_topic, b"rt-run/0", pack(records[i:i + 100]), 0) for i in range(0, 600, 100)])

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log")
    service.start("--batch-rows", "1000", "--batch-ms", "600000")
    try:
        service.wait_for("SELECT count() FROM trainmon.step", 600, timeout=60)
    finally:
        assert service.stop() == 0


def test_sigterm_writes_the_last_batch_and_commits(kafka_broker, bootstrap, topic_prefix, tmp_path):
    # All topics exist up front: no rebalance (which writes buffered rows) during the test.
    kafka_broker.create_topics(topics.all_topics(topic_prefix))
    step_topic = topics.topic_for("step", topic_prefix)
    # One Kafka message: its records are handed out together, so "receiving records" in
    # the service's log means all 50 are in its buffer.
    records = [encode(StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=10, duration_ms=5,
                                 loss=1.0, norm=1.0, lr=1e-3)) for i in range(50)]
    send_raw(bootstrap, [(step_topic, b"rt-run/0", pack(records), 0)])
    # A long batch interval: only the SIGTERM path can write these rows.
    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log")
    service.start("--batch-ms", "600000")
    service.wait_for_log(lambda log: "receiving records" in log)  # polled into its buffer
    assert service.value("SELECT count() FROM trainmon.step") == 0
    assert service.stop() == 0
    assert service.value("SELECT count() FROM trainmon.step") == 50

    committed = committed_offsets(bootstrap, f"{topic_prefix}clickhouse", step_topic)
    assert {p: o or 0 for p, o in committed.items()} == end_offsets(bootstrap, step_topic)


def test_a_rebalance_with_rows_buffered_writes_each_once(kafka_broker, bootstrap, topic_prefix, tmp_path):
    """Another member joins while the service holds a buffered batch that ClickHouse
    rejects in part: the hand-over must neither stall nor lose or duplicate a row."""
    kafka_broker.create_topics(topics.all_topics(topic_prefix))
    step_topic = topics.topic_for("step", topic_prefix)
    # A record the schema accepts and ClickHouse refuses (integers beyond Int64 no longer
    # pass the schema): a CHECK constraint refuses step 99.
    path = tmp_path / "chdb"
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    done = run_trainmon(bootstrap, "sql", "--path", str(path),
                        "ALTER TABLE trainmon.step ADD CONSTRAINT below_99 CHECK step < 99")
    assert done.returncode == 0, done.stderr
    good = [StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=1, duration_ms=1,
                       loss=1, norm=1, lr=1) for i in range(3)]
    too_big = good[0].model_copy(update={"event_id": "too-big", "step": 99})
    send_raw(bootstrap, [(step_topic, b"rt-run/0", encode(record), 0) for record in [*good, too_big]])

    service = ClickHouseService(bootstrap, topic_prefix, path, tmp_path / "svc.log")
    service.start("--batch-ms", "600000")  # rows stay buffered until a rebalance or SIGTERM
    before_intruder = list(ASSIGNED.finditer(service.wait_for_log(lambda log: "receiving records" in log)))
    deadline = time.monotonic() + 120
    group = f"{topic_prefix}clickhouse"
    intruder = Consumer(group, bootstrap=bootstrap)
    intruder.subscribe(topics.all_topics(topic_prefix)[:-1])
    try:
        while not intruder.assignment():  # joined: the service has been through a revocation
            intruder.poll(0.2, max_messages=1)
            assert time.monotonic() < deadline, service.log.read_text()[-3000:]
    finally:
        intruder.close()
    log = service.log.read_text()
    assert re.search(r"revoking \d+ partitions", log), log[-3000:]

    # Everything back with the service and the batch read again (ClickHouse refused it
    # at the revocation, so it was not written then); SIGTERM writes what it holds. On a
    # busy machine the rejoin after the intruder leaves takes seconds: wait for it.
    service.wait_for_log(lambda log: _reassigned_all_and_reading(log, before_intruder), 180)
    assert service.stop() == 0
    assert service.rows("SELECT step, count() AS n FROM trainmon.step GROUP BY step ORDER BY step") == \
        [{"step": i, "n": 1} for i in range(3)]
    letters = read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 1)
    assert [base64.b64decode(json.loads(m.value)["value_base64"]) for m in letters] == [encode(too_big)]


ASSIGNED = re.compile(r"\bassigned (\d+) partitions; ")


def _reassigned_all_and_reading(log: str, before: list[re.Match]) -> bool:
    """Since the assignments ``before`` the intruder came, the service has had one with
    the intruder and then one as large as the last before it, and has polled records
    since (the loader logs "receiving records" once after each assignment)."""
    assignments = list(ASSIGNED.finditer(log))
    return len(assignments) >= len(before) + 2 and assignments[-1].group(1) == before[-1].group(1) \
        and "receiving records" in log[assignments[-1].end():]
