"""The background worker: a bounded in-memory queue drained by one daemon thread.

The calling (training) thread only puts records on a queue. The worker thread encodes
them (encoding.py), packs them into messages (packing.py) and hands those to delivery.py,
which sends them and keeps what Kafka does not take (the spill file, a write-ahead log)
until it does, retrying with backoff. This module schedules: when the thread wakes, what
it gathers, when a log call may send its own record. Modelled on the Sentry SDK's worker:
never block the caller, flush at exit.

No polling when there is nothing to do: the thread sleeps until a record arrives in an
empty queue. It then needs the GIL, which the training thread holds until its burst of
log calls is done, so records logged together (the GPU records of one sample) leave
together. While records come faster than one message per ``pack_window_s`` (above 2
steps/s with a 0.5 s window), it stops being woken per record and gathers them on a
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

import logging
import os
import queue
import threading
import time
import weakref

from ..kafka_client.errors import TransportUnavailable
from ..kafka_client.transport import Entry
from ..schemas import MAX_RECORDS_PER_MESSAGE, Record, count
from .delivery import Delivery
from .encoding import Encoder, Observer, Rejecter
from .packing import pack_messages

log = logging.getLogger("trainmon.producer")


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
# Messages a log call may leave unanswered before it reads the answers itself, where the
# transport's answers may wait (the thread's watch reads them every _WATCH_S).
_UNREAD_ANSWERS_MAX = 64
# After an error the sender thread did not expect, it pauses this long before its next
# tick, twice as long after each further error in a row, up to the maximum.
_ERROR_PAUSE_MIN_S = 0.01
_ERROR_PAUSE_MAX_S = 5.0


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
        self._encoder = Encoder(self._observers, max_record_bytes, on_reject or (
            lambda record, reason: log.error("trainmon: dropped a %s record: %s", record.kind, reason)))
        # Log calls may send their own records after a quiet spell (see the module's
        # docstring) where nothing of theirs waits on a file (the observers) and the
        # client's send never blocks (librdkafka's; kafka-python's may wait for metadata).
        self._quiet_calls_send = yield_to_caller and not linger_s and not self._observers
        self._reset()
        self_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (w := self_ref()) and w._after_fork())

    def _after_fork(self) -> None:
        self._delivery.spill.forget_after_fork()  # (the parent's file, and its lock)
        self._reset()

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
        self._delivery = Delivery(self._make_transport, self._spill_dir, self._spill_name,
                                  memory_bound=self._queue_size, hand_to_thread=self._hand_to_thread)
        self._transport = self._delivery.transport
        self._backlog = self._delivery.backlog
        self._closed = False
        self._said_closed = False
        # Held by the sender thread except while it waits; a log call sends its own record
        # only when it can take the lock at once and the thread is watching (not working,
        # every record queued before delivered).
        self._lock = threading.Lock()
        self._watching = False
        self._watch_next = False  # the next wait for records watches (see _wait)
        self._sent_by_callers = 0
        self._serving_for_caller = False  # Kafka's reports are being collected by a log call
        self._in_hand: list = []  # what the current tick took from the queue (see _rescue)
        self._callers_may_send = (self._quiet_calls_send
                                  and getattr(self._transport, "sends_without_blocking", False))
        # A transport whose answers a log call need not read before it sends (the relay's:
        # reading them is a recv, tens of µs with cold caches at 1 step/s). The thread reads
        # them at its watch (_WATCH_S), a flush at once; a message that failed is kept
        # then, and records sent meanwhile may reach Kafka before it is sent again, as the
        # thread's own messages sent while earlier ones were unanswered may.
        self._answers_may_wait = getattr(self._transport, "answers_may_wait", False)
        # A transport that takes a log call's checked values and has them written as JSON
        # elsewhere (the node's relay: kafka_client/relay_transport.py), or None.
        self._send_values = getattr(self._transport, "send_values", None)

    @property
    def sent(self) -> int:
        """Records handed to Kafka and not reported failed."""
        return self._delivery.sent

    @property
    def dropped(self) -> int:
        """Records kept neither in Kafka, nor on disk, nor in memory."""
        return self._delivery.dropped

    @property
    def spilled(self) -> int:
        """Records waiting in the spill file for Kafka."""
        return self._backlog.on_disk

    @property
    def held_in_memory(self) -> int:
        """Records waiting in memory for Kafka because the spill file cannot be written."""
        return self._backlog.in_memory

    @property
    def spill_error(self) -> OSError | None:
        """Why the spill directory refuses records (e.g. ENOSPC: a full disk), while it
        does; None once it takes them again."""
        return self._delivery.spill_error

    @property
    def spill_errors(self) -> int:
        """How many times the spill directory refused records (a counter for metrics)."""
        return self._delivery.spill_errors

    @property
    def queued(self) -> int:
        """Records handed to submit and not yet taken by the worker thread."""
        return self._items.qsize()

    @property
    def in_flight(self) -> int:
        """Messages handed to Kafka and not answered yet."""
        return self._transport.in_flight

    @property
    def last_sent_at(self) -> float | None:
        """When (time.monotonic) records last left for Kafka; None before the first."""
        return self._last_sent if self._last_sent > 0 else None

    @property
    def spill_path(self):
        return self._delivery.spill.path

    def submit(self, topic: str, key: bytes, record: Record | tuple) -> None:
        """Queue a record: built, or a log call's checked values (``deferred.queued``)."""
        if self._closed:
            self._keep_after_close([(topic, key, record) if type(record) is not tuple else (topic, key, *record)])
            return
        if self._thread is None:
            self._start()
        if self._watching and type(record) is tuple:  # (a log call's, see deferred.queued)
            now = time.monotonic()
            if now - self._last_sent >= self._pack_window_s and self._send_now(topic, key, record, now):
                return
        if self._items.qsize() >= self._queue_size:
            # The worker is far behind: keep memory bounded and the record safe on disk.
            entry = self._encoder.entry(topic, key, record)
            if entry is not None:
                self._delivery.keep([entry])
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
            # answered, and none failed, may this record go ahead of the thread. Except
            # where answers may wait (the relay's: see _answers_may_wait).
            transport, delivery = self._transport, self._delivery
            if not (self._answers_may_wait and transport.in_flight < _UNREAD_ANSWERS_MAX):
                delivery.serving_for_caller = True
                try:
                    transport.serve()
                finally:
                    delivery.serving_for_caller = False
                if transport.in_flight:
                    return False
            if self._backlog.records or now < delivery.retry_at:
                return False
            if self._send_values is None or not self._send_values(topic, key, record, self._values_entry):
                entry = self._encoder.entry(topic, key, record)
                if entry is None:  # rejected (counted and logged)
                    return True
                try:
                    transport.send(entry)
                except TransportUnavailable:
                    self._items.put(_Encoded(entry))  # the thread spills it and backs off
                    self._watching = False
                    return True
            delivery.sent += 1
            self._sent_by_callers += 1
            self._last_sent = now
            return True
        finally:
            self._lock.release()

    def _values_entry(self, topic: str, key: bytes, item: tuple) -> Entry | None:
        """The JSON of a log call's values that failed through the relay (it is kept and
        sent again); None where the encoder rejects it, which then no longer counts as
        sent (it was counted when the call sent it), or where a log call is collecting the
        relay's answers: the values go back to the sender thread, which writes the JSON
        and keeps it, not the training loop's call (up to _UNREAD_ANSWERS_MAX at once)."""
        if self._delivery.serving_for_caller:
            self._delivery.sent -= 1
            self._delivery.postpone()
            self._items.put((topic, key, *item))
            self._watching = False
            return None
        entry = self._encoder.entry(topic, key, item)
        if entry is None:
            self._delivery.sent -= 1
        return entry

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
        self._delivery.close(timeout=max(0.5, timeout / 2))
        if not self._thread or not self._thread.is_alive():
            # A log call that found the producer open and queued its record after the
            # thread took its last items (only the thread takes them while it lives).
            self._keep_after_close(self._drain([]))
        return ok and not self.dropped

    def _keep_after_close(self, items: list) -> None:
        """Records logged once the producer closed (another thread of the job still logging
        at exit, say): no thread sends them now. They go to the spill file, which the next
        producer on this machine sends, or are counted dropped where it cannot take them."""
        entries = [entry for entry in map(self._entry_of, items) if entry is not None]
        if not entries:
            return
        records = sum(count(value) for _, _, value in entries)
        try:
            self._delivery.spill.append(entries)
        except OSError as exc:
            self._delivery.dropped += records
            log.error("trainmon: dropped %d record(s) logged after the producer closed: the spill "
                      "file %s cannot take them (%s)", records, self._delivery.spill.path, exc)
            return
        if not self._said_closed:
            self._said_closed = True
            log.warning("trainmon: a record was logged after the producer closed; it and any later "
                        "ones are kept in %s and sent by the next trainmon producer that starts "
                        "(this is said once)", self._delivery.spill.path)

    def _hand_to_thread(self, entries: list[Entry]) -> None:
        """Failures reported while a log call collected Kafka's reports: the thread keeps
        them, not the training loop's call."""
        for entry in entries:
            self._items.put(_Encoded(entry))
        self._watching = False

    # -- worker thread -------------------------------------------------------------

    def _run(self) -> None:
        with self._lock:
            self._delivery.adopt_orphans()
            pause = 0.0
            while True:
                try:
                    if self._tick():
                        return
                    pause = 0.0
                except Exception:  # last resort: this thread is every later record's way to Kafka
                    # An error that recurs at every tick must neither spin a core nor flood
                    # the job's log: the thread tries again after a pause that doubles, up
                    # to _ERROR_PAUSE_MAX_S (records meanwhile wait in the queue).
                    pause = min(_ERROR_PAUSE_MAX_S, max(_ERROR_PAUSE_MIN_S, 2 * pause))
                    log.exception("trainmon: the producer's sender thread hit an error; it tries "
                                  "again in %.2f s", pause)
                    try:
                        self._rescue()
                    except Exception:
                        log.exception("trainmon: could not keep the records in hand after that error")
                    self._sleep(pause)

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
        # Unanswered messages: their answers are collected in a while (a failure spilled).
        # A relay's come as the relay sends its next window, and one is nearly always
        # unanswered there: waking _ANSWER_WAIT_S after each would wake the thread every 2
        # s at 1 step/s; the watch's _WATCH_S bounds their wait as it does while log calls
        # send. Except while bytes wait to be written to the relay (its socket was full: a
        # large record), which each wake writes on.
        timeout = None
        if self._transport.in_flight:
            timeout = (_WATCH_S if self._answers_may_wait and not getattr(self._transport, "unsent_bytes", 0)
                       else _ANSWER_WAIT_S)
        if self._backlog.records:
            retry_in = max(0.01, self._delivery.retry_at - time.monotonic())
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
        items = self._in_hand = self._next_items()
        if (again := self._delivery.orphans_again_at) is not None and time.monotonic() >= again:
            self._delivery.adopt_orphans()
        if self._transport.in_flight and time.monotonic() - self._served_at >= _SERVE_EVERY_S:
            # Kafka's reports so far (a failed message is spilled). Only messages handed
            # over before this tick can have one.
            self._served_at = time.monotonic()
            self._transport.serve()
        entries: list[Entry] = []
        held_since = time.perf_counter()
        encode = self._encoder.queued
        for item in items:
            if type(item) is _Encoded:
                entries.append(item.entry)
                continue
            if isinstance(item, tuple):
                entry = encode(item)
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
                self._in_hand = []
                return True
            item.ok = self._delivery.flush(item.deadline)
            item.done.set()
        if entries or (self._backlog.records and time.monotonic() >= self._delivery.retry_at):
            self._deliver(entries)
        self._in_hand = []
        return False

    def _rescue(self) -> None:
        """After an error in a tick: what it took from the queue is kept (the spill file;
        some of it may have reached Kafka already: sent twice, never lost), and a flush
        among it is answered False at once instead of at its timeout."""
        items, self._in_hand = self._in_hand, []
        kept = []
        for item in items:
            if isinstance(item, _Flush):
                item.done.set()  # (ok stays False)
                continue
            try:
                entry = self._entry_of(item)
            except Exception:  # (the encoder itself failing: this record is lost, said)
                log.exception("trainmon: could not keep a record after the sender's error")
                self._delivery.dropped += 1
                continue
            if entry is not None:
                kept.append(entry)
        self._delivery.keep(kept)

    def _entry_of(self, item) -> Entry | None:
        """A queued item's entry, outside a tick; None for a marker (a flush, the stop) or
        a record the encoder rejects (counted and logged)."""
        if type(item) is _Encoded:
            return item.entry
        return self._encoder.queued(item) if isinstance(item, tuple) else None

    def _deliver(self, entries: list[Entry]) -> None:
        if self._delivery.deliver(pack_messages(entries)):
            self._last_sent = time.monotonic()
            self._watch_next = True
