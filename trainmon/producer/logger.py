"""TrainingRunLogger-style API: one call per record, checked on the caller, sent behind.

    from trainmon.producer import Producer
    with Producer() as tm:              # settings from TRAINMON_* / torchrun env vars
        tm.run_start(config=cfg)
        tm.log_step(step, epoch=..., step_tokens=..., duration_ms=..., loss=..., norm=..., lr=...)

Only ``step`` and ``loss`` are required; a value not passed is "not logged" (None).

A log call never raises in the default mode: whatever is wrong with it (a bad value, a
missing or unknown argument, an envelope field such as ``host=`` passed as an argument,
an integer beyond Int64) rejects that one record, counts it in ``producer.rejected`` and
logs one warning per record kind naming what was wrong. ``TRAINMON_STRICT=1`` raises
instead (pydantic's ``ValidationError``, or ``TypeError`` for a bad call).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import time
import traceback
import uuid
import weakref
from datetime import datetime, timezone
from typing import Any, Callable

from pydantic import ValidationError

from .. import topics
from ..filenames import safe_name
from ..schemas import (AllocatorRecord, CheckpointRecord, DatasetRecord, DiskRecord, EvalRecord,
                       GpuHealthRecord, GpuModelRecord, GpuRecord, LogEventRecord, MoeRecord,
                       ProducerHealthRecord, Record, RunRecord, StepRecord)
from .config import ProducerConfig
from .deferred import EARLIEST_TIME, LATEST_TIME, checked_values, queued
from .disk import DiskSampler
from .health import HealthReporter, health_fields
from .surogate import ConsoleLine, JsonLogFile
from ..kafka_client.transport import Transport, TransportSettings, Undelivered
from ..kafka_client.transport_choice import make_transport
from .worker import Worker

log = logging.getLogger("trainmon.producer")
UTC = timezone.utc

# The envelope's fields are filled in by the producer; passed to a log call they are refused.
ENVELOPE_FIELDS = frozenset(Record.model_fields)
MAX_REASON_CHARS = 4096  # a run end's reason beyond this is cut (a traceback line can be huge)
MAX_EVENT_TEXT_CHARS = 2000  # a log event's text beyond this is cut (LogEventRecord.text)


class _Missing:
    """Default of a required argument: left out of the record, so the schema reports the
    field as missing instead of Python raising TypeError on the training thread."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


def _never_raises(kind: str):
    """In the default mode a log call that cannot even be made (wrong positional
    arguments, an argument given twice) is a rejected record, not an exception."""

    def wrap(method):
        @functools.wraps(method)
        def call(self: "Producer", *args: Any, **fields: Any) -> bool:
            try:
                return method(self, *args, **fields)
            except Exception as exc:
                if self.config.strict:
                    raise
                self._reject(kind, f"{method.__name__}(): {type(exc).__name__}: {exc}")
                return False
        return call
    return wrap


