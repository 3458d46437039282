"""Disks that fill, on small tmpfs filesystems each test mounts for itself (skipped, with
the reason, without root or without permission to mount): the producer's spill directory,
the ClickHouse data volume and the broker's log directory. For each: nothing acknowledged
is lost (exact counts), the condition is said (a log line naming the path and "no space
left") and is in a plain attribute for metrics, the place is kept (no offset committed
past a row not written), and the service recovers by itself once the filler file that
filled the disk is deleted.

The broker cannot recover in place: Kafka stops itself when its only log directory fails
(a full disk included). "Recovers" there means the producers keep every record (spill
file) while it is down, and the broker restarted once space returns has them all.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from trainmon import topics
from trainmon.broker import Broker
from trainmon.consumers import serving
from trainmon.consumers.clickhouse import create_all, loader
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse.refusals import blames_rows, disk_full
from trainmon.consumers.memory_stream import memory_streams
from trainmon.consumers.runtime import RetryPolicy
from trainmon.kafka_client import TopicPartition
from trainmon.kafka_client.memory_consumer import committed_offsets
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer import spill as spill_module
from trainmon.producer.spill import SpillFile
from trainmon.schemas import StepRecord, encode, pack, unpack

from .conftest import read_records
from .samples import envelope
from .waiting import wait_until


class SmallDisk:
    """A tmpfs of ``size`` mounted at ``path``; ``fill`` writes a filler file until the
    disk is full (or only ``leave`` bytes are free), ``free`` deletes it."""

    def __init__(self, path: Path, size: str):
        self.path = path
        self.filler = path / "filler"
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")

    def fill(self, leave: int = 0) -> None:
        with open(self.filler, "ab", buffering=0) as out:
            try:
                while True:
                    out.write(b"\0" * (1 << 16))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        if leave:
            os.truncate(self.filler, max(0, self.filler.stat().st_size - leave))
        assert self.free_bytes() <= leave

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], check=True)  # something still open


@pytest.fixture
def small_disk(tmp_path):
    disks: list[SmallDisk] = []

    def mount(size: str, name: str = "disk") -> SmallDisk:
        disk = SmallDisk(tmp_path / name, size)
        disks.append(disk)
        return disk

    yield mount
    for disk in disks:
        disk.unmount()


def said(caplog, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if all(w in r.getMessage() for w in words)]


def steps_of(values: list[bytes]) -> list[int]:
    return [json.loads(record)["step"] for value in values for record in unpack(value)]


# -- the producer's spill directory ----------------------------------------------------------

def test_a_spill_directory_that_fills_loses_nothing_and_takes_records_again_once_freed(
        small_disk, caplog):
    """Kafka away: 200 records go to the spill file; the disk fills, with 8 KiB left so
    that the next append is cut off mid-write (taken back whole); the next 300 wait in
    memory, said once with the path; the filler deleted, they move back to the file; the
    broker back, every record arrives, each once."""
    disk = small_disk("1m")
    spill_dir = disk.path / "spill"
    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id="full", spill_dir=spill_dir, queue_size=10_000),
                        transport=broker.transport)
    caplog.set_level(logging.WARNING, logger="trainmon.producer")
    try:
        broker.up = False
        for step in range(200):
            producer.log_step(step, loss=1.0)
        wait_until(lambda: producer.spilled == 200, what="200 records in the spill file")

        disk.fill(leave=8 << 10)
        for step in range(200, 500):
            producer.log_step(step, loss=1.0, timers={"forward": 1.0, "backward": 2.0})
        wait_until(lambda: producer.spilled + producer.held_in_memory == 500, what="500 records kept")
        assert producer.held_in_memory > 0 and producer.dropped == 0
        worker = producer._worker
        assert worker.spill_error is not None and worker.spill_error.errno == errno.ENOSPC
        assert worker.spill_errors >= 1
        full = said(caplog, "cannot keep records", str(spill_dir), "no space left")
        assert len(full) == 1, [r.getMessage() for r in caplog.records]
        # The file holds whole records only: the append cut off by the full disk was taken back.
        lines = producer._worker.spill_path.read_text().splitlines()
        assert all(json.loads(line) for line in lines)
        assert sum(len(unpack(json.loads(line)[2].encode())) for line in lines) == producer.spilled

        disk.free()
        logged = 500

        def log_one_more() -> bool:  # the loop goes on; the disk is tried again within a second
            nonlocal logged
            producer.log_step(logged, loss=1.0)
            logged += 1
            return producer.held_in_memory == 0

        wait_until(log_one_more, timeout=10, pause=0.02, what="the records in memory back in the file")
        wait_until(lambda: producer.spilled == logged, what="every record in the file")
        assert worker.spill_error is None
        assert said(caplog, "takes records again", str(spill_dir))

        broker.up = True
        assert producer.flush(10)
        assert sorted(steps_of(broker.values("trainmon.step"))) == list(range(logged))  # each once
        assert producer.dropped == 0
    finally:
        producer.close(timeout=1)


def test_an_append_cut_off_by_a_full_disk_is_taken_back_whole(small_disk):
    disk = small_disk("256k")
    spill = SpillFile(disk.path, "run.0")
    record = lambda i: ("t", b"k", f'{{"i":{i},"pad":"{"x" * 200}"}}'.encode())  # noqa: E731
    spill.append([record(i) for i in range(10)])
    size = spill.path.stat().st_size
    disk.fill(leave=8 << 10)
    with pytest.raises(OSError) as refused:
        spill.append([record(i) for i in range(10, 300)])  # ~70 KB: part of it fits
    assert refused.value.errno == errno.ENOSPC
    assert spill.path.stat().st_size == size and spill.count == 10  # no torn record left
    disk.free()
    spill.append([record(i) for i in range(10, 20)])
    assert [json.loads(v)["i"] for _, _, v in spill.read(1 << 20)] == list(range(20))
    spill.close()


def test_an_acknowledgement_with_no_room_to_rewrite_the_spill_file_loses_nothing(small_disk, monkeypatch):
    """Where the filesystem cannot free the acknowledged front of the file in place, the
    rest is rewritten into a new file; on a full disk that cannot be done: the file stays, its read position moves on, and the
    rewrite happens at a later acknowledgement once there is room."""
    monkeypatch.setattr(spill_module, "punch_front", lambda fd, length: False)  # (a rewrite)
    disk = small_disk("256k")
    spill = SpillFile(disk.path, "run.0")
    record = lambda i: ("t", b"k", f'{{"i":{i},"pad":"{"x" * 200}"}}'.encode())  # noqa: E731
    spill.append([record(i) for i in range(100)])
    first = spill.read(10_000)
    spill.append([record(i) for i in range(100, 110)])  # spilled during the resend
    disk.fill()
    spill.acknowledge()  # the rewrite does not fit
    assert spill.head > 0 and spill.count == 110 - len(first)

    rest = []
    while spill.count:
        batch = spill.read(10_000)
        rest += batch
        spill.acknowledge()
        if len(rest) > 40 and disk.filler.exists():
            disk.free()  # room again: the next rewrite fits
    got = [json.loads(v)["i"] for _, _, v in first + rest]
    assert got == list(range(110))  # each once, in order
    assert spill.head == 0 and spill.path.stat().st_size == 0
    spill.close()


def test_on_a_full_disk_an_acknowledged_front_is_freed_in_place_making_room(small_disk):
    """Freeing the acknowledged front in place needs no room: on a full disk it goes
    through, and the space it frees takes new records."""
    disk = small_disk("256k")
    spill = SpillFile(disk.path, "run.0")
    record = lambda i: ("t", b"k", f'{{"i":{i},"pad":"{"x" * 200}"}}'.encode())  # noqa: E731
    spill.append([record(i) for i in range(200)])  # ~50 KB
    first = spill.read(30_000)
    disk.fill()
    spill.acknowledge()
    if spill.path.stat().st_blocks * 512 >= spill.path.stat().st_size:
        pytest.skip("this tmpfs cannot punch holes")
    assert disk.free_bytes() >= 16 << 10  # the front's pages were given back
    spill.append([record(i) for i in range(200, 250)])  # ~12 KB: fits in what was freed
    rest = []
    while spill.count:
        rest += spill.read(30_000)
        spill.acknowledge()
    assert [json.loads(v)["i"] for _, _, v in first + rest] == list(range(250))
    spill.close()


# -- the ClickHouse data volume --------------------------------------------------------------

PREFIX = "full."
GROUP = "full.clickhouse"
STEP_0 = TopicPartition(topics.topic_for("step", PREFIX), 0)


def steps(first: int, n: int) -> bytes:
    return pack([encode(StepRecord(**envelope(i, rank=0), step=i, loss=1.0, norm=1.0))
                 for i in range(first, first + n)])


def stored(client) -> int:
    return client.query("SELECT count() FROM trainmon.step").result_rows[0][0]


def test_a_full_volume_is_told_apart_from_a_refused_row():
    def server(code: int, text: str) -> DatabaseError:
        return DatabaseError(f"Code: {code}. DB::Exception: {text}", code=code)

    reserved = server(243, "Cannot reserve 1.00 MiB, not enough space. (NOT_ENOUGH_SPACE)")
    written = server(75, "Cannot write to file /var/lib/clickhouse/store/x/data.bin, errno: 28, "
                         "strerror: No space left on device. (CANNOT_WRITE_TO_FILE_DESCRIPTOR)")
    for full in (reserved, written):
        assert disk_full(full) and not blames_rows(full)  # retried, nothing dead-lettered
    row = server(469, "Constraint `positive` for table trainmon.step is violated")
    assert not disk_full(row) and blames_rows(row)


def test_a_full_clickhouse_volume_holds_the_batch_uncommitted_and_loads_it_once_freed(small_disk, caplog):
    disk = small_disk("16m")
    client = connect(Target(path=disk.path / "chdb"))
    create_all(client, "trainmon")
    broker = MemoryBroker()
    broker.append(STEP_0.topic, b"full-run", steps(0, 100))
    sink = loader.ClickHouseSink(client, database="trainmon", max_rows=1_000, max_wait_s=0.05,
                                 storage=f"chdb:{disk.path / 'chdb'}/trainmon")
    stop = threading.Event()
    runtime = serving.attach(sink, group=GROUP, topic_prefix=PREFIX, stop=stop,
                             retry=RetryPolicy(0.05, 0.2), open_stream=memory_streams(broker))
    caplog.set_level(logging.WARNING)
    running = threading.Thread(target=runtime.run, name="loader")
    running.start()
    try:
        wait_until(lambda: committed_offsets(broker, GROUP).get(STEP_0) == 1, what="the first batch committed")
        assert stored(client) == 100

        disk.fill()
        for first in range(100, 1_000, 100):
            broker.append(STEP_0.topic, b"full-run", steps(first, 100))
        wait_until(lambda: sink.disk_full_errors >= 3, what="inserts refused for space, retried")
        assert sink.disk_full
        assert committed_offsets(broker, GROUP)[STEP_0] == 1  # not past the rows not written
        assert stored(client) == 100
        full = said(caplog, "no space left", str(disk.path / "chdb"))
        assert len(full) == 1, [r.getMessage() for r in caplog.records][-5:]
        assert runtime.stream.dead_letters == 0
        metrics = runtime.metrics.registry
        assert metrics.get_sample_value("trainmon_clickhouse_disk_full") == 1
        assert metrics.get_sample_value("trainmon_clickhouse_disk_full_refusals_total") >= 3

        disk.free()
        wait_until(lambda: committed_offsets(broker, GROUP).get(STEP_0) == 10, what="everything committed")
        assert not sink.disk_full and metrics.get_sample_value("trainmon_clickhouse_disk_full") == 0
        assert said(caplog, "space again")
    finally:
        stop.set()
        running.join(30)
        client.close()
    assert not running.is_alive()
    check = connect(Target(path=disk.path / "chdb"))
    try:
        rows = check.query("SELECT count(), uniqExact(step), min(step), max(step) FROM trainmon.step FINAL")
        assert rows.result_rows[0] == (1_000, 1_000, 0, 999)
        assert check.query("SELECT count() FROM trainmon.step").result_rows[0][0] == 1_000  # once each
    finally:
        check.close()


# -- the broker's log directory --------------------------------------------------------------

@pytest.mark.kafka
@pytest.mark.slow  # a broker of its own, on the small disk
def test_a_full_broker_log_directory_stops_the_broker_and_a_restart_after_freeing_delivers_all(
        small_disk, tmp_path, topic_prefix):
    """Kafka stops itself when its only log directory fails (a full disk included): the
    producer keeps every record (spill file) meanwhile and never raises; once the filler
    is deleted, the broker restarted on the same directory has the records acknowledged
    before the disk filled and, from the producer, all the others."""
    data_dir = tmp_path / "broker"
    disk = small_disk("64m", name="broker/logs")  # the broker's log.dirs, nothing else
    broker = Broker(data_dir, heap="256m", partitions=1).start()
    producer = Producer(ProducerConfig(bootstrap=broker.bootstrap, topic_prefix=topic_prefix,
                                       run_id="full-broker", spill_dir=tmp_path / "spill", linger_ms=5))
    try:
        for step in range(100):
            producer.log_step(step, loss=1.0)
        assert producer.flush(30)  # acknowledged

        disk.fill()
        for step in range(100, 300):
            assert producer.log_step(step, loss=1.0) is True  # never raises, never blocks
        wait_until(lambda: not broker.running(), timeout=60, what="Kafka to stop on its failed log dir",
                   pause=0.2, details=lambda: (data_dir / "broker.log").read_text()[-2000:])
        said_by_kafka = (data_dir / "broker.log").read_text()
        assert "No space left on device" in said_by_kafka and str(disk.path) in said_by_kafka
        # What Kafka did not acknowledge waits in the Kafka client or, past its delivery
        # timeout, in the spill file: nothing is dropped.
        assert producer.dropped == 0 and producer.held_in_memory == 0

        disk.free()
        broker = Broker(data_dir, heap="256m", partitions=1).start()  # same ports, same log dir
        assert producer.flush(60), (producer.spilled, producer.held_in_memory)
        records = read_records(broker.bootstrap, topic_prefix, "step", 300, timeout=30)
        assert sorted({r.step for r in records}) == list(range(300))  # none lost
        assert len(records) == 300  # none twice
    finally:
        producer.close(timeout=5)
        broker.stop(kill=True)
