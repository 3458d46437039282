"""Training logs as a source: ``trainmon ingest`` turns a job's console output
(Megatron, NeMo, torchtitan, nanoGPT, HF Trainer, Surogate) into the records a
producer would have sent.

    lines.py     a console line without its launcher prefix: text, rank, time
    formats/     one parser per log format, and auto-detection by name
    failures.py  how runs end: tracebacks, OOM, NCCL, Slurm, Killed
    ids.py       deterministic event ids, so reading a log twice keeps rows once
    session.py   lines -> records with their envelope, run start and end
    reader.py    a finished file, a followed file, a pipe
    cli.py       the command
"""

from .session import FormatNotDetected, Session

__all__ = ["FormatNotDetected", "Session"]
