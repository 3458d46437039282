"""torchtitan's metrics lines (``[titan] <time> - root - INFO - `` is taken off by
lines.py, the colour codes too; what is left starts ``- root - INFO - ``)::

    step:  1  loss: 12.0345  grad_norm:  4.0412  memory: 33.54GiB(35.31%)  tps: 1,234  tflops: 23.45  mfu: 7.52%
    validate step: 20  loss:  9.3507  memory: 69.81GiB(88.17%)  tps: 74,600
    Training completed

Older releases print ``wps`` for ``tps`` and no grad norm or tflops. ``tps`` is tokens
per second per device; ``memory`` the peak reserved by the caching allocator since the
last line (sent as an allocator record, in bytes).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_number

_STEP = re.compile(r"(?:^|[\s-])step:\s*(\d+)\s+loss:\s*(\S+)(.*)")
_VALIDATE = re.compile(r"\bvalidate step:\s*(\d+)\s+loss:\s*(\S+)(.*)")
_FIELD = re.compile(r"(\w+):\s*([-+\w.,]+)")
_DETECT = re.compile(r"(?:^|[\s-])step:\s*\d+\s+loss:\s*\S+\s+(?:grad_norm:\s*\S+\s+)?memory:\s*[\d.]+GiB")
_DONE = re.compile(r"\bINFO - Training completed\s*$")
GIB = 1024 ** 3
_SAME_PRINT = timedelta(seconds=60)

# metrics-line field -> StepRecord field
_STEP_FIELDS = {"grad_norm": "norm", "tps": "tokens_per_second", "wps": "tokens_per_second",
                "tflops": "tflops_per_gpu", "mfu": "sol_percent"}


class TorchTitanParser(FormatParser):
    name = "torchtitan"
    description = "torchtitan ([titan] ... step: loss: memory: tps: lines)"

    def __init__(self) -> None:
        super().__init__()
        # Ranks launched without --tee print the same line (rank 0's step) once each, with
        # no prefix to tell them apart: the last step seen per printed rank, and when, to
        # keep one (a run restarted from a checkpoint may print the step again, later).
        self._last: dict[tuple[str, int | None], tuple[int, datetime | None]] = {}

    @classmethod
    def detect(cls, line: Line) -> bool:
        return bool(_DETECT.search(line.text) or _VALIDATE.search(line.text))

    def feed(self, line: Line) -> list[Parsed]:
        text = line.text
        if (m := _VALIDATE.search(text)) is not None:
            return self._validation(m, line)
        if (m := _STEP.search(text)) is not None:
            return self._step(m, line)
        if _DONE.search(text):
            self.finished = True
        return []

    def _repeated(self, kind: str, step: int, line: Line) -> bool:
        key = (kind, line.rank)
        last = self._last.get(key)
        self._last[key] = (step, line.time)
        if last is None or last[0] != step:
            return False
        return last[1] is None or line.time is None or abs(line.time - last[1]) < _SAME_PRINT

    def _step(self, m: re.Match, line: Line) -> list[Parsed]:
        step, loss = int(m.group(1)), try_number(m.group(2))
        if loss is None or self._repeated("step", step, line):
            return []
        fields: dict[str, Any] = {"step": step, "loss": loss}
        out = []
        for name, value in _FIELD.findall(m.group(3)):
            if name == "memory":
                gib = try_number(value.removesuffix("GiB"))
                if gib is not None and gib >= 0:
                    out.append(Parsed("allocator", {"step": step, "stats": [],
                                                    "peak_reserved": int(gib * GIB)},
                                      line.rank, line.time))
            elif name in _STEP_FIELDS:
                number = try_number(value)
                if number is not None:
                    fields[_STEP_FIELDS[name]] = number
        return [Parsed("step", fields, line.rank, line.time), *out]

    def _validation(self, m: re.Match, line: Line) -> list[Parsed]:
        step, loss = int(m.group(1)), try_number(m.group(2))
        if loss is None or self._repeated("eval", step, line):
            return []
        fields: dict[str, Any] = {"step": step, "loss": loss}
        tps = dict(_FIELD.findall(m.group(3))).get("tps")
        if tps is not None and (value := try_number(tps)) is not None:
            fields["tokens_per_second"] = value
        return [Parsed("eval", fields, line.rank, line.time)]
