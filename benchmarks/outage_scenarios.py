"""Never lose, never raise, never stall: a broker outage and consumer kills, measured.

    .venv/bin/python benchmarks/outage_scenarios.py [--outages 60,300] [--kills 5]
    .venv/bin/python benchmarks/outage_scenarios.py --outages 10 --settle 5 --kills 2  # quick try

Everything is real and local: a Kafka broker of its own per scenario (free port, own data
dir), the ClickHouse service as its own process (``python -m trainmon consume clickhouse
--path <fresh chDB dir> --topic-prefix P``, otherwise its default settings: static group
membership, default group), and producer processes that log step records at 50 steps/s
through the public Producer API, each with a spill directory of its own. ClickHouse is
read through the service's SQL endpoint. The defaults take about 10-12 minutes.

1. Broker outage, once per ``--outages`` value (seconds): 4 producer processes (ranks 0-3
   of one run) log for ``--settle`` s (20), the broker's JVM is killed with kill -9 for
   the outage, started again on the same port and data dir, the ranks log ``--settle`` s
   more and close (``close(timeout=120)``). Measured:
   - records logged (sum over ranks), log calls that raised, the slowest log call;
   - delivery again: per rank, the first Kafka acknowledgement after the outage minus the
     moment the broker was back (``Broker.start()`` returned); acknowledgements are seen
     by wrapping the transport's delivery callback in the producer process (observation
     only); also the first row ClickHouse inserted after the return;
   - ClickHouse, once caught up (polled until distinct ids == logged, or 120 s): distinct
     event ids, rows without FINAL, duplicates = rows - distinct ids (the producer is not
     idempotent: a resend after a lost acknowledgement can store a record twice in Kafka;
     the ReplacingMergeTree / FINAL / distinct ids count it once; a background merge may
     already have collapsed some, so this is a lower bound on the copies Kafka holds);
   - spill left at close (``producer.spilled`` after close, and files left in the spill
     dirs with the records they hold), dropped (``producer.dropped``), close()'s result.
2. Ranks killed during the outage (``--mid-outage-kill``, on by default): 4 ranks log for
   ``--settle`` s, the broker is killed with -9, and 20 s into the outage every rank is
   killed with -9 (as an operator's chaos test would: at no chosen moment, so whatever
   the sender was doing, a resend of its spill file included). Meanwhile the spill files
   are counted every 0.5 s. Then the broker returns, the next producer on the machine (one
   per spill directory) starts and sends what the killed ranks left, and ClickHouse is read.
   Measured: records the ranks logged (each writes its steps to a file as it logs them),
   how many are in ClickHouse once, how many were lost and how old the oldest lost one was
   at the kill, and how often a spill file fell back to empty during the outage.
3. Consumer kill -9, ``--kills`` times (5): while one producer logs at 50 steps/s, the
   ClickHouse service is killed with -9 and started again at once; measured is the time
   from the restart to the first row it inserts (its ``_inserted_at``); then every record
   must be in ClickHouse exactly once (distinct ids == logged).

Targets: spill left at close 0; dropped 0; all records in ClickHouse; duplicates reported;
delivery within 10 s of the broker's return; consumer loading again within 15 s each time;
ranks killed mid-outage lose nothing logged more than LOSABLE_S (8 s) before the kill, and
their spill files never fall back to empty during the outage.
A service that exits on its own is restarted (as docker-compose would) and reported.
Every process and temp dir is cleaned up, and every scenario has a deadline.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainmon import topics  # noqa: E402
from trainmon.broker import Broker, free_port  # noqa: E402
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint, query_endpoint  # noqa: E402
from trainmon.schemas import count  # noqa: E402

RATE = 50.0                # steps/s per producer
RANKS = 4                  # producers in the broker-outage scenario
ACK_GAP_S = 2.0            # no acknowledgement for this long: a gap in delivery
CATCH_UP_S = 120.0         # how long ClickHouse may take to hold every record after close
CLOSE_TIMEOUT_S = 120.0
DELIVERY_TARGET_S = 10.0
CONSUMER_TARGET_S = 15.0
# What a rank killed during an outage may lose: the records Kafka has not given up on yet
# (the 5 s delivery timeout), the pack window (0.5 s) and the reports' interval (2 s).
LOSABLE_S = 8.0
MID_OUTAGE_KILL_S = 20.0


# -- producer processes ------------------------------------------------------------------

def watch_acknowledgements(producer, gap_s: float = ACK_GAP_S) -> list[tuple[float | None, float]]:
    """Gaps of ``gap_s`` or more in Kafka's acknowledgements, as (last ack before, first
    ack after) wall times; the first acknowledgement of all is (None, t). Uses the
    transport's ``on_ack`` hook (instrumentation: it changes nothing the producer does)."""
    gaps: list[tuple[float | None, float]] = []
    last: list[float | None] = [None]

    def on_ack():
        now = time.time()
        if last[0] is None or now - last[0] >= gap_s:
            gaps.append((last[0], now))
        last[0] = now

    producer._worker._transport.on_ack = on_ack
    return gaps


