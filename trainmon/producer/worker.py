"""The background worker: a bounded in-memory queue drained by one daemon thread.

The calling (training) thread only puts records on a queue. The worker thread serializes,
hands records to the transport, and when the broker is unreachable moves them to the
spill file instead of holding them in memory, retrying with backoff. Modelled on the
Sentry SDK's worker: never block the caller, flush at exit.

No polling when there is nothing to do: the thread sleeps until a record arrives in an
empty queue. It then needs the GIL, which the training thread holds until its burst of
log calls is done, so records logged together (the GPU records of one sample) leave
together. While records come faster than one message per ``pack_window_s`` (above 1.25
steps/s with a 0.8 s window), it stops being woken per record and gathers them on a
timer instead, one message per window: a thread wake-up and a Kafka request cost far
more than a record, and at these rates caches are cold at every wake. A window ends early
once a full message's worth (MAX_RECORDS_PER_MESSAGE) is queued, and for a flush. A
record logged after a quiet spell leaves at once; none waits longer than the window. A
bulk source sets ``linger_s`` to pack more per message. Kafka reports failed messages
only (they are spilled); those are collected at each wake, and every few seconds while
messages are unacknowledged; a flush collects them at once. While records wait in the
spill file, it wakes at their retry time. At 10 steps/s that is one wake per window.

A record logged after a quiet spell, while the thread waits for work with everything
before it acknowledged, is sent by the log call itself (``_send_now``): building and
handing one record to librdkafka (whose produce never blocks) costs the training thread
less than waking a second thread with cold caches to do it. Meanwhile the thread
watches: it wakes every ``_WATCH_S`` while the log calls send, to collect Kafka's reports
(a failed message is spilled), and waits for a record alone after a watch in which none
was sent. At 1 step/s that is one wake per ``_WATCH_S`` instead of one per step.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import typing
import weakref
from functools import lru_cache
from typing import Any, Callable

from ..kafka_client.errors import TransportUnavailable
from ..schemas import MAX_MESSAGE_BYTES, MAX_RECORDS_PER_MESSAGE, Record, count, encode, pack
from ..schemas.jsonsafe import json_safe
from .deferred import DeferredRecord
from .backlog import Backlog
from .spill import Entry, SpillFile, claim_orphans

log = logging.getLogger("trainmon.producer")

Observer = Callable[[Record], None]
Rejecter = Callable[[Record, str], None]


# Kafka's reports (librdkafka queues one per message, success or not; only a failure runs
# a callback, which spills the message) are collected at a tick at most this often, and
# while messages are unacknowledged the thread wakes for them after _ANSWER_WAIT_S. A
# message fails at the earliest after the delivery timeout (5 s) unless Kafka refuses it
# outright, so a failure is on disk a second or two later; records logged at 1 step/s
# wake the thread sooner anyway, so the timed wake adds no wake-up there.
_SERVE_EVERY_S = 1.0
_ANSWER_WAIT_S = 2.0
# The sender thread holds the GIL at most about this long before handing it back to the
# training thread (the clock is read every _HOLD_CHECK_EVERY records). Handing it back
# every 16 records (~80 µs) instead, a producer logging flat out spent 16.6-16.9 µs of CPU
# per record against 14.9-16.0, and delivered 44k records/s against 52-56k (measured):
# each hand-back costs two thread switches, and the thread then waits out the training
# thread's 5 ms switch interval before it may go on. At training rates a wake encodes a
# few records, far below either.
_HOLD_S = 0.0005
_HOLD_CHECK_EVERY = 16
# While log calls send their own records, the thread wakes this often to collect Kafka's
# reports: a message Kafka gives up on (after the 5 s delivery timeout) is on disk within
# this much more, even if the loop logs nothing after it.
_WATCH_S = 10.0
# Records sent again from the backlog go in batches of about this size; the thread waits
# for Kafka's answer to each batch (every message fails within the delivery timeout, 5 s,
# while the broker is away) before the next, and returns to the queue after _BACKLOG_TURN_S.
_BACKLOG_BATCH_BYTES = 8 << 20
_ANSWERS_WITHIN_S = 10.0
_BACKLOG_TURN_S = 1.0


class _Flush:
    def __init__(self, timeout: float):
        self.deadline = time.monotonic() + timeout
        self.done = threading.Event()
        self.ok = False


class _Stop:
    pass


class _Encoded:
    """A record a log call encoded but could not hand to Kafka itself: the thread sends it."""

    __slots__ = ("entry",)

    def __init__(self, entry: Entry):
        self.entry = entry


class Worker:
    def __init__(self, make_transport, spill_dir, spill_name: str, queue_size: int = 100_000,
                 yield_to_caller: bool = True, linger_s: float = 0.0, pack_window_s: float = 0.0,
                 observers: list[Observer] | None = None, max_record_bytes: int = 1_000_000,
                 on_reject: Rejecter | None = None):
        self._make_transport = make_transport
        self._linger_s = linger_s
        self._pack_window_s = pack_window_s
        # A training loop wants the GIL back promptly; a bulk source (trainmon ingest),
        # whose own thread only produces records, is faster without the hand-backs.
        self._yield_to_caller = yield_to_caller
        self._spill_dir = spill_dir
        self._spill_name = spill_name
        self._queue_size = queue_size
        self._observers = observers or []
        # Kafka refuses a message over its size limit on every retry: such a record would
        # sit at the head of the spill file and hold back every record behind it.
        self._max_record_bytes = max_record_bytes
        self._on_reject = on_reject or (lambda record, reason: log.error(
            "trainmon: dropped a %s record: %s", record.kind, reason))
        self.sent = 0
        self.dropped = 0  # records that could be kept neither in Kafka, nor on disk, nor in memory
        # Log calls may send their own records after a quiet spell (see the module's
        # docstring) where nothing of theirs waits on a file (the observers) and the
        # client's send never blocks (librdkafka's; kafka-python's may wait for metadata).
        self._quiet_calls_send = yield_to_caller and not linger_s and not self._observers
        self._reset()
        self_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (w := self_ref()) and w._reset())

    def _reset(self) -> None:
        """Fresh state: at construction and in a forked child, which must neither use the
        parent's thread, sockets or spill file nor send the parent's queued records."""
        # A C queue: put and get are single calls, and a put wakes the thread only while
        # it is blocked in get (not while it gathers on its timer).
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._last_sent = -1e9  # monotonic time of the latest message handed to Kafka
        self._gathering = False  # records come faster than one message per pack window
        # Ends a window early: set by a log call that finds a full message's worth queued,
        # and by flush / close.
        self._window_over = threading.Event()
        self._served_at = 0.0  # monotonic time Kafka's reports were last collected
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._spill = SpillFile(self._spill_dir, self._spill_name)
        # Without a usable spill directory, records wait in memory up to the queue's bound.
        self._backlog = Backlog(self._spill, memory_bound=self._queue_size)
        self._transport = self._make_transport(self._undelivered)
        self._disk_error_reported = False
        self._drop_reported = False
        self._retry_at = 0.0
        self._backoff = 0.5
        self._closed = False
        # Held by the sender thread except while it waits; a log call sends its own record
        # only when it can take the lock at once and the thread is watching (not working,
        # every record queued before delivered).
        self._lock = threading.Lock()
        self._watching = False
        self._watch_next = False  # the next wait for records watches (see _wait)
        self._sent_by_callers = 0
        self._serving_for_caller = False  # Kafka's reports are being collected by a log call
        self._callers_may_send = (self._quiet_calls_send
                                  and getattr(self._transport, "sends_without_blocking", False))

    @property
    def spilled(self) -> int:
        """Records waiting in the spill file for Kafka."""
        return self._backlog.on_disk

    @property
    def held_in_memory(self) -> int:
        """Records waiting in memory for Kafka because the spill file cannot be written."""
        return self._backlog.in_memory

    @property
    def queued(self) -> int:
        """Records handed to submit and not yet taken by the worker thread."""
        return self._items.qsize()

    @property
    def spill_path(self):
        return self._spill.path

    def submit(self, topic: str, key: bytes, record: Record | tuple) -> None:
        """Queue a record: built, or a log call's checked values (``deferred.queued``)."""
        if self._thread is None:
            self._start()
        if self._watching and type(record) is tuple:  # (a log call's, see deferred.queued)
            now = time.monotonic()
            if now - self._last_sent >= self._pack_window_s and self._send_now(topic, key, record, now):
                return
        if self._items.qsize() >= self._queue_size:
            # The worker is far behind: keep memory bounded and the record safe on disk.
            entry = self._entry(topic, key, record)
            if entry is not None:
                self._keep([entry])
            return
        # A log call's values go in flat, one tuple: see deferred.queued.
        self._items.put((topic, key, record) if type(record) is not tuple else (topic, key, *record))
        # After the put, not before: from here on no log call sends by itself until the
        # thread has delivered this record (a record sent at once would overtake it).
        self._watching = False
        if (self._gathering and self._items.qsize() >= MAX_RECORDS_PER_MESSAGE
                and not self._window_over.is_set()):
            self._window_over.set()

    def _send_now(self, topic: str, key: bytes, record: tuple, now: float) -> bool:
        """Send a record on the caller's thread; False where the thread must do it."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._watching or self._closed:
                return False
            # Kafka's reports of earlier messages first (librdkafka counts a message until
            # its report is collected, even a success): only with every one of them
            # answered, and none failed, may this record go ahead of the thread.
            transport = self._transport
            self._serving_for_caller = True
            try:
                transport.serve()
            finally:
                self._serving_for_caller = False
            if transport.in_flight or self._backlog.records or now < self._retry_at:
                return False
            entry = self._entry(topic, key, record)
            if entry is None:  # rejected (counted and logged)
                return True
            try:
                transport.send(entry)
            except TransportUnavailable:
                self._items.put(_Encoded(entry))  # the thread spills it and backs off
                self._watching = False
                return True
            self.sent += 1
            self._sent_by_callers += 1
            self._last_sent = now
            return True
        finally:
            self._lock.release()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="trainmon-producer", daemon=True)
                self._thread.start()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record so far is acknowledged by Kafka; False if it could not be."""
        if self._thread is None:
            self._start()
        marker = _Flush(timeout)
        self._items.put(marker)
        self._watching = False
        self._window_over.set()
        marker.done.wait(timeout + 1.0)
        return marker.ok

    def close(self, timeout: float = 10.0) -> bool:
        if self._closed:
            return True
        ok = self.flush(timeout)
        self._closed = True
        if self._thread is not None:
            self._items.put(_Stop())
            self._watching = False
            self._window_over.set()
            self._thread.join(timeout + 1.0)
        self._transport.close(timeout=max(0.5, timeout / 2))
        lost = self._backlog.discard_memory()
        if lost:
            self.dropped += lost
            log.error("trainmon: %d records kept in memory (the spill directory %s could not be "
                      "written) were not taken by Kafka before exit", lost, self._spill_dir)
        if self._spill.count:
            log.warning("trainmon: %d records could not reach Kafka; they are kept in %s and "
                        "sent by the next trainmon producer that starts", self._spill.count,
                        self._spill.path)
        if self.dropped:
            log.error("trainmon: %d records were dropped: Kafka did not take them and the "
                      "spill directory %s could not keep them", self.dropped, self._spill_dir)
        try:
            self._spill.close()
        except OSError:
            pass
        return ok and not self.dropped

    # -- worker thread -------------------------------------------------------------

    def _run(self) -> None:
        with self._lock:
            try:
                claim_orphans(self._spill_dir, self._adopt, own=self._spill.path)
            except OSError as exc:  # an unreadable spill directory: nothing of earlier runs to send
                log.warning("trainmon: cannot read the spill directory %s: %s", self._spill_dir, exc)
            while True:
                try:
                    if self._tick():
                        return
                except Exception:  # last resort: this thread is every later record's way to Kafka
                    log.exception("trainmon: the producer's sender thread hit an error; it goes on")

    def _wait(self, timeout: float | None):
        """The next queued item, waiting up to timeout (None: for ever) without the lock;
        None when the time passed. Watches (log calls may send) where it can."""
        watch = self._callers_may_send and self._watch_next and not self._backlog.records
        if watch:
            timeout = _WATCH_S if timeout is None else min(timeout, _WATCH_S)
            sent_before = self._sent_by_callers
            self._watching = True
            if self._items.qsize():  # (a record put before the flag was set)
                self._watching = False
        self._lock.release()
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            return None
        finally:
            self._lock.acquire()
            self._watching = False
            if watch:
                # Watch again while log calls send; a watch without one ends it, and the
                # next record wakes the thread.
                self._watch_next = self._sent_by_callers != sent_before

    def _next_items(self) -> list:
        """What is queued, once there is something to do ([] when only a timed duty is)."""
        if self._gathering:
            # Sleep out the window instead of being woken per record; a window that
            # gathered nothing ends this, and the next record wakes the thread again.
            self._wait_window(self._last_sent + self._pack_window_s - time.monotonic())
            items = self._drain([])
            self._gathering = bool(items)
            return items
        timeout = _ANSWER_WAIT_S if self._transport.in_flight else None
        if self._backlog.records:
            retry_in = max(0.01, self._retry_at - time.monotonic())
            timeout = retry_in if timeout is None else min(timeout, retry_in)
        first = self._wait(timeout)
        if first is None:
            return []
        if isinstance(first, (tuple, _Encoded)):
            if self._linger_s:
                self._sleep(self._linger_s)  # a bulk source: let more records join this one
            elif (wait := self._last_sent + self._pack_window_s - time.monotonic()) > 0:
                # Records come faster than one message per window: this one joins the next.
                self._gathering = True
                self._wait_window(wait)
        return self._drain([first])

    def _wait_window(self, seconds: float) -> None:
        """Sleep out the pack window, or less (see _window_over). (_gathering is set by now:
        a record queued from here on is seen by the log call that queues it.)"""
        if self._items.qsize() >= MAX_RECORDS_PER_MESSAGE:
            return
        self._lock.release()
        try:
            self._window_over.wait(max(0.0, seconds))
        finally:
            self._window_over.clear()
            self._lock.acquire()

    def _sleep(self, seconds: float) -> None:
        self._lock.release()
        try:
            time.sleep(max(0.0, seconds))
        finally:
            self._lock.acquire()

    def _drain(self, items: list) -> list:
        try:
            for _ in range(self._items.qsize()):
                items.append(self._items.get_nowait())
        except queue.Empty:  # (only this thread takes items; kept for safety)
            pass
        return items

    def _tick(self) -> bool:
        """Encode and deliver what is queued; True when told to stop."""
        items = self._next_items()
        if self._transport.in_flight and time.monotonic() - self._served_at >= _SERVE_EVERY_S:
            # Kafka's reports so far (a failed message is spilled). Only messages handed
            # over before this tick can have one.
            self._served_at = time.monotonic()
            self._transport.serve()
        entries: list[Entry] = []
        held_since = time.perf_counter()
        for item in items:
            if type(item) is _Encoded:
                entries.append(item.entry)
                continue
            if isinstance(item, tuple):
                entry = self._encode(item)
                if entry is not None:
                    entries.append(entry)
                if (self._yield_to_caller and len(entries) % _HOLD_CHECK_EVERY == 0
                        and time.perf_counter() - held_since >= _HOLD_S):
                    # Hand the GIL back to the training thread now and then, instead
                    # of making it wait out the interpreter's 5 ms switch interval.
                    time.sleep(0)
                    held_since = time.perf_counter()
                continue
            self._deliver(entries)
            entries = []
            if isinstance(item, _Stop):
                return True
            self._finish_flush(item)
        if entries or (self._backlog.records and time.monotonic() >= self._retry_at):
            self._deliver(entries)
        return False

    def _encode(self, item: tuple) -> Entry | None:
        topic, key = item[0], item[1]
        record = item[2] if len(item) == 3 else DeferredRecord.from_queued(item[2:])
        if not self._observers:
            return self._entry(topic, key, record)
        encoded = self._encoded(record)
        if encoded is None:
            return None
        record, value = encoded  # the observers see what Kafka gets
        for observe in self._observers:
            try:
                observe(record)
            except Exception:  # a local log sink must never cost a record
                log.exception("trainmon: local log sink failed")
        return self._checked(topic, key, record, value)

    def _entry(self, topic: str, key: bytes, record: Record | DeferredRecord | tuple) -> Entry | None:
        """The message of one record (the observers not told), or None once it is rejected."""
        if type(record) is tuple:
            record = DeferredRecord.from_queued(record)
        if type(record) is DeferredRecord and not self._observers:
            # A log call's numbers, written without pydantic: the path of nearly every
            # record of a training loop, kept short (it runs with cold caches).
            try:
                value = record.encode()
            except Exception as exc:  # (the quick check vouched for its fields)
                self._reject(record, f"{type(exc).__name__}: {exc}")
                return None
            if len(value) <= self._max_record_bytes:
                return topic, key, value
            return self._checked(topic, key, record, value)
        encoded = self._encoded(record)
        return None if encoded is None else self._checked(topic, key, *encoded)

    def _encoded(self, record: Record | DeferredRecord) -> tuple[Record, bytes] | None:
        """The record and its JSON, or None once it is rejected: one record that cannot
        be built or encoded is counted and logged, never an exception that ends the
        sender thread."""
        if type(record) is DeferredRecord:
            try:
                record = record.build()  # (the observers are handed records)
            except Exception as exc:  # (the quick check vouched for its fields)
                self._reject(record, f"{type(exc).__name__}: {exc}")
                return None
        try:
            return encode_safely(record)
        except Exception as exc:
            self._reject(record, f"cannot be written as JSON: {type(exc).__name__}: {exc}")
            return None

    def _checked(self, topic: str, key: bytes, record: Record, value: bytes) -> Entry | None:
        if len(value) > self._max_record_bytes:
            if type(record) is DeferredRecord:
                record = record.build()  # (numbers only: never this large in practice)
            self._reject(record, too_large(record, len(value), self._max_record_bytes))
            return None
        return topic, key, value

    def _reject(self, record: Record, reason: str) -> None:
        try:
            self._on_reject(record, reason)
        except Exception:
            log.exception("trainmon: dropped a %s record: %s", record.kind, reason)

    def _deliver(self, entries: list[Entry]) -> None:
        messages = pack_messages(entries)
        if self._backlog.records:
            # Older records wait for Kafka: these go behind them, in order.
            self._keep(messages)
            if time.monotonic() >= self._retry_at:
                self._send_backlog(time.monotonic() + _BACKLOG_TURN_S)
            return
        if time.monotonic() < self._retry_at:
            self._keep(messages)
            return
        for i, entry in enumerate(messages):
            try:
                self._transport.send(entry)
            except TransportUnavailable as exc:
                self._keep(messages[i:])
                self._unreachable(exc)
                return
            self.sent += count(entry[2])
        self._backoff = 0.5
        if messages:
            self._last_sent = time.monotonic()
            self._watch_next = True

    def _unreachable(self, reason: object) -> None:
        if self._backoff == 0.5:
            log.info("trainmon: Kafka unreachable (%s); keeping records in %s until it returns",
                     reason, self._spill.path)
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)

    def _send_backlog(self, until: float, answers_by: float | None = None) -> bool:
        """Send what waits for Kafka, oldest first, one batch at a time, until it is all
        acknowledged (True) or Kafka fails one (False: back off) or ``until`` passes.

        A batch stays in the spill file while it is in flight and is dropped from it only
        once Kafka has answered every message in it (a write-ahead log): a rank killed
        during the retry keeps it. Waiting for the answers holds this thread (not the
        training loop, whose records queue meanwhile) at most the delivery timeout, or
        until ``answers_by`` (a flush's deadline). A batch given up on before its answers
        came is sent again later: a record may reach Kafka twice, never zero times."""
        while self._backlog.records:
            batch = self._backlog.peek(_BACKLOG_BATCH_BYTES)
            failed: list[Entry] = []
            try:
                for entry in batch:
                    self._transport.send(entry, on_undelivered=failed.extend)
            except TransportUnavailable as exc:
                self._unreachable(exc)
                return False  # (what was handed over may still arrive: at worst sent twice)
            wait = _ANSWERS_WITHIN_S if answers_by is None else answers_by - time.monotonic()
            if not self._transport.flush(max(0.1, min(_ANSWERS_WITHIN_S, wait))):
                self._unreachable("no answer from Kafka")  # unanswered: still on disk
                return False
            records = sum(count(value) for _, _, value in batch)
            lost_again = sum(count(value) for _, _, value in failed)
            if lost_again == records:
                self._unreachable("Kafka took none of the records sent again")
                return False
            if failed:
                # Kafka took part of the batch: the rest joins the end before the batch
                # is let go, so it is on disk (or in memory) at every moment.
                self._keep(failed)
            self._backlog.acknowledge()
            self.sent += records - lost_again
            self._backoff = 0.5
            self._last_sent = time.monotonic()
            if time.monotonic() >= until:
                break
        return not self._backlog.records

    def _undelivered(self, entries: list[Entry]) -> None:
        """Kafka gave up on these (no acknowledgement within the delivery timeout: the
        broker is away): into the backlog, and no new sends until the backoff has
        passed, so they are not handed straight back to a client that cannot deliver
        them. Runs where the client reports deliveries (the worker's thread for
        librdkafka, kafka-python's own thread). They were counted as sent when handed over."""
        self.sent -= sum(count(value) for _, _, value in entries)
        if self._serving_for_caller:
            # The thread keeps them, not the training loop's call.
            for entry in entries:
                self._items.put(_Encoded(entry))
            self._watching = False
        else:
            self._keep(entries)
        self._retry_at = max(self._retry_at, time.monotonic() + self._backoff)
        self._backoff = min(self._backoff * 2, 5.0)

    def _keep(self, entries: list[Entry]) -> bool:
        """Into the backlog: the spill file, else memory up to the bound; records beyond
        it are dropped and counted. Each is said once; never an error for the training
        loop. True when the records are on disk."""
        if not entries:
            return True
        kept = self._backlog.add(entries)
        if kept.disk_error is not None and not self._disk_error_reported:
            self._disk_error_reported = True
            log.error("trainmon: cannot keep records in the spill directory %s (%s): records Kafka "
                      "has not acknowledged wait in memory instead, up to %d, and a rank killed "
                      "before Kafka takes them loses them (this is said once)",
                      self._spill_dir, kept.disk_error, self._backlog.memory_bound)
        if kept.dropped:
            self.dropped += kept.dropped
            if not self._drop_reported:
                self._drop_reported = True
                log.error("trainmon: %d records wait in memory for Kafka, the bound: further records "
                          "Kafka does not take are dropped and counted (this is said once; the count "
                          "is in the message at exit and in producer.dropped)",
                          self._backlog.memory_bound)
        return kept.on_disk

    def _adopt(self, entries: list[Entry]) -> bool:
        """An earlier producer's spilled records (see claim_orphans): True once on disk here."""
        return self._keep(entries)

    def _finish_flush(self, marker: _Flush) -> None:
        # Records that wait for Kafka go out first; keep at it until the deadline, as a
        # large backlog only fits into Kafka as acknowledgements come.
        while True:
            while self._backlog.records and time.monotonic() < marker.deadline:
                if not self._send_backlog(marker.deadline, answers_by=marker.deadline):
                    time.sleep(min(0.2, max(0.0, marker.deadline - time.monotonic())))
            remaining = marker.deadline - time.monotonic()
            flushed = remaining > 0 and self._transport.flush(remaining)
            # Messages Kafka gave up on during that flush are back in the backlog: while
            # there is time, send them again.
            if not self._backlog.records or marker.deadline - time.monotonic() < 0.5:
                break
        marker.ok = flushed and not self._backlog.records
        marker.done.set()


