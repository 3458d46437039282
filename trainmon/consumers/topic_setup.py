"""Make sure every topic a consumer subscribes to exists before it joins its group.

A consumer started before any job has logged would otherwise subscribe to topics that
are not there yet, and notice them only at its next metadata refresh; a topic that
appears later also changes the group's metadata and forces a rebalance mid-stream.
Creating the topics first (as ``trainmon broker start`` does) keeps the first assignment
the final one.
"""

from __future__ import annotations

import logging

from ..kafka_client import KafkaError, create_topics, wait_for_leaders

log = logging.getLogger("trainmon.consumers")


def ensure_topics(wanted: list[str], env: dict | None = None) -> None:
    """Create missing topics with the broker's default partition count and replication;
    a cluster that refuses (ACLs) or is away is logged, not fatal."""
    try:
        created = create_topics(wanted, env=env)
    except KafkaError as exc:
        log.warning("could not create topics %s (%s); continuing", wanted, exc)
        return
    if created:
        log.info("created topics: %s", ", ".join(created))
        # Subscribing before their leaders are known would leave them out of the first
        # assignment until the next metadata refresh (10 s), and rebalance then.
        if not wait_for_leaders(created, env=env):
            log.warning("topics %s have no leader yet; continuing", ", ".join(created))
