"""What an insert error means for the loader: retry, blame rows, or split the batch.

- **Retry**: the server or the way to it failed -- connection and network errors,
  timeouts, memory limits, too many simultaneous queries, merges behind ("too many
  parts"), read-only or full disks, a missing table or a denied grant. The rows are not at
  fault: the same insert later (after the server recovers, or an operator fixes it) goes
  in, so the loader retries with backoff and dead-letters nothing.
- **Rows**: anything else, e.g. a value a column cannot hold (client-side ``DataError``),
  a violated CHECK constraint, a type or range error. The loader then tries each row alone
  against a Null-engine twin of the table to find the culprits, dead-letters them, and
  inserts the rest.
- **Too many partitions**: one insert whose rows span more months (tables are partitioned
  by ``toYYYYMM(time)``) than ``max_partitions_per_insert_block`` (100 by default). Every
  row is fine and so is the batch, only not in one insert: see :func:`month_runs`.
"""

from __future__ import annotations

import re
import struct
from datetime import datetime, timezone
from itertools import groupby
from typing import Sequence

from clickhouse_connect.driver.exceptions import DataError, Error as ClickHouseError, OperationalError

# ClickHouse error codes a retry can fix: the server, the network or the setup, not the rows.
RETRY_CODES = frozenset({
    3,     # UNEXPECTED_END_OF_FILE
    16,    # NO_SUCH_COLUMN_IN_TABLE (table changed under us)
    32,    # ATTEMPT_TO_READ_AFTER_EOF
    60,    # UNKNOWN_TABLE
    81,    # UNKNOWN_DATABASE
    159,   # TIMEOUT_EXCEEDED
    160,   # TOO_SLOW
    164,   # READONLY
    173,   # CANNOT_ALLOCATE_MEMORY
    192,   # UNKNOWN_USER
    193,   # WRONG_PASSWORD
    198,   # DNS_ERROR
    202,   # TOO_MANY_SIMULTANEOUS_QUERIES
    203,   # NO_FREE_CONNECTION
    209,   # SOCKET_TIMEOUT
    210,   # NETWORK_ERROR
    225,   # NO_ZOOKEEPER
    236,   # ABORTED
    241,   # MEMORY_LIMIT_EXCEEDED
    242,   # TABLE_IS_READ_ONLY
    243,   # NOT_ENOUGH_SPACE
    252,   # TOO_MANY_PARTS (merges behind; the partitions variant is told apart below)
    279,   # ALL_CONNECTION_TRIES_FAILED
    285,   # TOO_FEW_LIVE_REPLICAS
    286,   # UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE
    290,   # LIMIT_EXCEEDED
    319,   # UNKNOWN_STATUS_OF_INSERT
    373,   # SESSION_IS_LOCKED
    394,   # QUERY_WAS_CANCELLED
    425,   # SYSTEM_ERROR
    439,   # CANNOT_SCHEDULE_TASK
    452,   # SETTING_CONSTRAINT_VIOLATION
    473,   # DEADLOCK_AVOIDED
    497,   # ACCESS_DENIED
    516,   # AUTHENTICATION_FAILED
    999,   # KEEPER_EXCEPTION
    1000,  # POCO_EXCEPTION
})
_CODE = re.compile(r"\bCode:\s*(\d+)")
NOT_ENOUGH_SPACE = 243
# A write that failed for space after ClickHouse had reserved it (a server's
# CANNOT_WRITE_TO_FILE_DESCRIPTOR and the like) says so only in its text.
_NO_SPACE = re.compile(r"No space left on device|errno:? ?28\b|ENOSPC", re.IGNORECASE)
_PARTITIONS = re.compile(r"too many partitions for (a )?single insert block(?: \(more than (\d+)\))?",
                         re.IGNORECASE)
DEFAULT_PARTITION_LIMIT = 100


def error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    if code is None:
        match = _CODE.search(str(exc))
        code = int(match.group(1)) if match else None
    return code


def partition_limit(exc: BaseException) -> int | None:
    """The per-insert partition limit when ``exc`` is "too many partitions for a single
    INSERT block", else None."""
    match = _PARTITIONS.search(str(exc)) if error_code(exc) == 252 else None
    if match is None:
        return None
    return int(match.group(2)) if match.group(2) else DEFAULT_PARTITION_LIMIT


def disk_full(exc: BaseException) -> bool:
    """The data volume is full: the insert did not fit, through no fault of its rows."""
    return error_code(exc) == NOT_ENOUGH_SPACE or bool(_NO_SPACE.search(str(exc)))


def refusal(exc: BaseException) -> bool:
    """Whether the loader handles ``exc`` from an insert (a ClickHouse error, or one the
    client raised serializing a row); anything else is a bug and propagates."""
    return isinstance(exc, ClickHouseError) or blames_rows(exc)


def blames_rows(exc: BaseException) -> bool:
    """True when the error may come from the rows themselves (so the culprits are looked
    for); False when a later retry of the same insert can succeed."""
    if isinstance(exc, DataError):  # the client could not serialize a value for its column
        return True
    if not isinstance(exc, ClickHouseError):  # raised while the client serialized the rows
        return isinstance(exc, (TypeError, ValueError, OverflowError, struct.error))
    if isinstance(exc, OperationalError):  # connection, network, stream failures
        return False
    if partition_limit(exc) is not None:
        return False  # no row is at fault; the batch is split (month_runs)
    if disk_full(exc):
        return False
    # A server error names its code; without one (the client closed, a transport
    # failure) nothing points at the rows.
    code = error_code(exc)
    return code is not None and code not in RETRY_CODES


def month_of(time: datetime) -> int:
    """The ClickHouse partition (``toYYYYMM(time)``, in UTC) of a record's time."""
    if time.tzinfo is not None:
        time = time.astimezone(timezone.utc)
    return time.year * 100 + time.month


def month_runs(messages: Sequence, limit: int) -> list[list]:
    """Split a partition's batch into consecutive runs each spanning at most ``limit``
    months, cut only between Kafka messages.

    Why split rather than dead-letter or raise the limit: every row is good, so none may
    be dead-lettered; the parts written are the same either way (one per month), and the
    server's limit stays respected. Why consecutive runs in offset order, whole messages
    each: the loader resumes a partition from ``max(_offset) + 1`` stored in ClickHouse, so
    when run k has landed, everything before its last offset must have landed too -- a
    crash between two runs then reads the remaining runs again, losing nothing. A single
    message spanning more months than the limit forms a run of its own (the caller
    inserts it with the limit raised to its month count: splitting inside a message would
    break that resume rule, as its records share one offset).
    """
    runs: list[list] = []
    run: list = []
    months: set[int] = set()
    for _, group in groupby(messages, key=lambda m: m.offset):
        group = list(group)
        group_months = {month_of(m.record.time) for m in group}
        if run and len(months | group_months) > limit:
            runs.append(run)
            run, months = [], set()
        run.extend(group)
        months |= group_months
    if run:
        runs.append(run)
    return runs


def months_in(messages: Sequence) -> int:
    return len({month_of(m.record.time) for m in messages})
