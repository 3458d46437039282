"""Sending a spill file back after a long outage: the cost of dropping each acknowledged batch.

    .venv/bin/python benchmarks/spill_resend.py [--sizes 64,256] [--dir DIR]

A producer that could not reach Kafka keeps its records in its spill file; once Kafka is
back it sends them again oldest first, 8 MiB at a time (delivery._BACKLOG_BATCH_BYTES),
and drops each batch from the file once Kafka has acknowledged it. This script fills a
spill file of each size with step records (their JSON as a producer writes it) and
replays that resend on the file alone (no Kafka: the read, the acknowledgement), two ways
in the same run, each on a fresh file in ``--dir`` (default: a temporary directory on the
disk of this checkout, not a tmpfs):

- ``in place``: what the file does now where the filesystem can punch holes (Linux
  ext4, xfs, btrfs, tmpfs): the acknowledged front's blocks are freed;
- ``rewrite`` (the reference): the rest of the file copied into a new one after every
  batch, as before, and as still where the filesystem cannot punch holes.

Printed per size: the wall time and CPU of the whole resend, and the bytes written to
the filesystem (``wchar`` of /proc/self/io: what the resend made the kernel write, the
copies included), and their ratio. Target (this change's, not an issue's): the bytes
written no more than the file's own size (none where punching holes works).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainmon.producer import spill as spill_module  # noqa: E402
from trainmon.producer.spill import SpillFile  # noqa: E402

BATCH_BYTES = 8 << 20  # delivery._BACKLOG_BATCH_BYTES


def step_entry(i: int) -> tuple[str, bytes, bytes]:
    value = (b'{"run_id":"bench","rank":0,"world_size":16,"host":"node-0","time":"2026-11-28T10:00:00.%06dZ",'
             b'"event_id":"bench-%d","schema_version":1,"step":%d,"epoch":0.0,"step_tokens":4096,'
             b'"duration_ms":250.0,"loss":2.0,"norm":1.0,"lr":0.0003,'
             b'"timers":{"forward":80.0,"backward":160.0}}' % (i % 1_000_000, i, i))
    return ("trainmon.step", b"bench", value)


def written_bytes() -> int:
    """Bytes this process has had the kernel write (/proc/self/io wchar; 0 where absent)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def fill(spill: SpillFile, size_bytes: int) -> int:
    records = 0
    while not spill.path.exists() or spill.path.stat().st_size < size_bytes:
        chunk = [step_entry(records + i) for i in range(10_000)]
        spill.append(chunk)
        records += len(chunk)
    return records


def resend(directory: Path, size_bytes: int, in_place: bool) -> dict:
    spill = SpillFile(directory, f"bench.{'punch' if in_place else 'rewrite'}")
    records = fill(spill, size_bytes)
    size = spill.path.stat().st_size
    punch = spill_module.punch_front
    if not in_place:
        spill_module.punch_front = lambda fd, length: False
    try:
        wrote, cpu, began = written_bytes(), time.process_time(), time.perf_counter()
        sent = 0
        while spill.count:
            sent += len(spill.read(BATCH_BYTES))
            spill.acknowledge()
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        wrote = written_bytes() - wrote
    finally:
        spill_module.punch_front = punch
        spill.close()
    assert sent == records, (sent, records)
    return {"size": size, "seconds": seconds, "cpu": cpu, "written": wrote}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="spill file sizes, MiB (default 64,256)")
    parser.add_argument("--dir", help="where the spill files go (default: a temporary directory "
                                      "beside this checkout)")
    args = parser.parse_args()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir or REPO.parent, prefix="spill-resend.") as tmp:
        directory = Path(tmp)
        print(f"resend in {BATCH_BYTES >> 20} MiB batches, files in {directory}; "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"  {'file':>9}  {'way':9}  {'wall s':>7}  {'CPU s':>6}  {'written MiB':>11}")
        verdicts = []
        for size_bytes in sizes:
            results = {}
            for in_place in (True, False):
                r = results[in_place] = resend(directory, size_bytes, in_place)
                print(f"  {r['size'] / 2**20:>6.0f} MiB  {'in place' if in_place else 'rewrite':9}  "
                      f"{r['seconds']:>7.2f}  {r['cpu']:>6.2f}  {r['written'] / 2**20:>11.0f}", flush=True)
            new, old = results[True], results[False]
            print(f"  {'':>9}  in place / rewrite: wall {new['seconds'] / old['seconds']:.3f}x, "
                  f"written {new['written'] / max(1, old['written']):.3f}x")
            verdicts.append((new["size"], new["written"]))
        print("target: bytes written during the resend <= the file's size")
        for size, wrote in verdicts:
            print(f"  {'met   ' if wrote <= size else 'MISSED'}  {size / 2**20:.0f} MiB file: "
                  f"{wrote / 2**20:.0f} MiB written")


if __name__ == "__main__":
    main()
