"""A fatal librdkafka error leaves its consumer unusable for good. Seen in
benchmarks/outage_scenarios.py: after a 60 s broker outage a static member was 'fenced by
other consumer with same group.instance.id' (its own earlier session), and the ClickHouse
service polled a dead client from then on. The adapter joins again with a new client.
librdkafka has no way to inject a fatal consumer error, so the test marks one the way the
error callback does, and checks the recovery for real: a new join, on_assign again,
records after it read."""

from __future__ import annotations

import time
import uuid

from trainmon.kafka_client import Consumer, Producer, create_topics


def test_a_fatal_error_rejoins_with_a_new_client(bootstrap):
    topic = f"fatal-{uuid.uuid4().hex[:8]}"
    create_topics([topic], bootstrap=bootstrap)
    producer = Producer(bootstrap=bootstrap)
    assigned: list[int] = []
    consumer = Consumer(f"g-{topic}", bootstrap=bootstrap, instance_id=f"i-{topic}")
    consumer.subscribe([topic], on_assign=lambda parts: assigned.append(len(parts)))

    def read(n: int) -> list[bytes]:
        got, deadline = [], time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            got += [m.value for m in consumer.poll(0.2)]
        return got

    try:
        producer.send(topic, b"before", b"k")
        producer.flush(10)
        assert read(1) == [b"before"] and len(assigned) == 1
        consumer.commit_consumed()
        first_client = consumer._consumer
        consumer._fatal = "Broker: Static consumer fenced by other consumer with same group.instance.id"
        producer.send(topic, b"after", b"k")
        producer.flush(10)
        assert read(1) == [b"after"]  # the new client resumes from the committed offset
        assert consumer._consumer is not first_client and len(assigned) == 2
    finally:
        consumer.close()
        producer.close()
