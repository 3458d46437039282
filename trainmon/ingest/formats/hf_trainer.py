"""Hugging Face Transformers' Trainer (and TRL, ms-swift, ... built on it)::

    ***** Running training *****
      Total optimization steps = 300
     20%|██        | 10/50 [00:17<01:06,  1.67s/it]{'loss': 0.6957, 'grad_norm': 1.97, 'learning_rate': 9e-06, 'epoch': 1.0}
    {'eval_loss': 0.6807, 'eval_runtime': 0.87, 'eval_samples_per_second': 22.9, 'epoch': 1.0}
    {'train_runtime': 123.4, 'train_samples_per_second': 3.2, 'train_loss': 0.69, 'epoch': 3.0}

The printed dicts are read key by key with a regex, never evaluated: values may be
``nan``, ``inf``, ``tensor(1.23, device='cuda:0')`` or, from ms-swift, quoted strings.
A loss dict is a step, an ``eval_*loss`` dict an eval, the ``train_runtime`` summary the
run's successful end; ms-swift's ``memory(GiB)`` (peak reserved) an allocator record.

The Trainer does not print the step in its dicts. It is, in this order:

1. the dict's own ``step`` (log_history prints), ``global_step`` (PaddleNLP) or
   ms-swift's ``global_step/max_steps``;
2. the counter of the training progress bar last drawn (tqdm's ``10/50 [...]``, the bar
   whose total is the optimization steps, else the longest bar: evaluation bars are
   shorter). The Trainer logs right after advancing the bar, so the bar shows the step;
3. without bars (``disable_tqdm``), the count of loss dicts so far times
   ``logging_steps`` when the log prints the TrainingArguments (the first one is step 1
   with ``logging_first_step=True``);
4. else the count of loss dicts: 1, 2, 3, ...

An evaluation dict takes the training bar's counter, else the step of the last loss dict.

DeepSpeed's fp16 loss scaler prints ``[deepspeed] OVERFLOW! Rank 0 Skipping step.
Attempted loss scale: 64, reducing to 32`` for each step it skips: a step record at the
bar's counter with no loss, ``skipped`` 1 and the reduced ``loss_scale`` (Megatron's
fields), so the skipped-iteration and loss-scale rules see a cascade as it happens. An
overflow its hysteresis absorbs (``Attempted loss scale: 65536, but hysteresis is 2.
Reducing hysteresis to 1``) is a skipped step too, at an unchanged scale; ``Attempted loss
scale: 1, reducing to 1`` a scale at its floor. ``max_grad_norm=`` of the printed
TrainingArguments goes into the run's config (the clipping threshold).

A ``'loss': 0.0`` next to a NaN or infinite ``grad_norm`` is a NaN loss: with
``logging_nan_inf_filter`` (on by default) the Trainer replaces a step's NaN or infinite
loss by the interval's running average, which is 0 while every step of the interval was
NaN (see ``_nan_filtered``). The record's loss is NaN. A 0.0 beside a finite grad norm
stays a zero loss.

``Saving model checkpoint to saves/run/checkpoint-411`` is a "saved" checkpoint record at
the step the directory names (``checkpoint-N``), else (the final ``save_model``) at the
training bar's counter or the last loss dict's step.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_integer, try_number
from .checkpoints import checkpoint, path_step

_DICT = re.compile(r"\{'[^{}]*(\}|$)")
_PAIR = re.compile(r"'([^'\\]+)':\s*('(?:[^'\\]|\\.)*'|tensor\([^()]*\)|[^,{}]+)")
_BAR = re.compile(r"(\d+)/(\d+) \[[^\]]*?(?:it/s|s/it)")
_DETECT = re.compile(r"\{'(?:loss|eval_loss|train_runtime)': |\*{5} Running training \*{5}")
_BLOCK = re.compile(r"\b(Num examples|Num Epochs|Instantaneous batch size per device|"
                    r"Total train batch size|Gradient Accumulation steps|Total optimization steps|"
                    r"Number of trainable parameters)\b[^=]*=\s*([\d,]+)")
_LOGGING_STEPS = re.compile(r"\blogging_steps=([\d.]+)")
_FIRST_STEP = re.compile(r"\blogging_first_step=True\b")
# eval_loss, and with a metric key prefix: eval_snli_loss, mrpc_en_eval_loss
_EVAL_LOSS = re.compile(r"(?:^|_)eval(?:_\w+)?_loss$")
_SAVING = re.compile(r"\bSaving model checkpoint to (\S+)")
# DeepSpeed's loss_scaler.py (update_scale), on an overflow: either
#     overflow_msg += f" Attempted loss scale: {int(self.cur_scale)}, reducing to {int(next_scale)}"
# or, while its hysteresis absorbs the overflow (the scale stays),
#     overflow_msg += f" Attempted loss scale: {int(self.cur_scale)}, but hysteresis is {self.cur_hysteresis}. ..."
# The step is skipped either way. Releases before 2021 said "[deepscale]".
_OVERFLOW = re.compile(r"\[deep(?:speed|scale)\] OVERFLOW! Rank \d+ Skipping step\. "
                       r"Attempted loss scale: ([\d.e+-]+), (?:reducing to ([\d.e+-]+)|but hysteresis is)")
# LLaMA-Factory's LogCallback logs a rounded copy of the Trainer's dict through its logger
# ("[INFO|2024-12-08 01:09:59] llamafactory.train.callbacks:157 >> {'loss': 0.0000, ...}"):
#     logger.info_rank0("{" + log_str + "}")   # log_str = f"'loss': {logs['loss']:.4f}, ..."
# The Trainer prints its own, unrounded and with grad_norm, next to it: the copy is skipped.
_LLAMAFACTORY_COPY = re.compile(r"\bllamafactory\.[\w.]+:\d+ >> $")
_MAX_GRAD_NORM = re.compile(r"\bmax_grad_norm=([\d.e+-]+|None)")  # TrainingArguments, as printed
_MAX_WRAPPED_LINES = 8
GIB = 1024 ** 3


def _value(raw: str) -> float | None:
    raw = raw.strip()
    if raw[:1] == "'":
        raw = raw[1:-1]
    elif raw.startswith("tensor("):
        raw = raw[len("tensor("):-1].split(",")[0]
    return try_number(raw)


class HfTrainerParser(FormatParser):
    name = "hf-trainer"
    description = "Hugging Face Trainer (printed log dicts and tqdm bars; TRL, ms-swift)"

    def __init__(self) -> None:
        super().__init__()
        self._bars: dict[int, int] = {}   # progress bar total -> its last counter
        self._total: int | None = None
        self._logging_steps: float | None = None
        self._first_step = False
        self._logged = 0                  # loss dicts so far
        self._last_step: int | None = None
        self._wrapped: list[Line] = []    # a dict hard-wrapped over lines, being joined

    @classmethod
    def detect(cls, line: Line) -> bool:
        return bool(_DETECT.search(line.text))

    def feed(self, line: Line) -> list[Parsed]:
        joined = bool(self._wrapped)
        if joined:
            self._wrapped.append(line)
            if "}" not in line.text and len(self._wrapped) < _MAX_WRAPPED_LINES:
                return []
            line = self._joined()
        text = line.text
        m = _DICT.search(text)
        self._read_bars(text[:m.start()] if m else text)
        if m is not None and _LLAMAFACTORY_COPY.search(text, 0, m.start()):
            return []  # a copy of the Trainer's own dict, which follows it
        if m is None:
            if "Saving model checkpoint" in text and (saving := _SAVING.search(text)):
                return self._checkpoint(saving.group(1), line)
            if "OVERFLOW!" in text and (overflow := _OVERFLOW.search(text)):
                return self._overflow(try_number(overflow.group(2) or overflow.group(1)), line)
            self._read_setup(text)
            return []
        if not m.group(1) and not joined:  # no closing brace: the rest is on the next lines
            self._wrapped = [line]
            return []
        values = dict(_PAIR.findall(m.group(0)))
        out = self._record(values, line)
        self._read_bars(text[m.end():])
        return out

    def flush(self) -> list[Parsed]:
        if not self._wrapped:
            return []
        line = self._joined()
        m = _DICT.search(line.text)
        return self._record(dict(_PAIR.findall(m.group(0))), line) if m else []

    def _joined(self) -> Line:
        first = self._wrapped[0]
        text = "".join(part.text for part in self._wrapped)
        self._wrapped = []
        return Line(text, first.rank, first.time)

    # -- context -------------------------------------------------------------------

    def _read_bars(self, text: str) -> None:
        for n, total in _BAR.findall(text):
            self._bars[int(total)] = int(n)

    def _read_setup(self, text: str) -> None:
        if (m := _BLOCK.search(text)) is not None:
            key = "_".join(m.group(1).lower().split())
            value = try_integer(m.group(2))
            if value is not None:
                self.config[key] = value
                if key == "total_optimization_steps":
                    self._total = value
        if (m := _LOGGING_STEPS.search(text)) is not None:
            self._logging_steps = try_number(m.group(1))
        if (m := _MAX_GRAD_NORM.search(text)) is not None:  # the clipping threshold, for the rules
            self.config["max_grad_norm"] = None if m.group(1) == "None" else try_number(m.group(1))
        if _FIRST_STEP.search(text):
            self._first_step = True

    def _bar_step(self) -> int | None:
        if not self._bars:
            return None
        total = self._total if self._total in self._bars else max(self._bars)
        return self._bars[total]

    def _every(self) -> int:
        """Steps between two loss dicts: ``logging_steps`` when the log printed it, else 1."""
        every = self._logging_steps
        if every is not None and 0 < every < 1 and self._total:
            every = math.ceil(every * self._total)  # a ratio of the total steps
        return int(every) if every and every >= 1 else 1

    def _counted_step(self) -> int:
        every = self._every()
        if self._first_step and every > 1:
            return 1 if self._logged == 1 else (self._logged - 1) * every
        return self._logged * every

    # -- records -------------------------------------------------------------------

    def _record(self, raw: dict[str, str], line: Line) -> list[Parsed]:
        values = {k: v for k, v in ((k, _value(r)) for k, r in raw.items()) if v is not None}
        step = _own_step(raw)
        if (total := _own_total(raw)) is not None:
            self._total = total
        if "train_runtime" in raw:
            return [Parsed("run", {"event": "end", "status": "success"}, line.rank, line.time)]
        eval_loss = next((k for k in raw if _EVAL_LOSS.search(k)), None)
        if "loss" not in values and eval_loss is None:
            return []
        own = step is not None
        if step is None:
            step = self._bar_step()
        epoch = values.get("epoch")
        if "loss" in values:
            self._logged += 1
            if step is None:
                step = self._counted_step()
            elif not own and (step == 0 or step == self._last_step):
                # The Trainer logs a step once, and never step 0: the bar drawn last is
                # behind, the dict came before the bar's redraw of its own step (tqdm.write
                # redraws after the dict; a terminal copy may keep only that redraw).
                step = self._counted_step() if self._last_step is None else self._last_step + self._every()
            self._last_step = step
            return self._step(step, values, epoch, line)
        if step is None:
            step = self._last_step or 0
        if (loss := values.get(eval_loss)) is None:
            return []
        fields: dict[str, Any] = {"step": step, "loss": loss}
        if epoch is not None:
            fields["epoch"] = epoch
        runtime = values.get(eval_loss.removesuffix("loss") + "runtime", values.get("eval_runtime"))
        if runtime is not None:
            fields["duration_ms"] = runtime * 1000.0
        return [Parsed("eval", fields, line.rank, line.time)]

    def _overflow(self, scale: float | None, line: Line) -> list[Parsed]:
        step = self._bar_step()
        if step is None:
            step = self._last_step
        if step is None or scale is None:
            return []
        return [Parsed("step", {"step": step, "loss_scale": scale, "skipped": 1}, line.rank, line.time)]

    def _checkpoint(self, path: str, line: Line) -> list[Parsed]:
        step = path_step(path)
        if step is None:
            step = self._bar_step()
        if step is None:
            step = self._last_step
        return [] if step is None else [checkpoint(step, line, path=path)]

    def _step(self, step: int, values: dict[str, float], epoch: float | None,
              line: Line) -> list[Parsed]:
        fields: dict[str, Any] = {"step": step, "loss": values["loss"]}
        if _nan_filtered(values):
            fields["loss"] = math.nan
        for key, field in (("grad_norm", "norm"), ("learning_rate", "lr")):
            if key in values:
                fields[field] = values[key]
        if epoch is not None:
            fields["epoch"] = epoch
        if self._total is not None:
            fields["total_steps"] = self._total
        losses = {k: v for k, v in values.items() if k.endswith("loss") and k != "loss"}
        if losses:
            fields["losses"] = losses
        out = [Parsed("step", fields, line.rank, line.time)]
        memory = values.get("memory(GiB)")  # ms-swift: torch.cuda.max_memory_reserved()
        if memory is not None and memory >= 0:
            out.append(Parsed("allocator", {"step": step, "stats": [],
                                            "peak_reserved": int(memory * GIB)},
                              line.rank, line.time))
        return out


def _nan_filtered(values: dict[str, float]) -> bool:
    """A loss of 0.0 that the Trainer's NaN filter made. transformers' trainer.py, the
    training loop::

        if (
            args.logging_nan_inf_filter
            and not is_torch_xla_available()
            and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step))
        ):
            # if loss is nan or inf simply add the average of previous logged losses
            tr_loss = tr_loss + tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)

    and ``_maybe_log_save_evaluate`` resets ``tr_loss -= tr_loss`` after each log: an
    interval whose every step was NaN adds 0 / n to 0 and logs ``'loss': 0.0``. Its
    gradients were not finite either (the grad norm is NaN or inf), which tells it apart
    from a loss that really is 0 (every label masked), whose gradients are finite."""
    norm = values.get("grad_norm")
    return values.get("loss") == 0.0 and norm is not None and not math.isfinite(norm)


def _own_step(raw: dict[str, str]) -> int | None:
    for key in ("step", "global_step"):
        if key in raw:
            step = _value(raw[key])
            return int(step) if step is not None and math.isfinite(step) and step >= 0 else None
    progress = raw.get("global_step/max_steps", "").strip("'").partition("/")[0]
    return try_integer(progress) if progress else None


def _own_total(raw: dict[str, str]) -> int | None:
    progress = raw.get("global_step/max_steps", "").strip("'").partition("/")[2]
    return try_integer(progress) if progress else None
