"""Edge cases of the spill file's durability (a corrupt orphan, short reads, ...), in
memory: a MemoryBroker stands in for Kafka."""

from __future__ import annotations

import logging
import os

import pytest

from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import delivery
from trainmon.producer.spill import SpillFile, claim_orphans

# (quick_answers: that module's autouse fixture, which these tests need as much)
from .test_producer_backlog_memory import entry, producer_for, quick_answers, steps_in  # noqa: F401
from .waiting import wait_until


def orphan_with(spill_dir, entries, tail: bytes) -> SpillFile:
    """A spill file whose owner died (lock free), with ``tail`` written after its records."""
    orphan = SpillFile(spill_dir, "gone.0")
    orphan.append(entries)
    os.write(orphan._fd, tail)
    os.close(orphan._fd)
    orphan._fd = None
    return orphan


@pytest.mark.parametrize("tail", [
    b"\xff\xfe\x00garbage",  # not UTF-8 (a block of another file after a power loss)
    b"123\n",  # JSON, but not a record's list
    b"null\n",
    b'[1, 2, 3]\n',
])
def test_a_corrupt_tail_of_an_orphan_is_skipped_and_its_records_sent(tmp_path, tail, caplog):
    spill_dir = tmp_path / "spill"
    orphan = orphan_with(spill_dir, [entry('{"a":1}'), entry('{"a":2}')], tail)
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        producer.log_step(0, loss=1.0)
        assert producer.flush(10)
        # The earlier producer's intact records reached Kafka, and the sender still works.
        assert steps_in(broker, "t") == [b'{"a":1}', b'{"a":2}']
        assert len(steps_in(broker)) == 1
    assert not orphan.path.exists()
    assert any("skipped" in r.getMessage() for r in caplog.records), caplog.text
    producer.close()


def test_dropping_the_acknowledged_front_keeps_all_of_a_tail_read_in_parts(tmp_path, monkeypatch):
    """Linux's pread returns at most 2 GiB - 4 KiB at once (and POSIX lets any read come
    back short): a spill file whose unacknowledged rest is larger than that, after a long
    outage, must still be rewritten whole. Shown at a small scale: reads capped at 100
    bytes."""
    spill = SpillFile(tmp_path, "run.0")
    spill.append([entry('{"a":0}')])
    assert spill.read(1 << 20) == [entry('{"a":0}')]
    spill.append([entry('{"a":%d}' % i) for i in range(1, 50)])  # while it was in flight
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: pread(fd, min(n, 100), offset))
    spill.acknowledge()
    monkeypatch.setattr(os, "pread", pread)
    assert spill.count == 49
    assert spill.read(1 << 20) == [entry('{"a":%d}' % i) for i in range(1, 50)]


def test_a_spill_file_whose_owner_still_lived_at_start_is_claimed_once_it_exits(tmp_path, monkeypatch):
    """A restarted rank that starts while the old one still exits (its file still locked)
    sends the old one's records once it is gone, not only at the next producer's start
    (there may be none: the job's last restart)."""
    monkeypatch.setattr(delivery, "ORPHANS_RETRY_S", 0.05)
    spill_dir = tmp_path / "spill"
    old = SpillFile(spill_dir, "mem.0")  # (its own open file: locked against the new one's)
    old.append([entry('{"a":1}'), entry('{"a":2}')])
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path)
    producer.log_step(0, loss=1.0)
    assert producer.flush(10)
    assert steps_in(broker, "t") == [] and old.path.exists()  # not stolen from a live owner
    os.close(old._fd)  # the old rank exits (a kill -9 alike): its lock is free
    old._fd = None
    step = 1

    def delivered() -> bool:
        nonlocal step
        producer.log_step(step, loss=1.0)  # (the sender thread wakes for records)
        step += 1
        producer.flush(1)
        return steps_in(broker, "t") == [b'{"a":1}', b'{"a":2}']

    wait_until(delivered, timeout=5, what="the old rank's records", pause=0.05)
    assert not old.path.exists()
    producer.close()


def test_a_spill_file_that_cannot_be_read_leaves_the_others_claimed(tmp_path, caplog):
    """One earlier file that cannot be opened or read (here a directory with a spill
    file's name; as well a disk error, a file of another user's) stopped the claim at it:
    the files after it were never sent. Now it is named in a warning and passed over, the
    others are claimed, and it is tried again later (it may become readable)."""
    spill_dir = tmp_path / "spill"
    bad = spill_dir / "a-bad.0.spill"  # (sorted first)
    bad.mkdir(parents=True)
    orphan = orphan_with(spill_dir, [entry('{"a":1}'), entry('{"a":2}')], b"")
    broker = MemoryBroker()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        producer = producer_for(broker, tmp_path)
        producer.log_step(0, loss=1.0)
        assert producer.flush(10)
        assert steps_in(broker, "t") == [b'{"a":1}', b'{"a":2}']
    assert not orphan.path.exists()
    assert any("a-bad.0.spill" in r.getMessage() for r in caplog.records), caplog.text
    assert producer._worker._delivery.orphans_again_at is not None  # tried again later
    producer.close()
    problems = []
    assert claim_orphans(spill_dir, lambda entries: True, unreadable=lambda p, e: problems.append(p))
    assert problems == [bad]
