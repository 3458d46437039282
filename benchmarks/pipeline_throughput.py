"""Producers -> Kafka -> ClickHouse: sustained records/s and log-call-to-row latency.

    python benchmarks/pipeline_throughput.py [--records 300000] [--producers 2] [--ranks 16]
                                             [--batch-rows N] [--batch-ms MS] [--warm-up-runs 1]
                                             [--reference CHECKOUT]

Runs a real broker (its own, unless TRAINMON_KAFKA_BOOTSTRAP is set), the ClickHouse
service as its own process on a fresh chDB directory (``trainmon consume clickhouse``),
and producer processes that log step records through the public Producer API: a job of
``--ranks`` ranks (16), each with a Producer of its own, every rank logging every step,
the ranks shared out among the processes (8 in each of 2 on this 2-core machine). Until
28 Nov the two processes were ranks 0 and 1 of a nominal 16 (``--ranks 2``): two rows
per step, where a 16-rank job writes 16. The difference is the service's: its
``step_stats`` rollup keeps one row of aggregate states per step, so an insert of
150,000 rows of two ranks took 0.74 s of chDB against 0.51 s with 16 ranks a step (1.26 s
with one), measured in one process on the same rows' shape.

1. burst: every producer logs its share as fast as it can; sustained records/s is the
   record count over the time from the first log call to the last row being visible.
   Consumer alone first (the records are in Kafka before the service starts; timed from
   its consumer group's partitions being assigned, the join printed apart), then end to
   end; ``--runs`` times (5), each on topics of its own with a fresh service, medians
   reported with every run's figure. One run before them warms the broker up and is only
   printed (``--warm-up-runs``): in a fresh broker's first run its JVM took 8-14 µs of CPU
   per record, in the runs after 3-6 (measured), and a broker serving a cluster has run
   for days. Beside the end-to-end rate, the rate while the rows went from 10 % to 90 %
   of the records (counted every 0.1 s): the middle of the run, without its start and its
   last batch. It is not the target's figure: by then the producers have mostly stopped
   logging (a log call is cheaper than its delivery, so they queue ahead), and the
   service has the cores they used.
2. paced: producers log at a fixed total rate (default 5,000/s, a busy 16-rank job);
   latency per record is the row's ``_inserted_at`` (set by ClickHouse when the insert
   is written) minus its ``time`` (set at the log call), p50 / p99 over all records.

``--reference CHECKOUT`` (``git worktree add /tmp/ref COMMIT``) compares this checkout with
other code: their runs alternate on the same broker (ABBA), each side's producers and
service running its own code, and the ratios of the medians are printed. On a shared VM
this is the comparison to trust: the rate drifts by a fifth within minutes, and a setting
that gained 15-38 % in two back-to-back comparisons lost 13 % over 6 alternating pairs.

Beside wall-clock rates it prints the service's records per CPU-second (its process,
all threads), a figure that holds on a machine shared with other work, and where the CPU
goes per record: the producer processes delivering alone (the first phase, before the
service starts) and, end to end, the producers, the service and the broker (its JVM, when
the broker is this script's own). Together they say what bounds the end-to-end rate on
a machine of N cores: about N / (their sum) records per second.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# The code a producer process runs: this checkout's, or a reference checkout's (--reference),
# named by the parent before it starts the process.
CODE_ENV = "TRAINMON_BENCH_CODE"
if os.environ.get(CODE_ENV):
    sys.path.insert(0, os.environ[CODE_ENV])
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import wait_joined  # noqa: E402

from trainmon import topics  # noqa: E402
from trainmon.broker import Broker  # noqa: E402
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint, query_endpoint  # noqa: E402


def produce(bootstrap: str, prefix: str, run_id: str, ranks: list[int], count: int, rate: float,
            start: mp.Event, results: mp.Queue, spill_dir: str, compression: str, world_size: int) -> None:
    """``count`` step records of the ranks ``ranks``, each rank's through its own Producer
    (as each rank of a job has one), every step logged by each of them in turn."""
    from trainmon.producer import Producer, ProducerConfig

    producers = []
    for rank in ranks:
        config = ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id, rank=rank,
                                world_size=world_size, spill_dir=Path(spill_dir) / f"rank{rank}",
                                queue_size=1_000_000)
        if compression != "default":
            config.compression = None if compression == "none" else compression
        producers.append(Producer(config))
    steps = count // len(ranks)
    start.wait()
    began, cpu = time.perf_counter(), sum(os.times()[:2])
    for step in range(steps):
        for producer in producers:
            producer.log_step(step, epoch=0.0, step_tokens=4096, duration_ms=250.0, loss=2.0,
                              norm=1.0, lr=3e-4, timers={"forward": 80.0, "backward": 160.0})
        if rate and step % 50 == 0:
            ahead = began + step * len(ranks) / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
    logged = time.perf_counter() - began
    for producer in producers:
        producer.close(timeout=120)
    # (CPU of the whole process, librdkafka's threads too, from the first log call until
    # everything was delivered.)
    results.put((ranks[0], steps * len(ranks) / logged, sum(p.spilled for p in producers), time.time(),
                 sum(os.times()[:2]) - cpu))


COMPRESSION = "default"
# The job's ranks, all logging every step, shared out among the producer processes (--ranks).
DEFAULT_RANKS = 16
RANKS = DEFAULT_RANKS


def ranks_by_process(ranks: int, producers: int) -> list[list[int]]:
    """The job's ranks shared out among the producer processes, as many to each."""
    if ranks % producers:
        raise ValueError(f"{ranks} ranks cannot be shared out evenly among {producers} producer processes")
    return [list(range(ranks))[index::producers] for index in range(producers)]


