"""Surogate-compatible local output: the JSON-lines log file and the console step line.

Both run on the worker thread (as observers), never on the training thread.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from typing import TextIO

from ..schemas import Record, StepRecord

_ENVELOPE = {"run_id", "rank", "world_size", "host", "event_id", "schema_version"}


class JsonLogFile:
    """Appends one line per record: ``{"log": "step", "time": ..., "step": ...}``."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def __call__(self, record: Record) -> None:
        fields = record.model_dump(mode="json", exclude_none=True, exclude=_ENVELOPE)
        line = json.dumps({"log": record.kind, "rank": record.rank, **fields})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


def _tokens_per_second(tps: float | None) -> str:
    if tps is None or not math.isfinite(tps):
        return "  n/a tps"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tps >= limit:
            return f"{tps / limit:.1f}{suffix} tps"
    return f"{tps:.0f} tps"


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours:02d}h{rest // 60:02d}m"


class ConsoleLine:
    """``:: step 100 [ 12.5%] \\ loss 2.3456 | norm 0.1234 | 125.3k tps | 156 ms | eta 02h15m``

    The arrow shows the loss trend against its moving average (``\\`` falling, ``/``
    rising, ``-`` flat); ``!`` marks a grad-norm spike (> 5x its moving average). A value
    the step did not log (grad norm, throughput, duration) prints as ``n/a``.
    """

    def __init__(self, stream: TextIO | None = None, spike_factor: float = 5.0, alpha: float = 0.1):
        self._stream = stream or sys.stderr
        self._spike_factor = spike_factor
        self._alpha = alpha
        self._loss_avg: float | None = None
        self._norm_avg: float | None = None
        self._ms_avg: float | None = None

    def _ema(self, avg: float | None, value: float | None) -> float | None:
        if value is None:
            return avg
        if not math.isfinite(value):
            return avg if avg is not None else value
        return value if avg is None or not math.isfinite(avg) else avg + self._alpha * (value - avg)

    def format(self, r: StepRecord) -> str:
        arrow = "-"
        if self._loss_avg is not None and r.loss is not None and math.isfinite(r.loss):
            if r.loss < self._loss_avg * 0.99:
                arrow = "\\"
            elif r.loss > self._loss_avg * 1.01:
                arrow = "/"
        spike = "!" if (r.norm is not None and self._norm_avg is not None and self._norm_avg > 0
                        and r.norm > self._spike_factor * self._norm_avg) else " "
        self._loss_avg = self._ema(self._loss_avg, r.loss)
        self._norm_avg = self._ema(self._norm_avg, r.norm)
        self._ms_avg = self._ema(self._ms_avg, r.duration_ms)
        progress = f"[{100.0 * r.step / r.total_steps:5.1f}%] " if r.total_steps else ""
        eta = ""
        if r.total_steps and self._ms_avg is not None and math.isfinite(self._ms_avg):
            eta = f" | eta {_eta((r.total_steps - r.step) * self._ms_avg / 1000.0)}"
        norm = "n/a" if r.norm is None else f"{r.norm:.4f}"
        ms = "n/a ms" if r.duration_ms is None else f"{r.duration_ms:.0f} ms"
        loss = "n/a" if r.loss is None else f"{r.loss:.4f}"
        return (f":: step {r.step} {progress}{arrow} loss {loss} |{spike}norm {norm} | "
                f"{_tokens_per_second(r.tokens_per_second)} | {ms}{eta}")

    def __call__(self, record: Record) -> None:
        if isinstance(record, StepRecord):
            print(self.format(record), file=self._stream, flush=True)
