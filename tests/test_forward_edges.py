"""The forwarders (W&B, Aim, TensorBoard) at their edges, each once a loss, a duplicate or a
leak: TensorBoard after a full disk, a progress file that cannot be saved, the memory of
runs long closed. In memory (the sink contract driven directly), real tracker libraries."""

from __future__ import annotations

import errno

import pytest

from trainmon.consumers.forwarding import ForwardingSink, ProgressStore
from trainmon.consumers.runtime import RetriableError
from trainmon.consumers.stream import Message
from trainmon.schemas import StepRecord

from .samples import envelope



def messages(records, first_offset=0):
    return [Message(r.kind, "t." + r.kind, r.rank, first_offset + i, None, b"", r)
            for i, r in enumerate(records)]


def steps(run_id, first, last, rank=0):
    return [StepRecord(**envelope(1000 * rank + step, rank=rank, run_id=run_id), step=step, loss=3.0 - step / 100,
                       losses={f"part{j}": float(j) for j in range(20)})
            for step in range(first, last)]


# tensorboard's writer thread dies of the full disk: that death is the case tested here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_recovers_from_a_full_disk_and_holds_each_point_once(tmp_path, monkeypatch):
    """A full disk is a sink failure the runtime retries (docs/forwarders.md). tensorboard's
    writer thread dies at its first failed write and every later call raises its error
    again, so the forwarder kept the broken writer and failed forever, also once space was
    freed. And a retry must not add the points that reached the file before the failure."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.compat.tensorflow_stub.io import gfile

    from trainmon.consumers.tensorboard_sink import TensorBoardSink

    full = {"on": False, "room": 10}  # once on: room for this many more events
    real_write = gfile.LocalFileSystem._write

    def write(self, filename, content, mode):
        if full["on"] and "events.out.tfevents" in str(filename):
            full["room"] -= 1
            if full["room"] < 0:
                real_write(self, filename, content[:len(content) // 2], mode)  # what fit
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, filename, content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", write)
    tracker = TensorBoardSink(tmp_path / "tb", max_queue_size=10)
    sink = ForwardingSink(tracker, ProgressStore(tmp_path / "tb" / ".trainmon-forwarder"))
    sink.put(messages(steps("tb-full", 0, 5)))
    sink.flush()

    sink.put(messages(steps("tb-full", 5, 40), first_offset=5))
    full["on"] = True
    with pytest.raises(RetriableError):
        sink.flush()
    full["on"] = False  # space freed: the runtime's retry of the same batch must go through
    sink.flush()
    tracker.close()

    acc = event_accumulator.EventAccumulator(str(tracker.run_dir("tb-full")),
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(40))


class RecordingTracker:
    name = "recording"

    def __init__(self):
        self.written: list[tuple[str, str, int]] = []  # (run, stream, step) per point written

    def write(self, work) -> None:
        from trainmon.consumers.metric_names import stream_key

        self.written += [(work.run_id, stream_key(r), r.step) for r in work.records]

    def flush(self) -> None:
        pass

    def close_idle(self, idle_seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_progress_file_that_cannot_be_written_is_retried_and_sends_nothing_twice(tmp_path, monkeypatch):
    """The high-water files live next to the artefacts (docs/forwarders.md), on the disk a
    full-disk failure hits. An OSError from saving them left ForwardingSink.flush as it
    was, not as a RetriableError: the runtime (which retries only those) stopped with it,
    without stopping the sink, and the restarted forwarder sent the batch again."""
    from trainmon.consumers.runtime import RetryPolicy
    from trainmon.kafka_client.memory_transport import MemoryBroker

    from .forward_helpers import MemoryProducers, drain, log_run, make_memory_forwarder

    broker = MemoryBroker()
    producers = MemoryProducers(broker, "rv.", tmp_path / "spill")
    try:
        sent = log_run(producers, "save-fails", steps=range(3), end=False)
    finally:
        producers.close()
    tracker = RecordingTracker()
    forwarding = make_memory_forwarder(tracker, broker, "rv.", "rv-save", tmp_path / "progress")
    forwarding.runtime.retry = RetryPolicy(first_s=0.01, max_s=0.02)
    store = forwarding.runtime.sink.store
    real_save, failures = store.save, [1]

    def save(progress):
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(progress)

    monkeypatch.setattr(store, "save", save)
    try:
        drain(forwarding, sent)
    finally:
        forwarding.runtime.close()
    assert failures == [0]
    assert len(tracker.written) == len(set(tracker.written)), "points sent twice"
    assert len(tracker.written) == sent - 1  # all but the run start
    assert ProgressStore(tmp_path / "progress").get("save-fails").high_water


def test_a_long_lived_forwarder_lets_go_of_the_runs_it_closed(tmp_path):
    """A forwarder serves many runs over weeks. Every run it ever saw kept its progress
    (the whole run config and a high-water mark per rank, kind and GPU) in the store's
    cache for good, after the tracker had closed the run as idle: memory grew with every
    run. Once a run is idle (``idle_close_seconds``) its progress is read again from its
    file if it comes back."""
    from trainmon.schemas import RunRecord

    tracker = RecordingTracker()
    sink = ForwardingSink(tracker, ProgressStore(tmp_path / "progress"), idle_close_seconds=0.0)
    offset = 0
    for n in range(30):
        run_id = f"run-{n}"
        start = RunRecord(**envelope(0, rank=0, run_id=run_id), event="start", project="p",
                          config={f"arg{i}": i for i in range(200)})
        batch = [start] + [r for rank in range(8) for r in steps(run_id, 0, 3, rank=rank)]
        sink.put(messages(batch, offset))
        offset += len(batch)
        sink.flush()
        sink.tick()  # the runtime's tick: handles of runs idle for idle_close_seconds close
    assert len(sink.store._cache) <= 1
    # A run that comes back is read from its file: nothing is sent twice.
    sink.put(messages(steps("run-3", 0, 4), offset))
    sink.flush()
    assert [key for key in tracker.written if key[0] == "run-3" and key[1] == "0/step"] == \
        [("run-3", "0/step", step) for step in range(4)]


def test_wandb_forgets_a_finished_runs_pie_charts(tmp_path):
    """The last allocator breakdown per (run, rank), kept to log a pie chart only when it
    changes, stayed after the W&B run was finished: for every rank of every run."""
    pytest.importorskip("wandb")
    from trainmon.consumers.forwarding import RunProgress, RunWork
    from trainmon.consumers.wandb_sink import WandbSink
    from trainmon.schemas import AllocatorRecord

    sink = WandbSink(directory=tmp_path / "wb", mode="offline")
    records = [AllocatorRecord(**envelope(rank, rank=rank, run_id="pie-run"), step=1,
                               stats=[dict(name="weights", device=2**30, managed=0, pinned=0, pageable=0)])
               for rank in range(4)]
    sink.write(RunWork("pie-run", RunProgress("pie-run"), records=records))
    sink.flush()
    sink.close_idle(0.0)
    assert not sink._runs
    assert not sink._last_pie
    sink.close()
