"""The loader's background inserts: in order, stopping at a failure, which the loader
then writes again on its own thread before anything newer; commits never pass a batch
not written. In memory (a stand-in write) and on chDB, no broker."""

from __future__ import annotations

import gc
import threading
import weakref
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from clickhouse_connect.driver.exceptions import OperationalError

from trainmon.consumers.clickhouse import loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse import create_all
from trainmon.consumers.clickhouse.writer import BackgroundWriter
from trainmon.consumers.metrics import ServiceMetrics
from trainmon.consumers.stream import Message
from trainmon.kafka_client import TopicPartition
from trainmon.schemas import StepRecord, encode


def test_the_writer_stops_at_a_failure_and_gives_back_the_rest_in_order():
    attempts, fail = [], threading.Event()
    fail.set()

    def write(batch):
        attempts.append(batch)
        if batch == "b2" and fail.is_set():
            raise OSError("server away")

    writer = BackgroundWriter([write], len, "test-writer")
    try:
        for batch in ("b1", "b2", "b3"):
            writer.submit(batch)
        writer.wait()
        assert isinstance(writer.error, OSError)
        assert writer.pending() == ["b2", "b3"] and writer.pending_rows() == 4
        assert attempts == ["b1", "b2"]  # b3 is never tried after b2 failed
        assert writer.take_back() == ["b2", "b3"] and writer.error is None

        fail.clear()
        writer.submit("b4")
        writer.wait()
        assert writer.error is None and writer.pending() == [] and attempts == ["b1", "b2", "b4"]
    finally:
        writer.close()
    assert not any(lane.thread.is_alive() for lane in writer._lanes)


def test_lanes_write_partitions_side_by_side_and_keep_each_partition_in_order():
    release_a1, written, lock = threading.Event(), [], threading.Lock()

    def write(batch):
        if batch == ("a", 1):
            assert release_a1.wait(10)
        if batch == ("b", 2):
            raise OSError("server away")
        with lock:
            written.append(batch)

    writer = BackgroundWriter([write, write], lambda b: 10, "test-lanes", key=lambda b: b[0])
    try:
        writer.submit(("a", 1))  # lane 0, held
        writer.submit(("a", 2))  # behind a1 on lane 0, not on the idle lane
        writer.submit(("b", 1))  # the idle lane, written while a1 is held
        writer.submit(("b", 2))  # fails: lane 1 stops; lane 0 goes on
        writer.wait(rows_at_most=20)
        assert written == [("b", 1)] and isinstance(writer.error, OSError)
        assert writer.take_back() == [("b", 2)] and writer.error is None
        assert writer.pending() == [("a", 1), ("a", 2)]
        release_a1.set()
        writer.wait()
        assert written == [("b", 1), ("a", 1), ("a", 2)] and writer.pending_rows() == 0
    finally:
        release_a1.set()
        writer.close()


T0 = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
TP = TopicPartition("t.step", 0)


def message(offset: int) -> Message:
    record = StepRecord(run_id="writer", rank=0, world_size=1, host="h", time=T0 + timedelta(seconds=offset),
                        event_id=f"w-{offset}", step=offset, loss=1.0)
    return Message("step", TP.topic, TP.partition, offset, b"k", encode(record), None, 0)


def test_a_failed_background_insert_is_written_again_first_and_held_back_from_commits(tmp_path, monkeypatch):
    client = connect(Target(path=tmp_path / "chdb"))
    create_all(client, "trainmon")
    tokens = []
    real_insert_json = loader.insert_json

    def connection_lost_once(client, kind, body, **kwargs):
        tokens.append(kwargs["dedup_token"])
        if len(tokens) == 1:
            raise OperationalError("connection reset by peer")
        real_insert_json(client, kind, body, **kwargs)

    monkeypatch.setattr(loader, "insert_json", connection_lost_once)
    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=2, max_wait_s=0)
    sink.start(SimpleNamespace(stopping=False, stream=SimpleNamespace(prefix="t.", dead_letters=0),
                               metrics=ServiceMetrics("test")))
    try:
        sink.put([message(0), message(1)])
        sink.flush()  # handed to the writer, which fails on it
        sink.writer.wait()
        assert sink.writer.error is not None
        assert sink.pre_commit({TP: 2}) == {TP: 0}  # not written: not committed
        assert sink.flush_in_s() == 0.0

        sink.put([message(2), message(3)])
        sink.flush()  # writes the failed batch here first (same token), then hands over the next
        sink.writer.wait()
        assert tokens == ["t.step-0-0-1", "t.step-0-0-1", "t.step-0-2-3"]
        assert sink.pre_commit({TP: 4}) == {TP: 4}
        assert sink.flush_in_s() is None
        rows = client.query("SELECT groupArray(step) FROM (SELECT step FROM trainmon.step ORDER BY step)")
        assert rows.result_rows == [([0, 1, 2, 3],)]
    finally:
        sink.stop()
        client.close()


def test_the_writer_keeps_nothing_it_wrote():
    class Batch(list):
        pass

    writer = BackgroundWriter([lambda batch: None], len, "test-writer")
    try:
        batch = Batch(range(50_000))
        written = weakref.ref(batch)
        writer.submit(batch)
        del batch
        writer.wait()
        gc.collect()
        assert written() is None
    finally:
        writer.close()
