"""A RecordStream over a MemoryBroker, for tests: the consumer runtime and any sink run on
it as on Kafka -- decoding, dead letters, commits, rebalances -- with no broker process.

    broker = MemoryBroker()
    Producer(config, transport=broker.transport).log_step(...)    # the producer's side
    stream = MemoryRecordStream(broker, "my-group", ["step"], topic_prefix="t.")
    SinkRuntime(sink, stream).run(until)
    # or serve(sink, open_stream=memory_streams(broker), topic_prefix="t.")

Only joining the group and the dead-letter producer differ from :class:`RecordStream`
(see :mod:`trainmon.kafka_client.memory_consumer` for what the memory group does); a
member is always dynamic, so no instance id is claimed.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from .. import topics
from ..kafka_client.memory_consumer import MemoryConsumer, MemoryProducer, create_topics
from ..kafka_client.memory_transport import MemoryBroker
from . import membership
from .stream import RecordStream


class MemoryRecordStream(RecordStream):
    def __init__(self, broker: MemoryBroker, group_id: str, kinds: Iterable[str] | None = None, *,
                 topic_prefix: str | None = None, env: dict | None = None,
                 undecoded_kinds: Iterable[str] = (), **consumer_settings):
        """Takes RecordStream's arguments (``env`` and Kafka settings are ignored)."""
        self.broker = broker
        super().__init__(group_id, kinds, topic_prefix=topic_prefix, env=env,
                         undecoded_kinds=undecoded_kinds, **consumer_settings)

    def _join(self, consumer_settings: dict) -> MemoryConsumer:
        self._instance = membership.InstanceId(None)
        self.instance_id = None
        create_topics(self.broker, [topics.topic_for(topics.DEADLETTER, self.prefix)])
        consumer = MemoryConsumer(self.broker, self.group_id)
        consumer.subscribe(self.topic_names)
        return consumer

    def _dead_letter_producer(self) -> MemoryProducer:
        return MemoryProducer(self.broker)


def memory_streams(broker: MemoryBroker) -> Callable[..., MemoryRecordStream]:
    """What ``serving.attach`` / ``serve`` take as ``open_stream``: streams on this broker."""
    return functools.partial(MemoryRecordStream, broker)
