"""Megatron-Bridge, one line: ``pretrain(config, forward_step_func, callbacks=[TrainmonCallback()])``
(``megatron.bridge.training.callbacks``).

What Bridge hands its callbacks becomes trainmon records with Megatron's field names:

- ``on_train_start``: a run start with the ConfigContainer (dataclasses as nested dicts);
- ``on_train_step_end``: a step record numbered as Megatron prints it (``iteration`` =
  ``train_state.step + 1``: Bridge fires before it increments), with ``loss_dict``'s
  ``lm loss`` as the loss and every other entry in ``losses``, ``grad_norm`` -> norm,
  ``skipped_iter`` -> skipped, the lr of the optimizer's first param group, the fp16 loss
  scale (``optimizer.get_loss_scale()``), ``train_iters`` -> total_steps, consumed
  samples (this step's batch included, as Megatron prints them: Bridge adds it after the
  callback), global batch x sequence length -> tokens per step, the wall time from
  ``on_train_step_start`` (evaluations and checkpoint saves between steps left out, as
  Megatron's interval timer does), and the named ``timers`` (this step's time, ms). MoE
  losses the model reports (``load_balancing_loss``, ``z_loss``) go into a moe record as
  well;
- ``on_eval_end``: an eval record from ``total_loss_dict`` (``lm loss``);
- ``on_train_end``: the run end, then a flush.

Importing this module needs neither Megatron nor a GPU: the class subclasses Bridge's
``Callback`` when it imports, and otherwise has the same methods, which is all
``CallbackManager.add`` looks at. A failure in here is logged, never raised into training.
"""

from __future__ import annotations

import time
from typing import Any

from ..producer import Producer
from .framework import ProducerOwner, plain


try:  # the real base class where Bridge imports (its package needs Transformer Engine)
    from megatron.bridge.training.callbacks import Callback as _Base
except Exception:  # noqa: BLE001 - ImportError, or a GPU-only dependency failing at import
    _Base = object

LM_LOSS = "lm loss"
MOE_LOSSES = {"load_balancing_loss": "aux_loss", "z_loss": "z_loss"}


def _float(value: Any) -> float | None:
    """A tensor, a [numerator, denominator] pair (Megatron's eval sums) or a number."""
    try:
        if hasattr(value, "detach"):
            value = value.detach().float().cpu()
            value = value.tolist() if value.numel() > 1 else value.item()
        if isinstance(value, (list, tuple)) and len(value) == 2:
            return float(value[0]) / float(value[1]) if float(value[1]) else None
        return float(value)
    except (TypeError, ValueError):
        return None


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class TrainmonCallback(ProducerOwner, _Base):
    def __init__(self, producer: Producer | None = None, timers: tuple[str, ...] = (),
                 **producer_settings: Any):
        self._use_producer(producer, producer_settings)
        self._timers = timers
        self._timer_totals: dict[str, float] = {}
        self._step_start: float | None = None

    # -- Bridge's events ----------------------------------------------------------------

    def on_train_start(self, context) -> None:
        def start():
            self.producer.run_start(config=plain(_get(context.state, "cfg")) or {})
        self._guard("on_train_start", start)

    def on_train_step_start(self, context) -> None:
        self._step_start = time.monotonic()

    def on_train_step_end(self, context) -> None:
        self._guard("on_train_step_end", lambda: self._step(context))

    def on_eval_end(self, context) -> None:
        def evaluate():
            losses = {k: _float(v) for k, v in (context.total_loss_dict or {}).items()}
            loss = losses.get(LM_LOSS, next(iter(losses.values()), None))
            if loss is not None:
                self.producer.log_eval(int(_get(context.state, "train_state.step") or 0), loss=loss)
        self._guard("on_eval_end", evaluate)

    def on_train_end(self, context) -> None:
        def end():
            self.producer.run_end("success")
            self.producer.flush(10.0)
        self._guard("on_train_end", end)

    # -- helpers ------------------------------------------------------------------------

    def _step(self, context) -> None:
        state, cfg = context.state, _get(context.state, "cfg")
        step = int(_get(state, "train_state.step") or 0) + 1  # Megatron's iteration number
        values = {k: _float(v) for k, v in (context.loss_dict or {}).items()}
        loss = values.pop(LM_LOSS, None)
        fields: dict[str, Any] = {"loss": loss}
        if values:
            fields["losses"] = {k: v for k, v in values.items() if v is not None}
        if context.grad_norm is not None:
            fields["norm"] = _float(context.grad_norm)
        if context.skipped_iter is not None:
            fields["skipped"] = int(bool(context.skipped_iter))
        groups = getattr(context.optimizer, "param_groups", None)
        if groups:
            fields["lr"] = _float(groups[0].get("lr"))
        if callable(getattr(context.optimizer, "get_loss_scale", None)):
            fields["loss_scale"] = _float(context.optimizer.get_loss_scale())
        fields["total_steps"] = _get(cfg, "train.train_iters")
        batch, seq = _get(cfg, "train.global_batch_size"), _get(cfg, "model.seq_length")
        consumed = _get(state, "train_state.consumed_train_samples")
        # Bridge adds the step's batch to consumed_train_samples after this callback;
        # Megatron prints the count with it (iteration 1: one global batch, not 0)
        fields["consumed_samples"] = consumed + batch if consumed is not None and batch else consumed
        if batch and seq:
            fields["global_batch_size"] = batch
            fields["step_tokens"] = batch * seq
        # the step's own time: an evaluation or a checkpoint save runs between a step's end
        # and the next one's start (Megatron stops its interval timer for both)
        if self._step_start is not None:
            fields["duration_ms"] = (time.monotonic() - self._step_start) * 1000.0
            self._step_start = None
        timers = getattr(state, "timers", None)
        if self._timers and timers is not None:
            fields["timers"] = self._timer_ms(timers) or None
        self.producer.log_step(step, **{k: v for k, v in fields.items() if v is not None or k == "loss"})
        moe = {MOE_LOSSES[k]: v for k, v in values.items() if k in MOE_LOSSES and v is not None}
        if moe:
            self.producer.log_moe_stats(step, aux_loss=moe.get("aux_loss"), z_loss=moe.get("z_loss"),
                                        expert_utilization=None, load_imbalance=None)

    def _timer_ms(self, timers) -> dict[str, float]:
        """This step's time of each named timer, ms. Megatron's elapsed() holds every step
        since its last reset (timers.log, at the log interval): the step's time is the growth
        of active_time(), which no reset touches. A timer Megatron has not made (not enabled
        at this timing_log_level) is left out: ``timers(name)`` would hand back a DummyTimer,
        whose elapsed() raises (the step record lost), or make it at log level 2, and
        Megatron's own later call with its level then fails an assert."""
        made = getattr(timers, "_timers", None)
        out: dict[str, float] = {}
        for name in self._timers:
            timer = made.get(name) if isinstance(made, dict) else timers(name)
            if timer is None:
                continue
            seconds = timer.elapsed(reset=False)  # (adds a running timer's stretch to active_time)
            if callable(getattr(timer, "active_time", None)):
                total = timer.active_time()
                seconds, self._timer_totals[name] = total - self._timer_totals.get(name, 0.0), total
            out[name] = seconds * 1000.0
        return out


__all__ = ["TrainmonCallback"]
