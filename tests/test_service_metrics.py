"""Each service's Prometheus endpoint, scraped over HTTP while it runs, in memory
(MemoryBroker, no Kafka): the runtime's lag, reads, writes and dead letters per kind;
the ClickHouse loader's inserts (chDB); notify's failed deliveries. The lag per
partition on the real broker: test_service_metrics_kafka.py; the supervisor's
restarts: test_stack.py."""

from __future__ import annotations

import pytest

from trainmon import topics
from trainmon.consumers import serving
from trainmon.consumers.clickhouse import create_all, loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.memory_stream import memory_streams
from trainmon.consumers.metrics import ServiceMetrics
from trainmon.kafka_client import TopicPartition
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import pack

from .metrics_support import scrape, served
from .notify_support import WebhookServer, alert, broker_with, notify_env
from .runtime_support import FAST, ListSink, step_values
from .waiting import wait_until

pytestmark = pytest.mark.timeout(60)

PREFIX = "metrics."
STEP = topics.topic_for("step", PREFIX)
EVAL = topics.topic_for("eval", PREFIX)
POISON = b'{"not": "a step"}'


class OneAtATime(ListSink):
    """Takes one Kafka message per poll: a backlog stays visible as lag."""

    def room(self) -> int:
        return 1


def test_the_endpoint_shows_the_lag_then_reads_writes_and_dead_letters_per_kind():
    broker = MemoryBroker()
    for value in step_values(40):
        broker.append(STEP, b"rt", value)
    broker.append(STEP, b"rt", POISON)
    broker.append(EVAL, b"rt", pack([b'{"not": "an eval"}', b"{}"]))  # two records, both poison
    sink = OneAtATime()
    rt = serving.attach(sink, group="metrics-list", topic_prefix=PREFIX, open_stream=memory_streams(broker),
                        retry=FAST)
    rt.lag_every_s = 0.0
    port = rt.metrics.serve(0)
    try:
        rt.step()
        rt.step()
        first = scrape(port)
        lags = first.by_label("trainmon_consumer_lag", "topic")
        # 41 step messages, one read per poll; the eval topic's one message, read or not.
        assert lags[STEP] == 41 - rt.stream.consumer.position(TopicPartition(STEP, 0)) > 30
        rt.run(lambda r: r.sink.context.read_to_end() and not sink.buffered)
        last = scrape(port)
    finally:
        rt.metrics.close()
    assert last.value("trainmon_records_read_total", kind="step") == 40
    assert last.value("trainmon_records_written_total", kind="step") == 40
    assert last.value("trainmon_records_dead_lettered_total", kind="step") == 1
    assert last.value("trainmon_records_dead_lettered_total", kind="eval") == 2
    assert last.value("trainmon_records_read_total", kind="eval") == 0
    assert set(last.by_label("trainmon_consumer_lag", "topic").values()) == {0}
    assert last.value("trainmon_batch_records_count") == 40  # one flush per record taken
    assert last.value("trainmon_batch_records_sum") == 40
    assert last.value("trainmon_commit_seconds_count") >= 1
    assert last.value("trainmon_service_info", service="list sink", group=rt.stream.group_id) == 1


def test_the_clickhouse_loader_reports_rows_inserted_insert_latency_and_a_poison_record(tmp_path):
    client = connect(Target(path=tmp_path / "chdb"))
    create_all(client, "trainmon")
    broker = MemoryBroker()
    broker.append(STEP, b"rt-run/0", pack(step_values(30)))
    broker.append(STEP, b"rt-run/0", POISON)
    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=1_000, max_wait_s=0.05)
    try:
        with served(sink, group="metrics-ch", topic_prefix=PREFIX, open_stream=memory_streams(broker)) as port:
            samples = wait_until(
                lambda: (s := scrape(port)).value("trainmon_records_written_total", kind="step") == 30 and
                s.value("trainmon_records_dead_lettered_total", kind="step") == 1 and s,
                20, "30 step rows written and one dead letter on the endpoint",
                details=lambda: str(scrape(port)))
    finally:
        client.close()
    assert samples.value("trainmon_records_read_total", kind="step") == 30
    inserts = samples.value("trainmon_clickhouse_insert_seconds_count", kind="step")
    assert inserts == sink.inserts >= 1
    assert 0 < samples.value("trainmon_clickhouse_insert_seconds_sum", kind="step") < 20


def test_notify_reports_its_failed_and_sent_deliveries(tmp_path):
    from trainmon.consumers.notify.config import load_config
    from trainmon.consumers.notify.sink import NotifySink

    from .notify_support import PREFIX as ALERTS_PREFIX

    fired = alert("run-m", "nan", "rank0", ranks=[0])
    with WebhookServer() as hook:
        hook.received.refuse = 2
        sink = NotifySink(load_config(notify_env(tmp_path, hook.json_url())), topic_prefix=ALERTS_PREFIX)
        with served(sink, topic_prefix=ALERTS_PREFIX, open_stream=memory_streams(broker_with([fired])),
                    retry=FAST) as port:
            samples = wait_until(lambda: (s := scrape(port)).value("trainmon_notifications_sent_total") == 1 and s,
                                 20, "the notification sent", details=lambda: str(scrape(port)))
    assert samples.value("trainmon_notifications_failed_total") == 2
    assert samples.value("trainmon_notifications_given_up_total") == 0
    assert samples.value("trainmon_records_read_total", kind="alert") == 1


def test_a_port_taken_is_logged_and_the_service_runs_without_metrics(caplog):
    first, second = ServiceMetrics("a"), ServiceMetrics("b")
    port = first.serve(0)
    try:
        assert second.serve(port) is None
        assert "cannot serve metrics" in caplog.text
        assert scrape(port).value("trainmon_service_info", service="a", group="") == 1
    finally:
        first.close()
