"""The event log's disk budget: every topic compressed on the broker and kept for a bounded
window, the same settings wherever topics are made (trainmon's topic creation, the
broker's defaults, compose); a topic older than its window is trimmed, and `trainmon
replay` says from when it can rebuild, refuses to pass that off as the whole history,
and with --retained rebuilds the window exactly."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from tests.clickhouse_service import trainmon_env
from tests.waiting import wait_until
from trainmon import topics
from trainmon.broker import Broker
from trainmon.consumers.retained_window import RetainedWindow, Trimmed
from trainmon.kafka_client import Consumer, TopicPartition
from trainmon.schemas import StepRecord, encode

REPO = Path(__file__).resolve().parents[1]
WEEK_MS = 7 * 24 * 3600 * 1000


def test_topics_are_compressed_by_the_broker_and_kept_a_week_by_default():
    assert topics.topic_config("step", env={}) == {
        "compression.type": "zstd", "retention.ms": str(WEEK_MS), "retention.bytes": "-1",
        "segment.ms": str(24 * 3600 * 1000)}


def test_the_alert_topic_is_kept_whole():
    """The incidents' event log: the engine rebuilds its book from it."""
    config = topics.config_for_topic("team.trainmon.alert", env={"TRAINMON_TOPIC_RETENTION_HOURS": "1"})
    assert config["retention.ms"] == "-1" and config["retention.bytes"] == "-1"
    assert topics.config_for_topic("team.trainmon.step", env={})["retention.ms"] == str(WEEK_MS)


def test_retention_and_compression_are_configurable():
    env = {"TRAINMON_TOPIC_RETENTION_HOURS": "2", "TRAINMON_TOPIC_RETENTION_BYTES": "1000000000",
           "TRAINMON_TOPIC_COMPRESSION": "gzip"}
    assert topics.topic_config("step", env=env) == {
        "compression.type": "gzip", "retention.ms": str(2 * 3600 * 1000), "retention.bytes": "1000000000",
        "segment.ms": str(2 * 3600 * 1000)}  # a segment no longer than the window
    forever = topics.topic_config("step", env={"TRAINMON_TOPIC_RETENTION_HOURS": "-1"})
    assert forever["retention.ms"] == "-1" and "segment.ms" not in forever


@pytest.mark.parametrize("variable, value, said", [
    ("TRAINMON_TOPIC_RETENTION_HOURS", "a week", "is not a number"),
    ("TRAINMON_TOPIC_RETENTION_HOURS", "0", "positive number, or -1"),
    ("TRAINMON_TOPIC_RETENTION_BYTES", "-5", "positive number, or -1"),
    ("TRAINMON_TOPIC_COMPRESSION", "brotli", "choose one of zstd"),
])
def test_a_bad_setting_is_refused_naming_the_variable(variable, value, said):
    with pytest.raises(ValueError, match=rf"{variable}={value!r}.*{said}"):
        topics.topic_config("step", env={variable: value})


def test_a_retention_under_kafkas_units_is_refused_not_sent_as_zero():
    """1e-9 hours is positive but 0 ms: retention.ms and segment.ms 0, which Kafka refuses
    (segment.ms is at least 1) when the topics are made, far from the setting."""
    with pytest.raises(ValueError, match="TRAINMON_TOPIC_RETENTION_HOURS=1e-09 is under a millisecond"):
        topics.topic_config("step", env={"TRAINMON_TOPIC_RETENTION_HOURS": "1e-9"})
    with pytest.raises(ValueError, match="TRAINMON_TOPIC_RETENTION_BYTES=0.5 is under a byte"):
        topics.topic_config("alert", env={"TRAINMON_TOPIC_RETENTION_BYTES": "0.5"})
    assert topics.topic_config("step", env={"TRAINMON_TOPIC_RETENTION_HOURS": "0.001"})["segment.ms"] == "3600"


