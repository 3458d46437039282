"""How a run ends, read from its console: tracebacks, CUDA out of memory, NCCL errors
and watchdog timeouts, Slurm cancellations and time limits, the shell's ``Killed``.

Format-independent: every line of every format passes through one ``FailureWatcher``
per rank. A Python traceback is judged at its last line (the exception), so the reason
stored is the exception itself, not "Traceback (most recent call last):".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_REASON = 500


@dataclass(frozen=True)
class Ending:
    status: str   # "failed" or "aborted", as in RunRecord.status
    reason: str


# (pattern, status, label) for one-line endings, most specific first. The label leads
# the reason so runs group by cause; the line itself follows for the details.
# A pattern marked "from the match" quotes the line from where it matched: an NCCL error can
# follow a progress bar or a c10 log prefix on the same line.
_ONE_LINE = [
    (re.compile(r"CANCELLED AT .* DUE TO TIME LIMIT"), "failed", "Slurm time limit"),
    (re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT"), "aborted", "Slurm job cancelled"),
    (re.compile(r"DUE TO NODE FAILURE|NODE_FAIL"), "failed", "Slurm node failure"),
    (re.compile(r"Watchdog caught collective operation timeout"), "failed",
     "NCCL watchdog timeout", True),
    (re.compile(r"ProcessGroupNCCL.*(?:timed out|timeout)|NCCL.*watchdog.*time", re.I),
     "failed", "NCCL watchdog timeout", True),
    (re.compile(r"NCCL error|ncclInternalError|ncclUnhandledCudaError|ncclSystemError|"
                r"ncclRemoteError|ncclInvalidUsage"), "failed", "NCCL error", True),
    (re.compile(r"^(?:\S+: line \d+: +\d+ )?Killed\b"), "failed", "Killed (SIGKILL, e.g. the out-of-memory killer)"),
    (re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\) received"), "failed", "Killed (SIGKILL)"),
    (re.compile(r"Segmentation fault|SIGSEGV"), "failed", "Segmentation fault"),
]
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_TRACEBACK = re.compile(r"^\s*Traceback \(most recent call last\):")
# The exception line that ends a traceback: "RuntimeError: ...", "torch.OutOfMemoryError: ...",
# "KeyboardInterrupt", "subprocess.CalledProcessError: ...".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Timeout)\b:?")
# One search per line decides whether any pattern above can match: most lines are not
# endings, and a backfill reads hundreds of thousands of them.
_ANY = re.compile(r"Traceback|CANCELLED|NODE_FAIL|NCCL|nccl|Killed|exitcode|SIGKILL|Signal 9|"
                  r"Segmentation fault|SIGSEGV|out of memory|OutOfMemory|Watchdog")
# PyTorch's c10 log lines carry their level: "[W328 16:19:30.66 ProcessGroupNCCL.cpp:1524]" is
# a warning (or I an info line), never the end of a run, whatever it mentions.
_C10_NOT_FATAL = re.compile(r"^\[[WI]\d{3,4} ")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_MAX_TRACEBACK_LINES = 2000


def _reason(label: str, text: str) -> str:
    text = " ".join(text.split())
    reason = label if not text or text == label else f"{label}: {text}" if label else text
    return reason[:MAX_REASON]


class FailureWatcher:
    """Feed it one rank's lines; ``feed`` returns an Ending when a line ends the run."""

    def __init__(self) -> None:
        self._in_traceback = False
        self._traceback_lines = 0

    @property
    def in_traceback(self) -> bool:
        return self._in_traceback

    def feed(self, text: str) -> Ending | None:
        if self._in_traceback:
            return self._traceback_line(text)
        if _ANY.search(text) is None:
            return None
        if _TRACEBACK.match(text):
            self._in_traceback, self._traceback_lines = True, 0
            return None
        if _C10_NOT_FATAL.match(text):
            return None
        for pattern, status, label, *from_match in _ONE_LINE:
            if (m := pattern.search(text)) is not None:
                return Ending(status, _reason(label, text[m.start():] if from_match else text))
        if _OOM.search(text) and ("Error" in text or "error" in text):
            return Ending("failed", _reason("CUDA out of memory", text))
        return None

    def _traceback_line(self, text: str) -> Ending | None:
        self._traceback_lines += 1
        stripped = text.strip()
        if not stripped or text[:1] in (" ", "\t") or stripped.startswith(_CHAINED) \
                or _TRACEBACK.match(text) or stripped.startswith("^"):
            if self._traceback_lines > _MAX_TRACEBACK_LINES:
                self._in_traceback = False
            return None
        # The first line that is not indented is the exception that ended the traceback.
        self._in_traceback = False
        if _EXCEPTION.match(stripped) is None and ":" not in stripped:
            return None  # something else interleaved (another rank's output); not the end
        if _OOM.search(stripped):
            return Ending("failed", _reason("CUDA out of memory", stripped))
        for pattern, status, label, *_ in _ONE_LINE:
            if pattern.search(stripped):
                return Ending(status, _reason(label, stripped))
        if stripped.startswith("KeyboardInterrupt"):
            return Ending("aborted", _reason("KeyboardInterrupt", stripped))
        return Ending("failed", _reason("", stripped))
