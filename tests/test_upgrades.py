"""Upgrades (docs/upgrades.md): producers and consumers of neighbouring versions side by side
lose nothing, and ClickHouse tables made by an older trainmon are migrated at start.

- A newer producer's record (an optional field this trainmon does not know) loads without
  that field; an older producer's record (fields added since missing) loads as it is.
- A record of a newer *major* schema_version is dead-lettered as parked, with what to do.
- tests/data/clickhouse_v0_ddl.sql is the DDL trainmon 3763773 ran (recorded from that
  commit's own code), tests/data/records_v0.jsonl one record of each of its kinds as its
  producer wrote them: today's loader migrates that database at start and loads old,
  current and newer records into it, resuming after the rows the old version loaded.
"""

from __future__ import annotations

import base64
import json
import math
import re
import threading
from pathlib import Path

import pytest

from trainmon import topics
from trainmon.consumers import serving
from trainmon.consumers.clickhouse import create_all, loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.memory_stream import memory_streams
from trainmon.consumers.runtime import RetryPolicy, read_to_end_as_of_now
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import (
    RECORD_TYPES, SCHEMA_VERSION, UNKNOWN_FIELDS, AllocatorRecord, DecodeError, StepRecord, decode, encode,
)

from .samples import envelope, one_of_each, sample

DATA = Path(__file__).parent / "data"
V0_DDL = DATA / "clickhouse_v0_ddl.sql"
V0_RECORDS = [line.encode() for line in (DATA / "records_v0.jsonl").read_text().splitlines()]
V0_KINDS = [json.loads(line)["event_id"].removeprefix("v0-") for line in V0_RECORDS]
PREFIX = "up."


def newer(record, **added) -> bytes:
    """``record`` as a newer producer writes it: the same major version, fields added."""
    body = json.loads(encode(record))
    body.update(added)
    return json.dumps(body).encode()


# -- the version policy, in memory ---------------------------------------------------------

def test_a_newer_producers_optional_field_is_ignored_and_the_record_loads():
    record = StepRecord(**envelope(1), **sample("step"))
    decoded = decode("step", newer(record, grad_noise_scale=0.5))
    assert encode(decoded) == encode(record)  # (the sample holds NaN: compared as written)
    assert UNKNOWN_FIELDS[("step", "grad_noise_scale")] >= 1

    # Also inside a nested model (an allocator segment gaining a field).
    allocator = AllocatorRecord(**envelope(2), **sample("allocator"))
    body = json.loads(encode(allocator))
    body["stats"][0]["compressed"] = 7
    assert encode(decode("allocator", json.dumps(body).encode())) == encode(allocator)
    assert UNKNOWN_FIELDS[("allocator", "stats.compressed")] >= 1


def test_an_unknown_field_does_not_hide_what_else_is_wrong():
    body = json.loads(newer(StepRecord(**envelope(1), **sample("step")), grad_noise_scale=0.5))
    body["step"] = -1
    with pytest.raises(DecodeError, match="step: Input should be greater than or equal to 0"):
        decode("step", json.dumps(body).encode())


@pytest.mark.parametrize("kind, line", list(zip(V0_KINDS, V0_RECORDS)), ids=V0_KINDS)
def test_an_older_producers_record_loads(kind, line):
    """Each kind as trainmon 3763773 wrote it (tests/data/records_v0.jsonl)."""
    record = decode(kind, line)
    assert record.event_id == f"v0-{kind}" and record.schema_version == 1


