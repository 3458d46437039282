"""TrainingRunLogger-style API: one call per record, validated on the caller, sent behind.

    from trainmon.producer import Producer
    with Producer() as tm:              # settings from TRAINMON_* / torchrun env vars
        tm.run_start(config=cfg)
        tm.log_step(step, epoch=..., step_tokens=..., duration_ms=..., loss=..., norm=..., lr=...)
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import uuid
import weakref
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from .. import topics
from ..schemas import (AllocatorRecord, DatasetRecord, EvalRecord, GpuModelRecord, GpuRecord,
                       MoeRecord, Record, RunRecord, StepRecord)
from .config import ProducerConfig
from .surogate import ConsoleLine, JsonLogFile
from .transport import KafkaTransport, kafka_settings
from .worker import Worker

log = logging.getLogger("trainmon.producer")
UTC = timezone.utc

# kafka-python logs every refused connection at ERROR; during a broker outage that would
# flood the training job's console. trainmon reports outages itself in one line.
logging.getLogger("kafka").setLevel(os.environ.get("TRAINMON_KAFKA_LOG_LEVEL", "CRITICAL").upper())


class Producer:
    def __init__(self, config: ProducerConfig | None = None, **overrides: Any):
        self.config = config or ProducerConfig.from_env(**overrides)
        cfg = self.config
        self.rejected: dict[str, int] = {}
        self._key = topics.record_key(cfg.run_id, cfg.rank)
        self._topics = {}
        self._envelope = {"run_id": cfg.run_id, "rank": cfg.rank,
                          "world_size": cfg.world_size, "host": cfg.host}
        self._new_id_prefix()
        self._run_open = False
        observers = []
        self._log_file = JsonLogFile(cfg.log_file) if cfg.log_file else None
        if self._log_file:
            observers.append(self._log_file)
        if cfg.console and cfg.rank == 0:
            observers.append(ConsoleLine())
        settings = kafka_settings(cfg.bootstrap, cfg.kafka, linger_ms=cfg.linger_ms,
                                  batch_size=cfg.batch_size, compression=cfg.compression)
        self._worker = Worker(lambda on_undelivered: KafkaTransport(settings, on_undelivered),
                              cfg.spill_dir, f"{_safe(cfg.run_id)}.{cfg.rank}",
                              queue_size=cfg.queue_size, observers=observers,
                              max_record_bytes=settings.get("max_request_size", 1 << 20) - 1024,
                              on_reject=lambda record, reason: self._reject(record.kind, reason))
        self_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := self_ref()) and p._new_id_prefix())
        atexit.register(_close_at_exit, self_ref)

    def _new_id_prefix(self) -> None:
        # Ids are prefix + counter: unique across processes (a forked child gets its own
        # prefix) and far cheaper than a uuid per record on the training thread.
        self._id_prefix = uuid.uuid4().hex[:20]
        self._ids = itertools.count()

    # -- the generic path ------------------------------------------------------------

    def _emit(self, model: type[Record], fields: dict[str, Any]) -> bool:
        if not self.config.enabled:
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
        topic = self._topics.get(record.kind)
        if topic is None:
            topic = self._topics[record.kind] = topics.topic_for(record.kind, self.config.topic_prefix)
        key = self._key if record.run_id == self.config.run_id and record.rank == self.config.rank \
            else topics.record_key(record.run_id, record.rank)
        self._worker.submit(topic, key, record)

    def _reject(self, kind: str, exc: ValidationError | str) -> None:
        count = self.rejected.get(kind, 0)
        self.rejected[kind] = count + 1
        if count == 0:
            log.warning("trainmon: rejected a %s record (further %s rejects are only counted): %s",
                        kind, kind, exc)

    # -- Surogate / Megatron style calls ------------------------------------------------

    def log_step(self, step: int, *, epoch: float = 0.0, step_tokens: int, duration_ms: float,
                 loss: float, norm: float, lr: float, **megatron: Any) -> bool:
        return self._emit(StepRecord, dict(step=step, epoch=epoch, step_tokens=step_tokens,
                                           duration_ms=duration_ms, loss=loss, norm=norm, lr=lr,
                                           **megatron))

    def log_eval(self, step: int, *, epoch: float = 0.0, eval_tokens: int, duration_ms: float,
                 loss: float) -> bool:
        return self._emit(EvalRecord, dict(step=step, epoch=epoch, eval_tokens=eval_tokens,
                                           duration_ms=duration_ms, loss=loss))

    def log_moe_stats(self, step: int, *, aux_loss: float, z_loss: float,
                      expert_utilization: float, load_imbalance: float, **per_layer: Any) -> bool:
        return self._emit(MoeRecord, dict(step=step, aux_loss=aux_loss, z_loss=z_loss,
                                          expert_utilization=expert_utilization,
                                          load_imbalance=load_imbalance, **per_layer))

    def log_gpu_state(self, step: int, **fields: Any) -> bool:
        return self._emit(GpuRecord, dict(step=step, **fields))

    def log_allocator(self, step: int, stats: list[dict], **torch_stats: Any) -> bool:
        return self._emit(AllocatorRecord, dict(step=step, stats=stats, **torch_stats))

    def log_dataset(self, split: str, *, files: int, tokens: int, **fields: Any) -> bool:
        return self._emit(DatasetRecord, dict(split=split, files=files, tokens=tokens, **fields))

    def log_gpu_model(self, **fields: Any) -> bool:
        return self._emit(GpuModelRecord, fields)

    def run_start(self, config: dict | None = None, **fields: Any) -> bool:
        self._run_open = True
        return self._emit(RunRecord, dict(event="start", config=config or {}, **fields))

    def run_end(self, status: str = "success", **fields: Any) -> bool:
        self._run_open = False
        return self._emit(RunRecord, dict(event="end", status=status, **fields))

    # -- lifecycle -----------------------------------------------------------------

    @property
    def spilled(self) -> int:
        return self._worker.spilled

    def flush(self, timeout: float = 10.0) -> bool:
        return self._worker.flush(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        ok = self._worker.close(timeout)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return ok

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._run_open:
            self.run_end("failed" if exc_type else "success")
        self.close()


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:64]


def _close_at_exit(ref: "weakref.ref[Producer]") -> None:
    producer = ref()
    if producer is not None:
        producer.close(timeout=float(os.environ.get("TRAINMON_EXIT_FLUSH_SECONDS", "10")))
