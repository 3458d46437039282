"""Megatron-LM, Megatron-DeepSpeed, Megatron-Core and Megatron-Bridge console logs.

All four print the same ``training_log`` line, with fields added over the years::

    [2024-06-13 10:48:27] iteration      100/  500000 | consumed samples: 51200 |
        elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 401.2 |
        learning rate: 1.500E-05 | global batch size:   512 | lm loss: 7.123456E+00 |
        load_balancing_loss: 1.02E+00 | loss scale: 1.0 | grad norm: 1.234 |
        number of skipped iterations:   0 | number of nan iterations:   0 |

then, at the same interval, timer lines (``time (ms) | forward-compute: 193.77 | ...``,
or ``(min, max) time across ranks (ms):`` and one indented line per timer), once a
``[Rank 0] (after 10 iterations) memory (MB) | allocated: ...`` line, and every eval
interval a ``validation loss at iteration N | lm loss value: ... |`` line. The step is
held until its timer lines have been read (the next iteration, a quiet moment while
following, or the end of the log), so its record carries them.

Checkpoint saves (formats/checkpoints.py): ``saving checkpoint at iteration N to PATH`` is
a "started" record, ``successfully saved checkpoint at|from iteration N to PATH`` a "saved"
one, held for the ``save-checkpoint`` timer row that follows it (its max across ranks is
the save's duration), else timed from the two lines' timestamps when both have one.

Fields are matched by name with spaces removed, so a line hard-wrapped anywhere (as
pasted into an issue) reads the same once joined.

A loss the line leaves out is a value, not a gap (see ``_missing_loss``): ``training_log``
prints each loss only when its average over the interval's advanced iterations is positive
(``>= 0`` since 2025), so an iteration line without its loss had a NaN (or, before 2025, a
zero) average, unless every iteration of the interval was skipped, which its ``number of
skipped iterations`` tells.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..lines import Line
from ..parsed import Parsed
from .base import FormatParser, integer, number
from .checkpoints import SAVED, SAVING, checkpoint, elapsed_ms

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_ITERATION_START = re.compile(r"\biteration\s+\d+\s*/")
# NeMo 2's progress printer ("Training epoch 0, iteration 28/99 | lr: ... |") has the
# same "iteration N/M |" shape: not a Megatron line, for detection.
_NEMO_PRINTER = re.compile(r"^\s*Training epoch \d+, iteration ")
_TIMERS_ONE_LINE = re.compile(r"^\s*time \(ms\)\s*\|")
_TIMERS_HEADER = re.compile(r"time across ranks \(ms\):\s*$")
_TIMER_ROW = re.compile(r"^\s+([\w\-/.: ]+?)\s*\.{2,}\s*:\s*(?:\(\s*([-\d.einfa]+)\s*,\s*([-\d.einfa]+)\s*\)|([-\d.einfa]+))\s*$")
# "[Rank 0] (after 10 iterations) memory (MB) | ..."; older releases: "after 5 iterations memory (MB) | ..."
_MEMORY = re.compile(r"(?:\[Rank (\d+)\]\s*)?\(?after (\d+) iterations\)?\s*memory \(MB\)\s*\|(.*)")
_VALIDATION = re.compile(r"\b(?:validation|test) loss at (?:iteration (\d+)|the end of training)[^|]*\|(.*)")
_ARGS_START = re.compile(r"^-+ arguments -+\s*$")
_ARGS_END = re.compile(r"^-+ end of arguments -+\s*$")
_ARG = re.compile(r"^\s*(\w+) \.{2,} (.*?)\s*$")
_WORLD_SIZE = re.compile(r"using world size:\s*(\d+)")
_DONE = re.compile(r"\[after training is done\]")
_MAX_WRAPPED_LINES = 8
MIB = 1024 * 1024


def _pairs(text: str) -> list[tuple[str, str]]:
    """The ``name: value`` fields of a ``|``-separated line. Releases before 2020 printed
    ``name value`` without the colon ("lm loss 6.758929E+00 | loss scale 64.0")."""
    pairs = []
    for part in text.split("|"):
        name, sep, value = part.rpartition(":")
        if not sep:
            name, _, value = part.strip().rpartition(" ")
        if value and not value.isspace() and name and not name.isspace():
            pairs.append((name, value))
    return pairs


_KEYS: dict[str, str] = {}


def _key(name: str) -> str:
    """A field name without spaces, lower case: the same however the line was wrapped."""
    key = _KEYS.get(name)
    if key is None:
        key = "".join(name.split()).lower()
        if len(_KEYS) < 4096:  # names repeat on every line; a bound for odd logs
            _KEYS[name] = key
    return key


# iteration-line field (spaces removed, lower case) -> (StepRecord field, converter)
_STEP_FIELDS: dict[str, tuple[str, Any]] = {
    "consumedsamples": ("consumed_samples", integer),
    "elapsedtimeperiteration(ms)": ("duration_ms", number),
    "elapsedtimeperiteration(s)": ("duration_ms", lambda v: number(v) * 1000.0),
    "elapsedtimeperiteration": ("duration_ms", number),  # Megatron-Bridge: "21392.5 ms"
    "learningrate": ("lr", number),
    "globalbatchsize": ("global_batch_size", integer),
    "lossscale": ("loss_scale", number),
    "gradnorm": ("norm", number),
    "paramsnorm": ("params_norm", number),
    "numzeros": ("num_zeros", integer),
    "numberofskippediterations": ("skipped", integer),
    "numberofnaniterations": ("nan_iterations", integer),
    "throughputpergpu(tflop/s/gpu)": ("tflops_per_gpu", number),
    "tflops": ("tflops_per_gpu", number),  # Megatron-DeepSpeed
}
# Auxiliary losses of mixture-of-experts routers: also sent as moe records.
_MOE_LOSSES = {"load_balancing_loss": "aux_loss", "aux_loss": "aux_loss",
               "moe_aux_loss": "aux_loss", "seq_load_balancing_loss": "aux_loss",
               "global_load_balancing_loss": "aux_loss", "z_loss": "z_loss", "moe_z_loss": "z_loss"}
_MAIN_LOSSES = ("lmloss", "loss")


class _HeldStep:
    """An iteration line's fields, kept until the lines that complete it have been read."""

    __slots__ = ("line", "fields", "losses", "consumed_tokens")

    def __init__(self, line: Line, fields: dict[str, Any]):
        self.line = line
        self.fields = fields
        self.losses: dict[str, float] = {}
        self.consumed_tokens: int | None = None

    def add(self, text: str) -> None:
        """Take the ``name: value |`` pairs of a piece of an iteration line."""
        fields = self.fields
        for name, value in _pairs(text):
            key = _key(name)
            try:
                known = _STEP_FIELDS.get(key)
                if known is not None:
                    if value.rstrip().endswith("s"):
                        value = _without_unit(value)
                    fields[known[0]] = known[1](value)
                elif key == "consumedtokens":
                    self.consumed_tokens = integer(value)
                elif key.endswith("loss"):
                    self.losses[name.strip()] = number(value)
            except ValueError:
                continue  # a field this parser does not understand: keep the rest


