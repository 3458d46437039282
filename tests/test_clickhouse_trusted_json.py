"""Records a trainmon producer validated go into ClickHouse as the JSON they came as.

The producer marks its messages with the fingerprint of its schemas
(``schemas.SCHEMA_HEADER``); the loader stores the records of such a message without
decoding them (ClickHouse parses the JSON), and validates everything else. These tests
check that both ways store the same rows, that a marked message ClickHouse refuses is
decoded and dead-lettered record by record like any other, and that a message without
the mark (or with another schema's) is validated as before."""

from __future__ import annotations

import base64
import json
import random
import tempfile
from datetime import datetime, timedelta, timezone

import pytest

from trainmon import topics
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse.columns import insert_batch, insert_json, json_body, json_ready
from trainmon.consumers.clickhouse import create_all
from trainmon.consumers.clickhouse.ddl import create_table_sql
from trainmon.consumers.clickhouse.loader import stored_as_they_come
from trainmon.consumers.stream import _lines_if_packed
from trainmon.producer.deferred import DeferredRecord, checked_values, field_rules, passes_quick_check
from trainmon.schemas import RECORD_TYPES, SCHEMA_HEADER, StepRecord, encode, pack, schema_fingerprint

from .clickhouse_service import ClickHouseService, run_trainmon
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .conftest import read_topic, send_raw
from .test_clickhouse_roundtrip import every_kind
from .test_producer_quick_check import ENVELOPE, ODD_VALUES, _all_numbers_may_do, _required_missing

TRUSTED = [(SCHEMA_HEADER, schema_fingerprint())]
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def chdb_client():
    with tempfile.TemporaryDirectory() as tmp:
        client = connect(Target(path=f"{tmp}/chdb"))
        for database in ("as_json", "as_columns"):
            create_all(client, database)
        yield client
        client.close()


def test_kinds_with_sub_records_or_free_form_json_are_not_stored_as_json():
    assert json_ready("step") and json_ready("gpu") and json_ready("eval")
    assert not json_ready("allocator")  # Nested stats columns
    assert not json_ready("run")  # config: free-form JSON kept as text
    assert "step" in stored_as_they_come({}) and "run" not in stored_as_they_come({})
    assert stored_as_they_come({"TRAINMON_CLICKHOUSE_VALIDATE_ALL": "1"}) == []


@pytest.mark.parametrize("kind", [k for k in RECORD_TYPES if json_ready(k)])
def test_json_and_column_inserts_store_the_same_rows(chdb_client, kind):
    records = [r for r in every_kind() if r.kind == kind]
    if kind == "step":  # a time in another zone is stored as the same instant
        records.append(records[0].model_copy(update={
            "event_id": "ev-zone", "time": T0.astimezone(timezone(timedelta(hours=2)))}))
    offsets = list(range(len(records)))
    insert_json(chdb_client, kind, json_body(("t", 0, offsets), [encode(r) for r in records]),
                database="as_json", dedup_token=f"json-{kind}")
    insert_batch(chdb_client, kind, records, database="as_columns", kafka=("t", 0, offsets),
                 dedup_token=f"columns-{kind}")

    def rows(database):
        return chdb_client.query(f"SELECT * EXCEPT _inserted_at FROM {database}.{kind} "
                                 "ORDER BY event_id").result_rows
    assert repr(rows("as_json")) == repr(rows("as_columns"))  # as text: NaN equals NaN
    assert len(rows("as_json")) == len(records)


@pytest.mark.parametrize("model", [m for m in RECORD_TYPES.values() if json_ready(m.kind) and _all_numbers_may_do(m)],
                         ids=lambda m: m.kind)
def test_what_a_log_call_writes_without_pydantic_is_stored_as_its_record(chdb_client, model):
    """The producer writes a log call's plain numbers as JSON itself (DeferredRecord.encode,
    fields in the order given): stored as JSON, the rows are those of the record built."""
    checks = field_rules(model)
    rng = random.Random(model.kind)
    required = {n: 1 for n, f in model.model_fields.items() if f.is_required() and n in checks}
    deferred = []
    for number in range(2000):
        fields = dict(required)
        for name in rng.sample(sorted(checks), k=rng.randint(0, len(checks))):
            fields[name] = rng.choice(ODD_VALUES)
        if passes_quick_check(model, fields) and not _required_missing(model, fields):
            deferred.append(DeferredRecord(model, ENVELOPE, 1.7e9 + rng.choice([0, 0.5, 0.123456]),
                                           "deferred", number, *checked_values(model, fields)))
    assert len(deferred) > 100
    offsets = list(range(len(deferred)))
    insert_json(chdb_client, model.kind, json_body(("t", 1, offsets), [d.encode() for d in deferred]),
                database="as_json", dedup_token=f"deferred-json-{model.kind}")
    insert_batch(chdb_client, model.kind, [d.build() for d in deferred], database="as_columns",
                 kafka=("t", 1, offsets), dedup_token=f"deferred-columns-{model.kind}")

    def rows(database):
        return chdb_client.query(f"SELECT * EXCEPT _inserted_at FROM {database}.{model.kind} "
                                 "WHERE _partition = 1 ORDER BY event_id").result_rows
    assert repr(rows("as_json")) == repr(rows("as_columns"))


