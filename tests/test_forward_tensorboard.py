"""TensorBoard forwarder: real broker, real event files, read back with EventAccumulator."""

from __future__ import annotations

import json

import pytest

from trainmon.consumers.tensorboard_sink import STATE_DIR, TensorBoardSink, main

from .forward_helpers import (CONFIG, assert_series, drain, expected_series, log_run,
                              make_forwarder)

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_run(directory) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """Scalars (tag -> [(step, value)]) and text summaries of the event files in one dir."""
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={
        event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = [t.tensor_proto.string_val[0].decode() for tag in tags["tensors"] for t in acc.Tensors(tag)]
    return scalars, texts


def read_all(sink: TensorBoardSink, run_id: str):
    rank0, texts = read_run(sink.run_dir(run_id, 0))
    rank1, _ = read_run(sink.run_dir(run_id, 1))
    return {0: rank0, 1: rank1}, texts


def test_tensorboard_holds_exactly_the_logged_series_also_after_replay(
        make_producer, bootstrap, topic_prefix, tmp_path):
    sent = log_run(make_producer, "tb-run")
    logdir = tmp_path / "tb"

    sink = TensorBoardSink(logdir)
    forwarder = make_forwarder(sink, bootstrap, topic_prefix, "tb-1", logdir / STATE_DIR)
    drain(forwarder, sent)
    sink.close()
    forwarder.stream.close()

    series, texts = read_all(sink, "tb-run")
    assert_series(series[0], expected_series()[0])
    assert_series(series[1], expected_series()[1])
    assert len(texts) == 1
    config = json.loads(texts[0].removeprefix("```json\n").removesuffix("\n```"))
    assert config["model"] == CONFIG["model"] and config["trainmon"]["name"] == "tb-run-name"

    # A forced replay: a new consumer group reads every topic from the beginning.
    sink = TensorBoardSink(logdir)
    replay = make_forwarder(sink, bootstrap, topic_prefix, "tb-replay", logdir / STATE_DIR)
    drain(replay, sent)
    sink.close()
    replay.stream.close()
    assert replay.stats.skipped == sent
    assert read_all(sink, "tb-run") == (series, texts)


def test_tensorboard_resumes_from_committed_offsets_without_duplicates(
        make_producer, bootstrap, topic_prefix, tmp_path, monkeypatch):
    logdir = tmp_path / "tb"
    first = log_run(make_producer, "tb-crash", steps=range(2), end=False)

    # Crash after the sink flushed a batch but before its offsets were committed.
    sink = TensorBoardSink(logdir)
    crashing = make_forwarder(sink, bootstrap, topic_prefix, "tb-group", logdir / STATE_DIR)
    monkeypatch.setattr(crashing.stream, "commit", lambda offsets: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        while True:
            crashing.runtime.step()
    # As the crashed process's exit would: the consumer closed and its static instance id
    # free, so the restarted one takes the same id and its partitions at once (another id
    # would wait out the old member's 45 s session).
    crashing.stream.close()
    sink.close()

    # The same group again: nothing was committed, so it re-reads all; the marks skip it.
    sink = TensorBoardSink(logdir)
    resumed = make_forwarder(sink, bootstrap, topic_prefix, "tb-group", logdir / STATE_DIR)
    drain(resumed, first)
    assert resumed.stats.skipped > 0
    # More training arrives; the committed offsets mean only the new records are read.
    second = log_run(make_producer, "tb-crash", steps=range(2, 4), start=False)
    drain(resumed, second)
    sink.close()
    resumed.stream.close()

    series, _ = read_all(sink, "tb-crash")
    assert_series(series[0], expected_series()[0])
    assert_series(series[1], expected_series()[1])


def test_tensorboard_cli_runs_until_idle(make_producer, bootstrap, topic_prefix, tmp_path, monkeypatch):
    sent = log_run(make_producer, "tb-cli", steps=range(1), end=True)
    monkeypatch.setenv("TRAINMON_KAFKA_BOOTSTRAP", bootstrap)
    monkeypatch.setenv("TRAINMON_TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert main(["--topic-prefix", topic_prefix, "--exit-when-idle", "3", "--linger-ms", "100"]) == 0
    series, _ = read_run(tmp_path / "tb" / "tb-cli")
    assert series["train/loss"] == [(0, pytest.approx(3.0))]
    assert sent == 7