def test_the_brokers_defaults_are_the_topic_config(tmp_path, monkeypatch):
    """A topic made on first use (by a producer) gets what trainmon gives the topics it
    creates: `trainmon up`'s and `trainmon broker start`'s broker."""
    monkeypatch.setenv("TRAINMON_TOPIC_RETENTION_HOURS", "48")
    (tmp_path / "kafka").mkdir()
    props = dict(line.split("=", 1) for line in
                 Broker(tmp_path / "kafka")._write_properties().read_text().splitlines())
    assert props["log.retention.ms"] == str(48 * 3600 * 1000)
    assert props["log.retention.bytes"] == "-1"
    assert props["compression.type"] == "zstd"
    assert props["log.roll.ms"] == str(24 * 3600 * 1000)
    assert "log.retention.hours" not in props


def test_compose_gives_its_brokers_and_consumers_the_same_settings():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    default = re.compile(r"\$\{(\w+):-(.*)\}")

    def resolved(value) -> tuple[str | None, str]:
        found = default.fullmatch(str(value))
        return (found.group(1), found.group(2)) if found else (None, str(value))

    kafka, consumer = compose["x-kafka-env"], compose["x-trainmon-env"]
    config = topics.topic_config("step", env={})
    assert resolved(kafka["KAFKA_LOG_RETENTION_HOURS"]) == ("TRAINMON_TOPIC_RETENTION_HOURS", "168")
    assert int(168 * 3600 * 1000) == int(config["retention.ms"])
    assert resolved(kafka["KAFKA_LOG_RETENTION_BYTES"]) == ("TRAINMON_TOPIC_RETENTION_BYTES", config["retention.bytes"])
    assert resolved(kafka["KAFKA_COMPRESSION_TYPE"]) == ("TRAINMON_TOPIC_COMPRESSION", config["compression.type"])
    assert int(kafka["KAFKA_LOG_ROLL_HOURS"]) * 3600 * 1000 == int(config["segment.ms"])
    for name in ("TRAINMON_TOPIC_RETENTION_HOURS", "TRAINMON_TOPIC_RETENTION_BYTES", "TRAINMON_TOPIC_COMPRESSION"):
        assert resolved(consumer[name])[0] == name  # the operator's one value reaches both


def test_the_window_says_from_when_it_is_whole():
    whole = RetainedWindow([], None)
    assert whole.complete and whole.describe() == "the topics hold every record ever sent to them"
    since = int(datetime(2026, 11, 19, 3, 0, tzinfo=timezone.utc).timestamp() * 1000)
    trimmed = RetainedWindow([Trimmed(TopicPartition("trainmon.step", 2), 1200, since)], since)
    assert not trimmed.complete
    assert trimmed.describe() == ("the topics hold every record sent since 2026-11-19 03:00:00 UTC; retention "
                                  "removed the 1,200 oldest of 1 partition(s) (trainmon.step)")


# -- on the session's broker, which checks retention every second ---------------------------

def step_records(run_id: str, steps: int, at: datetime) -> list[StepRecord]:
    return [StepRecord(run_id=run_id, rank=0, world_size=1, host="node-0", time=at + timedelta(seconds=s),
                       event_id=f"{run_id}-{s}", step=s, loss=3.0 - s / 100, lr=3e-4, step_tokens=4096,
                       duration_ms=800.0) for s in range(steps)]


