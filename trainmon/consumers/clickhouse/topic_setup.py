"""Make sure every topic the service subscribes to exists before it joins its group.

A subscribed topic that appears later changes the group's metadata and forces a
rebalance mid-stream; under heavy load kafka-python 3 was seen to stay in that rebalance
for a minute and more. Creating the topics first (as ``trainmon broker start`` does)
keeps the first assignment the final one.
"""

from __future__ import annotations

import logging

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from ... import kafka_config, topics
from ...schemas import RECORD_TYPES

log = logging.getLogger("trainmon.clickhouse")


def ensure_topics(topic_prefix: str | None = None, env: dict | None = None) -> None:
    """Create missing record and dead-letter topics with the broker's default partition
    count and replication; a cluster that refuses (ACLs) is logged, not fatal."""
    wanted = topics.all_topics(topic_prefix)
    try:
        admin = KafkaAdminClient(**kafka_config.client_settings(env))
    except (KafkaError, OSError) as exc:
        log.warning("cannot reach Kafka to create topics (%s); continuing", exc)
        return
    try:
        missing = [t for t in wanted if t not in set(admin.list_topics())]
        if missing:
            admin.create_topics({t: {} for t in missing}, raise_errors=False, wait_for_metadata=True)
            log.info("created topics: %s", ", ".join(missing))
    except KafkaError as exc:
        log.warning("could not create topics %s: %s", wanted, exc)
    finally:
        admin.close()
