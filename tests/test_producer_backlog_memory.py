"""The spill file as a write-ahead log and the memory backlog, in memory: a MemoryBroker
stands in for Kafka (it gives up on messages after its delivery timeout while down, as
librdkafka does), so these run in well under a second each. The real broker shows the
same end to end in test_producer_spill_wal.py."""

from __future__ import annotations

import fcntl
import json
import logging
import os

import pytest

from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig, worker
from trainmon.producer.spill import SUFFIX, SpillFile, claim_orphans
from trainmon.schemas import count, pack, unpack

from .waiting import wait_until


@pytest.fixture(autouse=True)
def quick_answers(monkeypatch):
    """The MemoryBroker gives up on a message after 0.5 s, not Kafka's 5 s: the sender's
    wait for Kafka's answers and its tick for collecting them are scaled down alike
    (2 s and 1 s -> 0.1 s), so these tests wait tenths of a second for what the real
    producer waits seconds for."""
    monkeypatch.setattr(worker, "_ANSWER_WAIT_S", 0.1)
    monkeypatch.setattr(worker, "_SERVE_EVERY_S", 0.1)


def entry(*records: str) -> tuple[str, bytes, bytes]:
    return ("t", b"k", pack([r.encode() for r in records]))


def steps_in(broker: MemoryBroker, topic: str = "trainmon.step") -> list[bytes]:
    return [record for value in broker.values(topic) for record in unpack(value)]


# -- the spill file ----------------------------------------------------------------------

def test_a_read_leaves_the_records_in_the_file_until_acknowledged(tmp_path):
    spill = SpillFile(tmp_path, "run.0")
    spill.append([entry('{"a":1}', '{"a":2}'), entry('{"a":3}')])
    assert spill.read(1 << 20) == [entry('{"a":1}', '{"a":2}'), entry('{"a":3}')]
    assert spill.count == 3 and spill.path.stat().st_size > 0  # still on disk
    spill.acknowledge()
    assert spill.count == 0 and spill.path.stat().st_size == 0


def test_acknowledging_keeps_what_was_spilled_during_the_resend(tmp_path):
    spill = SpillFile(tmp_path, "run.0")
    spill.append([entry('{"a":1}')])
    assert spill.read(1 << 20) == [entry('{"a":1}')]
    spill.append([entry('{"a":2}')])  # failed while the first was in flight
    spill.acknowledge()
    assert spill.count == 1
    assert spill.read(1 << 20) == [entry('{"a":2}')]
    # The rewritten file is still ours: no other producer can claim it while we live.
    fd = os.open(spill.path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the rewritten spill file is not locked")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    assert not list(tmp_path.glob("*.compacting"))


def test_a_read_returns_about_max_bytes_and_at_least_one_entry(tmp_path):
    spill = SpillFile(tmp_path, "run.0")
    spill.append([entry('{"a":%d}' % i) for i in range(100)])
    first = spill.read(50)
    assert 1 <= len(first) < 100
    spill.acknowledge()
    assert spill.count == 100 - len(first)
    assert spill.read(1 << 20)[0] == entry('{"a":%d}' % len(first))


def test_an_orphan_is_deleted_only_once_its_records_are_on_disk_again(tmp_path):
    orphan = SpillFile(tmp_path, "gone.0")
    orphan.append([entry('{"a":1}')])
    orphan._fd and os.close(orphan._fd)  # its owner died: the lock is free
    orphan._fd = None
    kept: list = []
    claim_orphans(tmp_path, lambda entries: kept.extend(entries) or False)  # only in memory
    assert kept == [entry('{"a":1}')] and orphan.path.exists()
    claim_orphans(tmp_path, lambda entries: True)  # on disk in the claimer's own file
    assert not orphan.path.exists()


# -- the producer over a MemoryBroker ------------------------------------------------------

def producer_for(broker: MemoryBroker, tmp_path, **config) -> Producer:
    config.setdefault("spill_dir", tmp_path / "spill")
    return Producer(ProducerConfig(run_id="mem", **config), transport=broker.transport)


def test_spilled_records_stay_on_disk_while_they_are_sent_again(tmp_path):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path)
    broker.up = False
    for step in range(100):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.spilled == 100, what="the records in the spill file")
    on_disk_at_resend: list[int] = []
    transport = producer._worker._transport
    send = transport.send

    def watched(entry, on_undelivered=None):
        if on_undelivered is not None:  # a resend from the backlog
            on_disk_at_resend.append(producer.spilled)
        return send(entry, on_undelivered)

    transport.send = watched
    wait_until(lambda: on_disk_at_resend, what="a resend while the broker is down")
    assert set(on_disk_at_resend) == {100}  # the attempt failed: nothing left the file
    broker.up = True
    assert producer.flush(10)
    assert producer.spilled == 0
    assert min(on_disk_at_resend) == 100
    assert len(steps_in(broker)) == 100
    producer.close()


