"""Kafka -> ClickHouse, exactly once: the sink behind ``trainmon consume clickhouse`` and
``trainmon replay``, on the consumer runtime (which polls, retries and commits; see
``serving.serve``).

- On partition assignment, seek each partition to ``max(_offset) + 1`` as stored in
  ClickHouse: the tables, not Kafka's committed offsets, say what is loaded, so an
  insert that succeeded just before a crash is never read again.
- Insert one batch per partition (JSON or columns, see below) with the dedup token
  ``topic-partition-first-last``; a failed insert is retried with the identical batch
  and token, so an insert that did land but whose answer was lost is dropped by
  ClickHouse instead of duplicated (the runtime's retry policy resumes with that batch).
- Inserts run on background threads (:mod:`.writer`; different partitions side by side
  when given more ``insert_clients``) while the runtime polls and decodes the next
  records; a partition's batches land in order, and whatever fails is taken back and
  retried on the runtime's thread before anything newer is handed over.
- Commit to Kafka what is written (``pre_commit``: for lag monitoring and for partitions
  that never had a row, e.g. only dead letters).
- On revocation, the insert in flight finishes and buffered rows of the revoked partitions
  are written before the hand-over (revocations run inside the runtime's poll, which waits
  for them, so no batch of a partition lands after it was handed over); the next owner
  starts from ``max(_offset) + 1``.
- A full data volume (:func:`.refusals.disk_full`) is an error a retry fixes: the batch
  stays in hand, its offsets uncommitted, and is inserted again, with backoff, until
  space returns; the condition is logged once, naming the volume, and is in
  ``disk_full`` (and counted in ``disk_full_errors``) while it lasts.
- A record ClickHouse cannot take (e.g. one a CHECK constraint refuses) is dead-lettered
  alone; the rest of its batch still goes in as one insert, so no batch is ever half
  written. Errors a retry can fix (connection, timeouts, memory, overload) are retried
  and dead-letter nothing; a batch spanning more months than one insert may hold is
  inserted in consecutive runs (see :mod:`.refusals`).

A Kafka message packs several records (``schemas.pack``); they share its offset, are
polled together and so always land in the same batch. Records a trainmon producer
validated (its messages carry the ``schemas.SCHEMA_HEADER`` mark) go in as the JSON they
came as, for the kinds :func:`.columns.json_ready` allows; the rest as column batches of
decoded records.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from prometheus_client import Counter, Gauge, Histogram

from ...kafka_client import KafkaError, TopicPartition
from ...schemas import RECORD_TYPES
from .. import runtime
from ..metrics import LATENCY_BUCKETS
from ..stream import Message
from .batches import PartitionBuffers
from .columns import insert_batch, insert_json, json_body, json_ready
from .schema_setup import create_probe_table
from .offsets import stored_positions
from .refusals import blames_rows, disk_full, month_runs, months_in, partition_limit, refusal
from .writer import BackgroundWriter

log = logging.getLogger("trainmon.clickhouse")

# Test hook: kill -9 this process right after the N-th batch insert, before its Kafka
# commit: the window in which a naive consumer duplicates rows.
_CRASH_AFTER_INSERTS = int(os.environ.get("TRAINMON_CLICKHOUSE_CRASH_AFTER_INSERTS") or 0)
DEFAULT_GROUP = "trainmon-clickhouse"
REVOKE_ATTEMPTS = 3  # a rebalance waits on these tries, not on an outage
COLLECT_S = 0.1  # while inserts are in flight, how often written batches are committed
# Rows of one insert at most: it matters only in a backlog (a catch-up, a replay, a burst),
# as a live stream is inserted every --batch-ms. Draining 900,000 step records, 150,000
# against 50,000: 212k against 177k records/s, 169k against 119k per CPU-second of the
# service (medians of 3, benchmarks/pipeline_throughput.py); its peak RSS 1.66 against
# 1.26 GB (chDB parses a ~50 MB body at once).
BATCH_ROWS = 150_000
# How long a batch waits for more rows after its first, in a live stream. With the
# producer's pack window (0.5 s), a record is a row within a second: 0.3 s and 0.5 s took
# the service the same CPU per record at 5,000 records/s (67-74 against 64-69 µs), and
# the log call -> row p99 was 0.77-0.79 against 1.02 s (benchmarks/pipeline_throughput.py).
BATCH_MS = 300


@dataclass
class Batch:
    """One partition's records for one insert, with the token that makes a retry of it a
    no-op. It changes only when rows were dead-lettered (``checked``: the rest, a new token)
    or the records decoded (see ``_write``)."""

    tp: TopicPartition
    messages: list[Message]
    token: str = ""
    checked: bool = False
    lettered: set[int] = field(default_factory=set)  # ids of its messages dead-lettered so far
    # The insert body when its records are all as they came (see columns.json_body), built
    # on the runtime's thread (ClickHouseSink._batches): the insert thread is the loader's
    # bottleneck. None: its records are decoded.
    json: bytes | None = None
    rows: int = field(init=False, default=0)

    def __post_init__(self):
        self.token = self.token or \
            f"{self.tp.topic}-{self.tp.partition}-{self.messages[0].offset}-{self.messages[-1].offset}"
        self.rows = sum(m.count for m in self.messages)

    def narrow(self, messages: list[Message], why: str) -> None:
        """From now on these (decoded) records, under a token of their own: they are not
        the batch whose insert may have landed."""
        self.messages, self.token, self.json = messages, f"{self.token}-{why}", None
        self.rows = len(messages)


class ClickHouseSink(runtime.Sink):
    """Every record kind into its table; serve it with ``serving.serve``."""

    name = "clickhouse loader"
    group = DEFAULT_GROUP
    counts_own_writes = True  # inserted by the writer's lanes, after the flush handed them over

    def __init__(self, client, *, database: str, max_rows: int = BATCH_ROWS, max_wait_s: float = BATCH_MS / 1000,
                 insert_clients: Sequence = (), env: dict | None = None, storage: str = ""):
        """``insert_clients``: one background insert lane each (see :mod:`.writer`); none:
        one lane on ``client``, which then never runs a query while that lane inserts.
        ``env``: where TRAINMON_CLICKHOUSE_VALIDATE_ALL is read (default os.environ).
        ``storage``: where the tables live, as log lines name it (``Target.describe()``)."""
        self.storage = storage or f"ClickHouse database {database}"
        self.undecoded_kinds = tuple(stored_as_they_come(env))
        self.client = client
        self.database = database
        self.buffers = PartitionBuffers(max_rows, max_wait_s)
        self.rows_inserted = 0
        self.inserts = 0
        self._counting = threading.Lock()  # the lanes count their inserts
        # The data volume full: True from an insert refused for space until one lands;
        # disk_full_errors counts such refusals (plain attributes, for metrics).
        self.disk_full = False
        self.disk_full_errors = 0
        self._refused_for_space: Counter | None = None  # its metric, once started
        # Taken back from the writer after a failure: written here, on the runtime's
        # thread (retried by it), before anything newer is handed to the writer.
        self._unwritten: deque[Batch] = deque()
        self.writer = BackgroundWriter([functools.partial(self._insert, client=c) for c in insert_clients or [client]],
                                       lambda b: b.rows, "trainmon-clickhouse-insert", key=lambda b: b.tp)
        self._flushed_at = time.monotonic()
        self._rewind: dict[TopicPartition, int] = {}
        self._dead_letters_settled = 0  # the stream's dead letters known to be in Kafka
        self._receiving = False
        self._reported_at = time.monotonic()

    # -- the sink contract -------------------------------------------------------------

    def start(self, context: runtime.SinkContext) -> None:
        super().start(context)
        self._insert_seconds = Histogram(
            "trainmon_clickhouse_insert_seconds", "Time one batch insert into ClickHouse took, per "
            "record kind (answered; a refused insert is not counted)", ["kind"],
            registry=context.metrics.registry, buckets=LATENCY_BUCKETS)
        Gauge("trainmon_clickhouse_disk_full", "1 while the data volume refuses inserts for space "
              "(rows wait, uncommitted, and are inserted once space returns)",
              registry=context.metrics.registry).set_function(lambda: float(self.disk_full))
        self._refused_for_space = Counter(
            "trainmon_clickhouse_disk_full_refusals", "Inserts the data volume refused for space "
            "(each retried)", registry=context.metrics.registry)

    def open(self, partitions: list[TopicPartition]) -> None:
        # One query at a time per client: a server's HTTP session refuses a second one
        # while the writer's insert runs (SESSION_IS_LOCKED).
        self.writer.wait()
        stored = stored_positions(self.client, self.database, partitions, self.context.stream.prefix)
        for tp in partitions:
            rewind = self._rewind.pop(tp, None)
            position = stored.get(tp, rewind)
            if position is not None:
                self.context.seek(tp, position)
        self._receiving = False  # say so again when records arrive after a rebalance
        log.info("assigned %d partitions; %d resume from ClickHouse offsets", len(partitions), len(stored))

    def put(self, messages: list[Message]) -> None:
        if not self._receiving:
            self._receiving = True
            log.info("receiving records")
        self.buffers.add(messages)

    def flush_in_s(self) -> float | None:
        if self._unwritten or self.writer.error is not None:
            return 0.0
        if self.buffers.rows:
            if self.buffers.due() or self._backlog_tail_read():
                return 0.0
            return self.buffers.seconds_until_due()
        if self.writer.pending_rows():  # collect and commit what it writes
            return max(0.0, self._flushed_at + COLLECT_S - time.monotonic())
        return None

    def _backlog_tail_read(self) -> bool:
        """The last batch of a backlog (a catch-up after a restart, a replay) goes as soon
        as it is read instead of ``max_wait_s`` after its first record: half a batch or
        more, with its partitions read to their end. (Not less: a live stream is read to
        its end at nearly every poll, and an insert costs ~20 ms however small.)"""
        return (self.buffers.rows >= self.buffers.max_rows // 2
                and self.context.read_to_end(self.buffers.first_offsets()))

    def room(self) -> int:
        return self.buffers.max_rows - self.buffers.rows

    def flush(self) -> None:
        """Hand the buffered batches to the writer, after writing here, in order, what it
        gave back after a failure (a retry by the runtime resumes with the batch that
        failed, under its same token). Waits for the writer only while it is a batch
        behind (memory stays bounded) and, when stopping, until all is written."""
        self._flushed_at = time.monotonic()
        while True:
            self._write_taken_back()
            if self.buffers.rows:
                self.writer.wait(rows_at_most=self.buffers.max_rows)
                if self.writer.error is not None:
                    continue
                self._dead_letters_durable()  # the poll's (records that did not decode)
                batches = self._batches(self.buffers.take())
                if self._dead_letters_pending():
                    # Decoding a mixed partition dead-lettered records: these batches are
                    # written here, in order, each once the dead letters are in Kafka.
                    self.writer.wait()
                    if self.writer.error is not None:
                        self._unwritten.extend(self.writer.take_back())
                    self._unwritten.extend(batches)
                    continue
                for batch in batches:
                    self.writer.submit(batch)
            if self.context.stopping:
                self.writer.wait()
                if self.writer.error is not None:
                    continue
            return

    def _batches(self, taken: dict[TopicPartition, list[Message]]) -> list[Batch]:
        """One batch per partition, each either all records as they came (JSON) or all
        decoded: a partition mixing messages of a trainmon producer with others (another
        writer, an older trainmon) has the former decoded here, on the runtime's thread."""
        batches = []
        for tp, messages in taken.items():
            undecoded, body = sum(m.record is None for m in messages), None
            if undecoded == len(messages):
                body = json_body((tp.topic, tp.partition, [m.offset for m in messages]), [m.value for m in messages])
            if undecoded and body is None:  # a mix, or a line that starts no JSON object
                messages = self.context.stream.decode(messages)
            if messages:
                batches.append(Batch(tp, messages, json=body))
        return batches

    def _write_taken_back(self) -> None:
        if self.writer.error is not None:
            error = self.writer.error
            self._unwritten.extend(self.writer.take_back())
            log.warning("insert %s failed (%s); writing it again", self._unwritten[0].token,
                        _first_line(error))
        while self._unwritten:
            self._write(self._unwritten[0])
            self._unwritten.popleft()

    def pre_commit(self, positions: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition, the first offset not written yet (all of it when written)."""
        first_unwritten: dict[TopicPartition, int] = {}
        for batch in [*self._unwritten, *self.writer.pending()]:
            first_unwritten.setdefault(batch.tp, batch.messages[0].offset)
        for tp, offset in self.buffers.first_offsets().items():
            first_unwritten.setdefault(tp, offset)
        return {tp: min(position, first_unwritten.get(tp, position)) for tp, position in positions.items()}

    def tick(self) -> None:
        if time.monotonic() - self._reported_at >= 30:
            self._reported_at = time.monotonic()
            log.info("%d rows inserted, %d dead letters", self.rows_inserted, self.context.stream.dead_letters)

    def close(self, partitions: list[TopicPartition]) -> None:
        """Hand the partitions over fully written (no Kafka commit needed: the next owner
        starts from the offsets stored in ClickHouse anyway)."""
        log.info("revoking %d partitions; writing what they hold first", len(partitions))
        self.writer.wait()
        if self.writer.error is not None:
            self._unwritten.extend(self.writer.take_back())
        revoked = set(partitions)
        batches = [b for b in self._unwritten if b.tp in revoked]
        self._unwritten = deque(b for b in self._unwritten if b.tp not in revoked)
        batches += self._batches(self.buffers.take(only=revoked))
        failed: set[TopicPartition] = set()
        for batch in batches:
            if batch.tp in failed:
                # Nothing of a partition may land after a batch of it that did not: the
                # next owner resumes from max(_offset) + 1 and would skip the failed one.
                continue
            try:
                # No dead-lettering in a rebalance: a refused record is read again by
                # whoever owns the partition next, and dead-lettered there.
                self.context.retry_call(f"insert {batch.token}", self._write, batch, False,
                                        attempts=REVOKE_ATTEMPTS)
            except runtime.RetriableError as exc:
                # Not written: read them again should the partition come back to us.
                failed.add(batch.tp)
                self._rewind.setdefault(batch.tp, batch.messages[0].offset)
                log.warning("revoked %s[%d] with %d rows not written (%s)", batch.tp.topic,
                            batch.tp.partition, batch.rows, exc)

    # -- writing --------------------------------------------------------------------

    def stop(self) -> None:
        self.writer.close()
        log.info("stopped: %d rows inserted in %d inserts, %d dead letters", self.rows_inserted,
                 self.inserts, self.context.stream.dead_letters)

    def _write(self, batch: Batch, dead_letter: bool = True, settings: dict | None = None) -> None:
        """Insert one batch; see :mod:`.refusals` for what each error leads to. Errors a
        retry can fix are raised as RetriableError for the runtime's retry policy; with
        ``dead_letter=False`` (in a rebalance) a refused row is one of them."""
        self._dead_letters_durable()
        try:
            self._insert(batch, settings)
            return
        except Exception as exc:
            if not refusal(exc):
                raise
            error = exc
        if disk_full(error):
            self._out_of_space(batch, error)
            raise runtime.RetriableError(f"insert {batch.token}: {_first_line(error)}") from error
        limit = partition_limit(error)
        if (blames_rows(error) or limit is not None) and any(m.record is None for m in batch.messages):
            # Stored as they came and refused for their rows: decode them (dead-lettering
            # what does not decode) and go on with the records, as for any batch. (An error
            # that does not blame the rows is retried as it is, under the same token: the
            # insert may have landed with its answer lost.)
            if not dead_letter:
                raise runtime.RetriableError(f"insert {batch.token}: {_first_line(error)}") from error
            log.warning("batch %s refused as JSON (%s); decoding its records", batch.token, _first_line(error))
            batch.narrow(self.context.stream.decode(batch.messages), "decoded")
            if batch.messages:
                self._write(batch, dead_letter, settings)
            return
        if limit is not None and settings is None:
            runs = month_runs(batch.messages, limit)
            if len(runs) > 1:
                log.info("batch %s spans more than %d months: inserting it in %d runs",
                         batch.token, limit, len(runs))
                for i, run in enumerate(runs):
                    self._write(Batch(batch.tp, run, f"{batch.token}-m{i}"), dead_letter)
                return
            # One Kafka message alone spans the months: it goes in as one insert allowed its
            # own month count (see month_runs for why not split it).
            self._write(batch, dead_letter, {"max_partitions_per_insert_block": months_in(batch.messages)})
            return
        if blames_rows(error) and not batch.checked and dead_letter:
            log.warning("batch %s refused (%s); checking its records one by one", batch.token,
                        _first_line(error))
            batch.narrow(self._without_culprits(batch), "checked")
            batch.checked = True
            if batch.messages:
                self._write(batch, dead_letter, settings)
            return
        if batch.checked and blames_rows(error):
            # Each row passes alone, the batch does not: not something to dead-letter.
            log.error("insert %s refused although each of its rows passes alone: %s", batch.token,
                      _first_line(error))
        raise runtime.RetriableError(f"insert {batch.token}: {_first_line(error)}") from error

    def _insert(self, batch: Batch, settings: dict | None = None, client=None) -> None:
        client = client or self.client
        messages = batch.messages
        started = time.monotonic()
        if batch.json is not None:
            insert_json(client, messages[0].kind, batch.json, database=self.database,
                        dedup_token=batch.token, settings=settings)
        else:  # decoded, all of them (see _batches)
            insert_batch(client, messages[0].kind, [m.record for m in messages], database=self.database,
                         dedup_token=batch.token, settings=settings,
                         kafka=(batch.tp.topic, batch.tp.partition, [m.offset for m in messages]))
        self._insert_seconds.labels(messages[0].kind).observe(time.monotonic() - started)
        self.context.metrics.count_written({messages[0].kind: batch.rows})
        with self._counting:
            self.rows_inserted += batch.rows
            self.inserts += 1
            crash = _CRASH_AFTER_INSERTS and self.inserts >= _CRASH_AFTER_INSERTS
            recovered, self.disk_full = self.disk_full, False
        if recovered:
            log.warning("%s: space again, inserts land (batch %s); %d refused for space meanwhile",
                        self.storage, batch.token, self.disk_full_errors)
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)

    def _dead_letters_pending(self) -> bool:
        return self.context.stream.dead_letters != self._dead_letters_settled

    def _dead_letters_durable(self) -> None:
        """Every dead letter so far in Kafka before rows after it land: the loader resumes
        a partition from max(_offset) + 1 stored in ClickHouse, past them, so one still in
        the producer's queue at a crash (or a stop while Kafka is away) would be lost, its
        record neither stored nor dead-lettered. (On the runtime's thread only.)"""
        if not self._dead_letters_pending():
            return
        stream = self.context.stream
        dead_letters = stream.dead_letters
        try:
            stream.settle_dead_letters()
        except KafkaError as exc:
            raise runtime.RetriableError(f"dead letters: {exc}") from exc
        self._dead_letters_settled = dead_letters

    def _out_of_space(self, batch: Batch, error: BaseException) -> None:
        """Say once per episode that the data volume is full; count every refusal."""
        with self._counting:
            first, self.disk_full = not self.disk_full, True
            self.disk_full_errors += 1
        if self._refused_for_space is not None:
            self._refused_for_space.inc()
        if first:
            log.error("%s: no space left on the data volume (%s); batch %s (%d rows) and what "
                      "follows wait, their Kafka offsets uncommitted, and are inserted again until "
                      "space returns", self.storage, _first_line(error), batch.token, batch.rows)

    def _without_culprits(self, batch: Batch) -> list[Message]:
        """Dead-letter the records ClickHouse cannot take; return the others. Each is
        tried alone against a Null-engine twin of its table, which stores nothing. An
        error that does not blame the row (the server went away meanwhile) is retried by
        the runtime: the check then starts again, skipping the records it dead-lettered
        already (``batch.lettered``)."""
        messages = batch.messages
        probe = create_probe_table(self.client, messages[0].kind, self.database)
        good = []
        for m in messages:
            if id(m) in batch.lettered:
                continue
            try:
                insert_batch(self.client, m.kind, [m.record], table=probe)
                good.append(m)
            except Exception as exc:
                if not refusal(exc):
                    raise
                if not blames_rows(exc) or partition_limit(exc) is not None:
                    raise runtime.RetriableError(f"checking {m.kind} records: {_first_line(exc)}") from exc
                self.context.dead_letter(m, f"ClickHouse cannot store this {m.kind} record: "
                                            f"{_first_line(exc)}")
                batch.lettered.add(id(m))
        return good


def stored_as_they_come(env: dict | None = None) -> list[str]:
    """The kinds whose records a trainmon producer validated go into ClickHouse as the JSON
    they came as (see schemas.SCHEMA_HEADER); none with TRAINMON_CLICKHOUSE_VALIDATE_ALL=1,
    which has every record decoded and validated here too."""
    env = os.environ if env is None else env
    if (env.get("TRAINMON_CLICKHOUSE_VALIDATE_ALL") or "").strip().lower() in ("1", "true", "yes", "on"):
        return []
    return [kind for kind in RECORD_TYPES if json_ready(kind)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
