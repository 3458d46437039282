"""A consumer service killed with -9 and restarted loads again within seconds.

Before static membership the dead member kept its partitions until the broker's session
timeout (45 s) expired, so the restarted service waited that long for an assignment."""

from __future__ import annotations

import time

from trainmon import topics
from trainmon.consumers import membership

from .clickhouse_service import ClickHouseService
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)

LIMIT_S = 15.0


def log_step(producer, step: int) -> None:
    assert producer.log_step(step, step_tokens=1, duration_ms=1, loss=1.0, norm=1.0, lr=1e-3)
    assert producer.flush(30)


def test_restart_after_kill_9_loads_new_records_within_15_s(kafka_broker, bootstrap, topic_prefix,
                                                            make_producer, tmp_path):
    kafka_broker.create_topics(topics.all_topics(topic_prefix))
    producer = make_producer()
    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "chdb", tmp_path / "svc.log")
    service.start()  # default settings: no instance id given, default session timeout
    try:
        log_step(producer, 0)
        service.wait_for("SELECT count() FROM trainmon.step", 1)
        service.kill()
        killed = time.monotonic()
        service.start()
        log_step(producer, 1)
        while (count := service.value("SELECT count() FROM trainmon.step")) != 2:
            assert service.running(), service.log.read_text()[-3000:]
            assert time.monotonic() - killed <= LIMIT_S, \
                f"not loading {LIMIT_S:.0f} s after the restart (count {count}):\n" \
                f"{service.log.read_text()[-3000:]}"
            time.sleep(0.1)
        print(f"kill -9 to loading again: {time.monotonic() - killed:.1f} s")
    finally:
        assert service.stop() == 0
    assert "(instance dynamic)" not in service.log.read_text()


def test_instance_ids_are_stable_per_host_and_distinct_per_process(tmp_path):
    env = {}
    first = membership.claim("trainmon-clickhouse", env, lock_dir=tmp_path)
    second = membership.claim("trainmon-clickhouse", env, lock_dir=tmp_path)
    other_group = membership.claim("trainmon-alerts", env, lock_dir=tmp_path)
    try:
        assert first.value.startswith("trainmon-clickhouse-") and second.value == f"{first.value}-2"
        assert other_group.value.startswith("trainmon-alerts-")
        first.release()
        again = membership.claim("trainmon-clickhouse", env, lock_dir=tmp_path)
        assert again.value == first.value  # the id a killed process held is free again
        again.release()
    finally:
        second.release()
        other_group.release()
    named = membership.claim("g", {membership.ENV: "svc a/1"}, lock_dir=tmp_path)
    assert named.value == "svc_a_1"
    named.release()
    assert membership.claim("g", {membership.ENV: "off"}, lock_dir=tmp_path).value is None


def test_two_consumers_of_one_group_on_one_host_share_the_partitions(kafka_broker, bootstrap, topic_prefix):
    """Both default to the same <group>-<hostname>; the second takes <id>-2, so the broker
    fences neither and each gets a share of the partitions."""
    from trainmon.consumers.stream import RecordStream

    kafka_broker.create_topics([topics.topic_for("step", topic_prefix)])
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
    group = f"{topic_prefix}pair"
    first = RecordStream(group, ["step"], topic_prefix=topic_prefix, env=env)
    second = RecordStream(group, ["step"], topic_prefix=topic_prefix, env=env)
    try:
        assert second.instance_id == f"{first.instance_id}-2"
        deadline = time.monotonic() + 60
        while not (first.consumer.assignment() and second.consumer.assignment()):
            assert time.monotonic() < deadline, (first.consumer.assignment(), second.consumer.assignment())
            first.poll(timeout_ms=100)
            second.poll(timeout_ms=100)
        assert not first.consumer.assignment() & second.consumer.assignment()
    finally:
        first.close()
        second.close()
