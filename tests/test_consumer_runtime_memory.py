"""The consumer runtime's contract in memory (a MemoryBroker and MemoryRecordStream, no
Kafka): commits only after a flush returned and only as far as pre_commit says, retries
with the same records, nothing committed after a crash or a stop mid-failure, poison and
refused records dead-lettered before their offsets commit, a refused commit tried again,
rebalances that hand a partition over only once it is closed, serve(sink) over what
the sink declares, and no garbage left for the (rarely run) cyclic collector per put or
flush. test_consumer_runtime.py and test_consumer_serving.py show the
same on the real broker."""

from __future__ import annotations

import base64
import json
import threading


import pytest

from trainmon import topics
from trainmon.consumers import runtime, serving
from trainmon.consumers.memory_stream import MemoryRecordStream, memory_streams
from trainmon.kafka_client import TopicPartition
from trainmon.kafka_client.memory_consumer import committed_offsets
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.schemas import pack

from .runtime_support import (FAST, HoldingSink, ListSink, StopOrderSink, cyclic_garbage, step_values,
                              until_flushed)

PREFIX = "mem."
STEP = topics.topic_for("step", PREFIX)
STEP_0 = TopicPartition(STEP, 0)


def broker_with(*values: bytes, topic: str = STEP) -> MemoryBroker:
    broker = MemoryBroker()
    for value in values:
        broker.append(topic, b"rt", value)
    return broker


def packed(n: int, per_message: int = 10) -> list[bytes]:
    values = step_values(n)
    return [pack(values[i:i + per_message]) for i in range(0, n, per_message)]


def stream_on(broker: MemoryBroker, group: str = "g", kinds=("step",)) -> MemoryRecordStream:
    return MemoryRecordStream(broker, group, kinds, topic_prefix=PREFIX)


def dead_letters(broker: MemoryBroker) -> list[dict]:
    return [json.loads(v) for v in broker.values(topics.topic_for(topics.DEADLETTER, PREFIX))]


def test_commits_follow_a_successful_flush_and_retries_keep_the_records():
    broker = broker_with(*packed(30), b'{"not": "a step"}')
    seen_committed = []
    sink = ListSink(failures=2, on_flush=lambda: seen_committed.append(committed_offsets(broker, "g")))
    stream = stream_on(broker)
    runtime.SinkRuntime(sink, stream, retry=FAST).run(until_flushed(sink, 30))

    assert sink.stopped
    assert [m.record.step for m in sink.flushed] == list(range(30))  # once each, in order
    assert sink.attempts >= 3 and sink.opened == [STEP_0]
    assert seen_committed[:2] == [{}, {}]  # nothing while the flush kept failing
    assert stream.dead_letters == 1
    assert committed_offsets(broker, "g") == {STEP_0: 4}  # the dead-lettered message included
    [letter] = dead_letters(broker)
    assert (letter["consumer"], letter["offset"]) == ("g", 3)
    assert base64.b64decode(letter["value_base64"]) == b'{"not": "a step"}'


def test_a_crash_in_flush_commits_nothing_and_the_group_reads_it_all_again():
    broker = broker_with(*packed(20, per_message=20))
    with pytest.raises(RuntimeError, match="disk is gone"):
        runtime.SinkRuntime(ListSink(crash=True), stream_on(broker), retry=FAST).run()
    assert committed_offsets(broker, "g") == {}

    again = ListSink()
    runtime.SinkRuntime(again, stream_on(broker), retry=FAST).run(until_flushed(again, 20))
    assert [m.record.step for m in again.flushed] == list(range(20))


def test_a_stop_while_the_flush_fails_gives_up_after_a_few_tries_and_commits_nothing():
    broker = broker_with(*packed(5))
    stop = threading.Event()
    sink = ListSink(failures=10 ** 9, on_flush=stop.set)  # the stop comes mid-outage
    runner = runtime.SinkRuntime(sink, stream_on(broker), stop=stop, retry=FAST)
    runner.run()
    assert runner.closed and sink.flushed == [] and sink.stopped  # told, to close its handles
    assert sink.attempts == runtime.STOPPING_ATTEMPTS
    assert committed_offsets(broker, "g") == {}


