"""Handing messages to Kafka and keeping what it does not take: the sender's delivery.

Fresh messages go straight to the transport. What Kafka gives up on (no acknowledgement
within the delivery timeout: the broker is away), or cannot take at all, goes to the
backlog (the spill file, a write-ahead log; memory where the disk cannot be written; see
backlog.py), and from then on newer messages join it behind, in order, until all of the
backlog is in Kafka's hands again; it leaves the file only once Kafka has answered it
(see :meth:`Delivery.resend`). Tries wait out one backoff policy (0.5 s, doubling to 5 s). Everything here runs on the sender thread, except :meth:`undelivered`, which
runs where the client reports failures (inside a serve or flush for librdkafka,
kafka-python's own thread), and :meth:`keep` from a log call that found the queue full.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..backoff import Backoff
from ..kafka_client.errors import TransportUnavailable
from ..kafka_client.transport import Entry, Transport, Undelivered
from ..schemas import count
from .backlog import DISK_RETRY_S, Backlog, Kept
from .spill import SpillFile, claim_orphans

log = logging.getLogger("trainmon.producer")

# Records sent again from the backlog go in batches of about this size, one in flight at a
# time; Kafka answers every message within the delivery timeout (5 s) even while the broker
# is away, so answers still missing after _ANSWERS_WITHIN_S are waited for.
_BACKLOG_BATCH_BYTES = 8 << 20
_ANSWERS_WITHIN_S = 10.0
# An earlier producer's spill file left where it was (this one's disk full, or its owner
# still exiting) is tried again this often: each try reads up to a chunk of it
# (spill.CLAIM_CHUNK_BYTES); a locked file costs an open and a flock.
ORPHANS_RETRY_S = 30.0


@dataclass
class _Resend:
    records: int
    failed: list[Entry]  # the batch's messages Kafka gave up on (its own failure handler)
    since: float  # monotonic time it was handed over


class Delivery:
    def __init__(self, make_transport: Callable[[Undelivered], Transport], spill_dir, spill_name: str,
                 memory_bound: int, hand_to_thread: Callable[[list[Entry]], None]):
        """``hand_to_thread`` takes failures reported while a log call collects Kafka's
        reports (``serving_for_caller``): the sender thread keeps them, not the log call."""
        self.spill_dir = spill_dir
        self.spill = SpillFile(spill_dir, spill_name)
        # Without a usable spill directory, records wait in memory up to the queue's bound.
        self.backlog = Backlog(self.spill, memory_bound=memory_bound)
        self.transport = make_transport(self.undelivered)
        self._hand_to_thread = hand_to_thread
        self.serving_for_caller = False
        self.sent = 0
        self.dropped = 0  # records that could be kept neither in Kafka, nor on disk, nor in memory
        self.retry_at = 0.0  # no sends before this monotonic time
        self._resending: _Resend | None = None  # a batch of the backlog Kafka has not answered yet
        self._backoff = Backoff(first_s=0.5, max_s=5.0)
        # The spill directory failing (full, read-only, not a directory): why, while it
        # lasts (None once it takes records again), and how many times it refused them.
        self.spill_error: OSError | None = None
        self.spill_errors = 0
        self._drop_reported = False
        # An earlier producer's spill file this one's disk could not take: when to try
        # again (the sender thread's tick), or None.
        self.orphans_again_at: float | None = None
        self._said_orphans_left = False
        self._said_unreadable: set[Path] = set()  # earlier spill files that could not be read

    def deliver(self, messages: list[Entry]) -> bool:
        """Send, or keep behind what waits; True when messages left for Kafka now."""
        self.retry_disk()
        if time.monotonic() < self.retry_at:
            self.keep(messages)
            return False
        if self.backlog.records and not self.resend():
            # Older records still wait on disk: these go behind them, in order. (Once all
            # of the backlog is in Kafka's hands, fresh messages follow it straight, not
            # through the file: a loop logging faster than the sender drains, whose queue
            # overflowed into the spill file, would otherwise write and read back every
            # record.)
            self.keep(messages)
            return False
        for i, entry in enumerate(messages):
            try:
                self.transport.send(entry)
            except TransportUnavailable as exc:
                self.keep(messages[i:])
                self._unreachable(exc)
                return False
            self.sent += count(entry[2])
        self._backoff.reset()
        return bool(messages)

    def _unreachable(self, reason: object) -> None:
        if self._backoff.fresh:
            log.info("trainmon: Kafka unreachable (%s); keeping records in %s until it returns",
                     reason, self.spill.path)
        self.retry_at = time.monotonic() + self._backoff.next()

    def resend(self, wait_until: float | None = None) -> bool:
        """Move the resend of the backlog on, oldest first, one batch at a time; True
        when all of it is in Kafka's hands (newer messages may follow it straight),
        False while part of it still waits on disk or Kafka failed a batch (back off).

        A batch stays in the spill file while it is in flight and is dropped from it only
        once Kafka has answered every message in it (a write-ahead log): a rank killed
        during the resend keeps it. The answers are collected at the sender's next turns,
        without waiting for them, unless ``wait_until`` (a flush's deadline) says to, or
        they are overdue (answers to newer messages kept the client busy): then the
        thread waits for them. A batch given up on before its answers came is sent again
        later: a record may reach Kafka twice, never zero times."""
        while True:
            if self._resending is not None:
                self.transport.serve()
                if self.transport.in_flight:
                    now = time.monotonic()
                    waited = now - self._resending.since
                    if (wait_until is not None and now < wait_until) or waited > _ANSWERS_WITHIN_S:
                        limit = wait_until if wait_until is not None else now + _ANSWERS_WITHIN_S
                        if not self.transport.flush(max(0.05, min(limit - now, _ANSWERS_WITHIN_S))) \
                                and waited > 2 * _ANSWERS_WITHIN_S:
                            self._resending = None  # unanswered: still on disk, sent again
                            self._unreachable("no answer from Kafka")
                            return False
                        continue
                    return self.backlog.records == self._resending.records
                if not self._confirm():
                    return False
            if not self.backlog.records:
                return True
            if not self._hand_over():
                return False

    def _hand_over(self) -> bool:
        """The backlog's oldest batch (about _BACKLOG_BATCH_BYTES) to Kafka, left on disk."""
        try:
            batch = self.backlog.peek(_BACKLOG_BATCH_BYTES)
        except OSError as exc:  # the disk failing under the file: try again later
            log.error("trainmon: cannot read back the spill file %s: %s", self.spill.path, exc)
            self._unreachable(exc)
            return False
        failed: list[Entry] = []
        try:
            for entry in batch:
                self.transport.send(entry, on_undelivered=failed.extend)
        except TransportUnavailable as exc:
            self._unreachable(exc)
            return False  # (what was handed over may still arrive: at worst sent twice)
        self._resending = _Resend(sum(count(value) for _, _, value in batch), failed, time.monotonic())
        return True

    def _confirm(self) -> bool:
        """Kafka answered every message of the batch in flight: let it go, but for what
        failed, which joins the end first (so it is on disk, or in memory, at every
        moment); False where none of it got through (back off)."""
        resent, self._resending = self._resending, None
        lost_again = sum(count(value) for _, _, value in resent.failed)
        if lost_again == resent.records:
            self._unreachable("Kafka took none of the records sent again")
            return False
        if resent.failed:
            self.keep(resent.failed)
        self.backlog.acknowledge()
        self.sent += resent.records - lost_again
        self._backoff.reset()
        return True

    def undelivered(self, entries: list[Entry]) -> None:
        """Kafka gave up on these: into the backlog, and no new sends until the backoff
        has passed, so they are not handed straight back to a client that cannot deliver
        them. They were counted as sent when handed over."""
        self.sent -= sum(count(value) for _, _, value in entries)
        if self.serving_for_caller:
            self._hand_to_thread(entries)
        else:
            self.keep(entries)
        self.postpone()

    def postpone(self) -> None:
        """No new sends until the backoff has passed: a message just failed."""
        self.retry_at = max(self.retry_at, time.monotonic() + self._backoff.next())

    def keep(self, entries: list[Entry]) -> bool:
        """Into the backlog: the spill file, else memory up to the bound; records beyond
        it are dropped and counted. Each is said once; never an error for the training
        loop. True when the records are on disk."""
        if not entries:
            return True
        kept = self.backlog.add(entries)
        self._said_disk(kept)
        if kept.dropped:
            self.dropped += kept.dropped
            if not self._drop_reported:
                self._drop_reported = True
                log.error("trainmon: %d records wait in memory for Kafka, the bound: further records "
                          "Kafka does not take are dropped and counted (this is said once; the count "
                          "is in the message at exit and in producer.dropped)",
                          self.backlog.memory_bound)
        return kept.on_disk

    def retry_disk(self) -> None:
        """While records wait in memory for a spill directory that failed, try it again
        (once a second at most): a disk with room again takes them back."""
        if self.backlog.in_memory:
            kept = self.backlog.retry_disk()
            if kept is not None:
                self._said_disk(kept)

    def _said_disk(self, kept: Kept) -> None:
        """The spill directory failing, or taking records again: said once each time."""
        if kept.disk_error is not None:
            self.spill_errors += 1
            if self.spill_error is None:
                log.error("trainmon: cannot keep records in the spill directory %s (%s): records Kafka "
                          "has not acknowledged wait in memory instead, up to %d, and a rank killed "
                          "before Kafka takes them loses them; the directory is tried again every "
                          "%.0f s (this is said once, and again should it recover and fail again)",
                          self.spill_dir, _said(kept.disk_error), self.backlog.memory_bound,
                          DISK_RETRY_S)
            self.spill_error = kept.disk_error
        elif kept.on_disk and self.spill_error is not None:
            self.spill_error = None
            log.warning("trainmon: the spill directory %s takes records again: %d records that waited "
                        "in memory are in %s now", self.spill_dir, kept.moved_to_disk, self.spill.path)

    def adopt_orphans(self) -> None:
        """Earlier producers' spill files left on this machine: their records join the
        backlog, and each file is deleted once they are on disk here."""
        self.orphans_again_at = None
        try:
            if claim_orphans(self.spill_dir, self._keep_on_disk, own=self.spill.path,
                             unreadable=self._unreadable_orphan):
                # Another producer's file, locked (a rank beside this one, or the one this
                # one restarted, still exiting), or one that could not be read. Looked at
                # again, so that the former's records leave once it is gone, not at the
                # next start (there may be none).
                again = time.monotonic() + ORPHANS_RETRY_S
                self.orphans_again_at = min(self.orphans_again_at or again, again)
        except OSError as exc:  # an unreadable spill directory: nothing of earlier runs to send
            log.warning("trainmon: cannot read the spill directory %s: %s", self.spill_dir, exc)

    def _unreadable_orphan(self, path: Path, exc: OSError) -> None:
        if path not in self._said_unreadable:  # (tried again every ORPHANS_RETRY_S: said once)
            self._said_unreadable.add(path)
            log.warning("trainmon: cannot read an earlier producer's spill file %s (%s); its records "
                        "are not sent until it can be read, the other files are", path, exc)

    def _keep_on_disk(self, entries: list[Entry]) -> bool:
        """An earlier producer's records: into this one's spill file, else left in theirs
        for a later start. Not into memory: with the disk failing, memory would only hold
        copies of records safe on disk, count them dropped should they not fit, and crowd
        out this run's own."""
        kept = self.backlog.add_to_disk(entries)
        if not kept.on_disk:
            if not self._said_orphans_left:
                self._said_orphans_left = True
                log.warning("trainmon: cannot take an earlier producer's spill file into %s (%s); it "
                            "stays where it is, and is tried again every %.0f s", self.spill_dir,
                            kept.disk_error, ORPHANS_RETRY_S)
            self.orphans_again_at = time.monotonic() + ORPHANS_RETRY_S
        return kept.on_disk

    def flush(self, deadline: float) -> bool:
        """Everything acknowledged by the deadline (the backlog first)?"""
        # Keep at it until the deadline, as a large backlog only fits into Kafka as
        # acknowledgements come.
        while True:
            while self.backlog.records and time.monotonic() < deadline:
                if not self.resend(wait_until=deadline):
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            remaining = deadline - time.monotonic()
            flushed = remaining > 0 and self.transport.flush(remaining)
            # Messages Kafka gave up on during that flush are back in the backlog: while
            # there is time, send them again.
            if not self.backlog.records or deadline - time.monotonic() < 0.5:
                break
        return flushed and not self.backlog.records

    def close(self, timeout: float) -> None:
        """The client closed (what it still held back in the backlog), the spill file
        released, and what is lost said."""
        self.transport.close(timeout=timeout)
        if self._resending is not None and not self.transport.in_flight:
            # The client's close waited out a batch sent again (from memory, say): where
            # Kafka took it, it is delivered, not lost with the rest of memory.
            self._confirm()
        lost = self.backlog.discard_memory()
        if lost:
            self.dropped += lost
            log.error("trainmon: %d records kept in memory (the spill directory %s could not be "
                      "written) were not taken by Kafka before exit", lost, self.spill_dir)
        if self.spill.count:
            log.warning("trainmon: %d records could not reach Kafka; they are kept in %s and "
                        "sent by the next trainmon producer that starts", self.spill.count,
                        self.spill.path)
        if self.dropped:
            log.error("trainmon: %d records were dropped: Kafka did not take them and the "
                      "spill directory %s could not keep them", self.dropped, self.spill_dir)
        try:
            self.spill.close()
        except OSError:
            pass


def _said(error: OSError) -> str:
    """An OSError as a log line says it: a full disk as "no space left", whatever the
    platform's wording."""
    if error.errno == errno.ENOSPC:
        return f"no space left on the device: {error}"
    return str(error)
