"""A long-lived broker (``trainmon up``, ``trainmon broker start``) touches its whole heap at
start, so its RSS does not climb towards the heap for the first hour of a soak; a broker for
one process (tests, benchmarks) does not pay for that (trainmon.broker.jvm_performance_options)."""

from __future__ import annotations

import psutil
import pytest

from trainmon.broker import Broker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

HEAP_MIB = 1024


def broker_rss_mib(broker: Broker) -> float:
    return psutil.Process(broker.pid()).memory_info().rss / 2**20


@pytest.mark.parametrize("throwaway", [False, True])
def test_a_long_lived_broker_holds_its_heap_from_the_start(tmp_path, monkeypatch, throwaway):
    # The tests' own JVM options (conftest.py) leave the touch out; a user's machine has none set.
    monkeypatch.delenv("KAFKA_JVM_PERFORMANCE_OPTS")
    broker = Broker(tmp_path / "kafka", heap=f"{HEAP_MIB}m", throwaway=throwaway).start()
    try:
        rss = broker_rss_mib(broker)
        if throwaway:
            assert rss < HEAP_MIB * 0.8, rss  # the heap's pages are touched as G1 uses them
        else:
            assert rss >= HEAP_MIB, rss
    finally:
        broker.stop()