def test_a_newer_major_version_is_parked_with_the_reason():
    body = json.loads(encode(StepRecord(**envelope(1), **sample("step"))))
    body["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(DecodeError) as caught:
        decode("step", json.dumps(body).encode())
    reason = caught.value.reason
    assert f"unsupported schema_version {SCHEMA_VERSION + 1}" in reason
    assert "parked" in reason and "replay" in reason
    # An older major, or junk, is refused but not called a newer producer's.
    body["schema_version"] = 0
    with pytest.raises(DecodeError, match="unsupported schema_version 0") as caught:
        decode("step", json.dumps(body).encode())
    assert "parked" not in caught.value.reason


# -- a database of the previous version, migrated and loaded ---------------------------------

def v0_statements() -> list[str]:
    text = "\n".join(line for line in V0_DDL.read_text().splitlines() if not line.startswith("--"))
    return [s.strip() for s in re.split(r";\s*\n", text) if s.strip()]


@pytest.fixture
def v0_database(tmp_path):
    """A chDB database as trainmon 3763773 created it, with its step row for offset 0 of
    the step topic loaded (as that version's loader would have)."""
    client = connect(Target(path=tmp_path / "chdb"))
    for statement in v0_statements():
        client.command(statement)
    old_columns = ["run_id", "rank", "world_size", "host", "time", "event_id", "schema_version", "step",
                   "epoch", "step_tokens", "duration_ms", "loss", "norm", "lr", "losses", "timers",
                   "_topic", "_partition", "_offset"]
    values = {**decode("step", V0_RECORDS[V0_KINDS.index("step")]).model_dump(),
              "_topic": topics.topic_for("step", PREFIX), "_partition": 0, "_offset": 0}
    client.insert("trainmon.step", [[values[c] for c in old_columns]], column_names=old_columns)
    yield client
    client.close()


def test_tables_of_the_previous_version_are_migrated_and_load_old_current_and_newer_records(v0_database):
    client = v0_database
    assert "nan_iterations" not in column_names(client, "step")
    assert "gpu_health" not in table_names(client)

    broker = MemoryBroker()
    key = b"up-run"
    step_topic = topics.topic_for("step", PREFIX)
    # Offset 0: the old version's producer, loaded by the old version (the row above).
    broker.append(step_topic, key, V0_RECORDS[V0_KINDS.index("step")])
    # An older producer's record of each kind it had, not loaded yet (step: a second one).
    second_v0_step = json.loads(V0_RECORDS[V0_KINDS.index("step")])
    second_v0_step.update(event_id="v0-step-2", step=4)
    broker.append(step_topic, key, json.dumps(second_v0_step).encode())
    for kind, line in zip(V0_KINDS, V0_RECORDS):
        if kind != "step":
            broker.append(topics.topic_for(kind, PREFIX), key, line)
    # This version's producer: one of each kind (the four newer kinds included), and a
    # step with fields that were required then and are optional now, and one added since.
    current = one_of_each(first=100)
    for record in current:
        broker.append(topics.topic_for(record.kind, PREFIX), key, encode(record))
    sparse = StepRecord(**envelope(200), step=7, loss=2.5, nan_iterations=3)
    broker.append(step_topic, key, encode(sparse))
    # A newer producer: a field added (loads without it), and a newer major version (parked).
    added = StepRecord(**envelope(300), step=8, loss=2.0, norm=1.0)
    broker.append(step_topic, key, newer(added, grad_noise_scale=0.25))
    broker.append(step_topic, key, newer(StepRecord(**envelope(301), step=9, loss=2.0),
                                         schema_version=SCHEMA_VERSION + 1))

    create_all(client, "trainmon")  # as the service does at start: migrates
    assert {"nan_iterations"} <= column_names(client, "step")
    assert {"gpu_health", "checkpoint", "disk", "log_event"} <= table_names(client)

    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=1_000, max_wait_s=0.05)
    stop = threading.Event()
    runtime = serving.attach(sink, group="up.clickhouse", topic_prefix=PREFIX, stop=stop,
                             retry=RetryPolicy(0.05, 0.2), open_stream=memory_streams(broker))
    give_up = threading.Timer(60, stop.set)  # a bug here fails the counts below, never hangs
    give_up.start()
    try:
        runtime.run(until=read_to_end_as_of_now(runtime.stream, topics.all_topics(PREFIX)[:-1]))
    finally:
        give_up.cancel()

    expected = {kind: 1 for kind in RECORD_TYPES}  # this version's one of each
    for kind in V0_KINDS:
        expected[kind] += 1  # and the older producer's
    expected["step"] += 1 + 1 + 1  # the old row (once: resumed after it), sparse, added
    counts = {kind: client.query(f"SELECT count() FROM trainmon.{kind}").result_rows[0][0]
              for kind in RECORD_TYPES}
    assert counts == expected

    rows = {r[0]: r[1:] for r in client.query(
        "SELECT event_id, step, loss, norm, epoch, nan_iterations FROM trainmon.step").result_rows}
    old_loss, old_norm = rows["v0-step"][1:3]
    assert math.isnan(old_loss) and old_norm == math.inf  # the old row, kept through the retyping
    assert rows["ev-200"] == (7, 2.5, None, None, 3)  # NULLs where the old columns took none
    assert rows["ev-300"] == (8, 2.0, 1.0, None, None)
    assert rows["v0-step-2"][0] == 4

    letters = [json.loads(v) for v in broker.values(topics.topic_for(topics.DEADLETTER, PREFIX))]
    assert len(letters) == 1 and "parked" in letters[0]["error"]
    assert json.loads(base64.b64decode(letters[0]["value_base64"]))["step"] == 9


def column_names(client, table: str) -> set[str]:
    return {r[0] for r in client.query("SELECT name FROM system.columns WHERE database = 'trainmon' "
                                       "AND table = {t:String}", parameters={"t": table}).result_rows}


def table_names(client) -> set[str]:
    return {r[0] for r in client.query("SELECT name FROM system.tables WHERE database = 'trainmon'").result_rows}
