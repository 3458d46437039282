"""Where to resume: the Kafka offsets already stored in ClickHouse.

The tables, not Kafka's committed offsets, are the source of truth: an insert that
succeeded just before a crash (and before its Kafka commit) is found here, so the
restarted consumer seeks past it instead of inserting it again.
"""

from __future__ import annotations

from collections import defaultdict

from ...kafka_client import TopicPartition

from ... import topics


def stored_positions(client, database: str, partitions: list[TopicPartition],
                     topic_prefix: str) -> dict[TopicPartition, int]:
    """The next offset to read for each partition that already has rows (max + 1)."""
    by_topic: dict[str, set[int]] = defaultdict(set)
    for tp in partitions:
        by_topic[tp.topic].add(tp.partition)
    positions = {}
    for topic, wanted in by_topic.items():
        kind = topics.kind_of(topic, topic_prefix)
        result = client.query(
            f"SELECT _partition, max(_offset) FROM {database}.{kind} "
            "WHERE _topic = {topic:String} GROUP BY _partition",
            parameters={"topic": topic})
        for partition, last in result.result_rows:
            if partition in wanted:
                positions[TopicPartition(topic, partition)] = last + 1
    return positions
