"""The consumer runtime: one loop for every trainmon consumer, after Kafka Connect's sink contract.

A sink -- the ClickHouse loader, the alerts engine, the Grafana forwarder, the W&B / Aim /
TensorBoard forwarders -- says only what it does with records:

    open(partitions)    partitions given to it; it may ``context.seek`` where each starts
    put(messages)       decoded records, in offset order per partition (or, of the kinds
                        the stream was told so, a trainmon producer's records as bytes)
    flush()             make everything put so far durable (raise RetriableError if it can't yet)
    pre_commit(pos)     of those positions, what is written (default: all; a sink writing
                        in the background says what it has not written yet)
    close(partitions)   partitions taken away: write what it holds of them, forget them
    stop()              the runtime is done with it (also when it stops with a batch
                        not written: the sink knows what it still holds)

and when its batch is due (``flush_in_s``). It also declares what it reads -- its consumer
group, record kinds, the kinds it takes undecoded, Kafka settings of its own -- and when a
catch-up job may end (``quiet_for``): ``serving.serve(sink)`` builds the stream and the
runtime from that. The runtime owns everything else, the same way for all of them:

- polling, on one thread; rebalance callbacks run inside the poll, so ``open`` / ``close``
  never race ``put`` / ``flush``; records polled for a partition since taken away are dropped;
- commits: right after ``flush`` returned, the offsets ``pre_commit`` says are written,
  never more (a commit Kafka refuses, e.g. during a rebalance, is tried again a little later);
- dead letters: records that do not decode (RecordStream) and those a sink refuses
  (``context.dead_letter``) go to the dead-letter topic, durably before their offsets commit;
- one retry policy (:class:`RetryPolicy`, tenacity): a RetriableError from ``put`` or
  ``flush`` is retried with exponential backoff and jitter, for as long as it takes while
  running and ``STOPPING_ATTEMPTS`` times once stopping;
- SIGTERM / SIGINT (``stop_on_signals``): the batch in hand is flushed and committed, then
  the runtime returns;
- metrics (:mod:`.metrics`, ``context.metrics``): records read, written and dead-lettered
  per kind, the lag per partition, flush and commit latency, batch sizes.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import tenacity

from ..backoff import Backoff
from ..kafka_client import KafkaError, TopicPartition
from .metrics import ServiceMetrics, per_kind
from .stream import Message, RecordStream

log = logging.getLogger("trainmon.consumers")

STOPPING_ATTEMPTS = 3  # tries of a flush once stopping: a stop must not wait on an outage
# A refused commit is tried again after this, doubling while it keeps failing: commits
# retried at once keep interrupting the group join they wait for.
COMMIT_RETRY_S = 5.0
LAG_EVERY_S = 1.0  # how often the lag metric is brought up to date (no broker call: cached ends)


class RetriableError(Exception):
    """The sink cannot do it now but the same call later can (a server away, a timeout)."""


# One for every Retrying: it holds a bound method of itself, a reference cycle (see call).
_RETRIABLE = tenacity.retry_if_exception_type(RetriableError)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, from ``first_s`` up to ``max_s`` between tries."""

    first_s: float = 0.5
    max_s: float = 30.0

    def retrying(self, stop: threading.Event, what: str, attempts: int | None = None) -> tenacity.Retrying:
        """A tenacity Retrying that retries RetriableError only: ``attempts`` times, or
        unbounded until ``stop`` is set and then STOPPING_ATTEMPTS times. Waits wake at
        once when ``stop`` is set."""

        def give_up(state: tenacity.RetryCallState) -> bool:
            limit = attempts or (STOPPING_ATTEMPTS if stop.is_set() else None)
            return limit is not None and state.attempt_number >= limit

        def say(state: tenacity.RetryCallState) -> None:
            # The error as text: a log record kept by a handler (a test's capture, a queue)
            # must not hold the exception, whose traceback holds the Retrying and its frames.
            log.warning("%s failed (attempt %d), retrying in %.1f s: %s", what, state.attempt_number,
                        state.next_action.sleep, str(state.outcome.exception()))

        backoff = Backoff(self.first_s, self.max_s, jitter_s=self.first_s)
        return tenacity.Retrying(
            retry=_RETRIABLE,
            wait=lambda state: backoff.wait_before(state.attempt_number),
            stop=give_up, sleep=stop.wait, before_sleep=say, reraise=True)

    def call(self, stop: threading.Event, what: str, fn: Callable, *args, attempts: int | None = None):
        """``fn(*args)`` under :meth:`retrying`, whose Retrying is let go of afterwards.

        Why not just ``retrying(...)(fn, *args)``: tenacity keeps the last attempt's actions,
        bound methods of the Retrying, in the Retrying's own state, a reference cycle that
        only the cyclic garbage collector frees, and the services run it rarely
        (gc_tuning.py). A Retrying per put and per flush was never freed: the TensorBoard
        forwarder gained ~1,400 of them a minute and ~40 MiB of RSS an hour at 5,000
        records/s (benchmarks/soak.py). Clearing those actions breaks the cycle, and
        reference counting frees the Retrying at once."""
        retrying = self.retrying(stop, what, attempts)
        try:
            return retrying(fn, *args)
        finally:
            retrying.iter_state.reset()


