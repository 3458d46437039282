"""NeMo: NeMo 1's PyTorch Lightning progress bar, and NeMo 2's ProgressPrinter::

    Epoch 0: : 100%|██████████| 50/50 [16:26<00:00, v_num=gjbq, reduced_train_loss=11.70, global_step=49.00, consumed_samples=12600.0, train_step_timing in s=12.80]
    Training epoch 0, iteration 28/99 | lr: 5.6e-06 | global_batch_size: 32 | global_step: 28 | reduced_train_loss: 2.778 | train_step_timing in s: 0.189 | consumed_samples: 928 | val_loss: 2.861

The bar redraws (carriage returns, split into lines by the session) repeat a step many
times, and Lightning draws each new counter first with the previous step's metrics: a
bar is held until its counter moves on (or the log goes quiet), and a step is sent once
per new ``global_step``, an eval once per new ``val_loss`` (it stays in the bar, and in
the printer's lines, until the next validation).

Lightning prints bar numbers with tqdm's 3 significant digits when that is shorter, so
``global_step=2e+3`` may be 1999: such a step is taken from the bar's own counter
instead, offset as the last exact ``global_step`` of the epoch was (else by one: NeMo's
``global_step`` is the counter minus one), when that agrees with the rounded value.

Checkpoint saves, each a "saved" record (one per path: NeMo may print two lines for one save)::

    Epoch 0, global step 100: 'val_loss' reached 2.34567 (best 2.34567), saving model to '/ckpt/x.ckpt' as top 3
    [NeMo I 2026-02-17 17:59:05 nemo_logging:393] Global Checkpoint Save : Rank: 0 : Iteration: 49 : Start time: 1771351145.879s : Save duration: 5.330s
    [NeMo I 2026-02-17 17:59:15 nemo_logging:393] Successfully saved checkpoint from iteration 49 to /ckpt/step=49.ckpt
    [NeMo I 2026-02-17 17:59:15 nemo_logging:393] Async checkpoint save for step 50 (/ckpt/step=49.ckpt) finalized successfully.

(Lightning's verbose ModelCheckpoint line, Megatron-Core's line with the save duration
NeMo printed before it, NeMo's async finalisation at the step its path names, else
``global_step - 1``: the iteration the save follows.)
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_integer, try_number
from .checkpoints import SAVED, checkpoint, path_step

_BAR = re.compile(r"^\s*Epoch (\d+):.*?(?:(\d+)/(\d+)|(\d+)it) \[([^\]]*)\]")
_PRINTER = re.compile(r"^\s*Training epoch (\d+), iteration (\d+)/(\d+) \|(.*)")
_DETECT = re.compile(r"\breduced_train_loss[=:]")
_LIGHTNING_SAVE = re.compile(r"^\s*Epoch \d+, global step (\d+): .*\bsaving model to "
                             r"(['\"]?)(.+?)\2(?: as top \d+)?\s*$")
_SAVE_DURATION = re.compile(r"Global Checkpoint Save : Rank: \d+ : Iteration: (\d+) :.*"
                            r"Save duration: ([\d.]+)\s*s")
_ASYNC_SAVED = re.compile(r"Async checkpoint save for step (\d+) \((.*?)\) finalized successfully")

# NeMo's metric -> (StepRecord field, converter)
_STEP_FIELDS: dict[str, tuple[str, Any]] = {
    "reduced_train_loss": ("loss", try_number),
    "lr": ("lr", try_number),
    "global_batch_size": ("global_batch_size", try_integer),
    # Rounded to 3 digits in the bar once large (1.63e+6): only exact counts are kept.
    "consumed_samples": ("consumed_samples", lambda v: None if "e" in v else try_integer(v)),
    "train_step_timing in s": ("duration_ms", lambda v: _scaled(v, 1000.0)),
    "grad_norm": ("norm", try_number),
    "gradient_norm": ("norm", try_number),  # NeMo on AWS Neuron
    "parameter_norm": ("params_norm", try_number),
    "TFLOPS_per_GPU": ("tflops_per_gpu", try_number),
}
# NeMo 2's memory metrics, in bytes -> AllocatorRecord field
_MEMORY_FIELDS = {"max_memory_reserved": "peak_reserved", "max_memory_allocated": "peak_allocated"}


def _scaled(text: str, factor: float) -> float | None:
    value = try_number(text)
    return None if value is None else value * factor


def _same(a: float | None, b: float) -> bool:
    return a == b or (a is not None and math.isnan(a) and math.isnan(b))


class NemoParser(FormatParser):
    name = "nemo"
    description = "NeMo 1 (Lightning progress bar) and NeMo 2 (progress printer)"

    def __init__(self) -> None:
        super().__init__()
        self._last_step: dict[int | None, int] = {}      # per printed rank
        self._last_val: dict[int | None, float] = {}
        self._offset: tuple[int, int] | None = None      # (epoch, global_step - bar counter)
        self._held: tuple[tuple[int, int], Any] | None = None  # ((epoch, counter), its last draw)
        self._saved_path: dict[int | None, str] = {}    # per printed rank: the last save's path
        self._save_ms: dict[int, float] = {}            # iteration -> NeMo's save duration

    @classmethod
    def detect(cls, line: Line) -> bool:
        text = line.text
        return bool(_DETECT.search(text) and (_BAR.match(text) or _PRINTER.match(text)))

    def feed(self, line: Line) -> list[Parsed]:
        text = line.text
        if (m := _PRINTER.match(text)) is not None:
            values = {}
            for part in m.group(4).split("|"):
                name, sep, value = part.partition(":")
                if sep:
                    values[name.strip()] = value.strip()
            step = try_integer(values.get("global_step", m.group(2)))
            # The printer's total is trainer.max_steps (max_steps - 1 in some releases).
            return self.flush() + self._records(step, values, None, int(m.group(3)), line)
        if (m := _BAR.match(text)) is not None:
            key = (int(m.group(1)), int(m.group(2) or m.group(4)))
            out = self.flush() if self._held is not None and self._held[0] != key else []
            self._held = (key, (m, line))
            return out
        if "heckpoint" in text or "saving model to" in text:
            return self._checkpoint(line)
        return []

    def _checkpoint(self, line: Line) -> list[Parsed]:
        text = line.text
        duration = None
        if (m := _SAVE_DURATION.search(text)) is not None:
            if (ms := try_number(m.group(2))) is not None:
                self._save_ms[int(m.group(1))] = ms * 1000.0
            return []
        if (m := SAVED.search(text)) is not None:
            step, path = int(m.group(1)), m.group(2)
            duration = self._save_ms.pop(step, None)
        elif (m := _LIGHTNING_SAVE.match(text)) is not None:
            step, path = int(m.group(1)), m.group(3)
        elif (m := _ASYNC_SAVED.search(text)) is not None:
            path = m.group(2)
            step = path_step(path)
            step = max(0, int(m.group(1)) - 1) if step is None else step
        else:
            return []
        if self._saved_path.get(line.rank) == path:
            return []  # the same save, told twice
        self._saved_path[line.rank] = path
        return [checkpoint(step, line, path=path, duration_ms=duration)]

    def flush(self) -> list[Parsed]:
        if self._held is None:
            return []
        (epoch, counter), (m, line) = self._held
        self._held = None
        values = {}
        for part in m.group(5).split(","):
            name, sep, value = part.partition("=")
            if sep:
                values[name.strip()] = value.strip()
        total = int(m.group(3)) if m.group(3) else None
        progress = epoch + counter / total if total else None
        return self._records(self._bar_step(values, epoch, counter), values, progress, None, line)

    def _bar_step(self, values: dict[str, str], epoch: int, counter: int) -> int | None:
        text = values.get("global_step")
        if text is None:
            return None
        step = try_integer(text)
        if step is None:
            return None
        if "e" not in text:
            self._offset = (epoch, step - counter)
            return step
        # Without an exact step in this epoch yet, the usual one: NeMo logs the step
        # before Lightning counts its batch (50/50 shows global_step=49).
        offset = self._offset[1] if self._offset is not None and self._offset[0] == epoch else -1
        exact = counter + offset
        return exact if abs(exact - step) <= step * 0.005 + 1 else step  # 3 digits' rounding

    def _records(self, step: int | None, values: dict[str, str], epoch: float | None,
                 total: int | None, line: Line) -> list[Parsed]:
        if step is None or step < 0:
            return []
        out = []
        rank = line.rank
        if self._last_step.get(rank) != step:
            self._last_step[rank] = step
            fields: dict[str, Any] = {"step": step}
            memory: dict[str, Any] = {}
            for name, value in values.items():
                if name in _STEP_FIELDS:
                    field, convert = _STEP_FIELDS[name]
                    if (converted := convert(value)) is not None:
                        fields[field] = converted
                elif name in _MEMORY_FIELDS and (converted := try_integer(value)) is not None:
                    memory[_MEMORY_FIELDS[name]] = converted
            if "loss" in fields:
                if epoch is not None:
                    fields["epoch"] = epoch
                if total is not None:
                    fields["total_steps"] = total
                out.append(Parsed("step", fields, rank, line.time))
            if memory:
                out.append(Parsed("allocator", {"step": step, "stats": [], **memory},
                                  rank, line.time))
        val = try_number(values["val_loss"]) if "val_loss" in values else None
        if val is not None and not _same(self._last_val.get(rank), val):
            self._last_val[rank] = val
            fields = {"step": step, "loss": val}
            ppl = try_number(values["val_ppl"]) if "val_ppl" in values else None
            if ppl is not None:
                fields["perplexity"] = ppl
            out.append(Parsed("eval", fields, rank, line.time))
        return out