def test_the_runtime_commits_only_what_pre_commit_says_is_written():
    broker = broker_with(*packed(30))
    holding = HoldingSink(hold_at=1)
    runtime.SinkRuntime(holding, stream_on(broker), retry=FAST).run(until_flushed(holding, 30))
    assert committed_offsets(broker, "g") == {STEP_0: 1}

    # The group starts again where the commit said: the two messages held back come again.
    again = HoldingSink(hold_at=None)
    runtime.SinkRuntime(again, stream_on(broker), retry=FAST).run(until_flushed(again, 20))
    assert [m.record.step for m in again.flushed] == list(range(10, 30))
    assert committed_offsets(broker, "g") == {STEP_0: 3}


class RefusingSink(ListSink):
    """Refuses odd steps through the context (a record the sink's store rejects)."""

    def put(self, messages):
        for m in messages:
            if m.record.step % 2:
                self.context.dead_letter(m, "odd steps are refused")
            else:
                self.buffered.append(m)


def test_records_a_sink_refuses_are_dead_lettered_and_then_committed():
    broker = broker_with(*packed(6, per_message=1))
    sink = RefusingSink()
    runtime.SinkRuntime(sink, stream_on(broker), retry=FAST).run(until_flushed(sink, 3))
    assert [m.record.step for m in sink.flushed] == [0, 2, 4]
    assert [(d["offset"], d["error"]) for d in dead_letters(broker)] == [(o, "odd steps are refused")
                                                                        for o in (1, 3, 5)]
    assert committed_offsets(broker, "g") == {STEP_0: 6}


def test_a_commit_refused_while_the_broker_is_away_is_made_later_without_raising(monkeypatch):
    monkeypatch.setattr(runtime, "COMMIT_RETRY_S", 0.0)
    broker = broker_with(*packed(10))
    sink = ListSink(on_flush=lambda: setattr(broker, "up", False))  # away as the commit comes
    runner = runtime.SinkRuntime(sink, stream_on(broker), retry=FAST)
    while not sink.flushed:
        runner.step()
    assert committed_offsets(broker, "g") == {}  # refused, and the runtime goes on
    broker.up = True
    runner.step()  # nothing new: the commit refused earlier is made now
    assert committed_offsets(broker, "g") == {STEP_0: 1}
    runner.close()


class ClosingSink(ListSink):
    """Holds its batch for a minute, writes what it holds of partitions taken away (the
    contract of ``close``), and keeps who opened and closed what."""

    poll_s = 0.05

    def __init__(self, events: list, name: str):
        super().__init__()
        self.events, self.name = events, name

    def flush_in_s(self):
        return 60.0 if self.buffered else None

    def open(self, partitions):
        self.events.append((self.name, "open", sorted(partitions)))

    def close(self, partitions):
        self.events.append((self.name, "close", sorted(partitions)))
        self.flush()


def test_a_rebalance_closes_a_partition_on_its_old_member_before_the_new_one_opens_it():
    """The old member writes what it holds at ``close``, but it commits only with a flush
    the runtime calls: the new member reads those records again (at least once, never
    lost) and commits them with its own flush."""
    kinds = ("step", "eval")
    broker = broker_with(*packed(20, per_message=5))
    evals, steps = [TopicPartition(topics.topic_for("eval", PREFIX), 0)], [STEP_0]
    events: list = []
    first = ClosingSink(events, "first")
    first_rt = runtime.SinkRuntime(first, stream_on(broker, kinds=kinds), retry=FAST)
    first_rt.step()
    assert [m.record.step for m in first.buffered] == list(range(20))

    second = ClosingSink(events, "second")
    second_rt = runtime.SinkRuntime(second, stream_on(broker, kinds=kinds), retry=FAST)
    second_rt.step()  # joins: the step partition is the first member's until it lets go
    assert events == [("first", "open", [*evals, *steps])]
    first_rt.step()
    second_rt.step()
    assert events == [("first", "open", [*evals, *steps]), ("first", "close", steps),
                      ("second", "open", steps)]
    assert [m.record.step for m in first.flushed] == list(range(20)) and first.buffered == []
    assert STEP_0 not in committed_offsets(broker, "g")

    for value in packed(10, per_message=5):
        broker.append(STEP, b"rt", value)
    second_rt.step()
    second_rt.flush_and_commit()
    assert [m.record.step for m in second.flushed] == [*range(20), *range(10)]
    assert committed_offsets(broker, "g")[STEP_0] == 6
    first_rt.close(), second_rt.close()


