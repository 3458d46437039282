"""A spill directory that cannot be written (a path under a regular file, a full disk)
while the broker is away: the training loop never sees an error, memory stays bounded,
and what is lost is counted, said once, and true."""

from __future__ import annotations

import logging
import socket

import pytest

from trainmon.producer import Producer, ProducerConfig


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.mark.kafka  # the Kafka client with no broker (in memory: test_producer_backlog_memory)
@pytest.mark.slow
def test_unwritable_spill_and_no_broker_never_raise_and_count_the_drop(unwritable_spill, caplog):
    producer = Producer(ProducerConfig(bootstrap=f"127.0.0.1:{closed_port()}", run_id="no-disk",
                                       spill_dir=unwritable_spill, queue_size=500))
    caplog.set_level(logging.ERROR, logger="trainmon.producer")
    logged = 5_000
    for step in range(logged):  # never raises, whatever the sender thread meets
        assert producer.log_step(step, loss=2.0, norm=1.0) is True
        # The queue is bounded: the training thread's memory cannot grow with the outage.
        assert producer.queued <= 500
    assert producer.flush(timeout=2) is False
    assert producer.close(timeout=2) is False
    assert producer.dropped > 0
    assert producer.dropped + producer.spilled + producer._worker.sent == logged
    said = [r.getMessage() for r in caplog.records if "cannot keep records" in r.getMessage()]
    assert len(said) == 1 and "not-a-directory" in said[0]
    assert any(f"{producer.dropped} records were dropped" in r.getMessage() for r in caplog.records)
