"""Topic and group administration."""

from __future__ import annotations

import concurrent.futures

from . import settings
from .errors import KafkaError


def _admin(env: dict | None, bootstrap: str | None):
    from confluent_kafka.admin import AdminClient

    return AdminClient(settings.librdkafka(env, bootstrap))


def list_topics(*, env: dict | None = None, bootstrap: str | None = None, timeout_s: float = 10.0) -> set[str]:
    from confluent_kafka import KafkaException

    try:
        return set(_admin(env, bootstrap).list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        raise KafkaError(f"list topics: {exc}", retriable=True) from exc


def create_topics(names: list[str], partitions: int | None = None, *, env: dict | None = None,
                  bootstrap: str | None = None, config: dict | None = None,
                  timeout_s: float = 30.0) -> list[str]:
    """Create the topics not there yet (broker defaults for partitions and replication
    unless given); returns the names created. One already there is not an error."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic

    admin = _admin(env, bootstrap)
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
        new = [NewTopic(n, num_partitions=partitions or -1, replication_factor=-1, config=config or {})
               for n in names if n not in existing]
        created = []
        for name, future in (admin.create_topics(new, operation_timeout=timeout_s).items() if new else ()):
            try:
                future.result(timeout_s)
                created.append(name)
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise
            except concurrent.futures.TimeoutError:  # (the future's own: not a KafkaException)
                raise KafkaError(f"create topics: Kafka did not answer for {name} within {timeout_s:g} s "
                                 f"(bootstrap {bootstrap or settings.bootstrap_servers(env)})", retriable=True) from None
        return created
    except KafkaException as exc:
        raise KafkaError(f"create topics: {exc}") from exc


def wait_for_leaders(names: list[str], *, env: dict | None = None, bootstrap: str | None = None,
                     timeout_s: float = 10.0) -> bool:
    """Wait until every partition of ``names`` has a leader in the cluster's metadata (a
    topic created a moment ago has none yet: a consumer subscribing then would leave it
    out of its assignment until its next metadata refresh). False at the deadline."""
    import time

    from confluent_kafka import KafkaException

    admin = _admin(env, bootstrap)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            known = admin.list_topics(timeout=max(0.5, deadline - time.monotonic())).topics
            if all(n in known and known[n].error is None and known[n].partitions
                   and all(p.leader >= 0 for p in known[n].partitions.values()) for n in names):
                return True
        except KafkaException:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def assigned_partitions(group: str, *, env: dict | None = None, bootstrap: str | None = None,
                        timeout_s: float = 10.0) -> int:
    """Partitions assigned to the members of ``group`` once it is stable (0 while it is
    empty or rebalancing): whether a consumer service has joined and may read."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from confluent_kafka import ConsumerGroupState, KafkaException

    admin = _admin(env, bootstrap)
    try:
        described = admin.describe_consumer_groups([group], request_timeout=timeout_s)[group].result(timeout_s)
    except (KafkaException, FutureTimeout) as exc:
        raise KafkaError(f"describe group {group}: {exc!r}", retriable=True) from exc
    if described.state != ConsumerGroupState.STABLE:
        return 0
    return sum(len(m.assignment.topic_partitions) for m in described.members if m.assignment)


def delete_group(group: str, *, env: dict | None = None, bootstrap: str | None = None,
                 timeout_s: float = 10.0) -> None:
    from concurrent.futures import TimeoutError as FutureTimeout

    from confluent_kafka import KafkaException

    admin = _admin(env, bootstrap)  # held until answered: a client collected first never answers
    try:
        admin.delete_consumer_groups([group], request_timeout=timeout_s)[group].result(timeout_s)
    except (KafkaException, FutureTimeout) as exc:
        raise KafkaError(f"delete group {group}: {exc!r}") from exc


def group_lag(group: str, topics: list[str], *, env: dict | None = None, bootstrap: str | None = None,
              timeout_s: float = 10.0) -> int:
    """Records on ``topics`` the group has not committed yet (a partition it never
    committed counts from its start). Asked without joining the group."""
    from .consumer import Consumer
    from .types import TopicPartition

    reader = Consumer(group, env=env, bootstrap=bootstrap)
    try:
        parts = [TopicPartition(t, p) for t in topics for p in reader.partitions_for(t)]
        return sum(reader.uncommitted(parts, timeout_s).values())
    finally:
        reader.close()


def replication_state(*, env: dict | None = None, bootstrap: str | None = None,
                      timeout_s: float = 10.0) -> list[str]:
    """Lines for `trainmon status` of a replicated stack: each broker and the partitions it
    leads, under-replicated partitions, and how many partitions have each ISR size."""
    from confluent_kafka import KafkaException

    try:
        metadata = _admin(env, bootstrap).list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise KafkaError(f"describe the cluster: {exc}", retriable=True) from exc
    partitions = [p for t in metadata.topics.values() for p in t.partitions.values()]
    leads = {broker_id: 0 for broker_id in metadata.brokers}
    isr_sizes: dict[int, int] = {}
    under = 0
    for p in partitions:
        leads[p.leader] = leads.get(p.leader, 0) + 1
        isr_sizes[len(p.isrs)] = isr_sizes.get(len(p.isrs), 0) + 1
        under += len(p.isrs) < len(p.replicas)
    lines = [f"broker {b.id} on {b.host}:{b.port}, leads {leads.get(b.id, 0)} partitions"
             for b in sorted(metadata.brokers.values(), key=lambda b: b.id)]
    lines.append(f"{len(partitions)} partitions, {under} under-replicated; ISR sizes: "
                 + ", ".join(f"{size}: {n}" for size, n in sorted(isr_sizes.items(), reverse=True)))
    return lines


def cluster_state(topics: list[str] | None = None, *, env: dict | None = None,
                  bootstrap: str | None = None, timeout_s: float = 10.0) -> dict:
    """The replication state as data (``replication_state`` says it in lines), from the
    metadata of the broker asked: ``brokers`` {id: "host:port"} of the live brokers,
    ``partitions`` {(topic, partition): {"leader", "replicas", "isr"}} of ``topics``
    (default: every topic), ``leaders`` {broker id: partitions of those it leads} (every
    live broker listed, -1 for partitions without a leader), and ``controller``: the id
    DescribeCluster gives. Under KRaft a broker answers DescribeCluster with some live
    broker, not the active controller (clients do not talk to controllers): read the
    active one from the quorum instead (a node's ``__cluster_metadata-0/quorum-state``)."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from confluent_kafka import KafkaException

    admin = _admin(env, bootstrap)
    try:
        metadata = admin.list_topics(timeout=timeout_s)
        try:
            controller = admin.describe_cluster(request_timeout=timeout_s).result(timeout_s).controller
        except (KafkaException, FutureTimeout):
            controller = None
    except KafkaException as exc:
        raise KafkaError(f"describe the cluster: {exc}", retriable=True) from exc
    wanted = set(metadata.topics) if topics is None else set(topics)
    partitions = {(t.topic, p.id): {"leader": p.leader, "replicas": list(p.replicas), "isr": list(p.isrs)}
                  for t in metadata.topics.values() if t.topic in wanted
                  for p in t.partitions.values()}
    leaders = {broker_id: 0 for broker_id in metadata.brokers}
    for p in partitions.values():
        leaders[p["leader"]] = leaders.get(p["leader"], 0) + 1
    return {"brokers": {b.id: f"{b.host}:{b.port}" for b in metadata.brokers.values()},
            "partitions": partitions, "leaders": leaders,
            "controller": None if controller is None else controller.id}
