"""The one place trainmon talks to a Kafka client library.

Every consumer, the admin calls and the producer's default transport use confluent-kafka
(librdkafka); the producer falls back to kafka-python, the pure-Python client, when
confluent-kafka is not installed or ``TRAINMON_KAFKA_CLIENT=kafka-python`` asks for it
(:mod:`.kafka_python_transport`). No other trainmon module imports a Kafka client, so what the rest of
the code sees is this small API: partitions are plain ``(topic, partition)`` tuples,
errors are :class:`KafkaError`, settings come from ``TRAINMON_KAFKA_*`` (:mod:`.settings`).
"""

from .admin import create_topics, delete_group, group_lag, list_topics, replication_state, wait_for_leaders
from .consumer import Consumer, RawMessage
from .errors import KafkaError
from .producer import Delivery, Producer
from .settings import bootstrap_servers
from .types import TopicPartition

__all__ = ["Consumer", "Delivery", "KafkaError", "Producer", "RawMessage", "TopicPartition",
           "bootstrap_servers", "create_topics", "delete_group", "group_lag", "list_topics",
           "replication_state", "wait_for_leaders"]