def encode_safely(record: Record) -> tuple[Record, bytes]:
    """A record and its JSON, for any value a caller could put in it.

    pydantic takes anything into a free-form field (``RunRecord.config``, typed
    ``dict[str, Any]``) but cannot serialize ``torch.bfloat16``, a numpy array,
    ``object()`` or a dict that holds itself, and writes nesting deeper than consumers can
    parse. Free-form fields therefore always go through ``json_safe`` (odd values become
    text, anything JSON holds keeps its value), as does any other field that fails to
    serialize. The record returned is a copy when a field was changed."""
    free = _free_form_fields(type(record))
    if free:
        record = record.model_copy(update={name: json_safe(getattr(record, name)) for name in free
                                           if getattr(record, name) is not None})
    try:
        return record, encode(record)
    except Exception:
        pass
    fixed = {}
    for name in type(record).model_fields:
        try:
            record.model_dump_json(include={name})
        except Exception:
            fixed[name] = json_safe(getattr(record, name))
    safe = record.model_copy(update=fixed)
    return safe, encode(safe)


@lru_cache(maxsize=None)
def _free_form_fields(model: type[Record]) -> tuple[str, ...]:
    """Fields whose type lets any value in (``Any`` somewhere in the annotation)."""
    return tuple(name for name, field in model.model_fields.items()
                 if _mentions_any(field.annotation))


