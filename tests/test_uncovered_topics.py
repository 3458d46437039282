"""A topic that looks like trainmon's but that no consumer reads is named at start-up."""

from __future__ import annotations

import logging

from trainmon import topics
from trainmon.consumers.stream import RecordStream


def test_uncovered_lists_trainmon_looking_topics_no_consumer_reads():
    existing = ["trainmon.step", "trainmon.stpe", "trainmon.deadletter", "trainmon.alert", "trainmonx",
                "team.trainmon.step", "team.trainmon.gpus", "team-other", "other.step", "__consumer_offsets"]
    assert topics.uncovered(existing, "trainmon.") == ["trainmon.stpe", "trainmonx"]
    assert topics.uncovered(existing, "team.trainmon.") == [
        "team-other", "team.trainmon.gpus", "trainmon.alert", "trainmon.deadletter", "trainmon.step",
        "trainmon.stpe", "trainmonx"]
    assert topics.uncovered(topics.all_topics("trainmon."), "trainmon.") == []


def test_a_consumer_names_a_misspelt_topic_when_it_starts(kafka_broker, bootstrap, topic_prefix, caplog):
    kafka_broker.create_topics([topics.topic_for("step", topic_prefix), f"{topic_prefix}stpe"])
    with caplog.at_level(logging.WARNING, logger="trainmon.consumers"):
        stream = RecordStream(f"{topic_prefix}g", ["step"], topic_prefix=topic_prefix,
                              env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
        stream.close()
    [warning] = [r.getMessage() for r in caplog.records if "no trainmon consumer reads" in r.getMessage()]
    assert f"{topic_prefix}stpe" in warning and f"{topic_prefix}step" not in warning.split(": ")[-1]