def produce(bootstrap: str, prefix: str, run_id: str, rank: int, world_size: int,
            spill_dir: str, log_path: str, go, stop, results, max_s: float,
            gap_s: float = ACK_GAP_S) -> None:
    """One rank: log step records at RATE until told to stop (or max_s), close, report
    (with every log call's duration in microseconds, ``durations_us``)."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from trainmon.producer import Producer, ProducerConfig

    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id,
                                       rank=rank, world_size=world_size, spill_dir=Path(spill_dir)))
    gaps = watch_acknowledgements(producer, gap_s)
    results.put(("ready", rank, None))
    go.wait()
    logged = raised = step = 0
    slowest = 0.0
    durations = array.array("f")
    began = time.monotonic()
    while not stop.is_set() and time.monotonic() - began < max_s:
        call = time.perf_counter()
        try:
            logged += producer.log_step(step, epoch=0.0, step_tokens=4096, duration_ms=20.0,
                                        loss=2.0, norm=1.0, lr=3e-4)
        except Exception:  # the producer promises this never happens: count it if it does
            raised += 1
        took = time.perf_counter() - call
        slowest = max(slowest, took)
        durations.append(took * 1e6)
        step += 1
        ahead = began + step / RATE - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    closing = time.monotonic()
    closed_ok = producer.close(timeout=CLOSE_TIMEOUT_S)
    results.put(("done", rank, {
        "logged": logged, "raised": raised, "slowest_ms": slowest * 1000,
        "spilled": producer.spilled, "dropped": producer.dropped,
        "rejected": sum(producer.rejected.values()), "closed_ok": closed_ok,
        "close_s": time.monotonic() - closing, "gaps": gaps, "durations_us": durations.tobytes()}))


class Producers:
    """Producer processes (spawned, so each has its own interpreter and GIL)."""

    def __init__(self, tmp: Path, bootstrap: str, prefix: str, run_id: str, ranks: int, max_s: float,
                 gap_s: float = ACK_GAP_S):
        ctx = mp.get_context("spawn")
        self.go, self.stop, self.results = ctx.Event(), ctx.Event(), ctx.Queue()
        self.spill_dirs = [tmp / f"spill-{rank}" for rank in range(ranks)]
        self.logs = [tmp / f"producer-{rank}.log" for rank in range(ranks)]
        self.procs = [ctx.Process(target=produce, daemon=True, name=f"rank{rank}", args=(
            bootstrap, prefix, run_id, rank, ranks, str(self.spill_dirs[rank]),
            str(self.logs[rank]), self.go, self.stop, self.results, max_s, gap_s))
            for rank in range(ranks)]
        for p in self.procs:
            p.start()

    def _collect(self, kind: str, timeout: float) -> dict[int, dict | None]:
        got: dict[int, dict | None] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(got)} of {len(self.procs)} producers {kind} after {timeout:.0f} s")
            try:
                what, rank, value = self.results.get(timeout=min(1.0, remaining))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self.procs):
                    raise RuntimeError(f"a producer process died: {[p.exitcode for p in self.procs]}")
                continue
            if what == kind:
                got[rank] = value
        return got

    def start_logging(self, timeout: float = 120.0) -> None:
        self._collect("ready", timeout)
        self.go.set()

    def finish(self, timeout: float = CLOSE_TIMEOUT_S + 60) -> list[dict]:
        self.stop.set()
        done = self._collect("done", timeout)
        for p in self.procs:
            p.join(30)
        return [done[rank] for rank in sorted(done)]

    def check(self) -> None:
        dead = [p.name for p in self.procs if p.exitcode is not None]
        if dead and not self.stop.is_set():
            raise RuntimeError(f"producer process(es) ended early: {dead}")

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def spill_left(dirs: list[Path]) -> tuple[int, int]:
    """(spill files, records in them) left in the spill directories."""
    files = records = 0
    for directory in dirs:
        for path in directory.glob("*.spill"):
            files += 1
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records += count(json.loads(line)[2].encode())
    return files, records


# -- the ClickHouse service ----------------------------------------------------------------

class Service:
    """``trainmon consume clickhouse`` as a child process with default settings. One that
    exits on its own is started again (as docker-compose's restart policy would) and
    noted in ``exits``; a deliberate ``kill()`` is not."""

    def __init__(self, tmp: Path, bootstrap: str, prefix: str):
        self.path = tmp / "chdb"
        self.log = tmp / "service.log"
        self.cmd = [sys.executable, "-m", "trainmon", "consume", "clickhouse",
                    "--path", str(self.path), "--topic-prefix", prefix]
        self.env = dict(os.environ, TRAINMON_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(REPO))
        self.env.pop("TRAINMON_CLICKHOUSE_URL", None)
        self.proc: subprocess.Popen | None = None
        self.exits: list[int] = []  # exit codes of exits nobody asked for
        self.launched_at = 0.0

    def launch(self) -> float:
        """Start the process (not waiting for it); returns the wall time of the start."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.launched_at = time.time()
        return self.launched_at

    def keep_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.exits.append(self.proc.returncode)
            time.sleep(1)
            self.launch()

    def sql(self, query: str, timeout: float = 60.0) -> list[str]:
        """A one-row query's values (TabSeparated), through the service's SQL endpoint."""
        deadline = time.monotonic() + timeout
        problem: object = "no endpoint yet"
        while time.monotonic() < deadline:
            self.keep_alive()
            info = find_endpoint(self.path)
            if info is not None and info["pid"] == self.proc.pid:
                try:
                    return query_endpoint(info, query, "TabSeparated", timeout=10).decode().split("\t")
                except (urllib.error.URLError, OSError) as exc:  # stopping or restarting
                    problem = exc
            time.sleep(0.2)
        raise TimeoutError(f"ClickHouse service: no answer to SQL in {timeout:.0f} s ({problem})")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def step_ids(service: Service, run_id: str) -> tuple[int, int]:
    """(distinct event ids, rows without FINAL) of the run's step records."""
    distinct, rows = service.sql(f"SELECT uniqExact(event_id), count() FROM trainmon.step "
                                 f"WHERE run_id = '{run_id}'")
    return int(distinct), int(rows)


def wait_caught_up(service: Service, run_id: str, logged: int, timeout: float = CATCH_UP_S):
    """Poll until ClickHouse holds every logged record (or the deadline); returns
    (distinct ids, rows without FINAL, seconds waited)."""
    began = time.monotonic()
    while True:
        distinct, rows = step_ids(service, run_id)
        if distinct >= logged or time.monotonic() - began >= timeout:
            return distinct, rows, time.monotonic() - began
        time.sleep(0.5)


def first_insert_after(service: Service, run_id: str, wall: float) -> float | None:
    """Wall time of the first row of the run inserted after ``wall``, or None."""
    n, first = service.sql(
        f"SELECT count(), toUnixTimestamp64Micro(min(_inserted_at)) FROM trainmon.step "
        f"WHERE run_id = '{run_id}' AND toUnixTimestamp64Micro(_inserted_at) > {int(wall * 1e6)}")
    return int(first) / 1e6 if int(n) else None


# -- helpers -------------------------------------------------------------------------------

def pause(seconds: float, service: Service, producers: Producers | None = None) -> None:
    """Sleep while keeping an eye on the service and the producers."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        service.keep_alive()
        if producers is not None:
            producers.check()
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))


class Overdue(RuntimeError):
    """A scenario ran past its deadline (not an OSError: no retry loop swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise Overdue in the main thread if the block runs past ``seconds``."""
    def expired(signum, frame):
        raise Overdue(f"{what}: over its deadline of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def pipeline(prefix_name: str):
    """A temp dir, a broker of its own with the topics, and the ClickHouse service; all
    stopped and removed however the block ends. Yields (tmp, broker, service, prefix)."""
    with tempfile.TemporaryDirectory(prefix=f"trainmon-{prefix_name}-") as tmp:
        tmp = Path(tmp)
        broker = Broker(tmp / "kafka", port=free_port(), throwaway=True)
        service = None
        try:
            broker.start(timeout=120)
            prefix = f"{prefix_name}{uuid.uuid4().hex[:6]}."
            broker.create_topics(topics.all_topics(prefix))
            service = Service(tmp, broker.bootstrap, prefix)
            service.launch()
            service.sql("SELECT 1", timeout=120)
            yield tmp, broker, service, prefix
        except BaseException:
            if service is not None:
                print(f"  ClickHouse service log (last lines):\n{service.tail()}", flush=True)
            raise
        finally:
            if service is not None:
                service.stop()
            broker.stop(kill=True)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def row(label: str, value) -> None:
    print(f"  {label:<52} {value}", flush=True)


# -- scenario 1: the broker away -----------------------------------------------------------

def broker_outage(outage_s: float, settle_s: float) -> dict:
    print(f"\nbroker outage {outage_s:.0f} s: kill -9 of the broker's JVM; {RANKS} ranks x "
          f"{RATE:.0f} steps/s; {settle_s:.0f} s of logging before and after", flush=True)
    run_id = f"outage{outage_s:.0f}-{uuid.uuid4().hex[:6]}"
    limit = 2 * 120 + settle_s * 2 + outage_s + 120 + CLOSE_TIMEOUT_S + 60 + CATCH_UP_S + 120
    with deadline(limit, f"broker outage {outage_s:.0f} s"), pipeline("outage") as (tmp, broker, service, prefix):
        producers = Producers(tmp, broker.bootstrap, prefix, run_id, RANKS,
                              max_s=2 * settle_s + outage_s + 300)
        try:
            producers.start_logging()
            pause(settle_s, service, producers)
            broker.stop(kill=True)
            killed = time.time()
            pause(outage_s, service, producers)
            restarting = time.time()
            broker.start(timeout=120)
            back = time.time()
            pause(settle_s, service, producers)
            ranks = producers.finish()
        finally:
            producers.terminate()
        logged = sum(r["logged"] for r in ranks)
        distinct, rows, waited = wait_caught_up(service, run_id, logged)
        first_row = first_insert_after(service, run_id, back)
        files, records_left = spill_left(producers.spill_dirs)
        resumed = [min((end for _, end in r["gaps"] if end > killed), default=None) for r in ranks]
        # Gaps in acknowledgements other than the outage's: the producer stalled.
        other_gaps = [end - start for r in ranks for start, end in r["gaps"]
                      if start is not None and not start <= killed < end]
        result = {
            "outage_s": outage_s, "logged": logged, "distinct": distinct, "rows": rows,
            "duplicates": rows - distinct, "dropped": sum(r["dropped"] for r in ranks),
            "spilled": sum(r["spilled"] for r in ranks), "spill_files": files,
            "spill_records": records_left, "raised": sum(r["raised"] for r in ranks),
            "delivery_s": [None if t is None else t - back for t in resumed],
        }
        row("broker back (start() took)", ms(back - restarting))
        per_rank = ", ".join(f"{r['logged']:,}" for r in ranks)
        row("records logged (sum over ranks)", f"{logged:,} ({per_rank})")
        row("log calls that raised / slowest log call",
            f"{result['raised']} / {max(r['slowest_ms'] for r in ranks):.1f} ms")
        row("rejected", sum(r["rejected"] for r in ranks))
        row("delivering again after the broker's return",
            ", ".join(f"rank {i}: {ms(d)}" for i, d in enumerate(result["delivery_s"]))
            + f"; max {ms(max_or_none(result['delivery_s']))}")
        row("first row in ClickHouse after the return", ms(None if first_row is None else first_row - back))
        row("other gaps of >= 2 s in acknowledgements",
            ", ".join(f"{g:.1f} s" for g in other_gaps) or "none")
        row("ClickHouse: distinct event ids", f"{distinct:,} (waited {waited:.1f} s after close)")
        row("ClickHouse: rows without FINAL", f"{rows:,}")
        row("duplicates (rows - distinct ids)", f"{rows - distinct:,}")
        row("spill left at close", f"{result['spilled']} records (producer.spilled); "
                                  f"{files} files holding {records_left} records")
        row("dropped (producer.dropped)", result["dropped"])
        row("close() True / slowest close",
            f"{sum(r['closed_ok'] for r in ranks)} of {len(ranks)} / {max(r['close_s'] for r in ranks):.1f} s")
        row("service exits on its own (restarted)", service.exits or "none")
        return result


def max_or_none(values):
    return None if not values or any(v is None for v in values) else max(values)


# -- scenario 2: ranks killed during the outage ------------------------------------------

def produce_until_killed(bootstrap: str, prefix: str, run_id: str, rank: int, world_size: int,
                         spill_dir: str, progress: str, go, results) -> None:
    """One rank that logs at RATE and writes "step wall-time" per record it logged."""
    from trainmon.producer import Producer, ProducerConfig

    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id,
                                       rank=rank, world_size=world_size, spill_dir=Path(spill_dir)))
    results.put(("ready", rank, None))
    go.wait()
    began, step = time.monotonic(), 0
    with open(progress, "a", buffering=1) as out:
        while True:
            producer.log_step(step, epoch=0.0, step_tokens=4096, duration_ms=20.0, loss=2.0, norm=1.0)
            out.write(f"{step} {time.time()}\n")
            step += 1
            ahead = began + step / RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


def logged_steps(progress: Path) -> dict[int, float]:
    return {int(step): float(at) for step, at in
            (line.split() for line in progress.read_text().splitlines() if line.count(" ") == 1)}


def mid_outage_kill(settle_s: float) -> dict:
    print(f"\nranks killed mid-outage: {RANKS} ranks x {RATE:.0f} steps/s; the broker killed after "
          f"{settle_s:.0f} s, every rank kill -9'd {MID_OUTAGE_KILL_S:.0f} s into the outage; the "
          f"next producer on the machine sends what they left", flush=True)
    run_id = f"midkill-{uuid.uuid4().hex[:6]}"
    limit = 2 * 120 + settle_s + MID_OUTAGE_KILL_S + 120 + CLOSE_TIMEOUT_S + CATCH_UP_S + 120
    with deadline(limit, "mid-outage kill"), pipeline("midkill") as (tmp, broker, service, prefix):
        ctx = mp.get_context("spawn")
        go, results = ctx.Event(), ctx.Queue()
        spill_dirs = [tmp / f"spill-{rank}" for rank in range(RANKS)]
        progress = [tmp / f"progress-{rank}" for rank in range(RANKS)]
        procs = [ctx.Process(target=produce_until_killed, daemon=True, args=(
            broker.bootstrap, prefix, run_id, rank, RANKS, str(spill_dirs[rank]), str(progress[rank]),
            go, results)) for rank in range(RANKS)]
        for p in procs:
            p.start()
        emptied = [0] * RANKS  # times a rank's spill file went from records to none
        try:
            for _ in procs:
                results.get(timeout=120)
            go.set()
            pause(settle_s, service)
            broker.stop(kill=True)
            outage_began = time.monotonic()
            before = [0] * RANKS
            while time.monotonic() - outage_began < MID_OUTAGE_KILL_S:
                for rank, directory in enumerate(spill_dirs):
                    now = spill_left([directory])[1]
                    emptied[rank] += before[rank] > 0 and now == 0
                    before[rank] = now
                service.keep_alive()
                time.sleep(0.5)
            for p in procs:
                p.kill()  # SIGKILL
            killed_at = time.time()
            for p in procs:
                p.join(30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        on_disk = spill_left(spill_dirs)
        broker.start(timeout=120)
        from trainmon.producer import Producer, ProducerConfig

        for rank, directory in enumerate(spill_dirs):  # the next job on this machine
            nxt = Producer(ProducerConfig(bootstrap=broker.bootstrap, topic_prefix=prefix,
                                          run_id=f"next-{run_id}", rank=rank, spill_dir=directory))
            nxt.flush(CLOSE_TIMEOUT_S)
            nxt.close(30)
        logged = [logged_steps(path) for path in progress]
        total = sum(len(steps) for steps in logged)
        # Every record the next producers sent is in Kafka now: wait for those that must
        # arrive, then until the count stops growing.
        must = sum(at < killed_at - LOSABLE_S for steps in logged for at in steps.values())
        distinct, rows, waited = wait_caught_up(service, run_id, must)
        while (again := step_ids(service, run_id)) != (distinct, rows):
            distinct, rows = again
            time.sleep(2)
        stored = [set(int(v) for v in service.sql(
            f"SELECT arrayStringConcat(groupArray(toString(step)), ',') FROM (SELECT DISTINCT step "
            f"FROM trainmon.step WHERE run_id = '{run_id}' AND rank = {rank})")[0].split(",") if v)
            for rank in range(RANKS)]
        lost_ages = [killed_at - at for rank in range(RANKS)
                     for step, at in logged[rank].items() if step not in stored[rank]]
        old_lost = sum(age > LOSABLE_S for age in lost_ages)
        row("records logged by the killed ranks", f"{total:,}")
        row("in the spill files at the kill", f"{on_disk[1]:,} records in {on_disk[0]} files")
        row("ClickHouse: distinct event ids / rows without FINAL",
            f"{distinct:,} / {rows:,} (waited {waited:.1f} s)")
        row("lost (in no table)", f"{len(lost_ages):,}, the oldest "
            f"{max(lost_ages, default=0):.1f} s old at the kill")
        row(f"lost that were logged > {LOSABLE_S:.0f} s before the kill", f"{old_lost:,}")
        row("spill file back to empty during the outage", f"{sum(emptied)} times ({emptied})")
        row("spill left after the next producer", f"{spill_left(spill_dirs)[1]} records")
        return {"logged": total, "distinct": distinct, "lost": len(lost_ages), "old_lost": old_lost,
                "emptied": sum(emptied), "left": spill_left(spill_dirs)[1]}


# -- scenario 3: the consumer killed -------------------------------------------------------

def wait_loading(service: Service, run_id: str, since: float, timeout: float = 60.0) -> float | None:
    """Seconds from ``since`` to the first row inserted after it; None past the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        first = first_insert_after(service, run_id, since)
        if first is not None:
            return first - since
        time.sleep(0.2)
    return None


def consumer_kills(kills: int) -> dict:
    print(f"\nconsumer kill -9, {kills} time(s): 1 rank x {RATE:.0f} steps/s; the ClickHouse "
          f"service (default settings) killed and started again at once", flush=True)
    run_id = f"kills-{uuid.uuid4().hex[:6]}"
    limit = 2 * 120 + 60 + kills * (5 + 60 + 60) + CLOSE_TIMEOUT_S + 60 + CATCH_UP_S + 60
    with deadline(limit, "consumer kills"), pipeline("kills") as (tmp, broker, service, prefix):
        producers = Producers(tmp, broker.bootstrap, prefix, run_id, 1, max_s=limit)
        recoveries: list[float | None] = []
        try:
            producers.start_logging()
            if wait_loading(service, run_id, 0.0) is None:
                raise TimeoutError("the service loaded nothing in 60 s")
            for i in range(kills):
                pause(5, service, producers)
                service.kill()
                restarted = service.launch()
                recoveries.append(wait_loading(service, run_id, restarted))
                row(f"kill {i + 1}: restart -> loading again", ms(recoveries[-1]))
            ranks = producers.finish()
        finally:
            producers.terminate()
        logged = ranks[0]["logged"]
        distinct, rows, waited = wait_caught_up(service, run_id, logged)
        log = service.log.read_text(errors="replace")
        ids = sorted(set(re.findall(r"joins as static member (\S+)", log)))
        membership = f"static, instance {', '.join(ids)}" if ids else "dynamic"
        row("max restart -> loading again", ms(max_or_none(recoveries)))
        row("group membership (from the service log)", membership)
        row("records logged", f"{logged:,}")
        row("ClickHouse: distinct event ids", f"{distinct:,} (waited {waited:.1f} s after close)")
        row("ClickHouse: rows without FINAL / duplicates", f"{rows:,} / {rows - distinct:,}")
        row("spill left at close / dropped", f"{ranks[0]['spilled']} / {ranks[0]['dropped']}")
        row("service exits on its own (restarted)", service.exits or "none")
        return {"recoveries": recoveries, "logged": logged, "distinct": distinct, "rows": rows}


# -- targets -------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def outage_targets(done: list[dict], target) -> None:
    target("spill left at close = 0",
           lambda o: o["spilled"] == o["spill_records"] == o["spill_files"] == 0,
           lambda o: f"{o['spilled']} records, {o['spill_files']} files")
    target("dropped = 0", lambda o: o["dropped"] == 0, lambda o: o["dropped"])
    target("log calls never raised", lambda o: o["raised"] == 0, lambda o: o["raised"])
    target("all records in ClickHouse (distinct ids == logged)",
           lambda o: o["distinct"] == o["logged"],
           lambda o: f"{o['distinct']:,} of {o['logged']:,}")
    row("duplicates (reported, no target)",
        ", ".join(f"{o['outage_s']:.0f} s: {o['duplicates']:,}" for o in done) or "-")
    target(f"delivery within {DELIVERY_TARGET_S:.0f} s of the broker's return",
           lambda o: (max_or_none(o["delivery_s"]) or 1e9) <= DELIVERY_TARGET_S,
           lambda o: f"max {ms(max_or_none(o['delivery_s']))}")


def print_targets(outages: list[dict | None], kills: dict | None, kills_run: bool,
                  midkill: dict | None = None, midkill_run: bool = False) -> None:
    print("\ntargets", flush=True)
    done = [o for o in outages if o is not None]
    complete = len(done) == len(outages)

    def target(label: str, ok, figure) -> None:
        """One line: met / MISSED (a failed scenario misses every target) and the figures."""
        figures = ", ".join(f"{o['outage_s']:.0f} s: {figure(o)}" for o in done)
        row(label, f"{verdict(complete and all(ok(o) for o in done))} ({figures or 'no outage finished'})")

    if not outages:
        row("broker outage targets", "not run (--outages '')")
    else:
        outage_targets(done, target)

    label = f"ranks killed mid-outage: nothing logged > {LOSABLE_S:.0f} s before the kill lost"
    if not midkill_run:
        row(label, "not run")
    elif midkill is None:
        row(label, "MISSED (the scenario failed)")
    else:
        row(label, f"{verdict(midkill['old_lost'] == 0)} ({midkill['old_lost']:,} of "
                   f"{midkill['logged']:,}; {midkill['lost']:,} lost in all)")
        row("ranks killed mid-outage: spill never back to empty",
            f"{verdict(midkill['emptied'] == 0)} ({midkill['emptied']} times)")
        row("ranks killed mid-outage: spill sent by the next producer",
            f"{verdict(midkill['left'] == 0)} ({midkill['left']} records left)")

    label = f"consumer back within {CONSUMER_TARGET_S:.0f} s each time"
    if not kills_run:
        row(label, "not run (--kills 0)")
    elif kills is None:
        row(label, "MISSED (the scenario failed)")
    else:
        rec = kills["recoveries"]
        row(label, f"{verdict(all(r is not None and r <= CONSUMER_TARGET_S for r in rec))} "
                   f"(max {ms(max_or_none(rec))})")
        row("after the kills, every record once (distinct ids)",
            f"{verdict(kills['distinct'] == kills['logged'])} ({kills['distinct']:,} of "
            f"{kills['logged']:,}; {kills['rows'] - kills['distinct']:,} duplicate rows)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outages", default="60,300", help="broker outages in seconds (default 60,300)")
    parser.add_argument("--settle", type=float, default=20.0,
                        help="seconds of logging before the kill and after the return (default 20)")
    parser.add_argument("--kills", type=int, default=5, help="consumer kill -9 rounds (default 5; 0 skips)")
    parser.add_argument("--mid-outage-kill", action=argparse.BooleanOptionalAction, default=True,
                        help="the ranks killed 20 s into a broker outage (default on)")
    args = parser.parse_args()
    outage_list = [float(x) for x in args.outages.split(",") if x.strip()]
    # `timeout` and Ctrl-C end the run through the finally blocks: nothing left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    outages: list[dict | None] = []
    for outage_s in outage_list:
        try:
            outages.append(broker_outage(outage_s, args.settle))
        except Exception as exc:
            print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
            outages.append(None)
    midkill = None
    if args.mid_outage_kill:
        try:
            midkill = mid_outage_kill(args.settle)
        except Exception as exc:
            print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
    kills = None
    if args.kills > 0:
        try:
            kills = consumer_kills(args.kills)
        except Exception as exc:
            print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
    print_targets(outages, kills, args.kills > 0, midkill, args.mid_outage_kill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
