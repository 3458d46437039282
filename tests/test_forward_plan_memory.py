"""What the W&B / Aim / TensorBoard forwarders hand their tracker, in memory: a tracker
that keeps every RunWork stands in for the libraries, a MemoryBroker for Kafka. Each
stream's points arrive once, in step order; a replay (a new group) sends nothing again; a
tracker failure is retried with the same batch and moves neither the progress nor the
offsets; a crash between the progress and the commit sends nothing twice. The forwarder
tests with the real libraries on the real broker (test_forward_*.py) show the same end to
end."""

from __future__ import annotations

import time

import pytest

from trainmon.consumers.forwarding import ProgressStore, RunProgress, RunWork, arg_parser, parse_ranks
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


def read_all(forwarding, records: int, timeout: float = 30.0) -> None:
    """Step until `records` more records were put (read), whether forwarded or held."""
    target = forwarding.runtime.records + records
    deadline = time.monotonic() + timeout
    while forwarding.runtime.records < target:
        assert time.monotonic() < deadline, f"read {forwarding.runtime.records}, wanted {target}"
        forwarding.runtime.step()


def test_a_new_runs_points_wait_for_its_start_record_and_their_offsets_stay_uncommitted(
        broker, producers, tmp_path):
    """W&B fixes a run's project when it makes the run: a batch holding a run's first steps
    but not its start record (another topic) must not make the run yet."""
    steps_only = log_run(producers, "mem-late", steps=range(2), start=False, end=False)
    other = log_run(producers, "mem-other", steps=range(2), end=False)  # its start came first
    tracker = KeepingTracker()
    tracker.start_wait_s = 60.0
    waiting = forwarder(broker, tracker, "fwd-late", tmp_path)
    read_all(waiting, steps_only + other)
    waiting.runtime.flush_and_commit()
    assert {w.run_id for w in tracker.durable} == {"mem-other"}  # the other run goes on
    assert waiting.stats.records == other and waiting.runtime.sink.flush_in_s() > 30
    committed = committed_offsets(broker, "fwd-late")
    step_partitions = {tp: offset for tp, offset in committed.items() if tp.topic == PREFIX + "step"}
    assert step_partitions and set(step_partitions.values()) == {0}, committed  # mem-late's come first

    start = producers(run_id="mem-late", rank=0, world_size=2)
    start.run_start(config=CONFIG, name="late-name", project="late-project")
    assert start.flush(30)
    drain(waiting, 1)
    waiting.runtime.flush_and_commit()
    late = [w for w in tracker.durable if w.run_id == "mem-late"]
    assert late[0].start is not None and late[0].start.project == "late-project"
    assert sum(len(w.records) for w in late) == steps_only  # every held point, once
    assert waiting.stats.records == steps_only + other + 1
    assert all(offset > 0 for tp, offset in committed_offsets(broker, "fwd-late").items()
               if tp.topic == PREFIX + "step")
    waiting.runtime.close()


def test_a_run_without_a_start_record_is_forwarded_after_the_wait(broker, producers, tmp_path):
    sent = log_run(producers, "mem-nostart", steps=range(2), start=False, end=False)
    tracker = KeepingTracker()
    tracker.start_wait_s = 1.0
    waiting = forwarder(broker, tracker, "fwd-nostart", tmp_path)
    began = time.monotonic()
    drain(waiting, sent)
    assert time.monotonic() - began >= 1.0
    assert len(tracker.points()) == sent and tracker.durable[0].start is None
    more = log_run(producers, "mem-nostart", steps=range(2, 3), start=False, end=False)
    began = time.monotonic()
    drain(waiting, more)  # once forwarded, its points no longer wait
    assert time.monotonic() - began < 1.0
    waiting.runtime.close()


def test_only_the_chosen_ranks_points_are_mirrored_and_every_offset_is_committed(broker, producers, tmp_path):
    """--ranks 0 (TRAINMON_FORWARD_RANKS): rank 1's points are left out, counted; rank 0's
    all arrive, and the run's start and end; every message is committed (a point left out
    is not read again)."""
    sent = log_run(producers, "ranks-run")
    tracker = KeepingTracker()
    fwd = make_memory_forwarder(tracker, broker, PREFIX, "fwd-ranks", tmp_path / "progress",
                                ranks=parse_ranks("0"))
    drain(fwd, sent)
    fwd.runtime.flush_and_commit()
    fwd.runtime.close()
    records = [r for w in tracker.durable for r in w.records]
    assert {r.rank for r in records} == {0}
    assert sorted(r.step for r in records if r.kind == "step") == list(range(STEPS))
    assert fwd.stats.left_out == 2 * STEPS  # rank 1's step and gpu records
    assert [w.ended for w in tracker.durable if w.ended] == ["success"]
    assert [w.config["trainmon"]["run_id"] for w in tracker.durable if w.config] == ["ranks-run"]
    committed = committed_offsets(broker, "fwd-ranks")
    assert sum(committed.values()) == sum(len(broker.topics[tp.topic]) for tp in committed)


@pytest.mark.parametrize("text, ranks", [("all", None), ("ALL", None), ("0", {0}), ("0,3,8-10", {0, 3, 8, 9, 10})])
def test_ranks_are_read_from_a_list(text, ranks):
    assert parse_ranks(text) == (None if ranks is None else frozenset(ranks))


@pytest.mark.parametrize("text, named", [("a", "'a'"), ("3-1", "'3-1'"), ("-1", "'-1'"), ("0,,1", "''")])
def test_a_wrong_rank_list_names_the_part(text, named):
    with pytest.raises(ValueError, match="is not a") as caught:
        parse_ranks(text)
    assert named in str(caught.value) and repr(text) in str(caught.value)


def test_the_ranks_option_defaults_to_trainmon_forward_ranks(monkeypatch):
    monkeypatch.delenv("TRAINMON_FORWARD_RANKS", raising=False)
    assert arg_parser("tensorboard", "x").parse_args([]).ranks is None  # every rank
    monkeypatch.setenv("TRAINMON_FORWARD_RANKS", "0-1")
    assert arg_parser("tensorboard", "x").parse_args([]).ranks == frozenset({0, 1})
    assert arg_parser("tensorboard", "x").parse_args(["--ranks", "all"]).ranks is None
