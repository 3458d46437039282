"""Shared fixtures: one real Kafka broker per test session, producers that clean up,
and a helper that reads topics back with a plain kafka-python consumer."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from trainmon import topics
from trainmon.broker import Broker
from trainmon.producer import Producer, ProducerConfig
from trainmon.schemas import decode, unpack


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    broker = Broker(tmp_path_factory.mktemp("kafka"), heap="768m").start()
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
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None)
    out: list = []
    deadline = time.monotonic() + timeout

    def poll() -> None:
        for batch in consumer.poll(timeout_ms=500).values():
            out.extend(item for m in batch for item in items(m))

    try:
        while len(out) < expected and time.monotonic() < deadline:
            poll()
        poll()  # give stragglers (duplicates) a moment to show up, too
    finally:
        consumer.close()
    return out


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
