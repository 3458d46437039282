"""Inserts on background threads, each partition's in the order they were handed over.

While ClickHouse works on an insert (chDB runs it in C++ without holding the GIL; a
server is waited on over HTTP), the consumer's own thread goes on polling and decoding
the next records: on two cores they overlap instead of taking turns. With more than one
lane (a thread with its own client: a chDB handle or a server session runs one query at
a time), inserts of different partitions also run side by side.

A partition's batches must land in offset order (the loader resumes from the highest
offset stored), so a batch goes to the lane that still holds one of its partition's, and
otherwise to the lane with the fewest rows to write. A lane stops at the first insert
that fails and keeps it, with everything handed to it after it, for the caller to take
back (``take_back``) and deal with on its own thread; the other lanes go on. The writer
never raises into the caller's thread and never dies of an error (a failure is data for
the caller); ``close`` ends it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, Hashable, Sequence, TypeVar

Batch = TypeVar("Batch")


class _Lane(Generic[Batch]):
    def __init__(self, write: Callable[[Batch], None]):
        self.write = write
        self.queue: deque[Batch] = deque()  # handed over, not written; [0] is being written
        self.error: BaseException | None = None  # why queue[0] failed; the lane waits
        self.thread: threading.Thread | None = None


class BackgroundWriter(Generic[Batch]):
    def __init__(self, writes: Sequence[Callable[[Batch], None]], size: Callable[[Batch], int], name: str,
                 key: Callable[[Batch], Hashable] = lambda batch: None):
        self._size = size
        self._key = key
        self._lanes = [_Lane(write) for write in writes]
        self._closed = False
        self._cond = threading.Condition()
        for i, lane in enumerate(self._lanes):
            lane.thread = threading.Thread(target=self._run, args=(lane,), name=f"{name}-{i}", daemon=True)
            lane.thread.start()

    # -- the caller's side ---------------------------------------------------------------

    def submit(self, batch: Batch) -> None:
        with self._cond:
            self._lane_for(batch).queue.append(batch)
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """Why a lane stopped (the first such lane's), or None."""
        return next((lane.error for lane in self._lanes if lane.error is not None), None)

    def pending(self) -> list[Batch]:
        """Batches handed over and not written yet; each partition's in order."""
        with self._cond:
            return [batch for lane in self._lanes for batch in lane.queue]

    def pending_rows(self) -> int:
        with self._cond:
            return sum(self._rows(lane) for lane in self._lanes)

    def wait(self, rows_at_most: int = 0) -> None:
        """Until the lanes still writing (not stopped at a failure) hold at most
        ``rows_at_most`` rows: with the default, until every lane is done or stopped."""
        with self._cond:
            self._cond.wait_for(lambda: sum(self._rows(lane) for lane in self._lanes
                                            if lane.error is None) <= rows_at_most)

    def take_back(self) -> list[Batch]:
        """After a failure: from each lane that stopped, the batch that failed and all
        handed to it after it, which the lane gives up; it is ready for new batches again."""
        with self._cond:
            taken = []
            for lane in self._lanes:
                if lane.error is not None:
                    taken += lane.queue
                    lane.queue, lane.error = deque(), None
            return taken

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for lane in self._lanes:
            lane.thread.join(timeout=60)

    def _rows(self, lane: _Lane) -> int:  # (holding the lock)
        return sum(self._size(b) for b in lane.queue)

    def _lane_for(self, batch: Batch) -> _Lane:  # (holding the lock)
        key = self._key(batch)
        for lane in self._lanes:
            if any(self._key(b) == key for b in lane.queue):
                return lane
        return min(self._lanes, key=self._rows)

    # -- a lane's thread -----------------------------------------------------------------

    def _run(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (lane.queue and lane.error is None))
                if self._closed:
                    return
                batch = lane.queue[0]
            try:
                lane.write(batch)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, never raised here
                with self._cond:
                    lane.error = exc
                    self._cond.notify_all()
                continue
            with self._cond:
                lane.queue.popleft()
                self._cond.notify_all()
            del batch  # written: nothing keeps it (not even this frame, while idle)