class Producer:
    def __init__(self, config: ProducerConfig | None = None, *,
                 transport: Callable[[Undelivered], Transport] | None = None, **overrides: Any):
        """``transport``: makes the way to Kafka from the callback for what it gives up on
        (default: the client ``config.client`` names; tests pass a MemoryBroker's)."""
        self.config = config or ProducerConfig.from_env(**overrides)
        cfg = self.config
        self.rejected: dict[str, int] = {}
        # Why every log call is refused (a run_id over the schema's limit), or None.
        self.disabled_reason: str | None = _envelope_problem(cfg)
        if self.disabled_reason is not None:
            if cfg.strict:
                raise ValueError(self.disabled_reason)
            log.error("%s", self.disabled_reason)
        self._key = topics.record_key(cfg.run_id)
        self._topics = {}
        self._envelope = {"run_id": cfg.run_id, "rank": cfg.rank,
                          "world_size": cfg.world_size, "host": cfg.host}
        self._envelope_items = tuple(self._envelope.items())  # (see deferred.queued)
        self._new_id_prefix()
        self._run_open = False
        observers = []
        self._log_file = JsonLogFile(cfg.log_file) if cfg.log_file else None
        if self._log_file:
            observers.append(self._log_file)
        if cfg.console and cfg.rank == 0:
            observers.append(ConsoleLine())
        # The worker packs the records it finds queued; the client then sends at once.
        settings = TransportSettings(cfg.bootstrap, cfg.kafka, linger_ms=0,
                                     batch_bytes=cfg.batch_size, max_message_bytes=cfg.max_message_bytes,
                                     compression=cfg.kafka_compression())
        if transport is None:
            def transport(on_undelivered: Undelivered) -> Transport:
                return make_transport(cfg.client, settings, on_undelivered, relay=cfg.relay)
        self._worker = Worker(transport,
                              cfg.spill_dir, f"{safe_name(cfg.run_id)}.{cfg.rank}",
                              queue_size=cfg.queue_size, yield_to_caller=cfg.yield_to_caller,
                              linger_s=cfg.linger_ms / 1000, pack_window_s=cfg.pack_window_ms / 1000,
                              observers=observers,
                              max_record_bytes=cfg.max_message_bytes - 1024,
                              on_reject=lambda record, reason: self._reject(record.kind, reason))
        self_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := self_ref()) and p._new_id_prefix())
        atexit.register(_close_at_exit, self_ref)
        self._last_step = 0  # the latest step logged, for the disk records
        self._disk: DiskSampler | None = None
        if (cfg.checkpoint_dir and cfg.disk_interval_s > 0 and cfg.local_rank == 0
                and cfg.enabled and self.disabled_reason is None):
            self._disk = DiskSampler(
                lambda fields: (p := self_ref()) is not None and p._emit(DiskRecord, fields),
                cfg.checkpoint_dir, cfg.disk_interval_s,
                step=lambda: getattr(self_ref(), "_last_step", 0)).start()
        self._health: HealthReporter | None = None
        if cfg.health_interval_s > 0 and cfg.enabled and self.disabled_reason is None:
            self._health = HealthReporter(lambda: (p := self_ref()) is not None and p.report_health(),
                                          cfg.health_interval_s).start()

    def _new_id_prefix(self) -> None:
        # Ids are prefix + counter: unique across processes (a forked child gets its own
        # prefix) and far cheaper than a uuid per record on the training thread. An id
        # needs to be unique among one rank's records of one run (ClickHouse's key is
        # run, rank, [step,] event_id): 48 random bits make two producers of one rank
        # drawing the same prefix a chance of ~n^2 / 2^49 in n restarts. Each id's random
        # part is incompressible on the broker's disk: 20 hex digits cost ~5 bytes a
        # record more there (docs/deploy.md, "Retention and compression").
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()

    # -- the generic path ------------------------------------------------------------

    def _emit(self, model: type[Record], fields: dict[str, Any]) -> bool:
        if not self.config.enabled:
            return False
        if self.disabled_reason is not None:  # said once, loudly, when the producer was made
            self.rejected[model.kind] = self.rejected.get(model.kind, 0) + 1
            return False
        now = time.time()
        if EARLIEST_TIME <= now < LATEST_TIME and (values := checked_values(model, fields)) is not None:
            # Valid for certain: written without building the record (see deferred.py).
            self._worker.submit(self._topic(model.kind), self._key, queued(
                model, self._envelope_items, now, self._id_prefix, next(self._ids), values))
            return True
        if not ENVELOPE_FIELDS.isdisjoint(fields):  # (isdisjoint: the cheap test, per call)
            clash = ENVELOPE_FIELDS.intersection(fields)
            problem = (f"{', '.join(sorted(clash))}: set by the producer for every record "
                       f"(envelope), not an argument of a log call")
            if self.config.strict:
                raise TypeError(problem)
            self._reject(model.kind, problem)
            return False
        missing = [k for k, v in fields.items() if v is MISSING]
        if missing:
            # The call's required arguments, even where the schema lets a record go without
            # them (a log may print no loss; a training loop always has one).
            problem = f"{', '.join(missing)}: Field required (an argument of this call)"
            if self.config.strict:
                raise TypeError(problem)
            self._reject(model.kind, problem)
            return False
        try:
            record = model(**self._envelope, time=datetime.now(UTC),
                           event_id=f"{self._id_prefix}-{next(self._ids)}", **fields)
        except ValidationError as exc:
            if self.config.strict:
                raise
            self._reject(model.kind, exc)
            return False
        self.send_record(record)
        return True

    def send_record(self, record: Record) -> None:
        """Queue an already built record (its own envelope kept), e.g. an alert."""
        key = self._key if record.run_id == self.config.run_id else topics.record_key(record.run_id)
        self._worker.submit(self._topic(record.kind), key, record)

    def _topic(self, kind: str) -> str:
        topic = self._topics.get(kind)
        if topic is None:
            topic = self._topics[kind] = topics.topic_for(kind, self.config.topic_prefix)
        return topic

    def _reject(self, kind: str, exc: ValidationError | str) -> None:
        count = self.rejected.get(kind, 0)
        self.rejected[kind] = count + 1
        if count == 0:
            log.warning("trainmon: rejected a %s record (further %s rejects are only counted): %s",
                        kind, kind, exc)

    # -- Surogate / Megatron style calls ------------------------------------------------

    # Required arguments default to MISSING (reported by the schema as a missing field);
    # the others to None, "not logged". Each returns True when the record was queued.

    @_never_raises("step")
    def log_step(self, step: int = MISSING, *, epoch: float | None = None,
                 step_tokens: int | None = None, duration_ms: float | None = None,
                 loss: float = MISSING, norm: float | None = None, lr: float | None = None,
                 **megatron: Any) -> bool:
        ok = self._emit(StepRecord, dict(step=step, epoch=epoch, step_tokens=step_tokens,
                                         duration_ms=duration_ms, loss=loss, norm=norm, lr=lr,
                                         **megatron))
        if ok:
            self._last_step = step
        return ok

    @_never_raises("eval")
    def log_eval(self, step: int = MISSING, *, epoch: float | None = None,
                 eval_tokens: int | None = None, duration_ms: float | None = None,
                 loss: float = MISSING) -> bool:
        return self._emit(EvalRecord, dict(step=step, epoch=epoch, eval_tokens=eval_tokens,
                                           duration_ms=duration_ms, loss=loss))

    @_never_raises("moe")
    def log_moe_stats(self, step: int = MISSING, *, aux_loss: float = MISSING,
                      z_loss: float = MISSING, expert_utilization: float = MISSING,
                      load_imbalance: float = MISSING, **per_layer: Any) -> bool:
        return self._emit(MoeRecord, dict(step=step, aux_loss=aux_loss, z_loss=z_loss,
                                          expert_utilization=expert_utilization,
                                          load_imbalance=load_imbalance, **per_layer))

    @_never_raises("gpu")
    def log_gpu_state(self, step: int = MISSING, **fields: Any) -> bool:
        return self._emit(GpuRecord, dict(step=step, **fields))

    @_never_raises("gpu_health")
    def log_gpu_health(self, step: int = MISSING, **fields: Any) -> bool:
        """GPU error counters (see GpuHealthRecord; GpuSampler sends them from NVML)."""
        return self._emit(GpuHealthRecord, dict(step=step, **fields))

    @_never_raises("checkpoint")
    def log_checkpoint(self, step: int = MISSING, *, path: str | None = None,
                       bytes: int | None = None, duration_ms: float | None = None,
                       **fields: Any) -> bool:
        """A finished checkpoint save: ``log_checkpoint(step, path=, bytes=, duration_ms=)``,
        optionally ``free_bytes=`` / ``total_bytes=`` of its filesystem. With
        TRAINMON_CHECKPOINT_DIR set, a disk record follows from the disk thread."""
        ok = self._emit(CheckpointRecord, dict(step=step, path=path, bytes=bytes,
                                               duration_ms=duration_ms, **fields))
        if ok and self._disk is not None:
            self._disk.nudge(step)
        return ok

    @_never_raises("disk")
    def log_disk(self, step: int | None = None, *, path: str = MISSING, free_bytes: int = MISSING,
                 total_bytes: int = MISSING, used_bytes: int = MISSING) -> bool:
        """Free space of a filesystem (the disk thread sends these by itself); ``step``
        defaults to the latest step logged."""
        return self._emit(DiskRecord, dict(step=self._last_step if step is None else step,
                                           path=path, free_bytes=free_bytes,
                                           total_bytes=total_bytes, used_bytes=used_bytes))

    @_never_raises("log_event")
    def log_event(self, level: str = MISSING, source: str = MISSING, text: str = MISSING, *,
                  count: int = 1, signature: str | None = None, **fields: Any) -> bool:
        """A warning or error worth keeping (``level`` "warning" / "error", ``source``
        "nccl", "cuda", "python", ...); ``text`` is cut to MAX_EVENT_TEXT_CHARS and is the
        signature when none is given."""
        if isinstance(text, str) and len(text) > MAX_EVENT_TEXT_CHARS:
            text = text[:MAX_EVENT_TEXT_CHARS - 3] + "..."
        if signature is None and isinstance(text, str):
            signature = text[:500]
        return self._emit(LogEventRecord, dict(level=level, source=source, text=text,
                                               count=count, signature=signature, **fields))

    @_never_raises("allocator")
    def log_allocator(self, step: int = MISSING, stats: list[dict] = MISSING, **torch_stats: Any) -> bool:
        return self._emit(AllocatorRecord, dict(step=step, stats=stats, **torch_stats))

    @_never_raises("dataset")
    def log_dataset(self, split: str = MISSING, *, files: int = MISSING, tokens: int = MISSING,
                    **fields: Any) -> bool:
        return self._emit(DatasetRecord, dict(split=split, files=files, tokens=tokens, **fields))

    @_never_raises("gpu_model")
    def log_gpu_model(self, **fields: Any) -> bool:
        return self._emit(GpuModelRecord, fields)

    @_never_raises("run")
    def run_start(self, config: dict | None = None, **fields: Any) -> bool:
        self._run_open = True
        if self.config.job_id and "job_id" not in fields:
            fields["job_id"] = self.config.job_id
        return self._emit(RunRecord, dict(event="start", config=config or {}, **fields))

    @_never_raises("run")
    def run_end(self, status: str = "success", reason: str | None = None, **fields: Any) -> bool:
        """``reason``: why the run ended ("CUDA out of memory", the last line of a
        traceback); cut to MAX_REASON_CHARS characters."""
        self._run_open = False
        if isinstance(reason, str) and len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS - 3] + "..."
        return self._emit(RunRecord, dict(event="end", status=status, reason=reason, **fields))

    # -- lifecycle -----------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Records logged and not yet taken by the sender thread (for callers that may
        wait, like ``trainmon ingest``; a training loop never needs to)."""
        return self._worker.queued

    @property
    def dropped(self) -> int:
        """Records lost: Kafka did not take them, the spill directory could not, and
        memory was at its bound (or the process exited)."""
        return self._worker.dropped

    @property
    def spilled(self) -> int:
        """Records waiting in the spill file for Kafka."""
        return self._worker.spilled

    @property
    def held_in_memory(self) -> int:
        """Records waiting in memory for Kafka, because the spill file cannot be written."""
        return self._worker.held_in_memory

    @_never_raises("producer_health")
    def report_health(self) -> bool:
        """Log a producer_health record now: what waits for Kafka and where, what was lost
        (the health thread calls this every TRAINMON_PRODUCER_HEALTH_INTERVAL_S)."""
        return self._emit(ProducerHealthRecord, health_fields(self._worker, self._last_step,
                                                              sum(self.rejected.values())))

    def flush(self, timeout: float = 10.0) -> bool:
        return self._worker.flush(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        if self._disk is not None:
            self._disk.stop()
            self._disk = None
        if self._health is not None:
            health, self._health = self._health, None
            health.stop()
            if health.sent:  # a run long enough to report: its last word, before the final flush
                self.report_health()
        ok = self._worker.close(timeout)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return ok

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._run_open:
            if exc_type is None:
                self.run_end("success")
            else:  # the reason: the traceback's last line, "torch.OutOfMemoryError: CUDA out of ..."
                self.run_end("failed", reason="".join(
                    traceback.format_exception_only(exc_type, exc)).strip() or exc_type.__name__)
        self.close()


def _envelope_problem(cfg: ProducerConfig) -> str | None:
    """Why no record of this producer could pass the schema (checked once, at creation,
    instead of rejecting every record for it), or None."""
    limits = Record.model_fields["run_id"].metadata
    max_len = next((m.max_length for m in limits if getattr(m, "max_length", None)), None)
    if max_len is not None and len(cfg.run_id) > max_len:
        return (f"trainmon: the run id is {len(cfg.run_id)} characters long, over the limit of "
                f"{max_len} (TRAINMON_RUN_ID, TORCHELASTIC_RUN_ID or SLURM_JOB_ID); this producer "
                f"is disabled and logs nothing: set TRAINMON_RUN_ID to a shorter id")
    envelope = {"run_id": cfg.run_id, "rank": cfg.rank, "world_size": cfg.world_size,
                "host": cfg.host}
    try:
        Record.model_validate({**envelope, "time": datetime.now(UTC), "event_id": "probe"})
    except ValidationError as exc:
        # Only what the configuration sets counts here; the records' own checks do the rest.
        errors = [e for e in exc.errors(include_url=False) if e["loc"] and e["loc"][0] in envelope]
        if errors:
            what = "; ".join(f"{e['loc'][0]}={envelope[e['loc'][0]]!r}: {e['msg']}" for e in errors)
            return f"trainmon: this producer is disabled and logs nothing: {what}"
    return None


def _close_at_exit(ref: "weakref.ref[Producer]") -> None:
    producer = ref()
    if producer is not None:
        producer.close(timeout=float(os.environ.get("TRAINMON_EXIT_FLUSH_SECONDS", "10")))
