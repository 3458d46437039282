"""torchtitan's metrics lines (``[titan] <time> - root - INFO - `` is taken off by
lines.py, the colour codes too; what is left starts ``- root - INFO - ``)::

    step:  1  loss: 12.0345  grad_norm:  4.0412  memory: 33.54GiB(35.31%)  tps: 1,234  tflops: 23.45  mfu: 7.52%
    validate step: 20  loss:  9.3507  memory: 69.81GiB(88.17%)  tps: 74,600
    Training completed

Older releases print ``wps`` for ``tps`` and no grad norm or tflops. ``loss: -1.0000`` (a
validation line: any negative loss) is the stand-in of a rank without the pipeline's last
stage (no loss there: the record has none, a validation line makes no eval record); ``mfu: N/A`` a device whose peak FLOPS torchtitan does not know (no value). ``tps`` is tokens
per second per device; ``memory`` the peak reserved by the caching allocator since the
last line (sent as an allocator record, in bytes).

Checkpoint saves: ``Saving the checkpoint (or staging if async is enabled).`` (older:
``Saving a full checkpoint at step 10``, ``... at last step, step 1000.``, ``Saving a model
weights only checkpoint in torch.bfloat16 at last step, step 10.``) is a "started" record,
``Finished saving the checkpoint (or staging if async is enabled)in 3.45 seconds.`` a "saved"
one with that duration, both at the step the line names, else the last metrics line's.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_number
from .checkpoints import checkpoint

_STEP = re.compile(r"(?:^|[\s-])step:\s*(\d+)\s+loss:\s*(\S+)(.*)")
_VALIDATE = re.compile(r"\bvalidate step:\s*(\d+)\s+loss:\s*(\S+)(.*)")
_FIELD = re.compile(r"(\w+):\s*([-+\w.,]+)")
_DETECT = re.compile(r"(?:^|[\s-])step:\s*\d+\s+loss:\s*\S+\s+(?:grad_norm:\s*\S+\s+)?memory:\s*[\d.]+GiB")
_DONE = re.compile(r"\bINFO - Training completed\s*$")
# The trainer's own start line, so that a run which dies before its first metrics line
# (an OOM in step 1) is still read as torchtitan: trainer.py logs it before the loop.
_STARTS = re.compile(r"\bINFO - Training starts at step \d+\.?\s*$")
GIB = 1024 ** 3
_SAME_PRINT = timedelta(seconds=60)
_SAVING = re.compile(r"\bSaving (?:the checkpoint|a full checkpoint at (?:last step, )?step (\d+)|"
                     r"a model (?:weights )?only checkpoint .*?\bstep (\d+))")
_SAVED = re.compile(r"\bFinished saving the checkpoint\b.*?\bin\s*([\d.]+)\s*seconds")

# A rank without the pipeline's last stage computes no loss and logs a stand-in, train.py:
#     loss = (
#         torch.mean(torch.stack(losses)).to(self.device)
#         if self.pp_has_last_stage
#         else torch.tensor([-1.0], device=self.device)
#     )
# ("loss: -1.0000" on such a rank's metrics line), and validate.py sums the same -1.0 per
# validation step before dividing by the token count (a small negative "loss"). A
# cross-entropy is never negative: a negative loss is that stand-in, no loss measured.


def _measured(loss: float | None) -> float | None:
    return None if loss is None or loss < 0 else loss


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
        self._saving_step: int | None = None  # the step a "Saving ..." line named

    @classmethod
    def detect(cls, line: Line) -> bool:
        return bool(_DETECT.search(line.text) or _VALIDATE.search(line.text)
                    or _STARTS.search(line.text))

    def feed(self, line: Line) -> list[Parsed]:
        text = line.text
        if (m := _VALIDATE.search(text)) is not None:
            return self._validation(m, line)
        if (m := _STEP.search(text)) is not None:
            return self._step(m, line)
        if _DONE.search(text):
            self.finished = True
        elif "checkpoint" in text:
            return self._checkpoint(line)
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
        fields: dict[str, Any] = {"step": step}
        if _measured(loss) is not None:
            fields["loss"] = loss
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

    def _checkpoint(self, line: Line) -> list[Parsed]:
        if (m := _SAVING.search(line.text)) is not None:
            named = m.group(1) or m.group(2)
            event, seconds = "started", None
        elif (m := _SAVED.search(line.text)) is not None:
            named, event, seconds = None, "saved", try_number(m.group(1))
        else:
            return []
        last = self._last.get(("step", line.rank))
        step = int(named) if named else self._saving_step if event == "saved" else None
        if step is None:
            step = last[0] if last is not None else 0
        self._saving_step = step if event == "started" else None
        if self._repeated(f"checkpoint-{event}", step, line):
            return []
        return [checkpoint(step, line, event=event,
                           duration_ms=None if seconds is None else seconds * 1000.0)]

    def _validation(self, m: re.Match, line: Line) -> list[Parsed]:
        step, loss = int(m.group(1)), _measured(try_number(m.group(2)))
        if loss is None or self._repeated("eval", step, line):
            return []
        fields: dict[str, Any] = {"step": step, "loss": loss}
        tps = dict(_FIELD.findall(m.group(3))).get("tps")
        if tps is not None and (value := try_number(tps)) is not None:
            fields["tokens_per_second"] = value
        return [Parsed("eval", fields, line.rank, line.time)]
