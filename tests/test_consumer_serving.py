"""serve(sink) on the real broker: the stream is the one the sink declares (its group, its
kinds), --exit-when-idle ends it once the sink says it is quiet, and a sink that fails to
start leaves its group and gives its static instance id back."""

from __future__ import annotations

import uuid

import pytest

from trainmon import topics
from trainmon.consumers import membership, runtime, serving

from .conftest import committed_offsets, end_offsets


class EvalSink(runtime.Sink):
    """Keeps the eval records it is given; quiet only once it holds ``wanted`` of them."""

    name = "eval sink"
    kinds = ("eval",)

    def __init__(self, group: str, wanted: int):
        self.group = group
        self.consumer_settings = {"group_instance_id": None}  # a throwaway group
        self.wanted = wanted
        self.kept = []

    def put(self, messages):
        self.kept += [m.record for m in messages]

    def quiet_for(self, sink_runtime, seconds):
        return len(self.kept) >= self.wanted and super().quiet_for(sink_runtime, seconds)


class BrokenSink(runtime.Sink):
    name = "broken sink"
    kinds = ("step",)

    def start(self, context):
        super().start(context)
        raise RuntimeError("its state does not load")


def test_serve_reads_the_declared_kinds_with_the_declared_group_until_quiet(bootstrap, topic_prefix,
                                                                           make_producer):
    tm = make_producer()
    for step in range(5):
        tm.log_step(step, step_tokens=1, duration_ms=1.0, loss=1.0, norm=1.0, lr=1e-4)
    tm.log_eval(4, loss=2.0)
    tm.log_eval(9, loss=1.5)
    assert tm.flush(30)
    sink = EvalSink(f"{topic_prefix}evals", wanted=2)
    done = serving.serve(sink, topic_prefix=topic_prefix, env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap},
                         exit_when_idle_s=0.5)
    assert [(r.kind, r.step) for r in sink.kept] == [("eval", 4), ("eval", 9)]
    assert done.stream.group_id == sink.group and done.stream.kinds == ["eval"]
    eval_topic = topics.topic_for("eval", topic_prefix)
    committed = committed_offsets(bootstrap, sink.group, eval_topic)
    assert {p: offset or 0 for p, offset in committed.items()} == end_offsets(bootstrap, eval_topic)
    assert done.closed


def test_a_sink_that_fails_to_start_gives_its_instance_id_back(bootstrap, topic_prefix):
    group = f"{topic_prefix}broken-{uuid.uuid4().hex[:6]}"
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
    with pytest.raises(RuntimeError, match="does not load"):
        serving.attach(BrokenSink(), group=group, topic_prefix=topic_prefix, env=env)
    # Released: the next process of the group gets the same static id, not "<id>-2".
    again = serving.attach(runtime.Sink(), group=group, topic_prefix=topic_prefix, env=env)
    try:
        assert again.stream.instance_id == membership.base_id(group, env)
    finally:
        again.close()