def run_producers(bootstrap, prefix, run_id, producers, per_producer, rate, spill_dir, code: Path = REPO):
    ctx = mp.get_context("spawn")
    os.environ[CODE_ENV] = str(code)  # (a spawned process inherits the environment at start)
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=produce, args=(bootstrap, prefix, run_id, ranks, per_producer,
                                                rate / producers if rate else 0, start, results,
                                                spill_dir, COMPRESSION, RANKS))
             for ranks in ranks_by_process(RANKS, producers)]
    for p in procs:
        p.start()
    time.sleep(3)  # imports and connections outside the measured time
    return procs, start, results


def sql(endpoint, query: str) -> str:
    return query_endpoint(endpoint, query, "TabSeparated").decode().strip()


def wait_rows(endpoint, run_id: str, expected: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = int(sql(endpoint, f"SELECT count() FROM trainmon.step WHERE run_id = '{run_id}'"))
        if n >= expected:
            return time.perf_counter()
        time.sleep(0.1)
    raise TimeoutError(f"only {n} of {expected} rows arrived in {timeout:.0f}s")


class RowWatcher:
    """Counts a run's rows every ``every_s`` on a thread of its own, from ``start()`` until
    they reach ``expected``: how the rows became visible over time (for
    :func:`steady_rate`), and when the last came (:meth:`wait`, what :func:`wait_rows`
    says, without a second count beside it)."""

    def __init__(self, endpoint, run_id: str, expected: int, every_s: float = 0.1):
        self.endpoint, self.run_id, self.expected, self.every_s = endpoint, run_id, expected, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="row-watcher", daemon=True)

    def start(self) -> "RowWatcher":
        self._thread.start()
        return self

    def wait(self, timeout: float) -> float:
        """The time (perf_counter) of the first count that reached ``expected``."""
        self._thread.join(timeout)
        self._stop.set()
        self._thread.join()
        if not self.samples or self.samples[-1][1] < self.expected:
            seen = self.samples[-1][1] if self.samples else 0
            raise TimeoutError(f"only {seen} of {self.expected} rows arrived in {timeout:.0f}s")
        return self.samples[-1][0]

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            n = int(sql(self.endpoint, f"SELECT count() FROM trainmon.step WHERE run_id = '{self.run_id}'"))
            self.samples.append((time.perf_counter(), n))
            if n >= self.expected:
                return


STEADY_MIN_COUNTS = 3  # distinct row counts between the two crossings: fewer, and it is one or
                       # two inserts (a batch is up to 150,000 rows), not a rate


