"""``trainmon consume tensorboard``: mirror the record streams into TensorBoard event files.

Layout (Megatron-Bridge's TensorBoard backend reads the same):
    $TRAINMON_TENSORBOARD_DIR/<run>/            rank 0, Surogate scalar names
    $TRAINMON_TENSORBOARD_DIR/<run>/rank<r>/    rank r > 0, the same names
so ``tensorboard --logdir $TRAINMON_TENSORBOARD_DIR`` overlays the ranks of a run on one
chart. Written with tensorboard's own EventFileWriter (no TensorFlow, no torch needed).
The run config goes in as a text summary named ``config``.
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid
from pathlib import Path

from .forwarding import RunWork, arg_parser, forward, require, safe_name
from .metric_names import scalars

STATE_DIR = ".trainmon-forwarder"


class TensorBoardSink:
    """Runs mirrored into TensorBoard event files: a forwarding.ExperimentTracker, which ForwardingSink
    drives on the consumer runtime."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, *, max_queue_size: int = 1000):
        require("tensorboard", "tensorboard")
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        self._text_metadata = text_metadata
        self._EventFileWriter = EventFileWriter
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._max_queue_size = max_queue_size
        self._writers: dict[tuple[str, int], _Writer] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._ending: set[tuple[str, int]] = set()  # writers of runs that ended: closed at flush

    def run_dir(self, run_id: str, rank: int = 0) -> Path:
        base = self.logdir / safe_name(run_id)
        return base if rank == 0 else base / f"rank{rank}"

    def _writer(self, run_id: str, rank: int) -> "_Writer":
        key = (run_id, rank)
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = _Writer(self._EventFileWriter, self.run_dir(run_id, rank),
                                                  self._max_queue_size)
        writer.last_used = time.monotonic()
        self._dirty.add(key)
        return writer

    def write(self, work: RunWork) -> None:
        try:
            self._write(work)
        except BaseException:
            self._roll_back()
            raise

    def _roll_back(self) -> None:
        """After a failed write or flush (a full disk): tensorboard's writer thread dies at
        its first failed write and raises that error from then on, so the writers written
        since their last flush are dropped, their files cut back to what was flushed (the
        runtime retries the whole batch, into new files: nothing twice, nothing lost)."""
        for key in list(self._dirty):
            writer = self._writers.pop(key, None)
            if writer is not None:
                writer.abandon()
        self._dirty.clear()
        self._ending.clear()

    def _write(self, work: RunWork) -> None:
        event_pb2, summary_pb2, _, _ = self._pb
        if work.config is not None:
            self._writer(work.run_id, 0).add(event_pb2.Event(
                wall_time=time.time(), step=0, summary=self._config_summary(work.config)))
        for record in work.records:
            values = [summary_pb2.Summary.Value(tag=s.flat_name(0), simple_value=s.value)
                      for s in scalars(record)]
            if values:
                self._writer(work.run_id, record.rank).add(event_pb2.Event(
                    wall_time=record.time.timestamp(), step=record.step,
                    summary=summary_pb2.Summary(value=values)))
        if work.ended is not None:  # closed once flushed: a failed batch is written again
            self._ending.update(k for k in self._writers if k[0] == work.run_id)

    def _config_summary(self, config: dict):
        _, summary_pb2, tensor_pb2, tensor_shape_pb2 = self._pb
        text = "```json\n" + json.dumps(config, indent=2, sort_keys=True, default=str) + "\n```"
        tensor = tensor_pb2.TensorProto(
            dtype=7,  # DT_STRING
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
        metadata = self._text_metadata.create_summary_metadata(display_name="config", description="")
        return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="config", metadata=metadata,
                                                                    tensor=tensor)])

    def flush(self) -> None:
        try:
            for key in self._dirty:
                writer = self._writers.get(key)
                if writer is not None:
                    writer.flush()
        except BaseException:
            self._roll_back()
            raise
        self._dirty.clear()
        for key in self._ending:
            if key in self._writers:
                self._close(key)
        self._ending.clear()

    def close_idle(self, idle_seconds: float) -> None:
        now = time.monotonic()
        for key in [k for k, w in self._writers.items() if now - w.last_used > idle_seconds]:
            self._close(key)

    def _close(self, key) -> None:
        writer = self._writers.pop(key)
        try:
            writer.close()
        except BaseException:
            writer.abandon()
            raise
        finally:
            self._dirty.discard(key)

    def close(self) -> None:
        for key in list(self._writers):
            self._close(key)


class _Writer:
    """One event file; flush() returns once its events are on disk (fsynced)."""

    def __init__(self, event_file_writer, directory: Path, max_queue_size: int):
        suffix = f".trainmon-{uuid.uuid4().hex[:8]}"
        self._writer = event_file_writer(str(directory), max_queue_size=max_queue_size,
                                         flush_secs=3600, filename_suffix=suffix)
        # The writer names its file itself; find it by the suffix to fsync it.
        self.path = glob.glob(os.path.join(glob.escape(str(directory)), f"events.out.tfevents.*{suffix}"))[0]
        self.durable = os.path.getsize(self.path)  # the file's bytes as of its last flush
        self.last_used = time.monotonic()

    def add(self, event) -> None:
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            self.durable = os.fstat(fd).st_size
        finally:
            os.close(fd)

    def close(self) -> None:
        self.flush()
        self._writer.close()

    def abandon(self) -> None:
        """Stop the writer (whatever state its thread is in) and cut its file back to what
        its last flush made durable."""
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 -- its thread died of this error already
            pass
        try:
            os.truncate(self.path, self.durable)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser("tensorboard", __doc__.splitlines()[0])
    parser.add_argument("--logdir", default=os.environ.get("TRAINMON_TENSORBOARD_DIR", "tensorboard"),
                        help="event files go under LOGDIR/<run> (default: TRAINMON_TENSORBOARD_DIR "
                             "or ./tensorboard)")
    args = parser.parse_args(argv)

    def make_tracker():
        sink = TensorBoardSink(args.logdir)
        return sink, sink.logdir / STATE_DIR

    return forward(args, make_tracker)
