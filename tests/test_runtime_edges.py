"""Edges of the Kafka consumer adapter under the runtime that a real broker hits only by
timing, shown with a stand-in for librdkafka's consumer: a rebalance served in the
middle of a poll."""

from __future__ import annotations

from confluent_kafka import TopicPartition as _TP

from trainmon.kafka_client import Consumer, TopicPartition

TOPIC = "edges.step"
P0 = TopicPartition(TOPIC, 0)


class _Message:
    def __init__(self, offset: int):
        self._offset = offset

    def error(self):
        return None

    def topic(self):
        return TOPIC

    def partition(self):
        return 0

    def offset(self):
        return self._offset

    def key(self):
        return b"k"

    def value(self):
        return b"{}"

    def timestamp(self):
        return (1, 0)

    def headers(self):
        return None


class ScriptedLibrdkafka:
    """librdkafka's consumer as the adapter calls it: each poll / consume runs the
    rebalance callbacks the script says are due there (as librdkafka serves them), then
    returns the script's messages. The group committed nothing."""

    def __init__(self, script: list):
        self.script = script
        self.on_assign = self.on_revoke = None

    def subscribe(self, topics, on_assign, on_revoke, on_lost):
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def _next(self):
        rebalance, messages = self.script.pop(0)
        if rebalance == "assign":
            self.on_assign(self, [_TP(TOPIC, 0)])
        elif rebalance == "revoke":
            self.on_revoke(self, [_TP(TOPIC, 0)])
        return messages

    def poll(self, timeout):
        messages = self._next()
        return messages[0] if messages else None

    def consume(self, n, timeout):
        return self._next()

    def committed(self, partitions, timeout):
        return [_TP(p.topic, p.partition, -1001) for p in partitions]

    def offsets_for_times(self, partitions, timeout):
        return [_TP(p.topic, p.partition, 0) for p in partitions]

    def assign(self, partitions):
        pass

    def unassign(self):
        pass

    def close(self):
        pass


def test_a_partition_revoked_within_a_poll_keeps_no_position_of_messages_handed_out_before():
    """A poll's first message came before a revocation that the rest of the poll then
    served: the adapter recorded that message's position after the revocation had
    dropped the partition's, and once the partition came back (no seek: where the group
    committed) the position said it was read past that message -- the runtime, which
    dropped the message (its partition was gone), would commit past it."""
    consumer = Consumer("edges", bootstrap="127.0.0.1:1")
    consumer._consumer.close()
    fake = ScriptedLibrdkafka([
        ("assign", [_Message(0)]), (None, [_Message(1)]),  # a poll: offsets 0 and 1
        (None, [_Message(2)]), ("revoke", []),  # a poll: offset 2, then the revocation
        ("assign", []),  # a poll: the partition is back, nothing read yet
    ])
    consumer._consumer = fake
    revoked: list = []
    consumer.subscribe([TOPIC], on_revoke=revoked.extend)

    assert [m.offset for m in consumer.poll(0.1)] == [0, 1]
    assert consumer.consumed() == {P0: 2}
    got = consumer.poll(0.1)
    assert revoked == [P0]
    assert consumer.poll(0.1) == [] and consumer.assignment() == {P0}
    # Nothing read since it came back: no position (it was {P0: 3}, past a message the
    # caller dropped, and committed as such by the runtime's next commit).
    assert consumer.consumed() == {}
    assert got == []  # (a message of a partition the poll revoked: not handed out)
    consumer.close()