def test_records_polled_for_a_partition_since_taken_away_are_not_put():
    broker = broker_with(*packed(10))
    sink = ListSink()
    runner = runtime.SinkRuntime(sink, stream_on(broker), retry=FAST)
    real_poll = runner.stream.poll

    def poll_then_lose_the_partition(**kwargs):
        got = real_poll(**kwargs)
        runner._revoked([STEP_0])  # as if the rebalance came between the fetch and the put
        return got

    runner.stream.poll = poll_then_lose_the_partition
    runner.step()
    assert sink.buffered == [] and sink.flushed == [] and runner.records == 0
    # Nor counted as read (the stream's count of its poll was; the runtime's is what it put).
    assert runner.metrics.registry.get_sample_value("trainmon_records_read_total", {"kind": "step"}) is None
    runner.close()


class EvalSink(runtime.Sink):
    """Keeps the eval records it is given; quiet only once it holds ``wanted`` of them."""

    name = "eval sink"
    kinds = ("eval",)
    poll_s = 0.05

    def __init__(self, group: str, wanted: int):
        self.group = group
        self.wanted = wanted
        self.kept = []

    def put(self, messages):
        self.kept += [m.record for m in messages]

    def quiet_for(self, sink_runtime, seconds):
        return len(self.kept) >= self.wanted and super().quiet_for(sink_runtime, seconds)


def test_serve_reads_the_declared_kinds_with_the_declared_group_until_quiet(tmp_path):
    from trainmon.producer import Producer, ProducerConfig

    broker = MemoryBroker()
    tm = Producer(ProducerConfig(run_id="mem", topic_prefix=PREFIX, spill_dir=tmp_path / "spill"),
                  transport=broker.transport)
    for step in range(5):
        tm.log_step(step, step_tokens=1, duration_ms=1.0, loss=1.0, norm=1.0, lr=1e-4)
    tm.log_eval(4, loss=2.0)
    tm.log_eval(9, loss=1.5)
    assert tm.flush(10)
    tm.close(timeout=5)
    sink = EvalSink(f"{PREFIX}evals", wanted=2)
    done = serving.serve(sink, topic_prefix=PREFIX, exit_when_idle_s=0.1, open_stream=memory_streams(broker))
    assert [(r.kind, r.step) for r in sink.kept] == [("eval", 4), ("eval", 9)]
    assert done.stream.group_id == sink.group and done.stream.kinds == ["eval"]
    eval_topic = topics.topic_for("eval", PREFIX)
    assert committed_offsets(broker, sink.group) == {TopicPartition(eval_topic, 0): len(broker.values(eval_topic))}
    assert done.closed


def test_puts_and_flushes_leave_nothing_for_the_cyclic_collector():
    """The services run the cyclic collector rarely (consumers/gc_tuning.py), so a put or a
    flush must leave no reference cycle behind: a tenacity Retrying per call did, and the
    TensorBoard forwarder grew by ~40 MiB an hour (benchmarks/soak.py)."""
    broker = broker_with(*packed(300, per_message=1))
    sink = ListSink(failures=2)  # the failed attempts and their retries too
    done = runtime.SinkRuntime(sink, stream_on(broker), retry=FAST)

    def run():
        while len(sink.flushed) < 300:
            done.step()

    assert cyclic_garbage(run, ("tenacity",)) == []
    assert sink.attempts >= 3


def test_a_stopped_sink_is_not_called_again_when_the_stream_closes():
    """Closing the stream revokes its partitions (librdkafka's close runs the revoke
    callback; the memory consumer does the same): a sink already stopped must not be
    asked to write what it holds of them after its stop() -- the ClickHouse loader's
    close waits on a writer its stop() closed, and inserts again after a stop that gave
    up on an outage."""
    broker = broker_with(*packed(10))
    sink = StopOrderSink()
    runner = runtime.SinkRuntime(sink, stream_on(broker), retry=FAST)
    runner.run(until_flushed(sink, 10))
    assert runner.closed and sink.calls == [("stop",)]
    assert committed_offsets(broker, "g") == {STEP_0: 1}


def test_a_runtime_closed_without_stopping_its_sink_still_closes_the_partitions():
    broker = broker_with(*packed(10))
    sink = StopOrderSink()
    runner = runtime.SinkRuntime(sink, stream_on(broker), retry=FAST)
    runner.step()
    runner.close()  # (as serve does when on_started raised: the sink was never stopped)
    assert sink.calls == [("close", [STEP_0])]
