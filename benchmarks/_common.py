"""Helpers shared by the benchmark scripts: a broker to run against, a service's join,
percentiles."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time

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


def wait_joined(group: str, bootstrap: str, service: subprocess.Popen, timeout_s: float = 120.0,
                pause: float = 0.1) -> float | None:
    """Until the service's consumer group is stable with partitions assigned (it has joined
    and reads, so its start-up is not measured): ``time.perf_counter()`` then, None if the
    service exited first (the caller reports it)."""
    from trainmon.kafka_client.admin import assigned_partitions

    deadline = time.monotonic() + timeout_s
    while not assigned_partitions(group, bootstrap=bootstrap):
        if service.poll() is not None:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{group}: no partitions assigned after {timeout_s:.0f} s")
        time.sleep(pause)
    return time.perf_counter()