class Sink:
    """What a consumer does with records; see the module docstring. Override what applies."""

    name = "sink"
    poll_s = 0.5  # the longest a poll waits: how often ``tick`` runs while nothing arrives
    context: "SinkContext"
    # What it reads, declared for serving.serve: its consumer group unless told another,
    # the record kinds (None: every kind), those of them handed out as the producer's bytes
    # (see RecordStream), and Kafka consumer settings of its own.
    group = ""
    kinds: tuple[str, ...] | None = None
    undecoded_kinds: tuple[str, ...] = ()
    consumer_settings: Mapping[str, Any] = MappingProxyType({})
    # A sink that writes in the background counts the records it wrote itself
    # (``context.metrics.count_written``); for the others a record is written once the
    # flush after its put returned.
    counts_own_writes = False

    def quiet_for(self, runtime: "SinkRuntime", seconds: float) -> bool:
        """Whether a catch-up job told to exit when idle for ``seconds`` may end now (it has
        nothing left to flush): no record put for that long. A sink that judges silences
        also waits until it has read everything."""
        return runtime.idle_s() >= seconds

    def start(self, context: "SinkContext") -> None:
        self.context = context

    def open(self, partitions: list[TopicPartition]) -> None:
        pass

    def put(self, messages: list[Message]) -> None:
        raise NotImplementedError

    def flush_in_s(self) -> float | None:
        """Seconds until a flush is due (0: now); None when there is nothing to flush."""
        return None

    def room(self) -> int:
        """How many more records to take before the next flush."""
        return RecordStream.MAX_RECORDS

    def tick(self) -> None:
        """Time-driven work, after every poll (close idle handles, judge silences)."""

    def flush(self) -> None:
        pass

    def pre_commit(self, positions: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Kafka Connect's preCommit: of the positions read up to (next offsets), what may
        be committed now. All of them by default (``flush`` wrote everything put); a sink
        that writes in the background returns, per partition, its first offset not written."""
        return positions

    def close(self, partitions: list[TopicPartition]) -> None:
        pass

    def stop(self) -> None:
        pass


class SinkContext:
    """What a sink may ask of the runtime (Kafka Connect's SinkTaskContext)."""

    def __init__(self, runtime: "SinkRuntime"):
        self._runtime = runtime
        self.stream = runtime.stream
        self.consumer = runtime.stream.consumer
        self.metrics: ServiceMetrics = runtime.metrics

    @property
    def stopping(self) -> bool:
        return self._runtime.stop.is_set()

    def idle_s(self) -> float:
        """Seconds since a record was last put (or the group last gave partitions)."""
        return self._runtime.idle_s()

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.consumer.seek(tp, offset)

    def dead_letter(self, message: Message, reason: str) -> None:
        self.stream.dead_letter(message, reason)

    def retry_call(self, what: str, fn: Callable, *args, attempts: int | None = None):
        """``fn(*args)`` under the runtime's retry policy, for a sink's own bounded retries
        (e.g. in ``close``)."""
        return self._runtime.retry.call(self._runtime.stop, what, fn, *args, attempts=attempts)

    def read_to_end(self, partitions: Iterable[TopicPartition] | None = None) -> bool:
        """These partitions (default: every assigned one) read up to their end as of the
        last fetch (no broker call)."""
        consumer = self.consumer
        assigned = consumer.assignment() if partitions is None else set(partitions)
        if not assigned:
            return False
        highs = {tp: consumer.watermarks(tp, cached=True)[1] for tp in assigned}
        if any(high < 0 for high in highs.values()):
            return False
        positions = consumer.positions(assigned)
        return all(positions[tp] >= high for tp, high in highs.items())


class SinkRuntime:
    lag_every_s = LAG_EVERY_S

    def __init__(self, sink: Sink, stream: RecordStream, *, stop: threading.Event | None = None,
                 retry: RetryPolicy | None = None, metrics: ServiceMetrics | None = None):
        self.sink = sink
        self.stream = stream
        self.stop = stop or threading.Event()
        self.retry = retry or RetryPolicy()
        self.metrics = metrics or ServiceMetrics(sink.name, stream.group_id)
        self.records = 0  # records put
        self.flushes = 0
        self._unflushed: dict[str, int] = {}  # records put since the last flush, per kind
        self._dead_letters_counted: dict[str, int] = {}
        self._lag_at = 0.0
        self._owned: set[TopicPartition] = set()
        self._put_since_commit = False
        self._dead_letters_committed = 0
        self._next_commit_at = 0.0
        self._commit_backoff = Backoff(COMMIT_RETRY_S, self.retry.max_s)
        self._active_at = time.monotonic()  # the last record put, or joining the group
        self._sink_stopped = False
        self.closed = False
        stream.consumer.listen(self._assigned, self._revoked)
        sink.start(SinkContext(self))

    # -- rebalances (inside poll, on this thread) ----------------------------------------

    def _assigned(self, partitions: list[TopicPartition]) -> None:
        self._owned.update(partitions)
        self._active_at = time.monotonic()
        self.sink.open(partitions)

    def _revoked(self, partitions: list[TopicPartition]) -> None:
        self._owned.difference_update(partitions)
        # Closing the stream revokes every partition (librdkafka's close runs this
        # callback), after run() stopped the sink: a stopped sink is not called again
        # (Kafka Connect skips the revocation of a stopped task the same way).
        if not self._sink_stopped:
            self.sink.close(partitions)

    # -- the loop ----------------------------------------------------------------------

    def step(self) -> int:
        """One poll: put what came, run the sink's tick, flush and commit if due.
        Returns the number of records put."""
        sink = self.sink
        due = sink.flush_in_s()
        wait = sink.poll_s if due is None else min(sink.poll_s, due)
        messages = self.stream.poll(timeout_ms=int(wait * 1000), max_records=max(1, sink.room()))
        read = self.stream.polled_by_kind
        owned = self._owned
        if messages and any((m.topic, m.partition) not in owned for m in messages):
            messages = [m for m in messages if (m.topic, m.partition) in owned]
            read = per_kind(messages)
        records = sum(read.values())
        if messages:
            self._call(sink.put, messages, what=f"{sink.name}: put")
            self.records += records
            self.metrics.count_read(read)
            unflushed = self._unflushed
            for kind, n in read.items():
                unflushed[kind] = unflushed.get(kind, 0) + n
            self._put_since_commit = True
            self._active_at = time.monotonic()
        elif not owned:
            self._active_at = time.monotonic()  # idle time counts from joining the group
        sink.tick()
        self._update_metrics()
        due = sink.flush_in_s()
        if due is not None and due <= 0:
            self.flush_and_commit()
        elif due is None and self._commit_due() and time.monotonic() >= self._next_commit_at:
            self._commit()  # dead letters alone, or a commit Kafka refused earlier
        return records

    def flush_and_commit(self, final: bool = False) -> None:
        started = time.monotonic()
        self._call(self.sink.flush, what=f"{self.sink.name}: flush")
        self.metrics.flush_seconds.observe(time.monotonic() - started)
        self.flushes += 1
        if self._unflushed:
            self.metrics.batch_records.observe(sum(self._unflushed.values()))
            if not self.sink.counts_own_writes:
                self.metrics.count_written(self._unflushed)
            self._unflushed = {}
        if self._commit_due() and (final or time.monotonic() >= self._next_commit_at):
            self._commit()

    def run(self, until: Callable[["SinkRuntime"], bool] | None = None) -> None:
        """Run until ``stop`` is set or ``until(self)`` holds with nothing left to flush;
        then flush, commit, stop the sink and close the stream."""
        try:
            try:
                while not self.stop.is_set():
                    self.step()
                    if until is not None and self.sink.flush_in_s() is None and until(self):
                        break
                self.flush_and_commit(final=True)
            except RetriableError as exc:  # only once stopping: retries are unbounded before
                log.warning("%s: stopped with a batch not written (%s); its records are not "
                            "committed and are read again at the next start", self.sink.name, exc)
            self._sink_stopped = True
            self.sink.stop()  # also after that: a sink closes its handles either way
        finally:
            self.close()

    def idle_s(self) -> float:
        """Seconds since a record was last put (or the group last gave partitions)."""
        return time.monotonic() - self._active_at

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._update_metrics(lag=False)  # the last dead letters; the lag is gone with the stream
            self.stream.close()

    # -- helpers -------------------------------------------------------------------------

    def _call(self, fn: Callable, *args, what: str):
        return self.retry.call(self.stop, what, fn, *args)

    def _update_metrics(self, lag: bool = True) -> None:
        """Dead letters per kind since the last look (the stream counts them); the lag,
        every ``lag_every_s``. A metric is never a reason for the loop to stop."""
        stream = self.stream
        if stream.dead_letters != sum(self._dead_letters_counted.values()):
            for kind, n in list(stream.dead_letters_by_kind.items()):
                new = n - self._dead_letters_counted.get(kind, 0)
                if new:
                    self.metrics.dead_lettered.labels(kind).inc(new)
                    self._dead_letters_counted[kind] = n
        if lag and time.monotonic() - self._lag_at >= self.lag_every_s:
            self._lag_at = time.monotonic()
            try:
                self.metrics.set_lag(partition_lags(stream.consumer))
            except Exception as exc:  # noqa: BLE001 -- e.g. the broker away: the lag waits
                log.debug("%s: lag not known now: %s", self.sink.name, exc)

    def _commit_due(self) -> bool:
        return self._put_since_commit or self.stream.dead_letters > self._dead_letters_committed

    def _commit(self) -> None:
        dead_letters = self.stream.dead_letters
        positions = self.stream.positions()
        offsets = self.sink.pre_commit(positions)
        started = time.monotonic()
        try:
            self.stream.commit(offsets)
        except KafkaError as exc:  # e.g. a rebalance under way: the next flush commits
            self.metrics.commit_failures.inc()
            wait = self._commit_backoff.next()
            self._next_commit_at = time.monotonic() + wait
            log.warning("%s: Kafka commit failed (trying again in %.0f s): %s", self.sink.name, wait, exc)
            return
        self.metrics.commit_seconds.observe(time.monotonic() - started)
        self._commit_backoff.reset()
        self._put_since_commit = offsets != positions  # the rest once the sink wrote it
        self._dead_letters_committed = dead_letters


def partition_lags(consumer) -> dict[tuple[str, int], int]:
    """(topic, partition) -> messages not read yet, for every assigned partition whose end
    the consumer has fetched (librdkafka's cached watermark: no broker call). A partition
    not read from yet is placed at its committed offset, asked once."""
    assigned = consumer.assignment()
    positions = consumer.positions(assigned) if assigned else {}
    lags = {}
    for tp, position in positions.items():
        high = consumer.watermarks(tp, cached=True)[1]
        if high >= 0:
            lags[(tp.topic, tp.partition)] = max(0, high - position)
    return lags


def read_to_end_as_of_now(stream: RecordStream, topic_names: Iterable[str]) -> Callable[[SinkRuntime], bool]:
    """An ``until`` for replays: every partition of the topics read up to the end it had
    when this was called."""
    consumer = stream.consumer
    partitions = [TopicPartition(t, p) for t in topic_names for p in consumer.partitions_for(t)]
    ends = consumer.end_offsets(partitions) if partitions else {}

    def done(runtime: SinkRuntime) -> bool:
        assigned = consumer.assignment()
        if any(tp not in assigned for tp in ends):
            return False
        return all(consumer.position(tp) >= end for tp, end in ends.items())

    return done


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM / SIGINT: give it to a runtime as ``stop``, and it finishes
    its batch, commits and returns."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
