"""Records the table refuses or that do not decode, at the edges of the loader's resume
point (max(_offset) + 1 of the rows in ClickHouse): a rebalance writes nothing of a
partition after its batch that failed; a dead letter is in Kafka before rows after it
land; a dead letter of a large record fits in a Kafka message. MemoryBroker and chDB,
the last on the real broker."""

from __future__ import annotations

import base64
import json
import threading

import pytest

from trainmon import topics
from trainmon.consumers import serving
from trainmon.consumers.clickhouse import create_all, loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.memory_stream import memory_streams
from trainmon.consumers.runtime import RetriableError, RetryPolicy
from trainmon.kafka_client import TopicPartition
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import StepRecord, encode, pack

from .samples import envelope
from .waiting import wait_until

PREFIX = "refused."
GROUP = "refused.clickhouse"
STEP_0 = TopicPartition(topics.topic_for("step", PREFIX), 0)
DLQ = topics.topic_for(topics.DEADLETTER, PREFIX)
FAST = RetryPolicy(first_s=0.01, max_s=0.05)


@pytest.fixture
def client(tmp_path):
    client = connect(Target(path=tmp_path / "chdb"))
    create_all(client, "trainmon")
    # A row ClickHouse refuses: loss >= 100 (a CHECK constraint, a server-side refusal).
    client.command("ALTER TABLE trainmon.step ADD CONSTRAINT sane_loss CHECK loss < 100")
    yield client
    client.close()


def steps(first: int, n: int, poison: int | None = None) -> bytes:
    """One Kafka message packing steps first..first+n-1; step ``poison`` has a loss the
    table refuses."""
    return pack([encode(StepRecord(**envelope(i, rank=0), step=i, epoch=0, step_tokens=10, duration_ms=5,
                                   loss=1000.0 if i == poison else 1.0, norm=1.0, lr=1e-3))
                 for i in range(first, first + n)])


def stored_steps(client) -> list[int]:
    return [row[0] for row in client.query("SELECT step FROM trainmon.step ORDER BY step").result_rows]


def dead_lettered_steps(broker: MemoryBroker) -> list[int]:
    return sorted(json.loads(base64.b64decode(json.loads(v)["value_base64"]))["step"]
                  for v in broker.values(DLQ))


class GatedClient:
    """The loader's insert-thread client: its inserts wait until ``gate`` is set."""

    def __init__(self, client, gate: threading.Event):
        self._client, self._gate = client, gate

    def insert(self, *args, **kwargs):
        assert self._gate.wait(30)
        return self._client.insert(*args, **kwargs)

    def raw_insert(self, *args, **kwargs):
        assert self._gate.wait(30)
        return self._client.raw_insert(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def loading(client, broker, *, insert_clients=(), max_wait_s=600.0, stop=None):
    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=1_000, max_wait_s=max_wait_s,
                                 insert_clients=insert_clients)
    return serving.attach(sink, group=GROUP, topic_prefix=PREFIX, stop=stop, retry=FAST,
                          open_stream=memory_streams(broker))


def drain(runtime, client, want: list[int], what: str) -> None:
    def done():
        runtime.step()
        return stored_steps(client) == want
    wait_until(done, 30, what, details=lambda: f"stored {stored_steps(client)}")


def test_a_revoked_partition_is_not_written_past_its_batch_that_failed(client):
    """close() in a rebalance writes the revoked partition's batches in order; when one
    fails (here: a row the table refuses, which a rebalance does not dead-letter), the
    later batches of that partition must not be written: ClickHouse's max(_offset) is
    where the next owner resumes, so writing them skips the failed batch for good."""
    broker = MemoryBroker()
    broker.append(STEP_0.topic, b"r/0", steps(0, 5, poison=2))  # offset 0: batch A
    gate = threading.Event()
    first = loading(client, broker, insert_clients=[GatedClient(client, gate)])
    while first.records < 5:
        first.step()
    first.flush_and_commit()  # batch A handed to the insert thread (held at the gate)
    broker.append(STEP_0.topic, b"r/0", steps(5, 5))  # offset 1: batch B, buffered
    while first.records < 10:
        first.step()
    gate.set()
    wait_until(lambda: first.sink.writer.error is not None, 30, "batch A refused on the insert thread")

    # A second member joins; the memory group deals it the step partition (see _Group.share).
    second = loading(client, broker, max_wait_s=0.0)
    second.step()
    first.step()  # the rebalance: first's close() of the step partition
    assert STEP_0 not in first.stream.consumer.assignment()
    drain(second, client, [0, 1, 3, 4, 5, 6, 7, 8, 9], "the new owner to load every good row")
    assert dead_lettered_steps(broker) == [2]
    for runtime in (first, second):
        runtime.stop.set()
        runtime.run()


