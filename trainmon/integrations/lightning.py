"""PyTorch Lightning, one line: ``Trainer(..., logger=TrainmonLogger())`` (or beside other
loggers: ``logger=[TrainmonLogger(), CSVLogger(...)]``).

Lightning hands every logger a flat dict of metric names per step; the usual names map
onto trainmon records:

- a training loss (``train_loss``, ``train/loss``, ``loss``, with Lightning's ``_step``
  suffix) makes a step record, with ``lr`` / ``lr-<Optimizer>`` (LearningRateMonitor),
  ``grad_norm`` / ``grad_2.0_norm_total`` (``lightning.pytorch.utilities.grad_norm``),
  ``epoch``, other ``*loss`` names into ``losses``; step time is the wall time since the
  previous step logged over the steps in between;
- a validation loss (``val_loss``, ``val/loss``, ``validation_loss``, ``valid_loss``)
  makes an eval record;
- ``log_hyperparams`` is the run start (its config), ``finalize`` the run end (Lightning's
  status "success", "failed" or "aborted"), ``after_save_checkpoint`` a checkpoint record;
- on a GPU, as W&B's system metrics: the gpu_model record, NVML's gpu and gpu_health
  records on their own thread, and an allocator record (torch.cuda's counters) with each
  step record (gpu_telemetry.py).

Other metrics (accuracy, perplexity, ...) have no trainmon field and are not sent. Every
rank logs its own records; a failure in here is logged, never raised into training.
"""

from __future__ import annotations

import math
import re
import time
from argparse import Namespace
from typing import Any

from lightning.pytorch.loggers.logger import Logger

from ..producer import Producer
from .framework import ProducerOwner, plain
from .gpu_telemetry import GpuTelemetry


TRAIN_LOSS = ("train_loss", "train/loss", "loss", "training_loss")
VAL_LOSS = ("val_loss", "val/loss", "validation_loss", "valid_loss", "validation/loss")
GRAD_NORM = ("grad_norm", "grad_2.0_norm_total", "train/grad_norm")
_LR = re.compile(r"^(?:lr|learning_rate|train/lr|lr-[\w.]+?)(?:/pg1)?$")


def _metric(metrics: dict[str, float], names: tuple[str, ...], suffix: str = "") -> float | None:
    """The first of ``names`` logged, as it is or with Lightning's ``suffix`` ("_step" for
    a value logged every step; "_epoch" for one aggregated over an epoch)."""
    for name in names:
        for key in (name, name + suffix) if suffix else (name,):
            value = metrics.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


class TrainmonLogger(ProducerOwner, Logger):
    def __init__(self, producer: Producer | None = None, **producer_settings: Any):
        super().__init__()
        self._use_producer(producer, producer_settings)
        self._started = False
        self._last: tuple[float, int] | None = None
        self._lr: float | None = None
        self._gpu: GpuTelemetry | None = None

    @property
    def name(self) -> str:
        return "trainmon"

    @property
    def version(self) -> str:
        return self.producer.config.run_id

    # -- Lightning's logger interface ---------------------------------------------------

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        def start():
            config = vars(params) if isinstance(params, Namespace) else dict(params or {})
            self._begin({k: plain(v) for k, v in config.items()})
        self._guard("log_hyperparams", start)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._guard("log_metrics", lambda: self._log(metrics, step))

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        def saved():
            path = getattr(checkpoint_callback, "last_model_path", "") or \
                getattr(checkpoint_callback, "best_model_path", "")
            step = self._last[1] if self._last else 0
            self.producer.log_checkpoint(step, path=path or None)
        self._guard("after_save_checkpoint", saved)

    def save(self) -> None:
        """Nothing to do: the producer sends in the background. Lightning calls ``save()``
        after every ``log_metrics``; a flush here would make each logged step wait for
        Kafka (up to 11 s when it is down). ``finalize`` flushes once, at the end."""

    def finalize(self, status: str) -> None:
        def end():
            if self._gpu is not None:
                self._gpu.stop()
            if not self._started:
                self.producer.run_start(config={})
            self.producer.run_end({"success": "success", "failed": "failed"}.get(status, "aborted"))
            self.producer.flush(10.0)
            self._started = False
        self._guard("finalize", end)

    # -- helpers ------------------------------------------------------------------------

    def _begin(self, config: dict[str, Any]) -> None:
        self.producer.run_start(config=config)
        self._started = True
        if self._gpu is None:
            self._gpu = GpuTelemetry(self.producer)
        self._guard("GPU telemetry", self._gpu.start)

    def _log(self, metrics: dict[str, float], step: int | None) -> None:
        step = int(step or 0)
        # LearningRateMonitor logs the lr in a call of its own, before the step's metrics.
        lr = next((float(v) for k, v in metrics.items() if _LR.match(k)), None)
        if lr is not None:
            self._lr = lr
        epoch = _metric(metrics, ("epoch",))
        val_loss = _metric(metrics, VAL_LOSS, "_epoch")
        if val_loss is not None:
            self.producer.log_eval(step, loss=val_loss, epoch=epoch)
        loss = _metric(metrics, TRAIN_LOSS, "_step")  # an epoch's mean is no step's loss
        if loss is None:
            return
        fields: dict[str, Any] = {"loss": loss, "epoch": epoch, "norm": _metric(metrics, GRAD_NORM, "_step")}
        fields["lr"] = self._lr
        losses = {k: float(v) for k, v in metrics.items() if "loss" in k and not k.startswith("val")
                  and not k.endswith("_epoch")
                  and not any(k.startswith(name) for name in TRAIN_LOSS)
                  and isinstance(v, (int, float)) and math.isfinite(v)}
        if losses:
            fields["losses"] = losses
        now = time.monotonic()
        if self._last is not None and step > self._last[1]:
            fields["duration_ms"] = (now - self._last[0]) * 1000.0 / (step - self._last[1])
        self._last = (now, step)
        if not self._started:  # no log_hyperparams call (a module without save_hyperparameters)
            self._begin({})
        self.producer.log_step(step, **fields)
        if self._gpu is not None:
            self._guard("GPU telemetry", lambda: self._gpu.step(step))


__all__ = ["TrainmonLogger"]
