"""The producer's own health, as records of the run: ``producer_health`` (see
ProducerHealthRecord) every ``TRAINMON_PRODUCER_HEALTH_INTERVAL_S`` seconds (60; 0 turns
it off), from a daemon thread of its own.

The training thread pays nothing for it: no log call counts or times anything more. The
thread reads what the sender keeps anyway (its queue's length, the spill file's records,
the time it last handed records to Kafka, the counts of sent, dropped and rejected
records) and logs one record like any other, so it lands in ClickHouse beside the
run's steps, where SQL, Grafana and the alert rules read it. The first record goes one
interval after the start, so a short job (a test, a benchmark) sends none.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("trainmon.producer")

DEFAULT_INTERVAL_S = 60.0


def health_fields(worker, step: int, rejected: int) -> dict[str, Any]:
    """ProducerHealthRecord's fields, read from the sender ``worker`` now."""
    error = worker.spill_error
    last_sent_at = worker.last_sent_at
    return {
        "step": step,
        "queued": worker.queued,
        "in_flight": worker.in_flight,
        "spilled": worker.spilled,
        "held_in_memory": worker.held_in_memory,
        "sent": worker.sent,
        "dropped": worker.dropped,
        "rejected": rejected,
        "spill_errors": worker.spill_errors,
        "spill_error": None if error is None else f"{type(error).__name__}: {error}"[:500],
        "last_sent_age_s": None if last_sent_at is None else round(time.monotonic() - last_sent_at, 3),
    }


class HealthReporter:
    """Calls ``report()`` every ``interval_s`` on a daemon thread until stopped; ``sent``
    counts the reports made. A report that raises is said once and the thread goes on."""

    def __init__(self, report: Callable[[], Any], interval_s: float = DEFAULT_INTERVAL_S):
        self.interval_s = interval_s
        self.sent = 0
        self._report = report
        self._stop = threading.Event()
        self._failed = False
        self._thread: threading.Thread | None = None

    def start(self) -> "HealthReporter":
        self._thread = threading.Thread(target=self._run, name="trainmon-health", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self._report():
                    self.sent += 1
            except Exception as exc:  # noqa: BLE001 -- a health record is never worth a crash
                if not self._failed:
                    self._failed = True
                    log.warning("trainmon: cannot report the producer's health (further failures "
                                "are silent): %r", exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
