"""Helpers shared by the benchmark scripts: a broker to run against, percentiles."""

from __future__ import annotations

import contextlib
import os
import tempfile

from trainmon.broker import Broker


@contextlib.contextmanager
def broker_bootstrap():
    """TRAINMON_KAFKA_BOOTSTRAP if set, else a throwaway local broker for this run."""
    if os.environ.get("TRAINMON_KAFKA_BOOTSTRAP"):
        yield os.environ["TRAINMON_KAFKA_BOOTSTRAP"]
        return
    with tempfile.TemporaryDirectory(prefix="trainmon-bench-") as tmp:
        # throwaway: stopped with this process, however it ends (SIGTERM, kill -9).
        broker = Broker(os.path.join(tmp, "kafka"), heap="1g", throwaway=True).start()
        try:
            yield broker.bootstrap
        finally:
            broker.stop()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(round(q / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[index]
