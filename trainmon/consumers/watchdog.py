"""Exit a consumer process whose Kafka call is stuck, so its supervisor restarts it.

kafka-python 3.0.12 can block a consumer's ``poll()`` or ``commit()`` forever on an
``event.wait()`` without a timeout (dpkp/kafka-python#3121; the fixes are not released).
No thread can interrupt another in Python, and every trainmon consumer resumes exactly
where its durable state says (ClickHouse offsets, alert checkpoints, forwarder marks), so
the honest remedy is crash-only: after ``TRAINMON_KAFKA_STUCK_SECONDS`` (default 300, 0
turns it off) in one call, log which call, dump every thread's stack and exit with
EXIT_STUCK. docker-compose restarts the service (``restart: unless-stopped``), as would
systemd or Kubernetes.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager

log = logging.getLogger("trainmon.consumers")

EXIT_STUCK = 75  # EX_TEMPFAIL: try again
DEFAULT_LIMIT_S = 300.0


class KafkaCallWatchdog:
    def __init__(self, limit_s: float, name: str = "consumer"):
        self.limit_s = limit_s
        self.name = name
        self._call: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    @classmethod
    def from_env(cls, env: dict | None = None, name: str = "consumer") -> "KafkaCallWatchdog":
        env = os.environ if env is None else env
        return cls(float(env.get("TRAINMON_KAFKA_STUCK_SECONDS") or DEFAULT_LIMIT_S), name)

    @contextmanager
    def watch(self, call: str):
        if self.limit_s <= 0:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainmon-kafka-watchdog",
                                            daemon=True)
            self._thread.start()
        self._call = (call, time.monotonic())
        try:
            yield
        finally:
            self._call = None

    def close(self) -> None:
        """Stop watching; the thread ends within its check interval."""
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(min(5.0, self.limit_s / 4)):
            call = self._call
            if call is not None and time.monotonic() - call[1] > self.limit_s:
                log.critical("trainmon %s: Kafka %s() has not returned for %.0f s "
                             "(kafka-python hang, dpkp/kafka-python#3121); exiting with %d so "
                             "the service is restarted; it resumes from its stored position",
                             self.name, call[0], time.monotonic() - call[1], EXIT_STUCK)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                logging.shutdown()
                os._exit(EXIT_STUCK)
