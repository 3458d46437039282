"""The producer against a broker that is late, goes away, or gets bad input."""

import logging
import os
import time

import pytest
from pydantic import ValidationError

from trainmon.broker import Broker, free_port
from trainmon.producer import Producer, ProducerConfig

from .conftest import read_records
from .waiting import wait_until

# Round trips and outages on both transports: librdkafka and the kafka-python fallback.
pytestmark = pytest.mark.usefixtures("both_clients")


@pytest.fixture
def own_broker(tmp_path):
    """A broker this test may stop and start; the shared one stays untouched."""
    broker = Broker(tmp_path / "kafka", port=free_port())
    yield broker
    broker.stop()


def step_fields(step):
    return dict(step_tokens=4096, duration_ms=50.0, loss=2.0 - step / 1000, norm=1.0, lr=1e-4)


def assert_exactly_once(records, producer_count_expected):
    ids = [r.event_id for r in records]
    assert len(ids) == producer_count_expected
    assert len(set(ids)) == len(ids), "a record arrived twice"


def test_broker_late_then_gone_for_10s_loses_nothing(own_broker, tmp_path):
    """Broker not started when the job begins, and stopped for 10 s mid-run."""
    producer = Producer(ProducerConfig(bootstrap=own_broker.bootstrap, run_id="outage",
                                       topic_prefix="o.", spill_dir=tmp_path / "spill", linger_ms=5))
    logged = 0
    for step in range(50):  # no broker yet: the loop must not notice
        started = time.perf_counter()
        assert producer.log_step(step, **step_fields(step))
        assert time.perf_counter() - started < 0.05
        logged += 1
    wait_until(lambda: producer.spilled >= 50, 30, "the records in the spill file", pause=0.2)
    assert producer.spilled == 50, "records should be waiting in the spill file"

    own_broker.start()
    for step in range(50, 100):
        producer.log_step(step, **step_fields(step))
        logged += 1
    assert producer.flush(60)

    own_broker.stop()
    outage_started = time.monotonic()
    step = 100
    while time.monotonic() - outage_started < 10:
        producer.log_step(step, **step_fields(step))
        logged += 1
        step += 1
        time.sleep(0.05)
    own_broker.start()
    for step in range(step, step + 50):
        producer.log_step(step, **step_fields(step))
        logged += 1
    assert producer.flush(90)
    producer.close()

    received = read_records(own_broker.bootstrap, "o.", "step", logged, timeout=60)
    assert_exactly_once(received, logged)
    assert sorted(r.step for r in received) == list(range(logged))


def test_records_spilled_at_exit_are_sent_by_the_next_producer(own_broker, tmp_path):
    spill = tmp_path / "spill"
    first = Producer(ProducerConfig(bootstrap=own_broker.bootstrap, run_id="exit", rank=0,
                                    topic_prefix="x.", spill_dir=spill))
    for step in range(20):
        first.log_step(step, **step_fields(step))
    assert not first.close(timeout=1)  # the broker never came: nothing delivered...
    assert list(spill.glob("*.spill")), "...but everything is kept on disk"

    own_broker.start()
    second = Producer(ProducerConfig(bootstrap=own_broker.bootstrap, run_id="exit", rank=0,
                                     topic_prefix="x.", spill_dir=spill))
    second.log_step(20, **step_fields(20))
    assert second.close(timeout=30)
    received = read_records(own_broker.bootstrap, "x.", "step", 21)
    assert_exactly_once(received, 21)
    assert not list(spill.glob("*.spill"))