def steady_rate(samples: list[tuple[float, int]], total: int, low: float = 0.1, high: float = 0.9) -> float | None:
    """Records/s while the rows went from ``low`` to ``high`` of ``total``: the middle of
    the run, without its start (processes getting going, the first batch waiting its batch
    time) and its tail (the last batch); see the module's docstring for what else it leaves
    out. Each crossing's time is interpolated between the two counts around it. None
    without samples on both sides, or with fewer than STEADY_MIN_COUNTS counts between."""
    def crossing(level: float) -> float | None:
        target = level * total
        for (t0, n0), (t1, n1) in zip(samples, samples[1:]):
            if n0 < target <= n1:
                return t0 + (t1 - t0) * (target - n0) / (n1 - n0)
        return None

    began, ended = crossing(low), crossing(high)
    if began is None or ended is None or ended <= began:
        return None
    if len({n for _, n in samples if low * total < n < high * total}) < STEADY_MIN_COUNTS:
        return None
    return (high - low) * total / (ended - began)


def median_of_measured(values: list[float]) -> float:
    """The median of the values that were measured (not NaN); NaN when none was."""
    measured = [v for v in values if not math.isnan(v)]
    return statistics.median(measured) if measured else math.nan


def rate_text(value: float) -> str:
    """A rate as printed; '-' where it was not measured (NaN)."""
    return "-" if math.isnan(value) else f"{value:,.0f}"


def us_text(value: float) -> str:
    """Microseconds as printed; '-' where not measured (an outside broker's CPU)."""
    return "-" if math.isnan(value) else f"{value:.1f}"


def latency_ms(endpoint, run_id: str) -> tuple[float, float, float]:
    out = sql(endpoint, "SELECT quantilesExact(0.5, 0.99, 1)(dateDiff('microsecond', time, _inserted_at)"
                        f" / 1000) FROM trainmon.step WHERE run_id = '{run_id}'")
    return tuple(float(x) for x in out.strip("[]").split(","))


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def warm_group_coordinator(bootstrap: str, topic: str) -> None:
    """Join and leave a throwaway consumer group. The first group a fresh broker sees
    makes it create its offsets topic, which held the service's join up for ~3 s in one
    run of two: a once-per-cluster cost, not the consumer's throughput."""
    from trainmon.kafka_client import Consumer

    consumer = Consumer(f"warm-{uuid.uuid4().hex[:8]}", bootstrap=bootstrap)
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.2)
    finally:
        consumer.close()


def start_service(tmp: Path, bootstrap: str, prefix: str, batch_arguments: list[str], code: Path = REPO):
    env = dict(os.environ, TRAINMON_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(code))
    with open(tmp / "service.log", "ab") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "trainmon", "consume", "clickhouse", "--path",
             str(tmp / "chdb"), "--topic-prefix", prefix, "--group", f"{prefix}ch",
             *batch_arguments],
            # (-m puts the working directory first on the path: the code's own)
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=code)
    while (endpoint := find_endpoint(tmp / "chdb")) is None:
        if service.poll() is not None:
            raise RuntimeError((tmp / "service.log").read_text())
        time.sleep(0.05)
    return service, endpoint


