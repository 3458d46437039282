"""trainmon ingest: a training job's console log into trainmon records.

    trainmon ingest train.log                      # backfill a finished log
    trainmon ingest --follow /path/slurm-1234.out  # follow a running job's log
    python train.py 2>&1 | trainmon ingest - > train.log   # like tee
    trainmon ingest --dry-run train.log | head     # the records as JSON lines
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..schemas import Record
from . import reader
from .formats import ALIASES, FORMATS
from .session import FormatNotDetected, Session

log = logging.getLogger("trainmon.ingest")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmon ingest", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("path", help="the log file, or - for standard input (passed through to stdout)")
    p.add_argument("--follow", "-F", action="store_true",
                   help="keep reading as the file grows, across truncation and rotation")
    p.add_argument("--dry-run", action="store_true",
                   help="print the records as JSON lines instead of sending them "
                        "(to stderr when reading standard input)")
    p.add_argument("--format", default="auto", choices=["auto", *FORMATS, *ALIASES], metavar="NAME",
                   help=f"the log format: auto (the default: detected), {', '.join(FORMATS)}")
    p.add_argument("--run-id", help="default: $TRAINMON_RUN_ID, else the file name")
    p.add_argument("--job-id", help="the job this log's runs belong to (every restart of one "
                                    "training job): default $TRAINMON_JOB_ID, else the run id")
    p.add_argument("--host", help="host name in the records (default: this machine's)")
    p.add_argument("--world-size", type=int, help="default: as the log prints it")
    p.add_argument("--idle", type=float, default=0.1, metavar="SECONDS",
                   help="while following, send held records after this long without a new "
                        "line (a step waits for its timer lines, printed right after it)")
    return p


def run_id_for(path: str, explicit: str | None, env=os.environ) -> str:
    if explicit:
        return explicit
    if env.get("TRAINMON_RUN_ID"):
        return env["TRAINMON_RUN_ID"]
    if path == "-":
        from ..producer.config import default_run_id
        return default_run_id(env)
    name = Path(path).name
    for suffix in (".log", ".txt", ".out", ".jsonl", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return name


class _DryRun:
    def __init__(self, stream):
        self._stream = stream

    def __call__(self, record: Record) -> None:
        # Surogate's / TRAINMON_LOG_FILE's layout ({"log": kind, ...}), with the envelope;
        # the record whole, as readers see it (a derived rate is not sent, but shown here).
        shown = record.model_dump_json(exclude_none=True).encode()
        self._stream.write(b'{"log":"%s",%s\n' % (record.kind.encode(), shown[1:]))


class _Paced:
    """Sends through the producer, waiting while its sender thread is far behind. A
    backfill reads a log faster than Kafka takes it; the producer would then keep the
    surplus in its spill file (written, read back, sent), which is there for a training
    loop that must never wait. Reading a log can wait."""

    HIGH = 20_000
    CHECK_EVERY = 1_000

    def __init__(self, producer):
        self._producer = producer
        self._sent = 0

    def __call__(self, record: Record) -> None:
        self._producer.send_record(record)
        self._sent += 1
        if self._sent % self.CHECK_EVERY == 0:
            while self._producer.queued > self.HIGH:
                time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("TRAINMON_LOG_LEVEL", "WARNING").upper(),
                        format="%(message)s", stream=sys.stderr)
    from_stdin = args.path == "-"
    if not from_stdin and not args.follow and not Path(args.path).is_file():
        print(f"trainmon ingest: no such file: {args.path}", file=sys.stderr)
        return 2
    run_id = run_id_for(args.path, args.run_id)
    # Two threads share the interpreter here, the parser and the producer's sender; handing
    # the GIL back and forth every 5 ms (the default) costs a backfill ~5 % of its CPU.
    sys.setswitchinterval(0.05)
    producer = None
    if args.dry_run:
        sink = _DryRun(sys.stderr.buffer if from_stdin else sys.stdout.buffer)
    else:
        from ..producer import Producer, ProducerConfig
        producer = Producer(ProducerConfig.from_env(run_id=run_id, yield_to_caller=False, linger_ms=20))
        sink = _Paced(producer)
    session = Session(run_id, sink, fmt=args.format, host=args.host, world_size=args.world_size,
                      job_id=args.job_id or os.environ.get("TRAINMON_JOB_ID"))

    stop = threading.Event()

    def on_term(signum, frame):
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    if from_stdin:
        lines = reader.pipe(sys.stdin.buffer, sys.stdout.buffer, idle_s=args.idle)
    elif args.follow:
        lines = reader.follow(Path(args.path), idle_s=args.idle, stop=stop)
    else:
        lines = reader.read_file(Path(args.path))
    status = 0
    try:
        for line in lines:
            if line is None:
                session.idle()
            else:
                session.feed(line)
        session.finish()
    except KeyboardInterrupt:
        session.idle()
    except BrokenPipeError:
        # "--dry-run x.log | head": whoever read the records has seen enough.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except FormatNotDetected as exc:
        print(f"trainmon ingest: {args.path}: {exc}", file=sys.stderr)
        status = 2
    finally:
        if producer is not None:
            if not producer.close(timeout=30):
                print("trainmon ingest: not every record reached Kafka; the rest is in the "
                      "spill directory and goes with the next producer", file=sys.stderr)
                status = status or 1
        if args.dry_run and not from_stdin:
            sys.stdout.flush()
    _summary(session, run_id, args.dry_run)
    return status


def _summary(session: Session, run_id: str, dry_run: bool) -> None:
    if not session.sent and not session.rejected:
        return
    counts = ", ".join(f"{n:,} {kind}" for kind, n in session.sent.most_common())
    where = "printed" if dry_run else "sent"
    msg = (f"trainmon ingest: {session.lines:,} lines of a {session.format} log -> {counts} "
           f"records {where} (run {run_id})")
    if session.rejected:
        msg += "; could not make " + ", ".join(f"{n:,} {k}" for k, n in session.rejected.items())
    if dry_run or session.rejected or os.environ.get("TRAINMON_LOG_LEVEL"):
        print(msg, file=sys.stderr)
    else:
        log.info(msg)
