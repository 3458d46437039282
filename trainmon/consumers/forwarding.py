"""What every forwarder does with a batch, on the consumer runtime (:mod:`.runtime`): hand
each run's new points to its experiment tracker (W&B, Aim, TensorBoard: an
:class:`ExperimentTracker`), make them durable, record progress; the runtime then commits
the offsets. :class:`ForwardingSink` is the runtime's sink; a tracker only writes.

Exactly what reaches a tracker is decided here, so the three behave the same:
- Idempotence: records of one (run, rank, kind[, GPU]) stream share a partition and
  arrive in order, so each stream's highest forwarded step (its high-water mark) tells
  which records a tracker already has. Records at or below it are skipped: a replay of
  the topics (a new consumer group, offsets reset) or a producer resend adds no point.
- Order of durability: tracker writes -> tracker flush -> progress file (atomic rename)
  -> Kafka commit. A crash anywhere re-reads records the marks then skip or re-send.
- Back-pressure: one batch at a time; the next poll waits until this one is flushed and
  committed, so a slow tracker makes consumer lag grow in Kafka, not memory here.
- A tracker failure (disk full, a locked run) never loses data: the runtime retries the
  same batch with backoff (marks and offsets stay where they were).
- A run's start record (its project and name) is on a topic of its own, so a batch can
  hold a new run's first steps without it. A tracker that fixes the project when it
  creates the run (W&B: ``start_wait_s``) gets a new run's points only once its start was
  read, or ``start_wait_s`` after its first: until then they stay in the batch, their
  offsets uncommitted (``pre_commit``), while the other runs' points go on.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from ..filenames import safe_name
from ..schemas import (DatasetRecord, GpuModelRecord, Record, RunRecord)
from ..kafka_client import TopicPartition
from . import runtime, serving
from .metric_names import STEP_KINDS, stream_key
from .stream import Message

log = logging.getLogger("trainmon.forwarders")

# Kinds a forwarder reads; alerts are not mirrored (they are their own consumer's output).
FORWARDED_KINDS = (*STEP_KINDS, "run", "gpu_model", "dataset")


class MissingDependency(RuntimeError):
    """An optional library a forwarder needs is not installed."""


def require(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingDependency(
            f"trainmon: the {extra} forwarder needs {module!r}, which is not installed: "
            f"pip install 'trainmon[{extra}]'") from exc


# -- progress: what each run has already received -------------------------------------

@dataclass
class RunProgress:
    run_id: str
    high_water: dict[str, int] = field(default_factory=dict)  # stream key -> highest step
    config: dict[str, Any] = field(default_factory=dict)  # the config last synced
    ended: str | None = None  # run end status, once forwarded
    sink: dict[str, Any] = field(default_factory=dict)  # sink-specific, e.g. the Aim run hash


class ProgressStore:
    """One JSON file per trainmon run under ``root``, replaced atomically."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._cache: dict[str, RunProgress] = {}

    def _path(self, run_id: str) -> Path:
        return self.root / f"{safe_name(run_id)}.json"

    def get(self, run_id: str) -> RunProgress:
        progress = self._cache.get(run_id)
        if progress is None:
            path = self._path(run_id)
            if path.exists():
                data = json.loads(path.read_text())
                progress = RunProgress(**{k: data[k] for k in data if k in RunProgress.__dataclass_fields__})
            else:
                progress = RunProgress(run_id)
            self._cache[run_id] = progress
        return progress

    def forget(self, run_id: str) -> None:
        """Let go of a run's cached progress (its file keeps it; ``get`` reads it again)."""
        self._cache.pop(run_id, None)

    def save(self, progress: RunProgress) -> None:
        path = self._path(progress.run_id)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            # dumps, not dump: dump writes with json's Python encoder, whose closures refer
            # to each other, a reference cycle per call left for the cyclic collector (which
            # the services run rarely, see gc_tuning.py); dumps takes the C encoder.
            f.write(json.dumps(progress.__dict__, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._cache[progress.run_id] = progress


# -- what one batch asks of a sink --------------------------------------------------------

@dataclass
class RunWork:
    """A run's share of one batch, already filtered against its progress."""
    run_id: str
    progress: RunProgress  # the progress as it will be once this work is durable
    records: list[Record] = field(default_factory=list)  # new step-carrying records, by (step, rank)
    config: dict[str, Any] | None = None  # the whole config, when it changed
    start: RunRecord | None = None  # the run start record, for names and project
    ended: str | None = None  # end status, when the run ended in this batch
    skipped: int = 0  # records of this batch the run already has
    left_out: int = 0  # points of ranks the forwarder does not mirror (--ranks)

    @property
    def started(self) -> bool:
        """Whether the run's start record was read (config_updates put it under "trainmon")."""
        return "trainmon" in self.progress.config

    @property
    def started_as(self) -> dict[str, Any]:
        """The run start's own fields (run_id, project, name, ...): from this batch's start
        record or one read before, by an earlier batch or by this forwarder before a
        restart (kept in the progress), so a tracker that makes the run again later (W&B,
        after finishing it) names it as the start did. {} before the start was read."""
        return self.progress.config.get("trainmon") or {}

    @property
    def empty(self) -> bool:
        return not self.records and self.config is None and self.ended is None


class ExperimentTracker(Protocol):
    """Where a forwarder mirrors runs: W&B, Aim, TensorBoard (WandbSink, AimSink,
    TensorBoardSink). Not a runtime Sink: :class:`ForwardingSink` is that, and hands each
    tracker only the points it does not have yet."""

    name: str  # also names the command (trainmon consume NAME) and the group (trainmon-NAME)
    # Optional: how long a new run's points may wait for its start record (absent or 0:
    # not at all), for a tracker that cannot change a run's project once it made the run.
    start_wait_s: float

    def write(self, work: RunWork) -> None: ...

    def flush(self) -> None:
        """Return once everything written so far survives a crash of this process."""

    def close_idle(self, idle_seconds: float) -> None: ...

    def close(self) -> None: ...


def config_updates(record: Record) -> dict[str, Any]:
    """What a non-metric record adds to the run's config (synced to W&B config, Aim params,
    a TensorBoard text summary)."""
    if isinstance(record, RunRecord):
        info = {"run_id": record.run_id, "world_size": record.world_size}
        info.update({k: v for k, v in (("hostnames", record.hostnames), ("versions", record.versions),
                                       ("name", record.name), ("project", record.project)) if v})
        return {**record.config, "trainmon": info}
    if isinstance(record, GpuModelRecord):
        key = "gpu" if (record.rank, record.id) == (0, 0) else f"gpu-{record.rank}-{record.id}"
        return {key: record.model_dump(mode="json", exclude={"run_id", "time", "event_id",
                                                              "schema_version", "world_size"})}
    if isinstance(record, DatasetRecord):
        return {"dataset": {record.split: record.model_dump(
            mode="json", include={"files", "tokens", "file_index", "chunk_index", "seed"})}}
    return {}


def _merge(base: dict, updates: dict) -> dict:
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def plan(messages: list[Message], store: ProgressStore,
         ranks: frozenset[int] | None = None) -> dict[str, RunWork]:
    """Split a batch by run and drop what each run already has (counted in each
    ``RunWork.skipped``) and the points of ranks not in ``ranks`` (None: every rank;
    counted in ``RunWork.left_out``)."""
    works: dict[str, RunWork] = {}
    for message in messages:
        record = message.record
        work = works.get(record.run_id)
        if work is None:
            work = works[record.run_id] = RunWork(record.run_id, copy.deepcopy(store.get(record.run_id)))
        progress = work.progress
        if record.kind in STEP_KINDS:
            if ranks is not None and record.rank not in ranks:
                work.left_out += 1
                continue
            key = stream_key(record)
            if record.step <= progress.high_water.get(key, -1):
                work.skipped += 1
                continue
            progress.high_water[key] = record.step
            work.records.append(record)
            continue
        if isinstance(record, RunRecord) and record.event == "end":
            if progress.ended == record.status:
                work.skipped += 1
            else:
                progress.ended = work.ended = record.status
            continue
        if isinstance(record, RunRecord):
            work.start = record
        merged = _merge(progress.config, config_updates(record))
        if merged != progress.config:
            progress.config = work.config = merged
        else:
            work.skipped += 1
    for work in works.values():
        work.records.sort(key=lambda r: (r.step, r.rank))
    return works


# -- the sink the runtime drives ---------------------------------------------------------

@dataclass
class ForwarderStats:
    batches: int = 0
    records: int = 0
    skipped: int = 0
    left_out: int = 0
    retries: int = 0
    seconds_in_sink: float = 0.0


class ForwardingSink(runtime.Sink):
    """Batches records for an experiment tracker (W&B, Aim, TensorBoard): a batch goes out
    when it holds ``batch_records`` or its first record waited ``linger_ms``. A failed write
    is retried by the runtime with the same batch (planned again against the progress, which
    only moves once a batch is durable). A new run's points that wait for its start record
    (see the module docstring) stay at the front of the batch."""

    kinds = FORWARDED_KINDS

    def __init__(self, target: ExperimentTracker, store: ProgressStore, *, batch_records: int = 5000,
                 linger_ms: int = 500, idle_close_seconds: float = 600.0, ranks: frozenset[int] | None = None):
        self.target = target
        self.ranks = ranks  # the ranks whose points are mirrored (None: every rank)
        self.name = f"{target.name} forwarder"
        self.group = default_group(target.name)
        self.store = store
        self.batch_records = batch_records
        self.linger_s = linger_ms / 1000
        self.idle_close_seconds = idle_close_seconds
        self.start_wait_s = getattr(target, "start_wait_s", 0.0)
        self.stats = ForwarderStats()
        self._batch: list[Message] = []
        self._held = 0  # the batch's first records: those of runs waiting for their start
        self._waiting: dict[str, float] = {}  # run id -> until when its points wait
        self._seen: dict[str, float] = {}  # run id -> when a batch last had its records
        self._first_at = 0.0  # when the first record after the held ones came
        # A batch the tracker made durable whose progress is not saved yet (a failed save):
        # (written works, ready works, waiting runs, its number of messages).
        self._durable: tuple[list[RunWork], list[RunWork], set[str], int] | None = None

    def put(self, messages: list[Message]) -> None:
        if len(self._batch) == self._held:
            self._first_at = time.monotonic()
        self._batch.extend(messages)

    def flush_in_s(self) -> float | None:
        now = time.monotonic()
        due = []
        if len(self._batch) > self._held:
            if len(self._batch) >= self.batch_records:
                return 0.0
            due.append(self.linger_s - (now - self._first_at))
        if self._held:
            due.append(min(self._waiting.values()) - now)
        return max(0.0, min(due)) if due else None

    def room(self) -> int:
        return self.batch_records - len(self._batch)  # held records count: they wait in Kafka

    def tick(self) -> None:
        self.target.close_idle(self.idle_close_seconds)
        # The progress of a run idle that long goes too (memory would grow with every run
        # the forwarder ever served); it is read from its file if the run comes back.
        now = time.monotonic()
        for run_id in [r for r, seen in self._seen.items() if now - seen > self.idle_close_seconds]:
            del self._seen[run_id]
            self.store.forget(run_id)

    def flush(self) -> None:
        if self._durable is None:  # (else: a batch the tracker has, whose progress failed to save)
            if not self._batch:
                return
            works = plan(self._batch, self.store, self.ranks)
            waiting = self._waiting_for_start(works)
            ready = [work for run_id, work in works.items() if run_id not in waiting]
            written = [work for work in ready if not work.empty]
            started = time.monotonic()
            try:
                for work in written:
                    self.target.write(work)
                self.target.flush()
            except Exception as exc:  # disk full, a locked run ...: the same batch later
                self.stats.retries += 1
                log.exception("trainmon: %s failed to write a batch", self.name)
                raise runtime.RetriableError(f"{type(exc).__name__}: {exc}") from exc
            finally:
                self.stats.seconds_in_sink += time.monotonic() - started
            self._durable = (written, ready, waiting, len(self._batch))
        written, ready, waiting, planned = self._durable
        try:
            for work in written:  # (again, after a failure: a save is idempotent)
                self.store.save(work.progress)
        except OSError as exc:  # the disk the tracker's files share: saved on the retry, not sent again
            self.stats.retries += 1
            log.exception("trainmon: %s failed to save its progress", self.name)
            raise runtime.RetriableError(f"progress: {type(exc).__name__}: {exc}") from exc
        self._durable = None
        now = time.monotonic()
        for run_id in (*(work.run_id for work in ready), *waiting):
            self._seen[run_id] = now
        held = [m for m in self._batch[:planned] if m.record.run_id in waiting] if waiting else []
        self.stats.batches += 1
        self.stats.records += planned - len(held)
        self.stats.skipped += sum(work.skipped for work in ready)
        self.stats.left_out += sum(work.left_out for work in ready)
        self._batch, self._held = held + self._batch[planned:], len(held)

    def pre_commit(self, positions: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Up to each partition's first held record; all of it where none is held."""
        first_held: dict[TopicPartition, int] = {}
        for message in self._batch[:self._held]:
            tp = TopicPartition(message.topic, message.partition)
            first_held[tp] = min(first_held.get(tp, message.offset), message.offset)
        return {tp: min(position, first_held.get(tp, position)) for tp, position in positions.items()}

    def _waiting_for_start(self, works: dict[str, RunWork]) -> set[str]:
        """The runs whose points wait for their start record: never forwarded before, no
        start read yet, and first seen less than ``start_wait_s`` ago."""
        if not self.start_wait_s:
            return set()
        now, waiting = time.monotonic(), set()
        for run_id, work in works.items():
            before = self.store.get(run_id)
            if work.started or before.high_water or before.config or before.ended:  # forwarded before
                self._waiting.pop(run_id, None)
                continue
            until = self._waiting.setdefault(run_id, now + self.start_wait_s)
            if now < until:
                waiting.add(run_id)
            else:
                log.warning("trainmon: %s: no start record of run %r within %.0f s of its first "
                            "points; forwarding them without its project and name",
                            self.name, run_id, self.start_wait_s)
                del self._waiting[run_id]
        return waiting

    def stop(self) -> None:
        self.target.close()


# -- the command line shared by the three forwarders ---------------------------------------

def parse_ranks(text: str) -> frozenset[int] | None:
    """``all`` -> None (every rank); ``0,3,8-15`` -> those ranks. ValueError naming what
    is wrong (argparse shows it as the option's error)."""
    if text.strip().lower() == "all":
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"ranks {text!r}: {part.strip()!r} is not a rank or a range like 0-7") from None
        if low < 0 or high < low:
            raise ValueError(f"ranks {text!r}: {part.strip()!r} is not a range of ranks from 0")
        ranks.update(range(low, high + 1))
    return frozenset(ranks)


def _ranks_option(text: str) -> frozenset[int] | None:
    try:
        return parse_ranks(text)
    except ValueError as exc:  # (argparse shows an ArgumentTypeError's own words)
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_group(tracker_name: str) -> str:
    return f"trainmon-{tracker_name}"


def arg_parser(tracker_name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"trainmon consume {tracker_name}", description=description)
    parser.add_argument("--group", default=default_group(tracker_name),
                        help="Kafka consumer group (default: %(default)s)")
    parser.add_argument("--topic-prefix", default=None, help="default: TRAINMON_TOPIC_PREFIX or 'trainmon.'")
    parser.add_argument("--batch-records", type=int, default=5000,
                        help="records per batch, the unit of write + commit (default: %(default)s)")
    parser.add_argument("--linger-ms", type=int, default=500,
                        help="how long to wait to fill a batch (default: %(default)s)")
    parser.add_argument("--idle-close-seconds", type=float, default=600.0,
                        help="close a run's handle after this long without records (default: %(default)s)")
    parser.add_argument("--ranks", type=_ranks_option, default=os.environ.get("TRAINMON_FORWARD_RANKS", "all"),
                        help="the ranks whose points are mirrored: all, or a list like 0 or 0-7,12 "
                             "(default: TRAINMON_FORWARD_RANKS or all; a run of thousands of ranks "
                             "is one chart per rank and metric: mirror rank 0, as HF and Megatron log "
                             "to W&B)")
    serving.add_exit_when_idle_argument(parser)
    serving.add_metrics_arguments(parser)
    return parser


def forward(args: argparse.Namespace, make_tracker: Callable[[], tuple[ExperimentTracker, Path]]) -> int:
    """Build the tracker, forward to it until SIGTERM / SIGINT (or idle, with
    --exit-when-idle), close cleanly."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tracker, state_dir = make_tracker()
    except MissingDependency as exc:
        print(exc, file=sys.stderr)
        return 2
    sink = ForwardingSink(tracker, ProgressStore(state_dir), batch_records=args.batch_records,
                          linger_ms=args.linger_ms, idle_close_seconds=args.idle_close_seconds,
                          ranks=args.ranks)
    serving.serve(sink, group=args.group, topic_prefix=args.topic_prefix, stop=runtime.stop_on_signals(),
                  exit_when_idle_s=args.exit_when_idle_s, **serving.metrics_options(args))
    log.info("trainmon: %s stopped: %s", sink.name, sink.stats)
    return 0
