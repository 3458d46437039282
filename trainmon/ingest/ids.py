"""Event ids for records read from a log: derived from the run, the source and the
record, so reading the same log again (a second backfill, a restarted follower, or a
backfill of a log first piped through ``trainmon ingest -``) yields the same ids and
the consumers keep each record once.

The n-th record of one kind, rank and step in a run is always the same record:
``occurrence`` tells apart a step logged twice (a job resumed from a checkpoint
repeats the steps after it).
"""

from __future__ import annotations

import hashlib

SOURCE = "log"


def event_id(run_id: str, kind: str, rank: int, key: object, occurrence: int) -> str:
    digest = hashlib.blake2b(f"{run_id}\0{SOURCE}\0{kind}\0{rank}\0{key}\0{occurrence}".encode(),
                             digest_size=12).hexdigest()
    return f"{SOURCE}-{digest}"


class Occurrences:
    """Counts how often each (kind, rank, key) has been seen in this read."""

    def __init__(self) -> None:
        self._seen: dict[tuple, int] = {}

    def next(self, kind: str, rank: int, key: object) -> int:
        k = (kind, rank, key)
        n = self._seen.get(k, 0)
        self._seen[k] = n + 1
        return n