def send_at(bootstrap: str, topic: str, records: list[StepRecord], timestamp_ms: int) -> None:
    """One message per record, as a training loop at 1 step/s sends, stamped at ``timestamp_ms``
    (trainmon's producers leave the stamp to the client: the time of sending)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for record in records:
        producer.produce(topic, value=encode(record), key=record.run_id.encode(), timestamp=timestamp_ms)
    assert producer.flush(30) == 0


def log_start(bootstrap: str, topic: str) -> int:
    reader = Consumer(None, bootstrap=bootstrap)
    try:
        return reader.watermarks(TopicPartition(topic, 0))[0]
    finally:
        reader.close()


def test_a_topic_past_its_window_is_trimmed_and_a_replay_rebuilds_the_window_exactly(
        bootstrap, topic_prefix, tmp_path, monkeypatch, capsys):
    from confluent_kafka.admin import AdminClient, ConfigResource

    from trainmon.consumers.clickhouse.cli import replay_main
    from trainmon.consumers.topic_setup import create_record_topics

    monkeypatch.setenv("TRAINMON_TOPIC_RETENTION_HOURS", "1")
    monkeypatch.setenv("TRAINMON_KAFKA_BOOTSTRAP", bootstrap)
    topic = topics.topic_for("step", topic_prefix)
    assert create_record_topics([topic], 1, bootstrap=bootstrap) == [topic]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    described = admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, topic)])
    config = next(iter(described.values())).result(10)
    assert (config["compression.type"].value, config["retention.ms"].value) == ("zstd", "3600000")

    now = datetime.now(timezone.utc)
    old, new = step_records("old-run", 12, now - timedelta(hours=3)), step_records("new-run", 15, now)
    new_ms = int(time.time() * 1000)
    send_at(bootstrap, topic, old, new_ms - 3 * 3600 * 1000)
    # The first new message closes the old records' segment (begun 3 h before it, past
    # segment.ms); that one is then past retention.ms, and the broker removes it.
    send_at(bootstrap, topic, new, new_ms)
    wait_until(lambda: log_start(bootstrap, topic) == len(old), 15, "the old records trimmed",
               pause=0.2, details=lambda: f"log start offset {log_start(bootstrap, topic)}")

    refused = replay_main(["--path", str(tmp_path / "refused"), "--topic-prefix", topic_prefix])
    said = capsys.readouterr().err
    since = datetime.fromtimestamp(new_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert refused == 2, said
    assert f"records since {since}" in said and "removed the 12 oldest" in said and "--retained" in said
    assert not (tmp_path / "refused").exists()  # nothing built

    # `trainmon replay --retained`, then the step table read back, in one process of its
    # own (chDB opens one directory per process; one interpreter start, not two).
    done = subprocess.run([sys.executable, "-c", REPLAY_AND_READ, str(tmp_path / "replayed"), topic_prefix],
                          env=trainmon_env(bootstrap), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said, rows = done.stdout.split("ROWS\n")
    assert "replayed 15 rows" in said and f"since {since}" in said
    assert rows.splitlines() == [f"new-run,{r.step},{r.event_id},{r.loss:g}" for r in new]


REPLAY_AND_READ = """
import sys
from trainmon.consumers.clickhouse.cli import replay_main
from trainmon.consumers.clickhouse.client import Target, connect
path, prefix = sys.argv[1], sys.argv[2]
code = replay_main(["--path", path, "--topic-prefix", prefix, "--retained"])
print("ROWS")
client = connect(Target(path=path))
for row in client.query("SELECT run_id, step, event_id, loss FROM trainmon.step FINAL ORDER BY step").result_rows:
    print(",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in row))
sys.exit(code)
"""


@pytest.mark.parametrize("name", ["TRAINMON_TOPIC_RETENTION_HOURS", "TRAINMON_TOPIC_RETENTION_BYTES"])
@pytest.mark.parametrize("value", ["inf", "nan", "Infinity"])
def test_a_retention_that_is_no_finite_number_is_refused_naming_the_variable(name, value):
    """float() takes "inf" and "nan" (natural guesses for "keep forever"): they passed the
    check and crashed later with OverflowError / "cannot convert float NaN to integer",
    naming no variable -- at `trainmon up` (the broker's properties) or at every start of
    a consumer service creating its topics (a restart loop)."""
    from trainmon.topics import topic_config

    with pytest.raises(ValueError, match=name):
        topic_config("step", {name: value})