def test_records_logged_during_a_resend_join_the_file_behind_it(tmp_path):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path)
    broker.up = False
    for step in range(50):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.spilled == 50)
    broker.up = True
    for step in range(50, 100):
        producer.log_step(step, loss=1.0)
    assert producer.flush(10)
    steps = [int(r.split(b'"step":')[1].split(b",")[0]) for r in steps_in(broker)]
    assert steps == list(range(100))  # in order, each once
    producer.close()


def test_without_a_usable_spill_directory_records_wait_in_memory(tmp_path, unwritable_spill):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill, queue_size=1_000)
    broker.up = False
    for step in range(300):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.held_in_memory == 300, what="records held in memory")
    assert producer.dropped == 0 and producer.spilled == 0
    broker.up = True
    assert producer.flush(10)
    assert producer.held_in_memory == 0 and producer.dropped == 0
    assert len(steps_in(broker)) == 300
    assert producer.close()


def test_beyond_the_memory_bound_records_are_dropped_and_counted(tmp_path, unwritable_spill):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill, queue_size=100)
    broker.up = False
    for step in range(300):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.dropped == 200, what="the records beyond the bound dropped")
    assert producer.held_in_memory == 100
    broker.up = True
    assert producer.flush(10)
    assert len(steps_in(broker)) == 100
    assert producer.close() is False  # records were lost: close says so
    assert producer.dropped == 200


def test_records_held_in_memory_at_exit_are_counted_as_dropped(tmp_path, unwritable_spill):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill)
    broker.up = False
    for step in range(20):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.held_in_memory == 20)
    assert producer.close(timeout=0.5) is False
    assert producer.dropped == 20 and producer.held_in_memory == 0


def test_count_of_a_packed_entry():  # (the backlog counts records, not messages)
    assert count(entry('{"a":1}', '{"a":2}')[2]) == 2


def test_an_unwritable_spill_with_the_broker_away_never_raises_and_says_the_drop_once(
        tmp_path, unwritable_spill, caplog):
    """test_producer_spill_unwritable.py's guarantee, on a MemoryBroker."""
    broker = MemoryBroker()
    broker.up = False
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill, queue_size=500)
    caplog.set_level(logging.ERROR, logger="trainmon.producer")
    logged = 5_000
    for step in range(logged):
        assert producer.log_step(step, loss=2.0, norm=1.0) is True
        assert producer.queued <= 500
    assert producer.flush(timeout=0.5) is False
    assert producer.close(timeout=0.5) is False
    assert producer.dropped > 0
    assert producer.dropped + producer.spilled + producer._worker.sent == logged
    said = [r.getMessage() for r in caplog.records if "cannot keep records" in r.getMessage()]
    assert len(said) == 1 and "not-a-directory" in said[0]
    assert any(f"{producer.dropped} records were dropped" in r.getMessage() for r in caplog.records)


def test_beyond_the_memory_bound_the_drop_is_said_once(tmp_path, unwritable_spill, caplog):
    """test_producer_spill_wal.py's memory-bound guarantee, on a MemoryBroker."""
    broker = MemoryBroker()
    broker.up = False
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill, queue_size=300)
    caplog.set_level(logging.ERROR, logger="trainmon.producer")
    for step in range(3_000):
        assert producer.log_step(step, loss=2.0) is True
        assert producer.held_in_memory <= 300
    wait_until(lambda: producer.dropped > 0, what="records beyond the bound to be dropped")
    assert producer.held_in_memory <= 300
    dropped_said = [r.getMessage() for r in caplog.records if "are dropped and counted" in r.getMessage()]
    assert len(dropped_said) == 1 and "300" in dropped_said[0]
    assert producer.close(timeout=0.5) is False


