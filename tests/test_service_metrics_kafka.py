"""The consumer lag per partition on the real broker (the shared session broker), read
from the endpoint over HTTP: while a consumer works through a backlog on two partitions,
each partition's gauge is its end minus what the consumer has taken from it, and 0 once
caught up. Everything else about the metrics is shown in memory
(test_service_metrics.py)."""

from __future__ import annotations

import pytest

from trainmon import topics
from trainmon.consumers import serving
from trainmon.kafka_client import Producer, create_topics

from .metrics_support import scrape
from .runtime_support import ListSink, step_values
from .waiting import wait_until

pytestmark = pytest.mark.timeout(60)

BACKLOG = {0: 30, 1: 12}  # messages per partition, one step record each


class OneAtATime(ListSink):
    name = "lag probe"
    kinds = ("step",)
    consumer_settings = {"group_instance_id": None}  # a throwaway group: dynamic member

    def room(self) -> int:
        return 1


def test_the_lag_per_partition_on_the_endpoint_follows_the_backlog_down_to_zero(bootstrap, topic_prefix):
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
    step_topic = topics.topic_for("step", topic_prefix)
    create_topics([step_topic], partitions=len(BACKLOG), env=env)
    producer = Producer(env=env)
    values = iter(step_values(sum(BACKLOG.values())))
    for partition, n in BACKLOG.items():
        for _ in range(n):
            producer.send(step_topic, next(values), key=b"rt", partition=partition)
    assert producer.flush(10)
    producer.close()

    sink = OneAtATime()
    rt = serving.attach(sink, group=f"{topic_prefix}lag", topic_prefix=topic_prefix, env=env)
    rt.lag_every_s = 0.0
    port = rt.metrics.serve(0)
    try:
        def taken() -> dict[str, float]:
            counts = {str(p): 0 for p in BACKLOG}
            for m in sink.buffered + sink.flushed:
                counts[str(m.partition)] += 1
            return counts

        def lag_as_expected_mid_backlog():
            rt.step()
            lags = scrape(port).by_label("trainmon_consumer_lag", "partition")
            expected = {str(p): n - taken()[str(p)] for p, n in BACKLOG.items()}
            return lags == expected and sum(expected.values()) >= 20 and lags

        lags = wait_until(lag_as_expected_mid_backlog, 20, "each partition's lag = its end - what was taken",
                          details=lambda: f"{scrape(port).by_label('trainmon_consumer_lag', 'partition')} "
                                          f"taken {taken()}")
        assert lags["0"] > 0 and lags["1"] > 0

        def caught_up():
            rt.step()
            return scrape(port).by_label("trainmon_consumer_lag", "partition") == {"0": 0, "1": 0}

        wait_until(caught_up, 20, "both partitions' lag 0 once read")
        assert scrape(port).value("trainmon_records_read_total", kind="step") == sum(BACKLOG.values())
    finally:
        rt.stop.set()
        rt.run()
        rt.metrics.close()
