"""From console lines to records: format detection, the envelope, run start and end.

A ``Session`` reads one log. Lines go in (``feed``), records come out through the
sink (the Producer, or a printer for ``--dry-run``). Until a format recognises a line
(``--format auto``), lines are kept and replayed into the chosen parser, so nothing
read before the first recognisable line is lost.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from datetime import datetime, timezone
from typing import Callable

from pydantic import ValidationError

from ..schemas import RECORD_TYPES, Record
from .dating import StepClock
from .failures import Ending, FailureWatcher
from .formats import FORMATS, FormatParser, by_name
from .ids import Occurrences, event_id
from .lines import Line, split_line
from .parsed import Parsed
from .warnings import WarningWatcher, event_key

log = logging.getLogger("trainmon.ingest")
UTC = timezone.utc
DETECT_LINES = 10_000  # lines kept while no format has recognised one


class FormatNotDetected(ValueError):
    pass


class Session:
    def __init__(self, run_id: str, sink: Callable[[Record], None], *, fmt: str = "auto",
                 host: str | None = None, world_size: int | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 job_id: str | None = None):
        self.run_id = run_id
        # Every run this log holds (a job restarted into the same log) is one job: the
        # session's, unless told (trainmon ingest --job-id, TRAINMON_JOB_ID).
        self.job_id = job_id or run_id
        self._sink = sink
        self._host = host or socket.gethostname()
        self._line_host: str | None = None
        self._world_size = world_size
        self._clock = clock
        self.parser: FormatParser | None = None if fmt == "auto" else by_name(fmt)()
        self._undetected: list[Line] = []
        self._watchers: dict[int, FailureWatcher] = {}
        self._running: set[int] = set()   # ranks whose run start was sent and not ended
        self._ended: set[int] = set()
        self._max_rank = 0
        self._occurrences = Occurrences()
        self._warnings = WarningWatcher()
        # The latest step sent, on any rank (steps are the run's: often only one rank
        # prints them), and the latest timestamp read: what a log event is dated with.
        self._last_step: int | None = None
        self._last_time: datetime | None = None
        self._step_clock = StepClock()  # dates step lines printed without a timestamp
        # The log's own clock: its latest timestamp or dated step. A record from a line
        # without a time takes it (the ingest time only before the log showed one), so a
        # backfill's run starts and ends, saves and evaluations stay on the run's timeline.
        self._log_time: datetime | None = None
        self._held_events: list[Parsed] | None = None  # while no format has been found
        self.sent: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.lines = 0

    @property
    def format(self) -> str | None:
        return self.parser.name if self.parser else None

    # -- input -----------------------------------------------------------------------

    def feed(self, raw: str) -> None:
        """One line of the log (with or without its newline)."""
        self.lines += 1
        if "\r" in raw.rstrip("\r\n"):
            # Progress bars (tqdm, Lightning) redraw with carriage returns: a file holds
            # thousands of updates on one "line"; each is a line of its own here.
            for part in raw.rstrip("\r\n").split("\r"):
                if part.strip():
                    self._line(split_line(part))
            return
        self._line(split_line(raw))

    def _line(self, line: Line) -> None:
        if self.parser is None:
            self._detect(line)
            return
        self._process(line)

    def idle(self) -> None:
        """The log went quiet (following): send what the parser holds."""
        if self.parser is not None:
            self._emit_all(self.parser.flush())
            self._end_if_finished()

    def finish(self) -> None:
        """The end of the log (backfill, or the pipe closed)."""
        if self.parser is None:
            # No format's line in the whole log: it may still say how the run ended (a
            # job that crashed before its first step).
            kept, self._undetected = self._undetected, []
            self.parser = FormatParser()
            self._held_events = []
            for line in kept:
                self._process(line)
            held, self._held_events = self._held_events, None
            if kept and not self.sent:  # warnings alone do not make a log readable
                raise FormatNotDetected(
                    f"no known log format in {len(kept):,} lines; choose one with "
                    f"--format ({', '.join(FORMATS)})")
            for p in held + self._warnings.finish():
                self._send_event(p)
            return
        self.idle()
        for p in self._warnings.finish():
            self._send_event(p)

    # -- internals -------------------------------------------------------------------

    def _detect(self, line: Line) -> None:
        self._undetected.append(line)
        for parser in FORMATS.values():
            if parser.detect(line):
                log.info("trainmon ingest: reading a %s log", parser.name)
                self.parser = parser()
                kept, self._undetected = self._undetected, []
                for earlier in kept:
                    self._process(earlier)
                return
        if len(self._undetected) > DETECT_LINES:
            self._undetected.pop(0)

    def _process(self, line: Line) -> None:
        rank = line.rank or 0
        # Records a line completes carry its pdsh host; a record held across lines
        # (a step waiting for its timers) takes the next line's, from the same printer.
        self._line_host = line.host
        self._emit_all(self.parser.feed(line))
        if line.time is not None:
            self._last_time = line.time
            self._step_clock.saw_time(line.time)
            if self._log_time is None or line.time > self._log_time:
                self._log_time = line.time
        watcher = self._watchers.get(rank)
        if self.parser.claimed and (watcher is None or not watcher.in_traceback):
            return  # an iteration or timer line: neither a warning nor how a run ends
        # A warning line without a timestamp of its own (c10's "[W328 16:19:30.66 ...]"
        # has no year) takes the log's latest: a backfill's events are not dated "now".
        for p in self._warnings.feed(line.text, rank, self._last_time, self._last_step, line.host):
            self._send_event(p)
        if watcher is None:
            watcher = self._watchers[rank] = FailureWatcher()
        ending = watcher.feed(line.text)
        if ending is not None:
            self._emit_all(self.parser.flush())
            self._end(rank, ending, line.time)

    def _emit_all(self, parsed: list[Parsed]) -> None:
        for p in parsed:
            rank = p.rank or 0
            if p.kind == "run":
                if p.fields.get("event") == "end":
                    self._running.discard(rank)
                    self._ended.add(rank)
                else:
                    self._running.add(rank)
                    self._ended.discard(rank)
                self._send(p, "end" if p.fields.get("event") == "end" else "start")
                continue
            if p.kind == "log_event":  # read back from trainmon's own JSON log
                self._send_event(p)
                continue
            if p.kind == "step":
                if p.time is None:
                    p.time = self._step_clock.date(p.fields.get("step"), p.fields.get("duration_ms"))
                if p.time is not None and (self._log_time is None or p.time > self._log_time):
                    self._log_time = p.time
            # A checkpoint saved after the run ended (the Trainer's final save_model follows
            # its summary) does not start it again.
            if rank not in self._running and p.kind != "checkpoint":
                self._start(rank, p.time)
            step = p.fields.get("step", "")
            if type(step) is int:
                self._last_step = step
            self._send(p, step)

    def _send_event(self, p: Parsed) -> None:
        """A log event: sent without starting a run (a warning printed at exit, after the
        run ended, or by a rank that logs no steps, is no run start), its id from its content."""
        if self._held_events is not None:
            self._held_events.append(p)
            return
        self._send(p, event_key(p))

    def _start(self, rank: int, when: datetime | None) -> None:
        self._running.add(rank)
        self._ended.discard(rank)
        config = dict(self.parser.config) if self.parser else {}
        self._send(Parsed("run", {"event": "start", "config": config}, rank, when), "start")

    def _end(self, rank: int, ending: Ending, when: datetime | None) -> None:
        if rank in self._ended:
            return
        self._running.discard(rank)
        self._ended.add(rank)
        self._send(Parsed("run", {"event": "end", "status": ending.status, "reason": ending.reason},
                          rank, when), "end")

    def _end_if_finished(self) -> None:
        if self.parser is not None and self.parser.finished:
            for rank in sorted(self._running):
                self._end(rank, Ending("success", ""), None)
            self.parser.finished = False

    def _send(self, p: Parsed, key: object) -> None:
        rank = p.rank or 0
        self._max_rank = max(self._max_rank, rank)
        world = self._world_size or (self.parser.world_size if self.parser else None) or 1
        fields = p.fields
        if p.kind == "run" and fields.get("event") == "end" and not fields.get("reason"):
            fields = {k: v for k, v in fields.items() if k != "reason"}
        if p.kind == "run" and fields.get("event") == "start" and not fields.get("job_id"):
            fields = {**fields, "job_id": self.job_id}
        n = self._occurrences.next(p.kind, rank, key)
        try:
            record = RECORD_TYPES[p.kind](
                run_id=self.run_id, rank=rank, world_size=max(world, self._max_rank + 1),
                host=p.host or self._line_host or self._host, time=p.time or self._log_time or self._clock(),
                event_id=event_id(self.run_id, p.kind, rank, key, n), **fields)
        except ValidationError as exc:
            if not self.rejected[p.kind]:
                log.warning("trainmon ingest: a %s record could not be made (further ones are "
                            "only counted): %s", p.kind, exc)
            self.rejected[p.kind] += 1
            return
        self.sent[p.kind] += 1
        self._sink(record)
