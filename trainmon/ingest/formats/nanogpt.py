"""nanoGPT (karpathy/nanoGPT ``train.py``) and the forks that kept its prints::

    Overriding config with config/train_shakespeare_char.py:
    max_iters = 5000 # the config file, as is
    Overriding: max_iters = 5000
    tokens per iteration will be: 16,384
    step 250: train loss 1.2345, val loss 1.4567
    iter 250: loss 1.3456, time 123.45ms, mfu 12.34%

    saving checkpoint to out-shakespeare-char

``iter`` lines are steps, ``step`` lines the evaluation every ``eval_interval``; the
tokens-per-iteration line, printed once at the start, sizes every later step (so the
record derives tokens per second from the step time). The configuration it prints goes
into the run's config, ``max_iters`` into the steps' total. ``saving checkpoint to DIR``
(printed after the evaluation, before ``torch.save``; forks print ``saving checkpoint ->
FILE``) is a "saved" checkpoint record at the step the file name says, else the last
step read: nanoGPT prints nothing when the save ends.

nanoGPT prints nothing when training ends either (``if iter_num > max_iters: break``, and
the script returns). With ``wandb_log`` it calls ``wandb.init`` and never ``wandb.finish``,
so wandb's footer (``wandb: Find logs at: ...``) is printed by its exit hook when the
process exits: after the last iteration, the run's end. A crash prints its traceback
before the footer, and that ends the run as failed first.
"""

from __future__ import annotations

import re

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, try_integer, try_number
from .checkpoints import checkpoint, path_step

_ITER = re.compile(r"^iter (\d+): loss ([-+\w.]+), time ([-+\w.]+)ms(?:, mfu ([-+\w.]+)%)?")
_EVAL = re.compile(r"^step (\d+): train loss ([-+\w.]+), val loss ([-+\w.]+)")
_TOKENS = re.compile(r"^tokens per iteration will be: ([\d,]+)")
_OVERRIDE = re.compile(r"^Overriding: (\w+) = (.*?)\s*$")
_CONFIG_FILE = re.compile(r"^Overriding config with \S+:\s*$")
_ASSIGNMENT = re.compile(r"^(\w+) = (.*?)\s*(?:#.*)?$")  # a line of the printed config file
_SAVING = re.compile(r"^saving checkpoint (?:to|->) (\S+)")
_WANDB_EXIT = re.compile(r"^wandb: Find logs at: ")  # wandb's footer, printed at process exit


class NanoGptParser(FormatParser):
    name = "nanogpt"
    description = "nanoGPT's train.py (iter / step lines)"

    def __init__(self) -> None:
        super().__init__()
        self._step_tokens: int | None = None
        self._total: int | None = None
        self._in_config_file = False
        self._last_step: int | None = None

    @classmethod
    def detect(cls, line: Line) -> bool:
        text = line.text
        return bool(_ITER.match(text) or _EVAL.match(text) or _TOKENS.match(text))

    def feed(self, line: Line) -> list[Parsed]:
        text = line.text
        if self._in_config_file:
            if (m := _ASSIGNMENT.match(text)) is not None:
                self._setting(m.group(1), m.group(2))
                return []
            if not text.strip() or text.lstrip().startswith("#"):
                return []
            self._in_config_file = False
        if (m := _ITER.match(text)) is not None:
            return self._iteration(m, line)
        if (m := _EVAL.match(text)) is not None:
            loss = try_number(m.group(3))
            self._last_step = int(m.group(1))
            if loss is None:
                return []
            return [Parsed("eval", {"step": int(m.group(1)), "loss": loss}, line.rank, line.time)]
        if (m := _SAVING.match(text)) is not None:
            step = path_step(m.group(1))
            step = self._last_step if step is None else step
            return [] if step is None else [checkpoint(step, line, path=m.group(1))]
        if (m := _TOKENS.match(text)) is not None:
            self._step_tokens = try_integer(m.group(1))
        elif (m := _OVERRIDE.match(text)) is not None:
            self._setting(m.group(1), m.group(2))
        elif _CONFIG_FILE.match(text):
            self._in_config_file = True
        elif _WANDB_EXIT.match(text):
            self.finished = True
        return []

    def _setting(self, name: str, text: str) -> None:
        value: object = text.strip("'\"")
        for convert in (int, float):
            try:
                value = convert(text)
                break
            except ValueError:
                pass
        if text in ("True", "False"):
            value = text == "True"
        self.config[name] = value
        if name == "max_iters" and isinstance(value, int) and value >= 0:
            self._total = value

    def _iteration(self, m: re.Match, line: Line) -> list[Parsed]:
        self._last_step = int(m.group(1))
        loss = try_number(m.group(2))
        if loss is None:
            return []
        fields = {"step": int(m.group(1)), "loss": loss}
        duration = try_number(m.group(3))
        if duration is not None:
            fields["duration_ms"] = duration
        mfu = try_number(m.group(4)) if m.group(4) else None
        # nanoGPT prints "mfu -100.00%" until its running estimate has 5 iterations:
        # a placeholder, not a measurement.
        if mfu is not None and mfu >= 0:
            fields["sol_percent"] = mfu
        if self._step_tokens is not None:
            fields["step_tokens"] = self._step_tokens
        if self._total is not None:
            fields["total_steps"] = self._total
        return [Parsed("step", fields, line.rank, line.time)]
