"""Make sure every topic a consumer subscribes to exists before it joins its group.

A consumer started before any job has logged would otherwise subscribe to topics that
are not there yet, and notice them only at its next metadata refresh; a topic that
appears later also changes the group's metadata and forces a rebalance mid-stream.
Creating the topics first (as ``trainmon broker start`` does) keeps the first assignment
the final one. Each is created with its disk budget (topics.topic_config: compression on
the broker, retention), the same whoever creates it: a consumer, ``trainmon up`` or
``trainmon broker start``.
"""

from __future__ import annotations

import json
import logging

from ..kafka_client import KafkaError, create_topics, wait_for_leaders
from ..topics import config_for_topic

log = logging.getLogger("trainmon.consumers")


def create_record_topics(names: list[str], partitions: int | None = None, *, env: dict | None = None,
                         bootstrap: str | None = None) -> list[str]:
    """Create those of ``names`` not there yet, each with its kind's topic config; the
    names created. Topics already there keep theirs (an operator may have changed them)."""
    by_config: dict[str, list[str]] = {}
    for name in names:
        by_config.setdefault(json.dumps(config_for_topic(name), sort_keys=True), []).append(name)
    created: list[str] = []
    for config, group in by_config.items():
        created += create_topics(group, partitions, env=env, bootstrap=bootstrap, config=json.loads(config))
    return created


def ensure_topics(wanted: list[str], env: dict | None = None) -> None:
    """Create missing topics with the broker's default partition count and replication;
    a cluster that refuses (ACLs) or is away is logged, not fatal."""
    try:
        created = create_record_topics(wanted, env=env)
    except KafkaError as exc:
        log.warning("could not create topics %s (%s); continuing", wanted, exc)
        return
    if created:
        log.info("created topics: %s", ", ".join(created))
        # Subscribing before their leaders are known would leave them out of the first
        # assignment until the next metadata refresh (10 s), and rebalance then.
        if not wait_for_leaders(created, env=env):
            log.warning("topics %s have no leader yet; continuing", ", ".join(created))
