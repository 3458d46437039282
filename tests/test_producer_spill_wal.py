"""The spill file is a write-ahead log: a rank killed with kill -9 during a broker outage,
at the moment its spilled records are being sent again and are not yet acknowledged,
loses only its last few seconds. And without a usable spill directory, records wait in
memory (up to the bound) until a late broker comes, instead of being dropped."""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmon.broker import Broker, free_port
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.spill import SUFFIX, _load
from trainmon.schemas import count

from .clickhouse_service import REPO, ClickHouseService, trainmon_env
from .waiting import wait_until

# On librdkafka, the default client: the write-ahead log is the producer's, the same for
# either transport, and test_producer_outage.py resends through both; the memory bound is
# also tested in memory (test_producer_backlog_memory.py). One client halves the ~3 min.

# What a kill may cost: records Kafka has not given up on yet (its 5 s delivery timeout),
# the pack window (0.5 s) and the interval at which the sender collects Kafka's reports (2 s).
LOSABLE_S = 8.0


@pytest.fixture
def own_broker(tmp_path):
    broker = Broker(tmp_path / "kafka", port=free_port()).start()
    yield broker
    broker.stop(kill=True)


def spilled_records(directory: Path) -> int:
    return sum(count(value) for path in directory.glob(f"*{SUFFIX}")
               for _, _, value in _load(path.read_bytes()))


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line (it prints whole lines and flushes), waiting up to timeout."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line, f"child said nothing (exit {proc.poll()}); stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return line.strip()


def test_rank_killed_while_its_spill_is_resent_loses_only_its_last_seconds(own_broker, tmp_path):
    prefix, run_id, spill = "wal.", "killed-mid-retry", tmp_path / "spill"
    progress, arm = tmp_path / "progress", tmp_path / "arm"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.spill_kill_child", own_broker.bootstrap, prefix, str(spill),
         run_id, str(progress), str(arm)],
        cwd=REPO, env=trainmon_env(own_broker.bootstrap), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert read_line(child, 60) == "READY"
        own_broker.stop(kill=True)
        outage_at = time.time()
        # Well into the outage: the spill file holds 11 s of records (50 steps/s; those
        # of the last ~7 s are still Kafka's or in the pack window) ...
        wait_until(lambda: spilled_records(spill) >= 550, 90, "11 s of records in the spill file", pause=0.1)
        # ... and the next time the sender hands spilled records to Kafka again, it is held
        # there (see spill_kill_child) and killed.
        arm.touch()
        assert read_line(child, 60) == "RESENDING"
        child.send_signal(signal.SIGKILL)
        killed_at = time.time()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)

    logged = {int(step): float(at) for step, at in
              (line.split() for line in progress.read_text().splitlines() if line.count(" ") == 1)}
    must_have = {step for step, at in logged.items() if at < killed_at - LOSABLE_S}
    outage_records = len([at for at in logged.values() if outage_at < at < killed_at - LOSABLE_S])
    assert outage_records >= 300, "the test should cover records logged during the outage"
    assert spilled_records(spill) >= outage_records, "the kill found the spilled records off disk"

    own_broker.start()
    # The next producer on this machine sends what the killed rank left.
    nxt = Producer(ProducerConfig(bootstrap=own_broker.bootstrap, run_id="next-job",
                                  topic_prefix=prefix, spill_dir=spill))
    nxt.log_step(0, loss=1.0)
    assert nxt.flush(60)
    assert nxt.close(30)
    assert spilled_records(spill) == 0

    service = ClickHouseService(own_broker.bootstrap, prefix, tmp_path / "ch", tmp_path / "ch.log").start()
    try:
        where = f"run_id = '{run_id}' AND step < {max(must_have) + 1}"
        service.wait_for(f"SELECT uniqExact(step) FROM trainmon.step WHERE {where}", len(must_have), 90)
        stored = {row["step"]: row["copies"] for row in service.rows(
            f"SELECT step, count() AS copies FROM trainmon.step FINAL WHERE run_id = '{run_id}' GROUP BY step")}
    finally:
        service.stop()
    assert must_have <= set(stored), f"lost: {sorted(must_have - set(stored))[:20]}"
    assert set(stored) <= set(logged)
    assert set(stored.values()) == {1}, "a record is in ClickHouse twice"


@pytest.mark.kafka
@pytest.mark.slow
def test_unwritable_spill_keeps_records_in_memory_until_a_late_broker_comes(tmp_path, unwritable_spill, caplog):
    prefix, run_id = "late.", "no-disk-late-broker"
    broker = Broker(tmp_path / "kafka", port=free_port())
    bound = 5_000
    producer = Producer(ProducerConfig(bootstrap=broker.bootstrap, run_id=run_id, topic_prefix=prefix,
                                       spill_dir=unwritable_spill, queue_size=bound))
    caplog.set_level(logging.ERROR, logger="trainmon.producer")
    started, step, most_held, most_queued = time.monotonic(), 0, 0, 0
    try:
        while time.monotonic() - started < 7:  # no broker for 7 s (> the 5 s delivery timeout), 100 steps/s
            assert producer.log_step(step, loss=2.0, norm=1.0) is True
            most_held = max(most_held, producer.held_in_memory)
            most_queued = max(most_queued, producer.queued)
            step += 1
            time.sleep(0.01)
        # By now Kafka has given up on the early records: they wait in memory, not dropped.
        assert producer.dropped == 0
        assert producer.held_in_memory > 0
        broker.start()
        for _ in range(300):
            assert producer.log_step(step, loss=2.0, norm=1.0) is True
            most_held = max(most_held, producer.held_in_memory)
            most_queued = max(most_queued, producer.queued)
            step += 1
            time.sleep(0.01)
        assert producer.flush(60)
        assert producer.close(30)
        assert producer.dropped == 0 and producer.held_in_memory == 0
        assert 0 < most_held <= bound and most_queued <= bound
        said = [r.getMessage() for r in caplog.records if "cannot keep records" in r.getMessage()]
        assert len(said) == 1 and "not-a-directory" in said[0] and "wait in memory" in said[0]
        assert not any("dropped" in r.getMessage() for r in caplog.records)

        service = ClickHouseService(broker.bootstrap, prefix, tmp_path / "ch", tmp_path / "ch.log").start()
        try:
            service.wait_for(f"SELECT uniqExact(step) FROM trainmon.step WHERE run_id = '{run_id}'", step, 90)
            assert service.value(f"SELECT count() FROM trainmon.step FINAL WHERE run_id = '{run_id}'") == step
        finally:
            service.stop()
    finally:
        broker.stop(kill=True)


@pytest.mark.kafka  # the Kafka clients' own delivery timeouts, no broker (in memory: test_producer_backlog_memory)
@pytest.mark.slow
def test_beyond_the_memory_bound_records_are_dropped_counted_and_said_once(unwritable_spill, caplog):
    producer = Producer(ProducerConfig(bootstrap=f"127.0.0.1:{free_port()}", run_id="bound",
                                       spill_dir=unwritable_spill, queue_size=300))
    caplog.set_level(logging.ERROR, logger="trainmon.producer")
    for step in range(3_000):
        assert producer.log_step(step, loss=2.0) is True
        assert producer.held_in_memory <= 300
        time.sleep(0.002)
    wait_until(lambda: producer.dropped > 0, 30, "records beyond the bound to be dropped")
    assert producer.held_in_memory <= 300
    dropped_said = [r.getMessage() for r in caplog.records if "are dropped and counted" in r.getMessage()]
    assert len(dropped_said) == 1 and "300" in dropped_said[0]
    assert producer.close(timeout=2) is False