def test_records_kafka_gives_up_on_are_spilled_and_sent_later(own_broker, tmp_path):
    """Records already handed to the client when the broker dies come back through its
    delivery reports (messages purged at close) into the spill file, and the next producer
    sends them."""
    own_broker.start()
    spill = tmp_path / "spill"
    config = dict(bootstrap=own_broker.bootstrap, run_id="abort", rank=0, topic_prefix="a.",
                  spill_dir=spill)
    first = Producer(ProducerConfig(**config))
    first.log_step(0, **step_fields(0))
    assert first.flush(30)
    own_broker.stop()
    for step in range(1, 31):
        first.log_step(step, **step_fields(step))
    # The worker hands them to the client, whose metadata is still cached; within 4 s,
    # inside the 5 s delivery timeout.
    wait_until(lambda: first._worker.sent >= 31, 4, "the records handed to the client", pause=0.02)
    assert first._worker.sent == 31 and first.spilled == 0
    assert not first.close(timeout=2)
    assert first.spilled == 30, "aborted batches should be spilled, record by record counted"

    own_broker.start()
    second = Producer(ProducerConfig(**config))
    assert second.close(timeout=30)
    received = read_records(own_broker.bootstrap, "a.", "step", 31)
    assert_exactly_once(received, 31)


def test_a_record_too_large_for_kafka_is_rejected_by_name_and_holds_nothing_back(
        make_producer, bootstrap, topic_prefix, caplog):
    producer = make_producer()
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        producer.run_start(config={"vocab": "x" * 1_100_000})  # valid, but over 1 MB of JSON
        for step in range(5):
            producer.log_step(step, **step_fields(step))
        assert producer.flush(30)
    assert producer.rejected == {"run": 1}
    assert "'config'" in caplog.text and "over the" in caplog.text and "Kafka message" in caplog.text
    assert [r.step for r in read_records(bootstrap, topic_prefix, "step", 5)] == list(range(5))
    assert read_records(bootstrap, topic_prefix, "run", 0, timeout=2) == []


def test_a_small_max_request_size_sends_packed_records_one_per_message(
        make_producer, bootstrap, topic_prefix):
    # The client refuses a 9 kB packed message before sending it: its records go again
    # one per message; a record over the limit by itself is rejected by name up front.
    producer = make_producer(compression=None, max_message_bytes=3000)
    for step in range(30):
        timers = {f"phase-{i}": 1.0 for i in range(200)} if step == 7 else None  # ~3.4 kB
        producer.log_step(step, timers=timers, **step_fields(step))
    assert producer.flush(30)
    assert producer.rejected == {"step": 1} and producer._worker._transport.dropped == 0
    received = read_records(bootstrap, topic_prefix, "step", 29)
    assert sorted(r.step for r in received) == [s for s in range(30) if s != 7]
    assert_exactly_once(received, 29)