class MegatronParser(FormatParser):
    name = "megatron"
    description = "Megatron-LM, Megatron-DeepSpeed, Megatron-Core, Megatron-Bridge"

    def __init__(self) -> None:
        super().__init__()
        self._held: _HeldStep | None = None    # the last step, until its timers are read
        self._wrapped: list[Line] = []         # a hard-wrapped iteration line being joined
        self._in_args = False
        self._in_timers = False
        self._last_step = 0
        self._last_logged: dict[int | None, int] = {}  # rank -> its previous iteration line's step
        self._loss_seen: set[int | None] = set()  # ranks whose iteration lines printed a loss
        self._last_tokens: tuple[int, int] | None = None  # (iteration, consumed tokens)
        self._saving: dict[tuple[int | None, int], Line] = {}  # (rank, iteration) -> its start line
        self._saved: Parsed | None = None   # a finished save, until its timer row is read

    @classmethod
    def detect(cls, line: Line) -> bool:
        text = line.text
        return bool((_ITERATION.search(text) and not _NEMO_PRINTER.match(text))
                    or _ARGS_START.match(text) or _WORLD_SIZE.search(text) or _MEMORY.search(text))

    # -- lines ---------------------------------------------------------------------

    def feed(self, line: Line) -> list[Parsed]:
        self.claimed = True  # until the line turns out to be none of ours, below
        out: list[Parsed] = self._save_timer(line.text) if self._saved is not None else []
        if self._wrapped:
            if self._starts_something(line.text) or len(self._wrapped) >= _MAX_WRAPPED_LINES:
                out += self._iteration(self._joined())
            else:
                self._wrapped.append(line)
                if line.text.rstrip().endswith("|"):
                    out += self._iteration(self._joined())
                return out
        text = line.text
        if self._in_args:
            if _ARGS_END.match(text):
                self._in_args = False
            elif (m := _ARG.match(text)) is not None:
                self.config[m.group(1)] = _arg_value(m.group(2))
                if m.group(1) == "world_size" and isinstance(self.config["world_size"], int):
                    self.world_size = self.config["world_size"]
            return out
        if self._in_timers:
            m = _TIMER_ROW.match(text)
            if m is not None:
                self._timer(m)
                return out
            self._in_timers = False
        if "iteration" in text and _ITERATION_START.search(text):
            if not text.rstrip().endswith("|"):
                self._wrapped = [line]
                return out
            return out + self._iteration(line)
        if _TIMERS_ONE_LINE.match(text):
            for part in text.split("|")[1:]:
                name, sep, value = part.rpartition(":")
                if sep and self._held is not None:
                    try:
                        self._held.fields.setdefault("timers", {})[name.strip()] = number(value)
                    except ValueError:
                        pass
            return out
        if self._held is not None and _is_continuation(text):
            # Megatron-Bridge breaks its iteration log over several lines, one group of
            # "name: value |" fields each.
            self._held.add(text)
            return out
        if _TIMERS_HEADER.search(text):
            self._in_timers = True
            return out
        self.claimed = False  # iterations, their continuations and timers were above
        if (m := _MEMORY.search(text)) is not None:
            return out + [self._memory(m, line)]
        if (m := _VALIDATION.search(text)) is not None:
            return out + self._validation(m, line)
        if "checkpoint" in text and (saves := self._checkpoint(line)) is not None:
            return out + saves
        if _ARGS_START.match(text):
            self._in_args = True
        elif (m := _WORLD_SIZE.search(text)) is not None:
            self.world_size = int(m.group(1))
        elif _DONE.search(text):
            self.finished = True
        return out

    def flush(self) -> list[Parsed]:
        out = self._iteration(self._joined()) if self._wrapped else []
        saved, self._saved = self._saved, None
        return out + self._release() + ([saved] if saved is not None else [])

    @staticmethod
    def _starts_something(text: str) -> bool:
        return bool(("iteration" in text and _ITERATION_START.search(text)) or _TIMERS_ONE_LINE.match(text)
                    or _MEMORY.search(text) or _VALIDATION.search(text))

    def _joined(self) -> Line:
        first = self._wrapped[0]
        text = "".join(part.text for part in self._wrapped)
        self._wrapped = []
        return Line(text, first.rank, first.time, first.host)

    # -- records -------------------------------------------------------------------

    def _iteration(self, line: Line) -> list[Parsed]:
        out = self._release()
        m = _ITERATION.search(line.text)
        if m is None:
            return out
        self._held = _HeldStep(line, {"step": int(m.group(1)), "total_steps": int(m.group(2))})
        self._held.add(line.text[m.end():])
        return out

    def _release(self) -> list[Parsed]:
        """The held step as records: the step, and a moe record for router losses."""
        held, self._held = self._held, None
        if held is None:
            return []
        fields, losses, line = held.fields, dict(held.losses), held.line
        step = fields["step"]
        main = next((n for n in losses if _key(n) in _MAIN_LOSSES), None)
        if main is None:
            main = next((n for n in losses if n not in _MOE_LOSSES), None)
        if main is not None:
            fields["loss"] = losses.pop(main)
            self._loss_seen.add(line.rank)
        elif self._missing_loss(fields, line.rank):
            fields["loss"] = math.nan
        self._last_logged[line.rank] = step
        if losses:
            fields["losses"] = losses
        tokens = self._step_tokens(step, fields.get("global_batch_size"), held.consumed_tokens)
        if tokens is not None:
            fields["step_tokens"] = tokens
        self._last_step = step
        out = [Parsed("step", fields, line.rank, line.time)]
        moe = {_MOE_LOSSES[n]: v for n, v in losses.items() if n in _MOE_LOSSES}
        if moe:
            out.append(Parsed("moe", {"step": step, **moe}, line.rank, line.time))
        return out

    def _missing_loss(self, fields: dict[str, Any], rank: int | None) -> bool:
        """Whether an iteration line without its loss means a NaN loss, by Megatron's
        ``training_log`` (megatron/training/training.py; Megatron-DeepSpeed's is the same
        with ``> 0.0``)::

            # Update losses and set nan iterations
            for key in loss_dict:
                if not skipped_iter:
                    total_loss_dict[key] = total_loss_dict.get(key, ...) + loss_dict[key]
            ...
            for key in total_loss_dict:
                if key not in [advanced_iters_key, skipped_iters_key, nan_iters_key]:
                    avg = total_loss_dict[key].item() / float(max(1, total_loss_dict[advanced_iters_key]))
                    if avg >= 0.0:
                        log_string += ' {}: {:.6E} |'.format(key, avg)

        A skipped iteration adds no loss, and an interval of skipped iterations only has no
        average (0 / max(1, 0)): the line then says ``number of skipped iterations`` equal to
        the iterations since the previous line, and the loss was not measured (None; the
        skipped count is the record's evidence). Otherwise the average was NaN (``NaN >= 0``
        is false; a NaN of a skipped iteration is counted in ``number of nan iterations``
        instead), or, before 2025 (``avg > 0.0``), zero: either way no loss worth having, so
        NaN. That holds for a rank whose earlier lines printed a loss, and for a first line
        (a log read from its middle) that says no iteration was skipped: every Megatron
        training loop reports at least its language-model loss."""
        skipped = fields.get("skipped")
        previous = self._last_logged.get(rank)
        interval = fields["step"] - previous if previous is not None and fields["step"] > previous else None
        if skipped is not None and skipped > 0 and (interval is None or skipped >= interval):
            return False  # every iteration skipped, or (interval unknown) maybe every one
        return rank in self._loss_seen or skipped == 0

    def _step_tokens(self, step: int, batch: int | None, consumed: int | None) -> int | None:
        seq = self.config.get("seq_length")
        if batch is not None and isinstance(seq, int):
            return batch * seq
        if consumed is None:
            return None
        last, self._last_tokens = self._last_tokens, (step, consumed)
        if last is None or step <= last[0] or consumed < last[1]:
            return None
        return (consumed - last[1]) // (step - last[0])

    def _timer(self, m: re.Match) -> None:
        if self._held is None:
            return
        name, low, high, single = m.groups()
        timers = self._held.fields.setdefault("timers", {})
        try:
            if single is not None:
                timers[name.strip()] = number(single)
            else:
                timers[name.strip()] = number(high)
                timers[f"{name.strip()}.min"] = number(low)
        except ValueError:
            pass

    def _checkpoint(self, line: Line) -> list[Parsed] | None:
        """A checkpoint line's records; None when the line is none."""
        if (m := SAVING.search(line.text)) is not None:
            rank = int(m.group(1)) if m.group(1) is not None else line.rank
            step = int(m.group(2))
            self._saving[(rank, step)] = line
            return [checkpoint(step, line, event="started", path=m.group(3), rank=rank)]
        if (m := SAVED.search(line.text)) is None:
            return None
        step = int(m.group(1))
        start = self._saving.pop((line.rank, step), None)
        out = [self._saved] if self._saved is not None else []
        self._saved = checkpoint(step, line, path=m.group(2),
                                 duration_ms=elapsed_ms(start and start.time, line.time))
        return out

    def _save_timer(self, text: str) -> list[Parsed]:
        """While a finished save is held: its ``save-checkpoint`` timer row gives its
        duration; any other line that is not a timer row releases it."""
        if _TIMERS_HEADER.search(text):
            return []
        m = _TIMER_ROW.match(text) if self._in_timers else None
        if m is not None:
            name, _, high, single = m.groups()
            timers = [(name, high or single)]
        elif _TIMERS_ONE_LINE.match(text):  # "time (ms) | save-checkpoint: 2345.67"
            timers = [part.rpartition(":")[::2] for part in text.split("|")[1:]]
        else:
            saved, self._saved = self._saved, None
            return [saved]
        for name, value in timers:
            if name.strip().startswith("save-checkpoint"):
                try:
                    self._saved.fields["duration_ms"] = number(value)
                except ValueError:
                    pass
        return []

    def _memory(self, m: re.Match, line: Line) -> Parsed:
        values = {}
        for part in m.group(3).split("|"):
            name, sep, value = part.rpartition(":")
            if sep:
                try:
                    values[_key(name)] = int(number(value) * MIB)
                except ValueError:
                    pass
        fields = {"step": int(m.group(2)), "stats": []}
        for key, field in (("allocated", "allocated"), ("maxallocated", "peak_allocated"),
                           ("reserved", "reserved"), ("maxreserved", "peak_reserved")):
            if key in values:
                fields[field] = values[key]
        rank = int(m.group(1)) if m.group(1) is not None else line.rank
        return Parsed("allocator", fields, rank, line.time)

    def _validation(self, m: re.Match, line: Line) -> list[Parsed]:
        out = self.flush()
        step = int(m.group(1)) if m.group(1) else self._last_step
        values = {}
        for name, value in _pairs(m.group(2)):
            try:
                values[name.strip()] = number(value)
            except ValueError:
                pass
        # "lm loss value: 2.3 | lm loss PPL: 10.4 |"; before 2020 "LM loss: 4.5 | LM PPL: 90.3"
        loss_name = next((n for n in values if _key(n) == "lmlossvalue"),
                         next((n for n in values if _key(n).endswith(("value", "loss"))), None))
        if loss_name is None:
            return out
        fields: dict[str, Any] = {"step": step, "loss": values[loss_name]}
        ppl = next((v for n, v in values.items() if _key(n).endswith("ppl")), None)
        if ppl is not None:
            fields["perplexity"] = ppl
        return out + [Parsed("eval", fields, line.rank, line.time)]


_CONTINUATION = re.compile(r"^\s*([A-Za-z][\w /()\-]*?)\s*:\s*[-+\d.na]")


def _is_continuation(text: str) -> bool:
    """A line that goes on an iteration line: it starts with a field the line has."""
    m = _CONTINUATION.match(text)
    if m is None:
        return False
    key = _key(m.group(1))
    return key in _STEP_FIELDS or key.endswith("loss") or key == "consumedtokens"


def _without_unit(value: str) -> str:
    """ "21392.5 ms" -> "21392.5" (Megatron-Bridge puts the unit after the value)."""
    value = value.strip()
    for unit in (" ms",):
        if value.endswith(unit):
            return value[: -len(unit)]
    return value


def _arg_value(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text
