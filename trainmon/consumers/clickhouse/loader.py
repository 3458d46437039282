"""Kafka -> ClickHouse, exactly once: the loop behind ``trainmon consume clickhouse``
and ``trainmon replay``.

- On partition assignment, seek each partition to ``max(_offset) + 1`` as stored in
  ClickHouse: the tables, not Kafka's committed offsets, say what is loaded, so an
  insert that succeeded just before a crash is never read again.
- Insert one column batch per partition with the dedup token
  ``topic-partition-first-last``; a failed insert is retried with the identical batch
  and token, so an insert that did land but whose answer was lost is dropped by
  ClickHouse instead of duplicated.
- Commit to Kafka after the inserts (for lag monitoring and for partitions that never
  had a row, e.g. only dead letters).
- On revocation, buffered rows of the revoked partitions are written before the hand-over
  (inserts and revocations take one lock, so no batch of a partition lands after it was
  handed over); the next owner starts from ``max(_offset) + 1``.
- A record ClickHouse cannot take (e.g. one a CHECK constraint refuses) is dead-lettered
  alone; the rest of its batch still goes in as one insert, so no batch is ever half
  written. Errors a retry can fix (connection, timeouts, memory, overload) are retried
  and dead-letter nothing; a batch spanning more months than one insert may hold is
  inserted in consecutive runs (see :mod:`.refusals`).

A Kafka message packs several records (``schemas.pack``); they share its offset, are
polled together and so always land in the same batch.

Rebalance callbacks run inside ``poll`` on the loop's own thread (librdkafka serves
them there), so the lock below only orders them with the flush of a stopping service.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

from ...kafka_client import KafkaError, TopicPartition
from ..stream import Message, RecordStream
from .batches import PartitionBuffers
from .columns import insert_batch
from .ddl import create_probe_table
from .offsets import stored_positions
from .refusals import blames_rows, month_runs, months_in, partition_limit, refusal

log = logging.getLogger("trainmon.clickhouse")

# Test hook: kill -9 this process right after the N-th batch insert, before its Kafka
# commit: the window in which a naive consumer duplicates rows.
COMMIT_BACKOFF_S = 5.0
_CRASH_AFTER_INSERTS = int(os.environ.get("TRAINMON_CLICKHOUSE_CRASH_AFTER_INSERTS") or 0)


class Loader:
    def __init__(self, client, *, database: str, group_id: str, topic_prefix: str | None = None,
                 env: dict | None = None, max_rows: int = 10_000, max_wait_s: float = 0.5,
                 stop: threading.Event | None = None, consumer_settings: dict | None = None):
        self.client = client
        self.database = database
        self.stop = stop or threading.Event()
        self.buffers = PartitionBuffers(max_rows, max_wait_s)
        self.rows_inserted = 0
        self.inserts = 0
        self.insert_retries = 0
        self._dead_letters_committed = 0
        self._inserted_since_commit = False
        self._receiving = False
        self._next_commit_at = 0.0
        self._lock = threading.RLock()
        self._owned: set[TopicPartition] = set()
        self._rewind: dict[TopicPartition, int] = {}
        self.stream = RecordStream(group_id, topic_prefix=topic_prefix, env=env,
                                   on_assign=self._on_assign, on_revoke=self._on_revoke,
                                   **(consumer_settings or {}))

    @property
    def dead_letters(self) -> int:
        return self.stream.dead_letters

    # -- rebalancing (inside poll) ------------------------------------------------------

    def _on_assign(self, partitions: list[TopicPartition]) -> None:
        with self._lock:
            stored = stored_positions(self.client, self.database, partitions, self.stream.prefix)
            for tp in partitions:
                rewind = self._rewind.pop(tp, None)
                position = stored.get(tp, rewind)
                if position is not None:
                    self.stream.consumer.seek(tp, position)
            self._owned.update(partitions)
            self._receiving = False  # say so again when records arrive after a rebalance
        log.info("assigned %d partitions; %d resume from ClickHouse offsets",
                 len(partitions), len(stored))

    def _on_revoke(self, partitions: list[TopicPartition]) -> None:
        # Hand the partitions over fully written. No Kafka commit needed here: the next
        # owner starts from the offsets stored in ClickHouse anyway.
        log.info("revoking %d partitions; writing what they hold first", len(partitions))
        with self._lock:
            self._owned.difference_update(partitions)
            for tp, messages in self.buffers.take(only=set(partitions)).items():
                try:
                    # No dead-lettering in a rebalance: a refused record is read again
                    # by whoever owns the partition next, and dead-lettered there.
                    self._insert_partition(tp, messages, attempts=3, dead_letter=False)
                except Exception as exc:
                    if not refusal(exc):
                        raise
                    # Not written: read them again should the partition come back to us.
                    self._rewind[tp] = messages[0].offset
                    log.warning("revoked %s[%d] with %d rows not written (%s)", tp.topic,
                                tp.partition, len(messages), exc)

    # -- writing --------------------------------------------------------------------

    def _buffer(self, messages: list[Message]) -> None:
        with self._lock:
            owned = self._owned  # TopicPartition is a namedtuple: a plain tuple finds it
            self.buffers.add([m for m in messages if (m.topic, m.partition) in owned])

    def flush_and_commit(self, final: bool = False) -> None:
        with self._lock:
            batches = self.buffers.take()
            for tp, messages in batches.items():
                self._insert_partition(tp, messages)
        # Outside the lock: inserting is done; a commit may wait for the broker.
        if self._commit_due() and (final or time.monotonic() >= self._next_commit_at):
            try:
                dead_letters = self.dead_letters
                self._inserted_since_commit = False
                self.stream.commit_polled()
                self._dead_letters_committed = dead_letters
            except KafkaError as exc:  # e.g. a rebalance under way; ClickHouse holds the truth
                self._inserted_since_commit = True
                # Commits retried at once keep interrupting the group join they wait for.
                self._next_commit_at = time.monotonic() + COMMIT_BACKOFF_S
                log.warning("Kafka commit failed (trying again in %.0f s): %s", COMMIT_BACKOFF_S, exc)

    def _commit_due(self) -> bool:
        return self._inserted_since_commit or self.dead_letters > self._dead_letters_committed

    def _insert_partition(self, tp: TopicPartition, messages: list[Message],
                          attempts: int | None = None, dead_letter: bool = True,
                          token: str | None = None) -> None:
        """Insert one partition's batch; see :mod:`.refusals` for what each error leads to.
        ``attempts`` bounds the retries of errors a retry can fix (unbounded while running,
        3 once stopping); ``dead_letter=False`` (in a rebalance) raises instead
        of looking for culprits."""
        token = token or f"{tp.topic}-{tp.partition}-{messages[0].offset}-{messages[-1].offset}"
        attempt = 0
        settings = None
        check, checked = False, False
        lettered: set[int] = set()  # a check cut short by the server going away resumes
        while True:
            try:
                if check:
                    messages = self._without_culprits(messages, lettered)
                    token += "-checked"
                    check, checked = False, True
                    if not messages:
                        return
                self._insert(tp, messages, token, settings)
                return
            except Exception as exc:
                if not refusal(exc):
                    raise
                limit = partition_limit(exc)
                if limit is not None and settings is None:
                    runs = month_runs(messages, limit)
                    if len(runs) > 1:
                        log.info("batch %s spans more than %d months: inserting it in %d runs",
                                 token, limit, len(runs))
                        for i, run in enumerate(runs):
                            self._insert_partition(tp, run, attempts, dead_letter, f"{token}-m{i}")
                        return
                    # One Kafka message alone spans the months: it goes in as one insert
                    # allowed its own month count (see month_runs for why not split it).
                    settings = {"max_partitions_per_insert_block": months_in(messages)}
                    continue
                if blames_rows(exc) and not checked:
                    if not dead_letter:
                        raise
                    log.warning("batch %s refused (%s); checking its records one by one",
                                token, _first_line(exc))
                    check = True
                    continue
                attempt += 1
                self.insert_retries += 1
                if attempt >= (attempts or (3 if self.stop.is_set() else 1 << 30)):
                    raise
                delay = min(30.0, 0.2 * 2 ** attempt)
                if checked and blames_rows(exc):
                    # Each row passes alone, the batch does not: not something to dead-letter.
                    log.error("insert %s refused although each of its rows passes alone "
                              "(attempt %d), retrying in %.1fs: %s", token, attempt, delay,
                              _first_line(exc))
                else:
                    log.warning("insert %s failed (attempt %d), retrying in %.1fs: %s",
                                token, attempt, delay, _first_line(exc))
                self.stop.wait(delay)

    def _insert(self, tp: TopicPartition, messages: list[Message], token: str,
                settings: dict | None = None) -> None:
        insert_batch(self.client, messages[0].kind, [m.record for m in messages],
                     database=self.database, dedup_token=token, settings=settings,
                     kafka=(tp.topic, tp.partition, [m.offset for m in messages]))
        self.rows_inserted += len(messages)
        self.inserts += 1
        self._inserted_since_commit = True
        if _CRASH_AFTER_INSERTS and self.inserts >= _CRASH_AFTER_INSERTS:
            os.kill(os.getpid(), signal.SIGKILL)

    def _without_culprits(self, messages: list[Message], lettered: set[int]) -> list[Message]:
        """Dead-letter the records ClickHouse cannot take; return the others. Each is
        tried alone against a Null-engine twin of its table, which stores nothing. An
        error that does not blame the row (the server went away meanwhile) is raised: the
        batch is then retried, and checked again later, skipping the records already
        dead-lettered (``lettered``: their ids)."""
        probe = create_probe_table(self.client, messages[0].kind, self.database)
        good = []
        for m in messages:
            if id(m) in lettered:
                continue
            try:
                insert_batch(self.client, m.kind, [m.record], table=probe)
                good.append(m)
            except Exception as exc:
                if not blames_rows(exc) or partition_limit(exc) is not None:
                    raise
                self.stream.dead_letter(m, f"ClickHouse cannot store this {m.kind} record: "
                                           f"{_first_line(exc)}")
                lettered.add(id(m))
        return good

    # -- the loop -------------------------------------------------------------------

    def run(self, until: Callable[["Loader"], bool] | None = None) -> None:
        """Consume until ``stop`` is set (or ``until(self)`` holds with nothing buffered),
        then write what is buffered and commit."""
        last_report = time.monotonic()
        try:
            while not self.stop.is_set():
                # Short polls: a stop request is noticed within half a second.
                wait = min(0.5, self.buffers.seconds_until_due())
                room = max(1, self.buffers.max_rows - self.buffers.rows)
                messages = self.stream.poll(timeout_ms=int(wait * 1000), max_records=room)
                if messages and not self._receiving:
                    self._receiving = True
                    log.info("receiving records")
                self._buffer(messages)
                if self.buffers.due() or (not self.buffers.rows and self._commit_due()
                                          and time.monotonic() >= self._next_commit_at):
                    self.flush_and_commit()
                if until is not None and not self.buffers.rows and until(self):
                    break
                if time.monotonic() - last_report >= 30:
                    last_report = time.monotonic()
                    log.info("%d rows inserted, %d dead letters", self.rows_inserted, self.dead_letters)
            self.flush_and_commit(final=True)
        finally:
            self.stream.close()
        log.info("stopped: %d rows inserted in %d inserts, %d dead letters, %d insert retries",
                 self.rows_inserted, self.inserts, self.dead_letters, self.insert_retries)


def caught_up_with(consumer, topic_names: list[str]) -> Callable[[Loader], bool]:
    """A condition true once every partition of the topics is read up to its end as of
    now (for replay: everything that was in the topics when it started)."""
    partitions = [TopicPartition(t, p) for t in topic_names for p in consumer.partitions_for(t)]
    ends = consumer.end_offsets(partitions) if partitions else {}

    def caught_up(loader: Loader) -> bool:
        assigned = consumer.assignment()
        if any(tp not in assigned for tp in ends):
            return False
        return all(consumer.position(tp) >= end for tp, end in ends.items())

    return caught_up


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
