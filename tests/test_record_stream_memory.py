"""RecordStream's own contract in memory (MemoryRecordStream over a MemoryBroker): a poll
keeps to its record budget whatever the packing, and whatever decoding raises for one
record costs that record only, dead-lettered with where it was. test_record_stream.py and
test_poison_nesting.py show the same on the real broker."""

from __future__ import annotations

import json

from trainmon import topics
from trainmon.consumers import stream as stream_module
from trainmon.consumers.memory_stream import MemoryRecordStream
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import MAX_RECORDS_PER_MESSAGE, encode, pack

from .test_poison_nesting import good_step
from .test_record_stream import steps

PREFIX = "mem."
STEP = topics.topic_for("step", PREFIX)


def test_polls_keep_to_their_record_budget_over_packed_and_single_messages():
    broker = MemoryBroker()
    packed = steps(0, 6 * MAX_RECORDS_PER_MESSAGE)
    for i in range(0, len(packed), MAX_RECORDS_PER_MESSAGE):
        broker.append(STEP, b"rs/0", pack(packed[i:i + MAX_RECORDS_PER_MESSAGE]))
    for value in steps(len(packed), 50):  # then a trickle
        broker.append(STEP, b"rs/0", value)

    stream = MemoryRecordStream(broker, "rs", ["step"], topic_prefix=PREFIX)
    received, sizes = [], []
    while len(received) < len(packed) + 50:
        batch = stream.poll(timeout_ms=100, max_records=1000)
        assert len(sizes) < 200, f"stuck after {len(received)} records: {sizes}"
        sizes.append(len(batch))
        received += batch
    stream.close()
    assert [m.record.step for m in received] == list(range(len(packed) + 50))
    assert max(sizes) <= 1000, sizes
    # The trickle is not read two messages a poll: the budget follows the packing.
    assert len([s for s in sizes if s]) <= 6 * MAX_RECORDS_PER_MESSAGE // 1000 + 3, sizes
    assert {(m.offset, m.index) for m in received[:2]} == {(0, 0), (0, 1)}


def test_any_exception_while_decoding_dead_letters_that_record_only(monkeypatch):
    real_decode = stream_module.decode

    def flaky(kind, value):
        if b'"step":1,' in value:
            raise RuntimeError("boom")
        return real_decode(kind, value)

    monkeypatch.setattr(stream_module, "decode", flaky)
    broker = MemoryBroker()
    broker.append(STEP, b"k", pack([encode(good_step(i)) for i in range(3)]))
    stream = MemoryRecordStream(broker, "deep", ["step"], topic_prefix=PREFIX)
    got = stream.poll(timeout_ms=100)
    stream.commit_polled()
    stream.close()
    assert [m.record.step for m in got] == [0, 2]
    [letter] = [json.loads(v) for v in broker.values(topics.topic_for(topics.DEADLETTER, PREFIX))]
    assert letter["index"] == 1 and "RuntimeError: boom" in letter["error"]


def test_a_dead_letter_kafka_refuses_is_sent_again_and_nothing_is_committed_past_it():
    """Answered is not stored: a dead letter Kafka refuses (a login without write access
    to the topic) made the flush before the commit return all the same, and the record's
    offset was committed with no dead letter anywhere."""
    from trainmon.kafka_client import KafkaError
    from trainmon.kafka_client.memory_consumer import MemoryProducer, committed_offsets
    from trainmon.kafka_client.producer import Delivery

    class RefusingOnce(MemoryProducer):
        refusals = 1

        def send(self, topic, value, key=None, **kwargs):
            if self.refusals:
                self.refusals -= 1
                return Delivery(done=True, error="Broker: Topic authorization failed")
            return super().send(topic, value, key, **kwargs)

    broker = MemoryBroker()
    broker.append(STEP, b"k", b'{"not": "a step"}')
    stream = MemoryRecordStream(broker, "refused", ["step"], topic_prefix=PREFIX)
    stream._dead_letter_producer = lambda: RefusingOnce(broker)
    assert stream.poll(timeout_ms=100) == [] and stream.dead_letters == 1
    dead = topics.topic_for(topics.DEADLETTER, PREFIX)
    try:
        stream.commit_polled()
        raise AssertionError("committed past a dead letter Kafka refused")
    except KafkaError as exc:
        assert exc.retriable and "authorization" in str(exc)
    assert committed_offsets(broker, "refused") == {}
    stream.commit_polled()  # the runtime's retry: the letter sent again is in Kafka, then the commit
    assert len(broker.values(dead)) == 1
    assert list(committed_offsets(broker, "refused").values()) == [1]
    stream.close()


def test_a_dead_letter_stays_within_kafkas_message_size_whatever_its_error_quotes():
    """A record's decode error may quote the record (a field path holds its dict keys: a
    900 kB step record whose ``losses`` keys are long gives a 900 kB reason). The dead
    letter with that reason whole was over Kafka's message size: refused, sent again at
    every commit and refused again, so the consumer never committed anything again."""
    from trainmon.kafka_client import TopicPartition
    from trainmon.kafka_client.memory_consumer import MemoryProducer, committed_offsets
    from trainmon.kafka_client.producer import Delivery

    class KafkasMessageSize(MemoryProducer):
        max_bytes = 1_000_000  # librdkafka's message.max.bytes: Producer.send reports it failed

        def send(self, topic, value, key=None, **kwargs):
            if len(value) + len(key or b"") > self.max_bytes:
                return Delivery(done=True, error="KafkaError: Broker: Message size too large")
            return super().send(topic, value, key, **kwargs)

    record = json.loads(encode(good_step(0)))
    record["losses"] = {f"{'k' * 300_000}{i}": "not a number" for i in range(3)}
    poison = json.dumps(record).encode()
    assert len(poison) < 1_000_000  # a message Kafka took
    broker = MemoryBroker()
    broker.append(STEP, b"k", poison)
    broker.append(STEP, b"k", encode(good_step(1)))
    stream = MemoryRecordStream(broker, "big-reason", ["step"], topic_prefix=PREFIX)
    stream._dead_letter_producer = lambda: KafkasMessageSize(broker)
    got = stream.poll(timeout_ms=100)
    assert [m.record.step for m in got] == [1] and stream.dead_letters == 1
    stream.commit_polled()  # raised, retriable, at every try: the letter was refused each time
    stream.close()
    assert committed_offsets(broker, "big-reason") == {TopicPartition(STEP, 0): 2}
    [letter] = [json.loads(v) for v in broker.values(topics.topic_for(topics.DEADLETTER, PREFIX))]
    assert letter["offset"] == 0 and letter["error"].startswith("losses.kkk")