def test_a_packed_message_goes_into_the_insert_body_as_its_records_would():
    """A Kafka message handed out whole: each of its lines gets the message's coordinates,
    as if its records had come one by one."""
    records = [encode(step(i)) for i in range(3)]
    assert _lines_if_packed(pack(records)) == 3
    assert json_body(("t", 2, [7, 9]), [pack(records), records[0]]) == \
        json_body(("t", 2, [7, 7, 7, 9]), [*records, records[0]])
    assert json_body(("t", 2, [7]), [records[0]]) == b'{"_topic":"t","_partition":2,"_offset":7,' + records[0][1:]
    for odd in (pack(records) + b"\n", records[0] + b"\n\n" + records[1], b" " + records[0], b""):
        # decoded record by record instead
        assert _lines_if_packed(odd) == 0 or json_body(("t", 2, [7]), [odd]) is None


def step(i: int, **fields) -> StepRecord:
    base = dict(step=i, epoch=0, step_tokens=1, duration_ms=1, loss=1.0, norm=1, lr=1)
    return StepRecord(run_id="trusted", rank=0, world_size=1, host="h", time=T0 + timedelta(seconds=i),
                      event_id=f"t-{i}", **{**base, **fields})


def test_refused_marked_records_are_decoded_and_dead_lettered_alone(bootstrap, topic_prefix, tmp_path):
    """Marked messages, one with a record ClickHouse refuses (a CHECK constraint) and one
    with a line that is not JSON; in another partition one marked with another schema's
    fingerprint and an unmarked one: every good record lands once, the two bad ones are
    dead-lettered with their reasons."""
    path = tmp_path / "chdb"
    assert run_trainmon(bootstrap, "clickhouse", "init", "--path", str(path)).returncode == 0
    done = run_trainmon(bootstrap, "sql", "--path", str(path),
                        "ALTER TABLE trainmon.step ADD CONSTRAINT sane_loss CHECK loss < 100")
    assert done.returncode == 0, done.stderr
    step_topic = topics.topic_for("step", topic_prefix)
    refused = step(2, loss=1000.0)
    send_raw(bootstrap, [(step_topic, b"k", pack([encode(step(0)), encode(step(1)), encode(refused)]), 0),
                         (step_topic, b"k", pack([encode(step(3)), b'{"step": 4,']), 0),
                         # Not as pack writes it (a blank line): decoded as it is read.
                         (step_topic, b"k", encode(step(7)) + b"\n\n" + encode(step(8)), 2)], headers=TRUSTED)
    # Partition 1: not marked as ours, so decoded as they are read.
    send_raw(bootstrap, [(step_topic, b"k", encode(step(5)), 1)],
             headers=[(SCHEMA_HEADER, b"another-schema")])
    send_raw(bootstrap, [(step_topic, b"k", encode(step(6)), 1)])

    service = ClickHouseService(bootstrap, topic_prefix, path, tmp_path / "svc.log").start()
    try:
        service.wait_for("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)",
                         [0, 1, 3, 5, 6, 7, 8])
        letters = [json.loads(m.value) for m in
                   read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 2)]
        by_index = {(letter["offset"], letter["index"]): letter for letter in letters}
        assert set(by_index) == {(0, 2), (1, 1)}
        assert "sane_loss" in by_index[0, 2]["error"]
        assert base64.b64decode(by_index[0, 2]["value_base64"]) == encode(refused)
        assert "not JSON" in by_index[1, 1]["error"]
        # The marked messages were stored as JSON first (and refused as such).
        assert "refused as JSON" in service.log.read_text()
        assert service.rows("SELECT count() AS n, uniqExact(event_id) AS u FROM trainmon.step") == \
            [{"n": 7, "u": 7}]
    finally:
        assert service.stop() == 0


def test_a_rate_left_out_of_the_json_is_derived_by_clickhouse_as_by_the_record(chdb_client):
    """A step record leaves tokens/s out of its JSON when it is the derived one (its bytes
    on the broker's disk); the step table's DEFAULT computes the very value the record
    holds, on a table as this version makes it and on one the previous version made
    (tokens_per_second without a DEFAULT, given one at start), and the rollups see it."""
    rng = random.Random(3)
    records = [step(i, step_tokens=rng.choice([1, 4096, 524288, 2**40]), duration_ms=rng.uniform(0.001, 5e4))
               for i in range(500)]
    records.append(step(500, step_tokens=7, duration_ms=0.0))  # no rate: NULL, as None
    records.append(step(501, step_tokens=7, duration_ms=2.0, tokens_per_second=12.5))  # given: kept
    assert all(b"tokens_per_second" not in encode(r) for r in records[:501])
    assert b"tokens_per_second" in encode(records[501])
    client = chdb_client
    create_all(client, "rates_now")
    client.command("CREATE DATABASE rates_previous")
    table = create_table_sql("step", "rates_previous")
    client.command(table.replace(" DEFAULT " + StepRecord.derived["tokens_per_second"].sql, ""))
    default = ("SELECT default_expression FROM system.columns WHERE database = 'rates_previous' "
               "AND table = 'step' AND name = 'tokens_per_second'")
    assert client.query(default).result_rows == [("",)]
    create_all(client, "rates_previous")  # as a service does at start
    assert "duration_ms" in client.query(default).result_rows[0][0]
    for database in ("rates_now", "rates_previous"):
        insert_json(client, "step", json_body(("t", 0, list(range(len(records)))), [encode(r) for r in records]),
                    database=database, dedup_token="rates")
        stored = dict(client.query(f"SELECT step, tokens_per_second FROM {database}.step").result_rows)
        assert stored == {r.step: r.tokens_per_second for r in records}, database  # exactly
        fastest = client.query(f"SELECT max(max_tokens_per_second) FROM {database}.step_stats").result_rows
        assert fastest == [(max(r.tokens_per_second for r in records if r.tokens_per_second),)]
