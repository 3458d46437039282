"""The consumer runtime's contract, with a sink of its own on the real broker (the same
contract in memory: test_consumer_runtime_memory.py): offsets are committed only after a
flush returned, and only as far as the sink's pre_commit says is written; a retriable
failure is retried with the same records, a crash or a stop in the middle of failing
commits nothing, poison is dead-lettered."""

from __future__ import annotations

import threading
import uuid

import pytest

from trainmon import topics
from trainmon.consumers import runtime
from trainmon.consumers.stream import RecordStream
from trainmon.schemas import pack

from .conftest import committed_offsets, end_offsets, send_raw
from .runtime_support import FAST, HoldingSink, ListSink, StopOrderSink, step_values, until_flushed


@pytest.fixture
def step_topic(kafka_broker, topic_prefix) -> str:
    topic = topics.topic_for("step", topic_prefix)
    kafka_broker.create_topics([topic])
    return topic


def stream_for(bootstrap, topic_prefix, group) -> RecordStream:
    return RecordStream(group, ["step"], topic_prefix=topic_prefix, env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap},
                        group_instance_id=None)


def test_commits_follow_a_successful_flush_and_retries_keep_the_records(bootstrap, topic_prefix, step_topic):
    values = step_values(30)
    send_raw(bootstrap, [(step_topic, b"rt", pack(values[i:i + 10]), 0) for i in range(0, 30, 10)]
             + [(step_topic, b"rt", b'{"not": "a step"}', 0)])
    group = f"rt-{uuid.uuid4().hex[:6]}"
    seen_committed = []
    sink = ListSink(failures=2, on_flush=lambda: seen_committed.append(committed_offsets(bootstrap, group, step_topic)))
    stream = stream_for(bootstrap, topic_prefix, group)
    rt = runtime.SinkRuntime(sink, stream, retry=FAST)
    rt.run(until_flushed(sink, 30))

    assert sink.stopped
    assert [m.record.step for m in sink.flushed] == list(range(30))  # once each, in order
    assert sink.attempts >= 3 and sink.opened
    # Nothing was committed while the flush kept failing; everything once it passed,
    # the dead-lettered message included.
    assert all(offset is None for attempt in seen_committed[:2] for offset in attempt.values())
    assert stream.dead_letters == 1
    assert committed_offsets(bootstrap, group, step_topic)[0] == end_offsets(bootstrap, step_topic)[0] == 4


def test_a_crash_in_flush_commits_nothing_and_the_group_reads_it_all_again(bootstrap, topic_prefix, step_topic):
    send_raw(bootstrap, [(step_topic, b"rt", pack(step_values(20)), 0)])
    group = f"rt-{uuid.uuid4().hex[:6]}"
    crashing = ListSink(crash=True)
    with pytest.raises(RuntimeError, match="disk is gone"):
        runtime.SinkRuntime(crashing, stream_for(bootstrap, topic_prefix, group), retry=FAST).run()
    assert all(offset is None for offset in committed_offsets(bootstrap, group, step_topic).values())

    again = ListSink()
    runtime.SinkRuntime(again, stream_for(bootstrap, topic_prefix, group), retry=FAST).run(until_flushed(again, 20))
    assert [m.record.step for m in again.flushed] == list(range(20))


def test_a_stop_while_the_flush_fails_gives_up_after_a_few_tries_and_commits_nothing(
        bootstrap, topic_prefix, step_topic):
    send_raw(bootstrap, [(step_topic, b"rt", pack(step_values(5)), 0)])
    group = f"rt-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    sink = ListSink(failures=10 ** 9, on_flush=lambda: stop.set())  # the stop comes mid-outage
    runner = runtime.SinkRuntime(sink, stream_for(bootstrap, topic_prefix, group), stop=stop, retry=FAST)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the runtime did not stop"
    assert runner.closed and sink.flushed == [] and sink.stopped  # told, to close its handles
    assert sink.attempts == runtime.STOPPING_ATTEMPTS
    assert all(offset is None for offset in committed_offsets(bootstrap, group, step_topic).values())


def test_the_runtime_commits_only_what_pre_commit_says_is_written(bootstrap, topic_prefix, step_topic):
    values = step_values(30)
    send_raw(bootstrap, [(step_topic, b"rt", pack(values[i:i + 10]), 0) for i in range(0, 30, 10)])
    group = f"rt-{uuid.uuid4().hex[:6]}"
    holding = HoldingSink(hold_at=1)
    runtime.SinkRuntime(holding, stream_for(bootstrap, topic_prefix, group), retry=FAST).run(
        until_flushed(holding, 30))
    assert committed_offsets(bootstrap, group, step_topic)[0] == 1

    # The group starts again where the commit said: the two messages held back come again.
    again = HoldingSink(hold_at=None)
    runtime.SinkRuntime(again, stream_for(bootstrap, topic_prefix, group), retry=FAST).run(
        until_flushed(again, 20))
    assert [m.record.step for m in again.flushed] == list(range(10, 30))
    assert committed_offsets(bootstrap, group, step_topic)[0] == 3


def test_a_stopped_sink_is_not_called_again_when_the_stream_closes(bootstrap, topic_prefix, step_topic):
    """librdkafka's close revokes the assignment through the rebalance callback, after
    run() stopped the sink: the stopped sink must not be asked to close partitions."""
    send_raw(bootstrap, [(step_topic, b"rt", pack(step_values(5)), 0)])
    sink = StopOrderSink()
    runner = runtime.SinkRuntime(sink, stream_for(bootstrap, topic_prefix, f"rt-{uuid.uuid4().hex[:6]}"),
                                 retry=FAST)
    runner.run(until_flushed(sink, 5))
    assert runner.closed and sink.calls == [("stop",)]
