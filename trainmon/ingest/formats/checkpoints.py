"""Checkpoint-save lines more than one format prints, and the step a checkpoint's path names.

Megatron-LM, -DeepSpeed, -Core, -Bridge, and NeMo 2 through Megatron-Core's checkpointing::

    saving checkpoint at iteration     100 to /ckpt in torch_dist format
    global rank 3 is saving checkpoint at iteration     100 to /ckpt/iter_0000100/mp_rank_03/model_optim_rng.pt
    successfully saved checkpoint at iteration     100 to /ckpt
      successfully saved checkpoint from iteration     100 to /ckpt [ t 1/8, p 1/1 ]
    [NeMo I 2025-06-18 22:03:04 nemo_logging:393] Successfully saved checkpoint from iteration      49 to /ckpt/x.ckpt

Each format module decides what its lines mean (a "started" or a "saved" record, which
step); ``checkpoint`` builds the record.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from ..lines import Line
from ..parsed import Parsed

SAVING = re.compile(r"(?:\bglobal rank (\d+) is )?\bsaving checkpoint at iteration\s+(\d+) to (\S+)")
SAVED = re.compile(r"\b[Ss]uccessfully saved checkpoint (?:at|from) iteration\s+(\d+) to (\S+)")
_PATH_STEP = re.compile(r"(?:global_step|iteration|iter|step|checkpoint|ckpt)[_=-]?(\d+)", re.I)


def path_step(path: str) -> int | None:
    """The step a checkpoint path names: ``checkpoint-411``, ``iter_0000100``,
    ``step=49``, ``ckpt_000128.pt``, ``global_step10``; the component nearest the end
    that names one. None when none does (``out-kirin``)."""
    for part in reversed(re.split(r"[/\\]", path)):
        found = _PATH_STEP.findall(part)
        if found:
            return int(found[-1])
    return None


def checkpoint(step: int, line: Line, *, event: str = "saved", path: str | None = None,
               duration_ms: float | None = None, rank: int | None = None) -> Parsed:
    fields: dict[str, Any] = {"step": step, "event": event}
    if path:
        fields["path"] = path
    if duration_ms is not None:
        fields["duration_ms"] = duration_ms
    return Parsed("checkpoint", fields, line.rank if rank is None else rank, line.time)


def elapsed_ms(start: datetime | None, end: datetime | None) -> float | None:
    """Milliseconds between two line timestamps, when both lines had one."""
    if start is None or end is None or end < start:
        return None
    return (end - start).total_seconds() * 1000.0
