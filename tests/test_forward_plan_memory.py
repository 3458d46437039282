"""What the W&B / Aim / TensorBoard forwarders hand their tracker, in memory: a tracker
that keeps every RunWork stands in for the libraries, a MemoryBroker for Kafka. Each
stream's points arrive once, in step order; a replay (a new group) sends nothing again; a
tracker failure is retried with the same batch and moves neither the progress nor the
offsets; a crash between the progress and the commit sends nothing twice. The forwarder
tests with the real libraries on the real broker (test_forward_*.py) show the same end to
end."""

from __future__ import annotations

import pytest

from trainmon.consumers.forwarding import ProgressStore, RunProgress, RunWork
from trainmon.consumers.runtime import RetryPolicy
from trainmon.consumers.metric_names import stream_key
from trainmon.kafka_client.memory_consumer import committed_offsets
from trainmon.kafka_client.memory_transport import MemoryBroker

from .forward_helpers import CONFIG, STEPS, MemoryProducers, drain, log_run, make_memory_forwarder
from .metrics_support import scrape
from .runtime_support import cyclic_garbage

PREFIX = "fwd."


class KeepingTracker:
    """An ExperimentTracker that keeps what it is given; ``failures`` flushes fail first."""

    name = "keeping"

    def __init__(self, failures: int = 0):
        self.failures = failures
        self.works: list[RunWork] = []
        self.durable: list[RunWork] = []
        self.closed = False

    def write(self, work: RunWork) -> None:
        self.works.append(work)

    def flush(self) -> None:
        if self.failures:
            self.failures -= 1
            self.works.clear()
            raise OSError("disk full")
        self.durable += self.works
        self.works.clear()

    def close_idle(self, idle_seconds: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def points(self) -> list[tuple]:
        return [(stream_key(r), r.step) for w in self.durable for r in w.records]


@pytest.fixture
def broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
def producers(broker, tmp_path):
    made = MemoryProducers(broker, PREFIX, tmp_path / "spill")
    yield made
    made.close()


def forwarder(broker, tracker, group, tmp_path):
    return make_memory_forwarder(tracker, broker, PREFIX, group, tmp_path / "progress")


def test_each_point_reaches_the_tracker_once_and_a_replay_sends_nothing(broker, producers, tmp_path):
    sent = log_run(producers, "mem-run")
    tracker = KeepingTracker()
    first = forwarder(broker, tracker, "fwd-1", tmp_path)
    port = first.runtime.metrics.serve(0)
    drain(first, sent)
    first.runtime.flush_and_commit()
    samples = scrape(port)  # its endpoint: what it read and wrote, per kind
    first.runtime.metrics.close()
    first.runtime.close()
    read, written = (samples.by_label(f"trainmon_records_{what}_total", "kind") for what in ("read", "written"))
    assert read == written and sum(read.values()) == sent and read["step"] == 2 * STEPS
    assert samples.by_label("trainmon_records_dead_lettered_total", "kind") == {}
    assert set(samples.by_label("trainmon_consumer_lag", "topic").values()) == {0}

    points = tracker.points()
    assert len(points) == len(set(points)), "a point was sent twice"
    per_stream: dict = {}
    for key, step in points:
        per_stream.setdefault(key, []).append(step)
    assert all(steps == sorted(steps) for steps in per_stream.values())
    assert max(len(steps) for steps in per_stream.values()) == STEPS
    [config] = [w.config for w in tracker.durable if w.config]
    assert config["model"] == CONFIG["model"] and config["trainmon"]["run_id"] == "mem-run"
    assert [w.ended for w in tracker.durable if w.ended] == ["success"]

    # A replay: a new group reads everything again; the progress skips all of it.
    replaying = KeepingTracker()
    replay = forwarder(broker, replaying, "fwd-replay", tmp_path)
    drain(replay, sent)
    replay.runtime.close()
    assert replay.stats.skipped == sent and replaying.points() == []


def test_a_tracker_failure_retries_the_same_batch_and_commits_only_once_it_is_durable(broker, producers, tmp_path):
    sent = log_run(producers, "mem-fail", steps=range(2), end=False)
    tracker = KeepingTracker(failures=2)
    failing = forwarder(broker, tracker, "fwd-fail", tmp_path)
    failing.runtime.retry = RetryPolicy(first_s=0.01, max_s=0.02)
    commits_at_flush = []
    real_flush = tracker.flush

    def flush():
        commits_at_flush.append(committed_offsets(broker, "fwd-fail"))
        real_flush()

    tracker.flush = flush
    drain(failing, sent)
    failing.runtime.close()
    assert failing.stats.retries == 2 and commits_at_flush[:3] == [{}, {}, {}]
    assert sorted(tracker.points()) == sorted(set(tracker.points())) and len(tracker.points()) > 0
    assert committed_offsets(broker, "fwd-fail")  # committed once the batch was durable


def test_a_crash_before_the_commit_sends_nothing_twice_and_new_records_follow(broker, producers, tmp_path):
    first = log_run(producers, "mem-crash", steps=range(2), end=False)
    tracker = KeepingTracker()
    crashing = forwarder(broker, tracker, "fwd-crash", tmp_path)
    crashing.stream.commit = lambda offsets: (_ for _ in ()).throw(OSError("crash"))
    with pytest.raises(OSError):
        while True:
            crashing.runtime.step()
    crashing.stream.consumer.close()
    assert committed_offsets(broker, "fwd-crash") == {}

    resumed = forwarder(broker, tracker, "fwd-crash", tmp_path)
    drain(resumed, first)
    assert resumed.stats.skipped == first  # all read again, all skipped by the progress
    second = log_run(producers, "mem-crash", steps=range(2, 4), start=False)
    drain(resumed, second)
    resumed.runtime.close()
    points = tracker.points()
    assert len(points) == len(set(points))
    assert {step for _, step in points} == set(range(4))


def test_saving_a_runs_progress_leaves_nothing_for_the_cyclic_collector(tmp_path):
    """Saved after every batch, by services that run the cyclic collector rarely
    (consumers/gc_tuning.py): json.dump's Python encoder left a cycle of closures per save."""
    store = ProgressStore(tmp_path)
    progress = RunProgress("run-1", high_water={"step/0": 41}, config={"lr": 3e-4, "tags": ["a"]})

    def run():
        for step in range(50):
            progress.high_water["step/0"] = step
            store.save(progress)

    assert cyclic_garbage(run, ("json.encoder",)) == []
    assert ProgressStore(tmp_path).get("run-1").high_water == {"step/0": 49}