def burst(bootstrap, prefix, run_id, producers, total, spill_dir, code: Path = REPO):
    """All producers log their share as fast as they can; returns (log-call rate,
    spilled, perf_counter at the first log call, wall seconds until all were delivered,
    the producer processes' CPU seconds)."""
    procs, start, results = run_producers(bootstrap, prefix, run_id, producers,
                                          total // producers, 0, spill_dir, code)
    began, began_wall = time.perf_counter(), time.time()
    start.set()
    rates = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return (sum(r[1] for r in rates), sum(r[2] for r in rates), began,
            max(r[3] for r in rates) - began_wall, sum(r[4] for r in rates))


CONSUMER_TARGET, END_TO_END_TARGET, PACED_P99_TARGET_MS = 200_000, 100_000, 1000  # issue #30


def one_run(tmp: Path, bootstrap: str, broker, producers: int, total: int, batch_arguments: list[str],
            index: int, label: str, code: Path = REPO) -> dict:
    """Consumer alone, then end to end, on topics of their own and a fresh service."""
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    if broker is not None:  # an outside broker creates topics on first use
        broker.create_topics(topics.all_topics(prefix))
    warm_group_coordinator(bootstrap, topics.topic_for("step", prefix))
    spill = str(tmp / "spill")
    service = None
    try:
        # 1. Consumer alone: drain records already in Kafka.
        log_rate, spilled, _, delivered, drain_producers_cpu = burst(bootstrap, prefix, "drain", producers,
                                                                     total, spill, code)
        (tmp / f"run{index}").mkdir()
        service, endpoint = start_service(tmp / f"run{index}", bootstrap, prefix, batch_arguments, code)
        service_process = psutil.Process(service.pid)
        up = time.perf_counter()
        # From its consumer's partitions being assigned: joining the group (a rebalance)
        # is the service's start-up, not its throughput; printed apart.
        ready = wait_joined(f"{prefix}ch", bootstrap, service, pause=0.01)
        if ready is None:
            raise RuntimeError(f"the service exited ({service.returncode}) before it joined its group")
        started_cpu = cpu_seconds(service_process)
        visible = wait_rows(endpoint, "drain", total, timeout=600)
        drain_cpu = cpu_seconds(service_process) - started_cpu
        out = {"log_rate": log_rate, "spilled": spilled, "delivered": total / delivered,
               "consumer": total / (visible - ready), "drain_s": visible - ready, "join_s": ready - up,
               "consumer_per_cpu_s": total / drain_cpu, "producer_us": 1e6 * drain_producers_cpu / total}
        # 2. Everything at once: producers -> Kafka -> ClickHouse.
        # Where the CPU goes end to end: the producer processes, the service, the broker
        # (when it is this script's own), per record.
        broker_pid = broker.pid() if broker is not None else None
        broker_process = psutil.Process(broker_pid) if broker_pid else None
        broker_cpu = cpu_seconds(broker_process) if broker_process else math.nan
        burst_cpu = cpu_seconds(service_process)
        watcher = RowWatcher(endpoint, "burst", total).start()
        log_rate, spilled, began, delivered, producers_cpu = burst(bootstrap, prefix, "burst", producers, total,
                                                                   spill, code)
        visible = watcher.wait(timeout=600)
        steady = steady_rate(watcher.samples, total)
        burst_cpu = cpu_seconds(service_process) - burst_cpu
        broker_cpu = (cpu_seconds(broker_process) if broker_process else math.nan) - broker_cpu
        p50, p99, _ = latency_ms(endpoint, "burst")
        out.update(e2e=total / (visible - began), e2e_steady=steady if steady is not None else math.nan,
                   e2e_s=visible - began, e2e_per_cpu_s=total / burst_cpu,
                   e2e_producer_us=1e6 * producers_cpu / total, e2e_service_us=1e6 * burst_cpu / total,
                   e2e_broker_us=1e6 * broker_cpu / total,
                   e2e_log_rate=log_rate, e2e_spilled=spilled, e2e_delivered=total / delivered,
                   backlog_p50=p50, backlog_p99=p99, endpoint=endpoint, prefix=prefix)
        print(f"{label}: consumer alone {out['consumer']:,.0f} records/s "
              f"({out['drain_s']:.2f} s after joining its group in {out['join_s']:.2f} s; "
              f"{out['consumer_per_cpu_s']:,.0f} per service CPU-s); end to end "
              f"{out['e2e']:,.0f} records/s ({out['e2e_s']:.2f} s; {rate_text(out['e2e_steady'])}/s from 10 % to 90 % "
              f"of the rows; {out['e2e_per_cpu_s']:,.0f} per service "
              f"CPU-s); log calls {out['log_rate']:,.0f}/s, delivered to Kafka {out['delivered']:,.0f}/s; "
              f"latency under backlog p50 {p50:.0f} ms, p99 {p99:.0f} ms; CPU per record: producers "
              f"{out['producer_us']:.1f} us delivering alone, end to end producers {out['e2e_producer_us']:.1f}, "
              f"service {out['e2e_service_us']:.1f}, broker {us_text(out['e2e_broker_us'])}", flush=True)
        out["service"] = service
        service = None
        return out
    finally:
        if service is not None:
            service.terminate()
            service.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000, help="burst phase record count")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5, help="runs of the two burst phases (medians reported)")
    parser.add_argument("--warm-up-runs", type=int, default=1,
                        help="runs before those, printed and left out of the medians (default 1): a "
                             "fresh broker spends 2-3 times the CPU per record in its first run")
    parser.add_argument("--paced-rate", type=float, default=5_000, help="records/s, paced phase")
    parser.add_argument("--paced-seconds", type=float, default=10)
    parser.add_argument("--compression", default="default",
                        help="producer compression: default (the producer's), none, gzip, ...")
    parser.add_argument("--ranks", type=int, default=DEFAULT_RANKS,
                        help=f"the job's ranks (default {DEFAULT_RANKS}), each with a Producer of its own, shared out "
                             "among the producer processes; every rank logs every step")
    parser.add_argument("--batch-rows", type=int, help="the service's --batch-rows (default: its own)")
    parser.add_argument("--batch-ms", type=int, help="the service's --batch-ms (default: its own)")
    parser.add_argument("--reference", metavar="CHECKOUT",
                        help="a checkout of the code to compare with (git worktree add DIR COMMIT): its "
                             "runs alternate with this checkout's on the same broker, and the ratios "
                             "of the medians are printed")
    args = parser.parse_args()
    batch_arguments = [*(["--batch-rows", str(args.batch_rows)] if args.batch_rows else []),
                       *(["--batch-ms", str(args.batch_ms)] if args.batch_ms else [])]
    global COMPRESSION, RANKS
    COMPRESSION, RANKS = args.compression, args.ranks
    try:
        ranks_by_process(args.ranks, args.producers)
    except ValueError as exc:
        parser.error(f"--ranks {args.ranks}: {exc}")

    # The code measured, and with --reference the code it is compared with, runs of the two
    # alternating on the same broker (ABBA): on a shared VM the rate drifts by a fifth
    # within minutes, and runs of one code after the other's would measure the drift.
    sides = {"this checkout": REPO}
    if args.reference:
        reference = Path(args.reference).resolve()
        if not (reference / "trainmon" / "__init__.py").is_file():
            parser.error(f"--reference {args.reference}: not a trainmon checkout (no trainmon/__init__.py)")
        sides["reference"] = reference
    with tempfile.TemporaryDirectory(prefix="trainmon-pipeline-") as tmp:
        tmp = Path(tmp)
        broker = None
        bootstrap = os.environ.get("TRAINMON_KAFKA_BOOTSTRAP")
        if not bootstrap:
            broker = Broker(tmp / "kafka", heap="1g", throwaway=True).start()
            bootstrap = broker.bootstrap
        total = args.records // args.ranks * args.ranks  # (every rank logs every step)
        print(f"{args.runs} runs of {total:,} step records of a {args.ranks}-rank job (each rank a Producer, "
              f"{args.ranks // args.producers} in each of {args.producers} processes), each run "
              f"on topics of its own with a fresh ClickHouse service"
              + (f"; this checkout's runs alternate with the reference's ({sides['reference']})"
                 if args.reference else ""), flush=True)
        results = {side: [] for side in sides}
        latency = {}
        service, index = None, 0
        try:
            for i in range(-args.warm_up_runs, args.runs):
                order = list(sides) if i % 2 == 0 else list(sides)[::-1]
                for side in order[:1] if i < 0 else order:  # (one warm-up run warms the broker)
                    # One service at a time: an idle one polls Kafka and merges its parts,
                    # CPU the next run would pay for.
                    if service is not None:
                        service.terminate()
                        service.wait(60)
                    label = (f"{'' if len(sides) == 1 else side + ', '}run {i + 1} of {args.runs}" if i >= 0 else
                             "warm-up run (a fresh broker's first; not in the medians)")
                    result = one_run(tmp, bootstrap, broker, args.producers, total, batch_arguments, index,
                                     label, sides[side])
                    index += 1
                    service = result.pop("service")
                    if i >= 0:
                        results[side].append(result)
                    if i == args.runs - 1:  # the side's last run: paced, on its service
                        latency[side] = paced(bootstrap, result, service, args, tmp, sides[side])
        finally:
            if service is not None:
                service.terminate()
                service.wait(60)
            if broker is not None:
                broker.stop()
    medians = {side: report(side if len(sides) > 1 else "", results[side], latency[side], args)
               for side in sides}
    if args.reference:
        now, then = medians["this checkout"], medians["reference"]
        print("this checkout against the reference (ratio of medians):")
        for key, name in [("consumer", "consumer alone, records/s"), ("e2e", "end to end, records/s"),
                          ("e2e_producer_us", "CPU per record end to end, producers"),
                          ("e2e_service_us", "CPU per record end to end, service"),
                          ("e2e_broker_us", "CPU per record end to end, broker")]:
            print(f"  {name}: {now[key]:,.1f} against {then[key]:,.1f}: {now[key] / then[key]:.2f}x")
    med = medians["this checkout"]
    p99 = latency["this checkout"][1]
    print("targets (issue #30):")
    for name, ok in [(f"consumer alone >= {CONSUMER_TARGET:,} records/s (median): {med['consumer']:,.0f}",
                      med["consumer"] >= CONSUMER_TARGET),
                     (f"end to end >= {END_TO_END_TARGET:,} records/s sustained (median): {med['e2e']:,.0f}",
                      med["e2e"] >= END_TO_END_TARGET),
                     (f"paced p99 log call -> row visible <= {PACED_P99_TARGET_MS / 1000:g} s: {p99:,.0f} ms",
                      p99 <= PACED_P99_TARGET_MS)]:
        print(f"  {'met   ' if ok else 'MISSED'}  {name}")
    return 0


