"""Inserts on a background thread, in the order they were handed over.

While ClickHouse works on one insert (chDB runs it in C++ without holding the GIL; a
server is waited on over HTTP), the consumer's own thread goes on polling and decoding
the next records: on two cores the two overlap instead of taking turns.

The writer stops at the first insert that fails and keeps it, with everything handed over
after it, for the caller to take back (``take_back``) and deal with on its own thread:
a partition's batches must land in offset order, since the loader resumes from the
highest offset stored. It never raises into the caller's thread and never dies of an
error (a failure is data for the caller); ``close`` ends it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, TypeVar

Batch = TypeVar("Batch")


class BackgroundWriter(Generic[Batch]):
    def __init__(self, write: Callable[[Batch], None], size: Callable[[Batch], int], name: str):
        self._write = write
        self._size = size
        self._queue: deque[Batch] = deque()  # handed over, not written; [0] is being written
        self.error: BaseException | None = None  # why _queue[0] failed; the writer waits
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------

    def submit(self, batch: Batch) -> None:
        with self._cond:
            self._queue.append(batch)
            self._cond.notify_all()

    def pending(self) -> list[Batch]:
        """Batches handed over and not written yet, in order."""
        with self._cond:
            return list(self._queue)

    def pending_rows(self) -> int:
        with self._cond:
            return self._rows()

    def wait(self, rows_at_most: int = 0) -> None:
        """Until at most ``rows_at_most`` rows are pending, or the writer stopped at a
        failure (``error``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.error is not None or self._rows() <= rows_at_most)

    def take_back(self) -> list[Batch]:
        """After a failure: the batch that failed and all handed over after it, which the
        writer gives up; it is ready for new batches again."""
        with self._cond:
            taken, self._queue, self.error = list(self._queue), deque(), None
            return taken

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _rows(self) -> int:  # (holding the lock)
        return sum(self._size(b) for b in self._queue)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and self.error is None))
                if self._closed:
                    return
                batch = self._queue[0]
            try:
                self._write(batch)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, never raised here
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                continue
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()
            del batch  # written: nothing keeps it (not even this frame, while idle)
