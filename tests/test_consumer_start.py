"""Where a consumer joining a group starts reading a partition no seek placed: the
group's committed offset, else the log's start (auto.offset.reset = earliest). The
adapter looks both up itself at assignment (kafka_client.consumer._start_offsets) rather
than leaving them to librdkafka, so the answers must be the same as librdkafka's. A
group's lag counts from the same place (Consumer.uncommitted)."""

from __future__ import annotations

import time
import uuid

from confluent_kafka.admin import AdminClient
from confluent_kafka import TopicPartition as _TP

from trainmon.kafka_client import Consumer, TopicPartition, create_topics, group_lag

from .conftest import send_raw


def test_committed_offset_else_log_start_else_what_arrives_later(bootstrap):
    topic = f"start-{uuid.uuid4().hex[:8]}"
    create_topics([topic], partitions=3, bootstrap=bootstrap)
    send_raw(bootstrap, [(topic, b"k", f"p0-{i}".encode(), 0) for i in range(5)]
             + [(topic, b"k", f"p1-{i}".encode(), 1) for i in range(6)])
    group = f"g-{topic}"
    # Partition 0: the group committed offset 3. Partition 1: nothing committed, and the
    # log's first 4 records deleted (its start is 4, not 0). Partition 2: empty.
    committer = Consumer(group, bootstrap=bootstrap)
    committer.commit({TopicPartition(topic, 0): 3})
    committer.close()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_records([_TP(topic, 1, 4)]).values():
        future.result(30)

    consumer = Consumer(group, bootstrap=bootstrap)
    assigned: list[TopicPartition] = []
    consumer.subscribe([topic], on_assign=assigned.extend)
    got: dict[int, list[tuple[int, bytes]]] = {0: [], 1: [], 2: []}
    try:
        deadline = time.monotonic() + 60
        while not assigned and time.monotonic() < deadline:
            for m in consumer.poll(0.2):
                got[m.partition].append((m.offset, m.value))
        assert len(assigned) == 3
        send_raw(bootstrap, [(topic, b"k", b"p2-late", 2)])
        while sum(map(len, got.values())) < 2 + 2 + 1 and time.monotonic() < deadline:
            for m in consumer.poll(0.2):
                got[m.partition].append((m.offset, m.value))
    finally:
        consumer.close()
    assert got == {0: [(3, b"p0-3"), (4, b"p0-4")],
                   1: [(4, b"p1-4"), (5, b"p1-5")],
                   2: [(0, b"p2-late")]}


def test_uncommitted_counts_from_the_commit_or_from_the_log_start_where_retention_removed_more(bootstrap):
    """A group's lag (``trainmon status``): records removed from the log (retention, a
    delete) are no longer the group's to read, whether it committed nothing there or
    committed short of them."""
    topic = f"lag-{uuid.uuid4().hex[:8]}"
    create_topics([topic], partitions=3, bootstrap=bootstrap)
    send_raw(bootstrap, [(topic, b"k", b"x", p) for p in (0, 1, 2) for _ in range(10)])
    group = f"g-{topic}"
    parts = [TopicPartition(topic, p) for p in (0, 1, 2)]
    committer = Consumer(group, bootstrap=bootstrap)
    # 0: committed 7, log whole. 1: committed 2, the log's first 6 removed. 2: nothing
    # committed, the first 4 removed.
    committer.commit({parts[0]: 7, parts[1]: 2})
    committer.close()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_records([_TP(topic, 1, 6), _TP(topic, 2, 4)]).values():
        future.result(30)

    reader = Consumer(group, bootstrap=bootstrap)
    try:
        assert reader.start_offsets(parts) == {parts[0]: 0, parts[1]: 6, parts[2]: 4}
        assert reader.uncommitted(parts) == {parts[0]: 3, parts[1]: 4, parts[2]: 6}
    finally:
        reader.close()
    assert group_lag(group, [topic], bootstrap=bootstrap) == 13