def _mentions_any(annotation) -> bool:
    return annotation is Any or any(_mentions_any(a) for a in typing.get_args(annotation))


def pack_messages(entries: list[Entry]) -> list[Entry]:
    """Encoded records -> Kafka messages: the records of each (topic, key) packed in
    order, up to MAX_RECORDS_PER_MESSAGE and MAX_MESSAGE_BYTES per message."""
    if len(entries) == 1:
        return entries  # (the common case at training rates: one record, as it is)
    by_key: dict[tuple[str, bytes], list[bytes]] = {}
    for topic, key, value in entries:
        by_key.setdefault((topic, key), []).append(value)
    messages: list[Entry] = []
    for (topic, key), values in by_key.items():
        start, size = 0, 0
        for i, value in enumerate(values):
            if i > start and (i - start >= MAX_RECORDS_PER_MESSAGE
                              or size + len(value) > MAX_MESSAGE_BYTES):
                messages.append((topic, key, pack(values[start:i])))
                start, size = i, 0
            size += len(value) + 1
        messages.append((topic, key, pack(values[start:])))
    return messages


def too_large(record: Record, size: int, limit: int) -> str:
    """Why a record cannot go to Kafka, naming its largest field."""
    sizes = {name: len(json.dumps(value, default=str)) for name, value in record.__dict__.items()}
    field = max(sizes, key=sizes.get)
    step = getattr(record, "step", None)
    return (f"{size:,} bytes of JSON{f' at step {step}' if step is not None else ''}, over the "
            f"{limit:,}-byte limit of one Kafka message; its largest field is {field!r} "
            f"(~{sizes[field]:,} bytes)")
