"""Shared fixtures: one real Kafka broker per test session, producers that clean up,
and a helper that reads topics back with a plain consumer (no group, no commits).

Tests that need a real broker are marked ``kafka`` here, by the fixtures they use; those
that start a broker of their own (``own_broker``, the stack's modules) also ``slow``; a
test that starts one otherwise, or waits out a real client's timeouts with no broker,
carries the marks itself. ``pytest -m "not kafka"`` runs the rest: in memory
(MemoryBroker, MemoryRecordStream) or with no Kafka at all.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from trainmon import topics
from trainmon.broker import Broker
from trainmon.kafka_client import Consumer, Producer as RawProducer, TopicPartition
from trainmon.producer import Producer, ProducerConfig
from trainmon.schemas import decode, unpack


# Every broker the tests start (the session's, a test's own, those of `trainmon up` and the
# demo run as subprocesses) lives for seconds or minutes: C1 only and the serial collector
# start it on about half the CPU of G1 and C2 (trainmon.broker.jvm_performance_options).
os.environ.setdefault("KAFKA_JVM_PERFORMANCE_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

# Fixtures that mean a real broker: the session's, or one a test starts for itself.
SHARED_BROKER_FIXTURES = frozenset({"kafka_broker", "bootstrap"})
OWN_BROKER_FIXTURES = frozenset({"own_broker"})
# Modules whose tests start the whole stack, broker included, as subprocesses.
STACK_MODULES = frozenset({"test_stack.py", "test_demo.py"})


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        fixtures = set(item.fixturenames)  # with those the test's fixtures use in turn
        own_broker = bool(fixtures & OWN_BROKER_FIXTURES) or item.path.name in STACK_MODULES
        if own_broker or fixtures & SHARED_BROKER_FIXTURES:
            item.add_marker(pytest.mark.kafka)
        if own_broker:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    # throwaway: stopped even when pytest is killed (kill -9 included) and leaves no JVM
    # behind; retention checked every second, so a test can see a topic trimmed.
    broker = Broker(tmp_path_factory.mktemp("kafka"), heap="768m", throwaway=True,
                    retention_check_ms=1000).start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def bootstrap(kafka_broker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture
def topic_prefix() -> str:
    """A prefix of its own per test, so tests sharing the broker never see each other."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def make_producer(bootstrap, topic_prefix, tmp_path):
    made: list[Producer] = []

    def make(**overrides) -> Producer:
        settings = dict(bootstrap=bootstrap, topic_prefix=topic_prefix, run_id="test-run",
                        spill_dir=tmp_path / "spill", linger_ms=5)
        settings.update(overrides)
        producer = Producer(ProducerConfig(**settings))
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close(timeout=5)


def _read(bootstrap: str, topic: str, expected: int, timeout: float, items) -> list:
    """``items(message)`` of one topic from the beginning, until ``expected`` arrived."""
    consumer = Consumer(None, bootstrap=bootstrap)
    out: list = []
    deadline = time.monotonic() + timeout
    while not (partitions := consumer.partitions_for(topic)) and time.monotonic() < deadline:
        time.sleep(0.2)  # the topic is not there yet
    parts = [TopicPartition(topic, p) for p in partitions]
    consumer.assign({tp: 0 for tp in parts})
    read_to: dict[int, int] = {}  # partition -> the offset after the last message read

    def poll() -> None:
        for message in consumer.poll(0.5):
            read_to[message.partition] = message.offset + 1
            out.extend(items(message))

    try:
        while len(out) < expected and time.monotonic() < deadline:
            poll()
        # Then on to the end of the log as it is now, so that duplicates already written
        # are counted too (a fixed half-second poll did that only probably, and cost each
        # of the suite's ~100 reads half a second).
        ends = consumer.end_offsets(parts)
        while any(read_to.get(tp.partition, 0) < end for tp, end in ends.items()) \
                and time.monotonic() < deadline:
            poll()
    finally:
        consumer.close()
    return out


def send_raw(bootstrap: str, messages: list[tuple[str, bytes | None, bytes, int | None]],
             headers: list[tuple[str, bytes]] | None = None) -> list[int]:
    """Raw Kafka messages (topic, key, value, partition or None), past the producer's
    checks (poison, hand-packed batches); their offsets once Kafka has them all."""
    raw = RawProducer(bootstrap=bootstrap)
    sent = [raw.send(topic, value, key=key, partition=partition, headers=headers)
            for topic, key, value, partition in messages]
    assert raw.flush(30) and not any(d.failed for d in sent), [d.error for d in sent if d.failed]
    return [d.offset for d in sent]


def _per_partition(topic: str, ask, group: str | None, bootstrap: str) -> dict:
    consumer = Consumer(group, bootstrap=bootstrap)
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for(topic)]
        return {tp.partition: o for tp, o in ask(consumer, parts).items()}
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    """The group's committed offset per partition of the topic (None: nothing committed)."""
    return _per_partition(topic, lambda c, parts: c.committed(parts), group, bootstrap)


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    return _per_partition(topic, lambda c, parts: c.end_offsets(parts), None, bootstrap)


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list:
    """Raw Kafka messages of one topic from the beginning, waiting until ``expected``
    messages arrived (of a record topic, use read_records: a message packs records)."""
    return _read(bootstrap, topic, expected, timeout, lambda m: [m])


def read_records(bootstrap: str, prefix: str, kind: str, expected: int, timeout: float = 30.0):
    """The records of one kind from the beginning, waiting until ``expected`` arrived."""
    values = _read(bootstrap, topics.topic_for(kind, prefix), expected, timeout,
                   lambda m: unpack(m.value))
    return [decode(kind, v) for v in values]


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def unwritable_spill(tmp_path) -> Path:
    """A spill directory that cannot be made: a regular file stands in its path."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the spill directory should be")
    return blocker / "spill"


@pytest.fixture(params=["confluent-kafka", "kafka-python"])
def both_clients(request, monkeypatch) -> str:
    """Run a producer test once per transport (``pytestmark = usefixtures("both_clients")``):
    librdkafka, the default, and kafka-python, the pure-Python fallback."""
    monkeypatch.setenv("TRAINMON_KAFKA_CLIENT", request.param)
    return request.param