def paced(bootstrap: str, last: dict, service: subprocess.Popen, args, tmp: Path,
          code: Path) -> tuple[float, float, float, float]:
    """Producers logging at ``--paced-rate`` into the topics and service of a side's last
    run: the latency a training job sees, log call -> row visible (p50, p99, max ms), and
    the service's CPU per record at that rate (µs; its inserts are of what came within a
    batch's wait, not of full batches)."""
    per = int(args.paced_rate * args.paced_seconds) // args.ranks * (args.ranks // args.producers)
    procs, start, queue = run_producers(bootstrap, last["prefix"], "paced", args.producers, per,
                                        args.paced_rate, str(tmp / "spill"), code)
    service_process = psutil.Process(service.pid)
    cpu = cpu_seconds(service_process)
    start.set()
    wait_rows(last["endpoint"], "paced", per * args.producers, timeout=600)
    service_us = 1e6 * (cpu_seconds(service_process) - cpu) / (per * args.producers)
    for _ in procs:
        queue.get(timeout=120)
    for p in procs:
        p.join()
    return (*latency_ms(last["endpoint"], "paced"), service_us)


def report(side: str, results: list[dict], latency: tuple[float, float, float, float], args) -> dict:
    """Prints one side's medians and paced latency; returns the medians."""
    med = {k: median_of_measured([r[k] for r in results]) for k in ("consumer", "e2e", "e2e_steady",
                                                                      "consumer_per_cpu_s", "e2e_per_cpu_s",
                                                                      "backlog_p99", "producer_us",
                                                                      "e2e_producer_us", "e2e_service_us",
                                                                      "e2e_broker_us")}
    each = {k: ", ".join(rate_text(r[k]) for r in results) for k in ("consumer", "e2e", "e2e_steady")}
    print(f"{side + ': ' if side else ''}medians of {len(results)} runs:")
    print(f"  consumer alone (the service drains the topics into ClickHouse): {med['consumer']:,.0f} records/s "
          f"(runs: {each['consumer']}); "
          f"{med['consumer_per_cpu_s']:,.0f} records per service CPU-second")
    print(f"  end to end, producers and consumer at once: {med['e2e']:,.0f} records/s "
          f"(runs: {each['e2e']}); "
          f"{med['e2e_per_cpu_s']:,.0f} records per service CPU-second; latency under backlog p99 "
          f"{med['backlog_p99']:.0f} ms")
    print(f"  CPU per record (us): producers delivering alone {med['producer_us']:.1f}; end to end, "
          f"producers {med['e2e_producer_us']:.1f}, service {med['e2e_service_us']:.1f}, broker "
          f"{us_text(med['e2e_broker_us'])} (the machine's cores over them bound the end-to-end rate)")
    print(f"  end to end while the rows went from 10 % to 90 % of the records: {rate_text(med['e2e_steady'])} "
          f"records/s (runs: {each['e2e_steady']}; - where the rows came in too few steps to tell)")
    p50, p99, worst, service_us = latency
    print(f"paced: {args.paced_rate:,.0f} records/s for {args.paced_seconds:.0f} s")
    print(f"  log call -> row visible: p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {worst:.0f} ms; "
          f"service CPU {service_us:.1f} us a record")
    return med


if __name__ == "__main__":
    sys.exit(main())
