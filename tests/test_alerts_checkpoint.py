"""The engine's checkpoint file and its background writer (a forked child), in memory."""

import gzip
import json
import os

import pytest

from trainmon.consumers.alerts import checkpoint
from .waiting import wait_until


def test_a_checkpoint_is_gzipped_json_and_round_trips(tmp_path):
    path = checkpoint.checkpoint_path(tmp_path, "alerts", "t.")
    assert path.name.endswith(".json.gz")
    saved = checkpoint.Checkpoint(engine={"runs": [1.5, 2]}, offsets={"t.step:0": 7},
                                  alert_offsets={0: 3}, run_partitions={"r": 0})
    checkpoint.save(path, saved)
    assert json.loads(gzip.decompress(path.read_bytes()))["offsets"] == {"t.step:0": 7}  # zcat reads it
    back = checkpoint.load(path)
    assert (back.engine, back.offsets, back.alert_offsets, back.run_partitions) == \
        (saved.engine, saved.offsets, saved.alert_offsets, saved.run_partitions)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the background writer forks")
def test_the_writer_saves_the_state_as_of_the_fork_while_the_caller_goes_on(tmp_path):
    path = tmp_path / "c.json.gz"
    state = {"step": 1}
    go_r, go_w = os.pipe()

    def make():  # (runs in the child: waits until the parent has moved on)
        os.read(go_r, 1)
        return checkpoint.Checkpoint(engine=dict(state), offsets={}, alert_offsets={}, run_partitions={})

    writer = checkpoint.Writer()
    writer.write(path, make)  # returns while the child waits on the pipe
    assert writer.busy() and not path.exists()
    state["step"] = 2  # the engine goes on judging
    os.write(go_w, b"x")
    wait_until(lambda: not writer.busy(), 30, "the writer to finish")
    assert checkpoint.load(path).engine == {"step": 1}
    assert (writer.written, writer.failed) == (1, 0)
    writer.write(path, make)  # the next one sees the state of its own moment
    os.write(go_w, b"x")
    writer.wait()
    assert checkpoint.load(path).engine == {"step": 2}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the background writer forks")
def test_a_failed_write_keeps_the_last_checkpoint_and_says_so(tmp_path, caplog):
    path = tmp_path / "c.json.gz"
    checkpoint.save(path, checkpoint.Checkpoint(engine={"old": True}, offsets={}, alert_offsets={},
                                                run_partitions={}))

    def make():
        raise ValueError("a rule's state that cannot be saved")

    writer = checkpoint.Writer()
    writer.write(path, make)
    writer.wait()
    assert (writer.written, writer.failed) == (0, 1)
    assert "checkpoint writer exited with 1" in caplog.text
    assert checkpoint.load(path).engine == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json.gz"]  # no temporary file left


def test_a_fork_that_fails_writes_the_checkpoint_in_the_caller(tmp_path, monkeypatch, caplog):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(checkpoint.os, "fork", no_fork)
    writer = checkpoint.Writer()
    writer.write(tmp_path / "c.json.gz", lambda: checkpoint.Checkpoint(engine={"step": 3}, offsets={},
                                                                      alert_offsets={}, run_partitions={}))
    assert writer.pid is None and (writer.written, writer.failed) == (1, 0)
    assert checkpoint.load(tmp_path / "c.json.gz").engine == {"step": 3}
    assert "cannot fork a checkpoint writer" in caplog.text


def test_a_checkpoint_due_while_the_last_write_still_runs_does_not_make_the_runtime_spin(tmp_path):
    """A checkpoint that falls due while the forked writer still writes the last one (at
    16,384 ranks a write can outlast the interval) is looked at again shortly: answering
    "flush now" at every poll made the runtime poll(0) and flush in a loop, a core spun
    for as long as the write ran."""
    from trainmon.consumers.alerts.service import WRITER_BUSY_RECHECK_S

    from .alerts_support import make_service, service_env

    class Writer:
        running = True

        def busy(self):
            return self.running

    service = make_service(service_env("127.0.0.1:9"), "spin.", tmp_path)
    service._writer = writer = Writer()
    service._checkpoint_at = 0.0  # due
    assert service.flush_in_s() == WRITER_BUSY_RECHECK_S > 0
    writer.running = False
    assert service.flush_in_s() == 0.0  # the write done: the checkpoint goes now
