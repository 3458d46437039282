"""The ClickHouse loader on the consumer runtime in memory (MemoryBroker, chDB, no Kafka):
a stop writes the batch in hand and commits it; a restart after a crash between the
insert and the Kafka commit resumes from the offsets stored in ClickHouse, so each row
is written once. test_clickhouse_roundtrip.py and test_clickhouse_exactly_once.py show
the same with the service process on the real broker."""

from __future__ import annotations

import threading

import pytest

from trainmon import topics
from trainmon.consumers import serving
from trainmon.consumers.clickhouse import create_all, loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.memory_stream import memory_streams
from trainmon.kafka_client import TopicPartition
from trainmon.kafka_client.memory_consumer import committed_offsets
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import StepRecord, encode, pack

from .samples import envelope

PREFIX = "mem."
GROUP = "mem.clickhouse"
STEP_0 = TopicPartition(topics.topic_for("step", PREFIX), 0)


@pytest.fixture
def client(tmp_path):
    client = connect(Target(path=tmp_path / "chdb"))
    create_all(client, "trainmon")
    yield client
    client.close()


def steps(first: int, n: int) -> bytes:
    return pack([encode(StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=10, duration_ms=5,
                                   loss=1.0, norm=1.0, lr=1e-3)) for i in range(first, first + n)])


def loading(client, broker: MemoryBroker, stop: threading.Event | None = None):
    """The loader attached to a runtime on the broker; batches wait ten minutes."""
    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=1_000, max_wait_s=600)
    return serving.attach(sink, group=GROUP, topic_prefix=PREFIX, stop=stop, open_stream=memory_streams(broker))


def stored_steps(client) -> list[int]:
    return [row[0] for row in client.query("SELECT step FROM trainmon.step ORDER BY step").result_rows]


def test_a_stop_writes_the_batch_in_hand_and_commits_it(client):
    broker = MemoryBroker()
    broker.append(STEP_0.topic, b"rt-run/0", steps(0, 50))
    stop = threading.Event()
    runtime = loading(client, broker, stop)
    while runtime.records < 50:
        runtime.step()
    assert stored_steps(client) == []  # buffered: the batch is not due for ten minutes
    stop.set()
    runtime.run()
    assert stored_steps(client) == list(range(50))
    assert committed_offsets(broker, GROUP)[STEP_0] == 1


def test_a_crash_before_the_commit_resumes_from_clickhouse_offsets_and_writes_each_row_once(client):
    broker = MemoryBroker()
    for first in (0, 20, 40):
        broker.append(STEP_0.topic, b"rt-run/0", steps(first, 20))
    stopping = threading.Event()
    crashing = loading(client, broker, stopping)
    crashing.stream.commit = lambda offsets: (_ for _ in ()).throw(OSError("crash before the commit"))
    while crashing.records < 60:
        crashing.step()
    stopping.set()  # a flush while stopping waits for its inserts: the crash comes after them
    with pytest.raises(OSError, match="crash"):
        crashing.flush_and_commit(final=True)
    crashing.sink.stop()
    crashing.stream.consumer.close()
    assert stored_steps(client) == list(range(60)) and committed_offsets(broker, GROUP) == {}

    broker.append(STEP_0.topic, b"rt-run/0", steps(60, 20))
    stop = threading.Event()
    again = loading(client, broker, stop)
    while again.records < 20:
        again.step()
    assert again.records == 20  # resumed at offset 3, from ClickHouse: nothing read twice
    stop.set()
    again.run()
    assert stored_steps(client) == list(range(80))
    assert committed_offsets(broker, GROUP)[STEP_0] == 4