def test_a_topic_limit_below_the_batch_size_names_the_setting_and_keeps_the_records(
        bootstrap, topic_prefix, tmp_path, caplog):
    """The broker refuses batches over the topic's max.message.bytes: the error says which
    setting to raise and the records wait in the spill file; once the limit is raised, the
    next producer sends every one of them."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

    from trainmon import topics

    topic = topics.topic_for("step", topic_prefix)
    config = dict(bootstrap=bootstrap, topic_prefix=topic_prefix, run_id="limit",
                  spill_dir=tmp_path / "spill", compression=None)  # the limit is on stored bytes
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "3000"})])
        first = Producer(ProducerConfig(**config))
        with caplog.at_level(logging.ERROR, logger="trainmon.producer"):
            # ~3.4 kB each: every batch is over the limit, however the records are packed
            timers = {f"phase-{i}": 1.0 for i in range(200)}
            for step in range(30):
                first.log_step(step, timers=timers, **step_fields(step))
            wait_until(lambda: "max.message.bytes" in caplog.text, 30, "the broker's refusal, named")
            assert not first.close(timeout=1)
        assert "max.message.bytes" in caplog.text and first.spilled == 30
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic,
                                            configs={"max.message.bytes": "1048588"})])
    finally:
        admin.close()
    assert Producer(ProducerConfig(**config)).close(timeout=30)
    received = read_records(bootstrap, topic_prefix, "step", 30, timeout=30)
    assert_exactly_once(received, 30)


def test_strict_mode_raises_a_field_named_error(make_producer):
    producer = make_producer(strict=True)
    with pytest.raises(ValidationError, match="step_tokens"):
        producer.log_step(1, step_tokens=-1, duration_ms=1.0, loss=1.0, norm=1.0, lr=1.0)
    with pytest.raises(ValidationError, match="split"):
        producer.log_dataset("validation", files=1, tokens=1)


def test_default_mode_counts_logs_once_and_keeps_going(make_producer, bootstrap, topic_prefix, caplog):
    producer = make_producer()
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        for step in range(10):
            if step % 3 == 0:
                assert not producer.log_step(step, step_tokens="many", duration_ms=1.0, loss=1.0,
                                             norm=1.0, lr=1.0)
            else:
                assert producer.log_step(step, **step_fields(step))
        assert not producer.log_eval(1, eval_tokens=-4, duration_ms=1.0, loss=1.0)
    assert producer.rejected == {"step": 4, "eval": 1}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "step_tokens" in warnings[0] and "eval_tokens" in warnings[1]
    assert producer.flush(20)
    received = read_records(bootstrap, topic_prefix, "step", 6)
    assert sorted(r.step for r in received) == [1, 2, 4, 5, 7, 8]


def test_forked_child_neither_inherits_the_queue_nor_a_dead_thread(make_producer, bootstrap,
                                                                    topic_prefix):
    producer = make_producer(run_id="fork")
    producer.log_step(0, **step_fields(0))
    for step in range(1, 5):  # queued at fork time (they join the next pack window)
        producer.log_step(step, **step_fields(step))
    pid = os.fork()
    if pid == 0:  # the child, like a DataLoader worker, logs through the inherited producer
        code = 0
        try:
            producer.log_step(1000, **step_fields(1000))
            code = 0 if producer.flush(20) else 3
            producer.close()
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert producer.flush(20)
    received = read_records(bootstrap, topic_prefix, "step", 6)
    assert sorted(r.step for r in received) == [0, 1, 2, 3, 4, 1000]
    assert len({r.event_id for r in received}) == 6


def test_local_json_log_and_console_line(make_producer, tmp_path, capsys):
    import json

    log_file = tmp_path / "train.jsonl"
    producer = make_producer(log_file=str(log_file), console=True)
    for step in range(1, 4):
        producer.log_step(step, step_tokens=125_300, duration_ms=1000.0, loss=3.0 - step, norm=0.1,
                          lr=1e-4, total_steps=8)
    producer.log_step(4, step_tokens=125_300, duration_ms=1000.0, loss=0.5, norm=5.0, lr=1e-4,
                      total_steps=8)
    assert producer.flush(20)
    producer.close()
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [line["log"] for line in lines] == ["step"] * 4
    assert lines[0]["step"] == 1 and lines[0]["loss"] == 2.0 and "event_id" not in lines[0]
    console = capsys.readouterr().err.splitlines()
    assert console[0].startswith(":: step 1 [ 12.5%] - loss 2.0000 | norm 0.1000 | 125.3k tps")
    assert console[1].startswith(":: step 2 [ 25.0%] \\ loss 1.0000")
    assert "|!norm 5.0000" in console[3] and console[3].endswith("eta 00h00m")


def test_a_training_loop_sends_uncompressed_and_a_bulk_source_with_lz4():
    # A training loop's messages hold a few records: lz4 would cost more CPU than it saves.
    assert ProducerConfig().kafka_compression() is None
    assert ProducerConfig(linger_ms=20).kafka_compression() == "lz4"  # trainmon ingest
    assert ProducerConfig.from_env({}, linger_ms=20).kafka_compression() == "lz4"
    assert ProducerConfig.from_env({"TRAINMON_KAFKA_COMPRESSION": "zstd"}).kafka_compression() == "zstd"
    assert ProducerConfig.from_env({"TRAINMON_KAFKA_COMPRESSION": ""},
                                   linger_ms=20).kafka_compression() is None
