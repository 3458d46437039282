"""Edge cases of the spill file's durability (a corrupt orphan, short reads, ...), in
memory: a MemoryBroker stands in for Kafka."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import delivery, spill as spill_module
from trainmon.producer.spill import SpillFile, claim_orphans, punch_front

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
    monkeypatch.setattr(spill_module, "punch_front", lambda fd, length: False)  # (a rewrite)
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


def padded(i: int) -> tuple[str, bytes, bytes]:
    return entry('{"a":%d,"pad":"%s"}' % (i, "x" * 1000))


def punching_works(directory) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"x" * 8192)
    fd = os.open(probe, os.O_RDWR)
    try:
        return punch_front(fd, 4096)
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("punching", [True, False], ids=["in place", "rewritten"])
def test_a_resend_drops_each_acknowledged_batch_from_the_file_and_keeps_the_rest_in_order(
        tmp_path, monkeypatch, punching):
    """After a long outage the spill file is sent back a batch at a time. Each batch
    Kafka acknowledged leaves the file: its blocks are freed in place (the file is not
    copied: it keeps its size, with fewer blocks), or, where the filesystem cannot punch
    holes, the rest is rewritten into a new file; every record is read back once, in
    order."""
    if punching and not punching_works(tmp_path):
        pytest.skip("this filesystem cannot punch holes")
    if not punching:
        monkeypatch.setattr(spill_module, "punch_front", lambda fd, length: False)
    spill = SpillFile(tmp_path, "run.0")
    spill.append([padded(i) for i in range(1000)])  # ~1 MB
    allocated = spill.path.stat().st_blocks * 512
    read, appended, checked = [], 1000, False
    while spill.count:
        read += spill.read(100_000)
        if appended < 1005:
            spill.append([padded(appended)])  # a record logged while the batch was in flight
            appended += 1
        spill.acknowledge()
        if len(read) >= 500 and not checked:
            stat, checked = spill.path.stat(), True
            if punching:
                assert stat.st_size > 1000 * 1000 and spill.head > 500_000  # not copied
                assert stat.st_blocks * 512 < allocated - 400_000  # the front's blocks freed
            else:
                assert stat.st_size < 600_000 and spill.head == 0  # the front is gone
    assert [json.loads(v)["a"] for _, _, v in read] == list(range(appended))
    assert spill.path.stat().st_size == 0 and spill.head == 0
    spill.close()


@pytest.mark.parametrize("seek_data", [True, False], ids=["SEEK_DATA", "read past the zeros"])
def test_an_orphan_freed_at_its_front_hands_over_only_its_unacknowledged_records(
        tmp_path, monkeypatch, seek_data):
    """A rank killed during a resend leaves a file whose acknowledged front is freed (it
    reads as zeros, megabytes of them): a claimer skips it, without reading it into memory
    as one line, and sends each record not yet acknowledged once (the batch in flight at
    the kill included)."""
    if not punching_works(tmp_path):
        pytest.skip("this filesystem cannot punch holes")
    owner = SpillFile(tmp_path, "gone.0")
    owner.append([padded(i) for i in range(3000)])  # ~3 MB
    acknowledged = owner.read(2_000_000)
    owner.acknowledge()
    in_flight = owner.read(100_000)  # then the kill: not acknowledged
    os.close(owner._fd)  # (the lock goes with it, as at a kill)
    assert owner.path.read_bytes()[:1000] == b"\0" * 1000
    if not seek_data:
        lseek = os.lseek
        def no_seek_data(fd, position, how):
            if how == os.SEEK_DATA:
                raise OSError(errno.EINVAL, "SEEK_DATA not supported")
            return lseek(fd, position, how)
        monkeypatch.setattr(os, "lseek", no_seek_data)
    chunks: list = []
    claim_orphans(tmp_path, lambda entries: chunks.append(entries) or True, chunk_bytes=50_000)
    got = [json.loads(v)["a"] for chunk in chunks for _, _, v in chunk]
    assert got == list(range(len(acknowledged), 3000))
    assert in_flight and got[:len(in_flight)] == [json.loads(v)["a"] for _, _, v in in_flight]
    assert max(len(chunk) for chunk in chunks) < 100  # read ~50 KB at a time, not all at once
    assert not owner.path.exists()