# -- found in review (2026-11-27): the spill file's edges ---------------------------------

def test_a_spill_file_claimed_between_its_creation_and_its_lock_is_made_again(tmp_path, monkeypatch):
    """Another producer starting on the machine globs the directory between the file's
    creation and its lock: it finds an empty, unlocked file and removes it as an orphan's.
    The owner must not then write into the removed file (a kill, or the exit, would lose
    every record spilled there)."""
    import types

    from trainmon.producer import spill as spill_module

    owner = SpillFile(tmp_path, "run.0")
    raced = []

    def flock(fd, op):
        if not raced:
            raced.append(True)
            claim_orphans(tmp_path, lambda entries: True)  # a producer starting right now
        return fcntl.flock(fd, op)

    monkeypatch.setattr(spill_module, "fcntl", types.SimpleNamespace(
        flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    owner.append([entry('{"a":1}'), entry('{"a":2}')])
    assert raced and owner.count == 2
    assert owner.path.read_text().count("\n") == 2


def test_an_earlier_producers_records_wait_in_its_file_while_the_disk_is_full_and_go_once_it_has_room(tmp_path, monkeypatch):
    """Adopting an orphan with this producer's own file unwritable: the orphan's records
    stay in their file (safe on disk), neither copied into memory, where they would be
    counted dropped past the bound and crowd out this run's records, nor counted at all;
    once the disk has room, the file is taken and sent (not only at the next start)."""
    import errno

    from trainmon.producer import delivery as delivery_module
    from trainmon.producer import spill as spill_module

    spill_dir = tmp_path / "spill"
    orphan = SpillFile(spill_dir, "earlier.0")
    orphan.append([entry(f'{{"orphan":{i}}}') for i in range(10)])
    os.close(orphan._fd)  # its owner was killed: the lock is free
    orphan._fd = None

    write_all, full = spill_module._write_all, [True]

    def full_disk(fd, data):
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(fd, data)

    monkeypatch.setattr(spill_module, "_write_all", full_disk)
    monkeypatch.setattr(delivery_module, "ORPHANS_RETRY_S", 0.2)
    broker = MemoryBroker()
    broker.up = False
    producer = producer_for(broker, tmp_path, queue_size=4, health_interval_s=0)
    for step in range(3):
        assert producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.held_in_memory == 3 and producer._worker.in_flight == 0,
               10, "the run's records held in memory",
               details=lambda: f"held {producer.held_in_memory}, dropped {producer.dropped}")
    assert producer.dropped == 0 and orphan.path.exists()
    broker.up = True
    assert producer.flush(5)
    assert len(steps_in(broker)) == 3 and producer.dropped == 0
    assert orphan.path.read_text().count("\n") == 10
    full.clear()  # the disk has room again: the orphan is taken at a tick after its retry time
    wait_until(lambda: producer.log_step(3, loss=1.0) and producer.flush(5) and not orphan.path.exists(),
               10, "the earlier producer's file taken and sent")
    assert sorted(json.loads(r)["orphan"] for r in steps_in(broker, "t")) == list(range(10))
    producer.close(timeout=1)


def test_records_kafka_takes_while_the_client_closes_are_not_counted_dropped(tmp_path, unwritable_spill):
    """Records held in memory (no spill directory) being sent again when close's flush
    runs out of time: the client's own close still waits for Kafka's answer, and what
    Kafka took there is delivered, not counted as dropped with the rest of memory."""
    broker = MemoryBroker()
    broker.up = False
    producer = producer_for(broker, tmp_path, spill_dir=unwritable_spill, health_interval_s=0)
    for step in range(5):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.held_in_memory == 5, 10, "records held in memory")
    transport, delivery = producer._worker._transport, producer._worker._delivery
    transport._delivery_timeout_s = 30.0  # Kafka slow to answer from now on
    wait_until(lambda: delivery._resending is not None, 10, "memory's records sent again")
    close = transport.close

    def kafka_answers_after_the_flush_deadline(timeout):
        broker.up = True
        return close(timeout)

    transport.close = kafka_answers_after_the_flush_deadline
    producer.close(timeout=0.3)
    assert len(steps_in(broker)) == 5
    assert producer.dropped == 0