def test_a_dead_letter_not_in_kafka_yet_is_not_skipped_by_a_restart(client):
    """A record ClickHouse refuses is dead-lettered and the rest of its batch inserted.
    The loader resumes from max(_offset) + 1 stored in ClickHouse, so once the rest landed
    the refused record is never read again: its dead letter must be in Kafka before then.
    Here Kafka is away (the dead letter waits in the producer) when the rest lands, and the
    process dies (kill -9, as TRAINMON_CLICKHOUSE_CRASH_AFTER_INSERTS does) before its
    commit: the restarted loader must still dead-letter step 2."""
    broker = MemoryBroker()
    broker.append(STEP_0.topic, b"r/0", steps(0, 5, poison=2))  # one message, offset 0
    crashing = loading(client, broker, max_wait_s=0.0)
    while crashing.records < 5:
        crashing.step()
    broker.up = False  # Kafka away: a dead letter waits in the producer's queue
    sink = crashing.sink
    crashing.stream.DEAD_LETTERS_WAIT_S = 0.2
    sink.flush()  # the batch to the insert thread, where the table refuses it
    wait_until(lambda: sink.writer.error is not None, 30, "the insert refused")
    try:
        sink.flush()  # here: step 2 dead-lettered (waiting in the producer), the rest inserted
    except RetriableError:
        pass  # (fixed: the rest waits until the dead letter is in Kafka)
    # kill -9 here: no commit, the producer's queue gone with the process.
    sink.writer.close()
    crashing.stream.consumer.close()
    broker.up = True

    again = loading(client, broker, max_wait_s=0.0)
    wait_until(lambda: again.step() is not None and again.stream.consumer.position(STEP_0) >= 1
               and again.sink.flush_in_s() is None, 30, "the restarted loader read the partition")
    again.stop.set()
    again.run()
    assert stored_steps(client) == [0, 1, 3, 4]
    assert dead_lettered_steps(broker) == [2], "step 2 is neither stored nor dead-lettered"


def test_a_large_poison_message_reaches_the_dead_letter_topic(bootstrap, topic_prefix):
    """A message that does not decode is dead-lettered with its bytes base64-encoded,
    a third larger: one of 900 kB (Kafka takes up to 1 MB) made a dead letter Kafka
    refuses. The producer's refusal was kept in a Delivery nobody looked at, the flush
    before the commit found nothing outstanding, and the offset was committed: the record
    was gone with no dead letter and no error."""
    from trainmon.consumers.stream import RecordStream

    from .conftest import read_topic, send_raw

    step_topic = topics.topic_for("step", topic_prefix)
    poison = b"x" * 900_000
    send_raw(bootstrap, [(step_topic, b"k", poison, 0)])
    stream = RecordStream(f"{topic_prefix}dead-letters", ["step"], topic_prefix=topic_prefix,
                          env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}, group_instance_id=None)
    try:
        wait_until(lambda: stream.poll(200) or stream.dead_letters, 60, "the poison message read")
        assert stream.dead_letters == 1
        stream.commit_polled()
    finally:
        stream.close()
    [letter] = read_topic(bootstrap, topics.topic_for(topics.DEADLETTER, topic_prefix), 1, timeout=15)
    body = json.loads(letter.value)
    assert body["offset"] == 0 and body["error"] and body["value_truncated"] and body["value_bytes"] == 900_000
    assert poison.startswith(base64.b64decode(body["value_base64"]))
