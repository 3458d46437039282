"""The HF Transformers Trainer, one line: ``Trainer(..., callbacks=[TrainmonCallback()])``.

What the Trainer already computes becomes trainmon records, with no other change to the
training code:

- ``on_train_begin``: a run start with the TrainingArguments and the model's config;
- ``on_log`` (every ``logging_steps``): a step record: ``loss``, ``grad_norm`` -> norm,
  ``learning_rate`` -> lr, ``epoch``, ``max_steps`` -> total_steps, other ``*loss`` keys
  into ``losses``; step time is the wall time since the previous log over the steps in
  between (the Trainer logs no step time of its own), tokens per step from
  ``num_input_tokens_seen`` when ``include_num_input_tokens_seen`` is on;
- ``on_evaluate``: an eval record per eval set (``eval_loss``, ``eval_<name>_loss``) with
  ``eval_runtime`` as its duration;
- ``on_save``: a checkpoint record (``output_dir/checkpoint-N`` and its size);
- ``on_train_end``: the run end, then a flush;
- on a GPU, as W&B's system metrics: the gpu_model record, NVML's gpu and gpu_health
  records on their own thread, and an allocator record at each log (gpu_telemetry.py).

Every process logs its own rank (trainmon keeps ranks apart; W&B's callback logs rank 0
only). The producer comes from the TRAINMON_* environment unless one is passed. A failure
in here is logged, never raised into the Trainer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..producer import Producer
from .framework import ProducerOwner
from .gpu_telemetry import GpuTelemetry


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dir_bytes(path: Path) -> int | None:
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return None


def _eval_sets(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    """(prefix, loss) per eval set: "eval_loss" -> ("eval_", x), "eval_snli_loss" -> ("eval_snli_", x)."""
    return [(k[:-len("loss")], float(v)) for k, v in metrics.items()
            if k.startswith("eval") and k.endswith("loss") and _finite_number(v)]


class TrainmonCallback(ProducerOwner, TrainerCallback):
    def __init__(self, producer: Producer | None = None, **producer_settings: Any):
        self._use_producer(producer, producer_settings)
        self._last: tuple[float, int, Any] | None = None  # (monotonic, step, tokens seen)
        self._gpu: GpuTelemetry | None = None

    # -- the Trainer's events -----------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def start():
            config: dict[str, Any] = {"training_args": args.to_sanitized_dict()}
            model_config = getattr(model, "config", None)
            if model_config is not None and hasattr(model_config, "to_dict"):
                config["model"] = model_config.to_dict()
            self.producer.run_start(config=config, name=args.run_name or None)
            self._last = (time.monotonic(), state.global_step, state.num_input_tokens_seen)
        self._guard("on_train_begin", start)
        self._guard("on_train_begin", self._start_gpu)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and _finite_number(logs.get("loss")):
            self._guard("on_log", lambda: self._log_step(state, logs))
            if self._gpu is not None:
                self._guard("on_log", lambda: self._gpu.step(state.global_step, kwargs.get("model"),
                                                             kwargs.get("optimizer")))

    def on_step_end(self, args, state, control, **kwargs):
        if self._gpu is not None and self._gpu.sampler is not None:
            self._gpu.sampler.set_step(state.global_step)  # (an attribute: no guard needed)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        def evaluate():
            for prefix, loss in _eval_sets(metrics or {}):
                runtime = (metrics or {}).get(f"{prefix}runtime", (metrics or {}).get("eval_runtime"))
                self.producer.log_eval(state.global_step, loss=loss, epoch=state.epoch,
                                       duration_ms=runtime * 1000.0 if _finite_number(runtime) else None)
        self._guard("on_evaluate", evaluate)

    def on_save(self, args, state, control, **kwargs):
        def save():
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.producer.log_checkpoint(state.global_step, path=str(path),
                                         bytes=_dir_bytes(path) if path.is_dir() else None)
        self._guard("on_save", save)

    def on_train_end(self, args, state, control, **kwargs):
        def end():
            if self._gpu is not None:
                self._gpu.stop()
            self.producer.run_end("success")
            self.producer.flush(10.0)
        self._guard("on_train_end", end)

    # -- helpers ------------------------------------------------------------------------

    def _start_gpu(self) -> None:
        if self._gpu is None:
            self._gpu = GpuTelemetry(self.producer)
        self._gpu.start()

    def _log_step(self, state, logs: dict[str, Any]) -> None:
        now, step = time.monotonic(), state.global_step
        tokens_seen = logs.get("num_input_tokens_seen", state.num_input_tokens_seen)
        fields: dict[str, Any] = {"loss": float(logs["loss"]), "epoch": state.epoch,
                                  "total_steps": state.max_steps or None}
        if _finite_number(logs.get("grad_norm")):
            fields["norm"] = float(logs["grad_norm"])
        if _finite_number(logs.get("learning_rate")):
            fields["lr"] = float(logs["learning_rate"])
        losses = {k: float(v) for k, v in logs.items()
                  if k.endswith("loss") and k != "loss" and _finite_number(v)}
        if losses:
            fields["losses"] = losses
        if self._last is not None and step > self._last[1]:
            then, before, tokens_before = self._last
            fields["duration_ms"] = (now - then) * 1000.0 / (step - before)
            if _finite_number(tokens_seen) and _finite_number(tokens_before) and tokens_seen > tokens_before:
                fields["step_tokens"] = int(tokens_seen - tokens_before) // (step - before)
        self._last = (now, step, tokens_seen)
        if fields["epoch"] is not None and not math.isfinite(fields["epoch"]):
            fields["epoch"] = None
        self.producer.log_step(step, **fields)


__all__ = ["TrainmonCallback"]