def test_a_record_logged_after_close_is_kept_in_the_spill_file(tmp_path, caplog):
    """A thread of the job still logging once the producer closed (a sampler at exit):
    no thread sends the record now; it is kept for the next producer, not lost unseen."""
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path, health_interval_s=0)
    assert producer.log_step(0, loss=1.0)
    assert producer.close(timeout=2)
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        producer.log_step(1, loss=1.0)
        producer.log_step(2, loss=1.0)
    assert len(steps_in(broker)) == 1 and producer.dropped == 0
    assert caplog.text.count("logged after the producer closed") == 1
    later = producer_for(broker, tmp_path, health_interval_s=0)  # (the next run on the machine)
    producer._worker._delivery.spill.close()  # (this process exiting: its lock ends)
    assert later.flush(5)
    later.close(timeout=1)
    assert sorted(json.loads(record)["step"] for record in steps_in(broker)) == [0, 1, 2]


def test_a_forked_child_does_not_keep_the_parents_spill_file_locked(tmp_path):
    """A flock belongs to the open file, which a forked child (a DataLoader worker) shares:
    while such a child lived, the parent's spill file stayed locked after the parent
    closed, and the next producer left its records there."""
    spill_dir = tmp_path / "spill"
    broker = MemoryBroker()
    broker.up = False
    parent = Producer(ProducerConfig(run_id="fork", spill_dir=spill_dir, health_interval_s=0),
                      transport=broker.transport)
    for step in range(5):
        parent.log_step(step, loss=1.0)
    wait_until(lambda: parent.spilled == 5, 10, "records spilled")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child that lives on and never logs
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    try:
        parent.close(timeout=0.2)  # Kafka still away: the 5 records stay in the file
        broker.up = True
        later = producer_for(broker, tmp_path, health_interval_s=0)
        later.log_step(0, loss=1.0)
        assert later.flush(5)
        later.close(timeout=1)
        assert len(steps_in(broker)) == 1 + 5, list(spill_dir.glob("*.spill"))
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)


def test_an_orphan_is_handed_over_in_chunks_and_deleted_only_once_all_of_it_is_kept(tmp_path):
    """After a long outage an orphan may hold gigabytes: it is not read into memory whole."""
    orphan = SpillFile(tmp_path, "gone.0")
    orphan.append([entry(f'{{"a":{i}}}') for i in range(100)])
    os.close(orphan._fd)
    orphan._fd = None
    calls: list = []
    claim_orphans(tmp_path, lambda entries: calls.append(entries) or len(calls) < 3, chunk_bytes=200)
    assert len(calls) == 3 and orphan.path.exists()  # the third was refused: the file stays
    calls.clear()
    claim_orphans(tmp_path, lambda entries: calls.append(entries) or True, chunk_bytes=200)
    assert len(calls) > 10 and max(len(chunk) for chunk in calls) < 10
    assert [e for chunk in calls for e in chunk] == [entry(f'{{"a":{i}}}') for i in range(100)]
    assert not orphan.path.exists()


def test_a_rewrites_temporary_file_left_by_a_killed_producer_is_removed(tmp_path):
    from trainmon.producer.spill import _COMPACTING

    left = tmp_path / f"gone.0.1.abc{SUFFIX}{_COMPACTING}"
    left.write_text("records that are also in the .spill file\n")
    busy = tmp_path / f"live.0.2.def{SUFFIX}{_COMPACTING}"
    busy.write_text("being rewritten\n")
    held = os.open(busy, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        claim_orphans(tmp_path, lambda entries: True)
        assert not left.exists() and busy.exists()
    finally:
        os.close(held)
