"""modded-nanogpt (KellerJordan/modded-nanogpt, the NanoGPT speedrun) and the scripts
that kept its prints::

    step:0/1530 val_loss:10.8258 train_time:0ms step_avg:nanms
    step:1/1530 train_loss:10.8258 train_time:31613ms step_avg:nanms
    step:13/1480 train_time:762ms step_avg:253.89ms
    step:125/3148 val_loss:4.54643 train_time:125.376s step_avg:1003.01ms
    peak memory consumption: 34262 MiB

A ``step:N/M`` line with ``val_loss`` is an evaluation, any other one a training step
(with its loss when the script prints ``train_loss``; newer records print none). M is the
steps' total; the validation at step M/M closes the run.

The step's ``duration_ms`` is the difference of ``train_time`` between it and the previous
step line, not ``step_avg``: ``step_avg`` is the running mean since the clock started, so
it hides a slow step. ``train_time`` counts training only (the clock stops for
validation), and:

- the first step line has a duration only when it is step 1 (the clock starts at 0 there);
- ``train_time`` going backwards is the clock restarted (the 2024 scripts reset it after
  10 warm-up steps, so step 11 prints 114ms after step 10's 33005ms): the step took the
  ``train_time`` it prints;
- a gap of k steps between two lines (a script that prints every k-th step) gives each
  its share, the difference divided by k;
- ``train_time`` in seconds (``125.376s``) is converted to milliseconds.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_number

_STEP = re.compile(r"^step:(\d+)/(\d+)((?: +\w+:\S*)+)\s*$")
# What makes a step:N/M line this format's: one of the fields its scripts print.
_DETECT = re.compile(r"^step:\d+/\d+ +(?:train_loss|val_loss|train_time):[-+\w.]+")
_FIELD = re.compile(r"(\w+):(\S*)")
_TIME = re.compile(r"^([-+\w.]+?)(ms|s)$")
_WORLD_SIZE = re.compile(r"\bwith world_size=(\d+)\b")
# Other names forks print for the fields the step record has.
_FIELDS = {"grad_norm": "norm", "norm": "norm", "lr": "lr"}


class ModdedNanoGptParser(FormatParser):
    name = "modded-nanogpt"
    description = "modded-nanogpt's train_gpt.py (step:N/M train_time / val_loss lines)"

    def __init__(self) -> None:
        super().__init__()
        self._last: tuple[int, float] | None = None  # the previous step line: step, train_time

    @classmethod
    def detect(cls, line: Line) -> bool:
        return bool(_DETECT.match(line.text))

    def feed(self, line: Line) -> list[Parsed]:
        text = line.text
        m = _STEP.match(text)
        if m is None or not _DETECT.match(text):
            if (w := _WORLD_SIZE.search(text)) is not None:
                self.world_size = int(w.group(1))
            return []
        step, total = int(m.group(1)), int(m.group(2))
        fields = dict(_FIELD.findall(m.group(3)))
        if "val_loss" in fields:
            return self._eval(step, total, fields, line)
        return self._step(step, total, fields, line)

    def _eval(self, step: int, total: int, fields: dict[str, str],
              line: Line) -> list[Parsed]:
        if step == total:
            self.finished = True  # the final validation: training is over
        loss = try_number(fields["val_loss"])
        if loss is None:
            return []
        return [Parsed("eval", {"step": step, "loss": loss}, line.rank, line.time)]

    def _step(self, step: int, total: int, fields: dict[str, str],
              line: Line) -> list[Parsed]:
        record: dict[str, Any] = {"step": step, "total_steps": total}
        if "train_loss" in fields:
            loss = try_number(fields["train_loss"])
            if loss is None:
                return []
            record["loss"] = loss
        for name, key in _FIELDS.items():
            if name in fields and key not in record:
                value = try_number(fields[name])
                if value is not None:
                    record[key] = value
        elapsed = _milliseconds(fields.get("train_time", ""))
        if elapsed is not None:
            duration = self._duration(step, elapsed)
            if duration is not None:
                record["duration_ms"] = duration
            self._last = (step, elapsed)
        return [Parsed("step", record, line.rank, line.time)]

    def _duration(self, step: int, elapsed: float) -> float | None:
        if self._last is None:
            return elapsed if step == 1 else None
        last_step, last_elapsed = self._last
        if elapsed < last_elapsed:
            return elapsed  # the clock was restarted
        if step <= last_step:
            return None  # a step printed again (a restart): no interval to measure
        return (elapsed - last_elapsed) / (step - last_step)


def _milliseconds(text: str) -> float | None:
    m = _TIME.match(text)
    if m is None:
        return None
    value = try_number(m.group(1))
    if value is None or not math.isfinite(value):
        return None
    return value * 1000 if m.group(2) == "s" else value
