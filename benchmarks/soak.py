"""A long soak through ``trainmon up``: every record exactly once, and nothing that grows.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--rate 5000] [--kill-every 300] [--ranks 4]
    .venv/bin/python benchmarks/soak.py --minutes 3 --kill-every 45   # a quick try

Everything is real and local: ``trainmon up`` (its own stack directory under a temp dir, its
own broker port) runs the broker, the ClickHouse loader (chDB), the alerts engine and the
TensorBoard forwarder (``--with tensorboard``) under its supervisor. ``--ranks`` producer
processes, the ranks of one run, log like a training job through the public Producer API
for ``--minutes``, together ``--rate`` records/s: a step record every step, a gpu record
every 5th step, an allocator record every 20th.

Every ``--kill-every`` seconds one consumer, in turn clickhouse, alerts, tensorboard, gets
``kill -9``; the supervisor restarts it. For each kill: how long until it ran again; its
consumer group's lag in Kafka messages (the producer packs up to 0.5 s of a rank's records
of a kind into one) on the partitions it commits, just before the kill, at the restart and
at its peak; and how long after the restart it had committed every message that was in
Kafka at the restart (caught up). At the end, how long each group took to lag 0.

Every ~10 s the RSS, open files (``/proc/PID/fd``) and threads of each process (Kafka's
JVM, the supervisor, each consumer) are sampled. (Handles a live thread keeps on its own
procfs files are counted apart from the open files, see :func:`open_files`: chDB keeps
three per pooled thread. They must stay within three per thread.) The slope per hour of
each is a least-squares fit within each life of the process (a restarted consumer starts a new life at its own
level, which is no growth), leaving out the start of each life (imports, caches, the JVM
touching its heap): a minute, or a tenth of the run when longer. A slope is *flat* when it is within its noise bound: two
standard errors of the slope (about 95 % confidence that the true slope is inside), and
never less than a change too small to matter over the run itself (2 files or threads, or
2 % of the median RSS, over the measured time). Beside it, the slope over the second half
of the run alone: growth that levels off (a warm-up) shows there as flat, a leak does not.
``--samples FILE`` keeps every sample as JSON.

At the end, once the producers are closed: each kind's records in ClickHouse for the run,
counted without ``FINAL`` (a copy stored twice counts twice until a merge collapses it)
and by distinct event id, against the records logged. Targets (met/MISSED): rows ==
distinct == logged per kind; the rate held; each kill restarted by the supervisor and
caught up within 60 s of its restart; no RSS, fd or thread slope above its bound (one that
falls beyond it is printed as such, and is no leak).

However the script ends (its end, an exception, SIGINT, SIGTERM, SIGHUP) it stops the
producers and runs ``trainmon down``; if the script itself is killed with -9, a watchdog
process runs ``trainmon down`` and the producers stop on their own. tests/test_soak_bench.py tests the slope fit and the
exactly-once check in memory.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainmon import topics  # noqa: E402

KILL_ORDER = ("clickhouse", "alerts", "tensorboard")
FORWARDER = "tensorboard"
GPU_EVERY, ALLOCATOR_EVERY = 5, 20  # steps between a rank's gpu / allocator records
RECORDS_PER_STEP = 1 + 1 / GPU_EVERY + 1 / ALLOCATOR_EVERY
KINDS = ("step", "gpu", "allocator")
SAMPLE_EVERY_S = 10.0
PROGRESS_EVERY_S = 60.0
SETTLE_MIN_S, SETTLE_SHARE = 60.0, 0.1  # the start of each process life left out of the slope
                                        # fit: a minute, or a tenth of the run if longer (the
                                        # broker's JVM touches its heap for minutes)
NOISE_SIGMAS = 2.0         # flat: |slope| within this many standard errors ...
FLOOR_COUNT_OVER_RUN = 2   # ... or under 2 files / threads over the measured time
FLOOR_RSS_OVER_RUN = 0.02  # ... or under 2 % of the median RSS over it
CATCH_UP_TARGET_S = 60.0
RATE_TARGET = 0.95         # of --rate, over the producing time
DRAIN_TIMEOUT_S = 300.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
GIVE_UP_S = 300.0          # a kill not restarted, or not caught up, within this is reported so
UP_TIMEOUT_S = 240.0


# -- pure parts (tests/test_soak_bench.py) ----------------------------------------------------

@dataclass(frozen=True)
class Fit:
    """A least-squares slope per hour, shared by every life of a process."""

    slope_per_h: float
    stderr_per_h: float
    samples: int
    lives: int


def slope_within_lives(samples: list[tuple[object, float, float]]) -> Fit | None:
    """Slope (units per hour) of ``(life, seconds, value)`` samples: each life (a pid) has
    its own level, all share one slope (least squares on the values and times centred
    within each life). None when there are too few samples for a slope and its error."""
    lives: dict[object, list[tuple[float, float]]] = {}
    for life, t, value in samples:
        lives.setdefault(life, []).append((t / 3600.0, value))
    centred = []
    for points in lives.values():
        if len(points) < 2:
            continue  # a single point says nothing about a slope within its life
        mean_t = statistics.fmean(t for t, _ in points)
        mean_v = statistics.fmean(v for _, v in points)
        centred.extend((t - mean_t, v - mean_v) for t, v in points)
    used = sum(1 for points in lives.values() if len(points) >= 2)
    freedom = len(centred) - used - 1
    sxx = sum(t * t for t, _ in centred)
    if freedom < 1 or sxx == 0:
        return None
    slope = sum(t * v for t, v in centred) / sxx
    residual = sum((v - slope * t) ** 2 for t, v in centred) / freedom
    return Fit(slope, math.sqrt(residual / sxx), len(centred), used)


def noise_bound(fit: Fit, floor_over_run: float, hours: float) -> float:
    """The largest slope per hour still called flat (see the module's docstring)."""
    return max(NOISE_SIGMAS * fit.stderr_per_h, floor_over_run / hours if hours > 0 else math.inf)


def is_flat(fit: Fit, floor_over_run: float, hours: float) -> bool:
    return abs(fit.slope_per_h) <= noise_bound(fit, floor_over_run, hours)


def exactly_once_sql(run_id: str, kinds=KINDS, database: str = "trainmon") -> str:
    """Per kind (its table is named after it): rows stored for the run (no FINAL: a copy
    stored twice counts twice) and distinct event ids."""
    quoted = "'" + run_id.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return " UNION ALL ".join(
        f"SELECT '{kind}' AS kind, count() AS stored, uniqExact(event_id) AS distinct_ids "
        f"FROM {database}.{kind} "
        f"WHERE run_id = {quoted}" for kind in kinds)


@dataclass(frozen=True)
class KindCheck:
    kind: str
    logged: int
    stored: int
    distinct: int

    @property
    def exactly_once(self) -> bool:
        return self.stored == self.distinct == self.logged


def exactly_once_checks(rows, logged: dict[str, int]) -> list[KindCheck]:
    """``rows`` of :func:`exactly_once_sql` against the records logged per kind; a kind
    with no rows at all counts as none stored."""
    found = {str(kind): (int(stored), int(distinct)) for kind, stored, distinct in rows}
    return [KindCheck(kind, count, *found.get(kind, (0, 0))) for kind, count in sorted(logged.items())]


# -- the producers (one process per rank) ---------------------------------------------------

def produce(bootstrap: str, run_id: str, rank: int, ranks: int, steps_per_s: float, seconds: float,
            start_at: float, spill_dir: str, results) -> None:
    from trainmon.producer import Producer, ProducerConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (terminate) when it stops
    parent = os.getppid()  # ... or, killed with -9, it cannot: then we stop when it is gone
    producer = Producer(ProducerConfig(bootstrap=bootstrap, run_id=run_id, rank=rank, world_size=ranks,
                                       spill_dir=Path(spill_dir) / str(rank)))
    logged = dict.fromkeys(KINDS, 0)
    while time.time() < start_at:
        time.sleep(0.01)
    began = time.monotonic()
    step = 0
    while (now := time.monotonic()) - began < seconds:
        if step % 1000 == 0 and os.getppid() != parent:
            break
        ahead = began + step / steps_per_s - now
        if ahead > 0.002:
            time.sleep(ahead)
        logged["step"] += producer.log_step(step, epoch=step / 10_000, step_tokens=4096, duration_ms=250.0,
                                            loss=2.0 + math.sin(step / 50) * 0.05, norm=1.0, lr=3e-4,
                                            timers={"forward": 80.0, "backward": 160.0})
        if step % GPU_EVERY == 0:
            logged["gpu"] += producer.log_gpu_state(
                step, id=rank, clock=1980, max_clock=1980, power=650_000, power_limit=700_000,
                temperature=62, temp_slowdown=87, gpu_util=97, mem_util=60, dram_free=20 << 30,
                pcie_rx=1 << 20, pcie_tx=1 << 20, fan=0)
        if step % ALLOCATOR_EVERY == 0:
            logged["allocator"] += producer.log_allocator(
                step, stats=[{"name": "model", "device": 30 << 30, "managed": 0, "pinned": 1 << 20, "pageable": 0}],
                allocated=60 << 30, peak_allocated=70 << 30, reserved=72 << 30)
        step += 1
    produced_s = time.monotonic() - began
    delivered = producer.close(timeout=120)
    results.put({"rank": rank, "logged": logged, "seconds": produced_s, "delivered": delivered,
                 "dropped": producer.dropped, "spilled": producer.spilled})


# -- the stack -------------------------------------------------------------------------------

def clean_env() -> dict[str, str]:
    """This environment without TRAINMON_* settings: the stack is configured by ``up`` alone."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINMON_")}, "PYTHONPATH": str(REPO)}


def trainmon(*arguments: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon", *arguments], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=clean_env())


WATCHDOG = """
import shutil, subprocess, sys
sys.stdin.buffer.read()  # EOF: the soak ended, however it ended
subprocess.run([sys.executable, "-m", "trainmon", "down", "--dir", sys.argv[1]], capture_output=True)
shutil.rmtree(sys.argv[2], ignore_errors=True)
"""


def start_watchdog(stack: Path, tmp: Path) -> subprocess.Popen:
    """Runs ``trainmon down`` and removes ``tmp`` once this process is gone, even after a
    kill -9 (its end of the pipe closes with it); a session of its own, so a Ctrl-C to ours
    does not reach it."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG, str(stack), str(tmp)], stdin=subprocess.PIPE, cwd=REPO,
                            env=clean_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_status(stack: Path) -> dict:
    try:
        return json.loads((stack / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def alive(pid: int | None) -> bool:
    import psutil

    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes(stack: Path) -> dict[str, int]:
    """name -> pid of every process of the stack running now."""
    from trainmon.broker import Broker

    status = read_status(stack)
    found = {"kafka": Broker(stack / "broker").pid(), "supervisor": status.get("supervisor")}
    found.update({name: s.get("pid") for name, s in status.get("services", {}).items()})
    return {name: pid for name, pid in found.items() if alive(pid)}


THREAD_HANDLES_PER_THREAD = 3  # ClickHouse's per-thread procfs files: stat, schedstat, io


def open_files(pid: int) -> tuple[int, int]:
    """``(open files, thread handles)`` of a process. A descriptor on ``/proc/PID/task/TID/``
    of one of its own live threads is a thread handle, not an open file: ClickHouse (chDB)
    opens three of them (its per-thread procfs metrics) the first time a pooled thread runs
    part of a query, and keeps them as long as that thread lives. Their number grows until
    every pooled thread has worked once, slowly over a long run, and never past three per
    thread; the threads are measured as such. A handle on a thread that is gone, like any
    other file or socket, counts as an open file, so a leak of them is still a leak."""
    live = set(os.listdir(f"/proc/{pid}/task"))
    own_threads = f"/proc/{pid}/task/"
    files = handles = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(own_threads) and target[len(own_threads):].split("/", 1)[0] in live:
            handles += 1
        else:
            files += 1
    return files, handles


def most_thread_handles(samples: list[tuple[int, float, dict[str, float]]]) -> tuple[int, int]:
    """``(thread handles, threads)`` of the sample with the most handles per thread."""
    worst = max(samples, key=lambda sample: sample[2]["thread_fds"] / max(sample[2]["threads"], 1))
    return int(worst[2]["thread_fds"]), int(worst[2]["threads"])


class Sampler:
    """RSS, open files and threads of every process of the stack, by name, with its pid;
    and the handles its threads keep on their own procfs files (see :func:`open_files`)."""

    METRICS = ("rss_mib", "fds", "threads")

    def __init__(self, stack: Path, began: float, settle_s: float):
        self.stack, self.began, self.settle_s = stack, began, settle_s
        self.samples: dict[str, list[tuple[int, float, dict[str, float]]]] = {}
        self.life_start: dict[tuple[str, int], float] = {}

    def sample(self) -> None:
        import psutil

        now = time.monotonic() - self.began
        for name, pid in processes(self.stack).items():
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    files, handles = open_files(pid)
                    values = {"rss_mib": proc.memory_info().rss / 2**20, "fds": files,
                              "threads": proc.num_threads(), "thread_fds": handles,
                              "cpu_s": cpu.user + cpu.system}
                started = proc.create_time()
            except (psutil.Error, OSError):
                continue  # it exited meanwhile (a kill, a restart)
            self.life_start.setdefault((name, pid), now - max(0.0, time.time() - started))
            self.samples.setdefault(name, []).append((pid, now, values))

    def latest(self) -> str:
        """The newest sample of each process, one line."""
        return ", ".join(f"{name} {values['rss_mib']:.0f} MiB/{values['fds']} fds/{values['threads']} threads"
                         for name, rows in self.samples.items() for _, _, values in rows[-1:])

    def cpu_share(self, name: str) -> float:
        """Cores the process kept busy while sampled, over all its lives."""
        busy = span = 0.0
        lives: dict[int, list] = {}
        for pid, t, values in self.samples.get(name, []):
            lives.setdefault(pid, []).append((t, values["cpu_s"]))
        for points in lives.values():
            busy += points[-1][1] - points[0][1]
            span += points[-1][0] - points[0][0]
        return busy / span if span else math.nan

    def settled(self, name: str, metric: str) -> list[tuple[int, float, float]]:
        return [(pid, t, values[metric]) for pid, t, values in self.samples.get(name, [])
                if t - self.life_start[(name, pid)] >= self.settle_s]


class Lag:
    """A consumer group's lag, in Kafka messages (a producer packs up to its pack window of
    a rank's records into one), on the partitions of the soak's kinds that the group has
    committed: a consumer that does not read a kind never commits its partitions, and they
    are none of its lag. Asked without joining the group."""

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.readers: dict[str, object] = {}

    def offsets(self, group: str) -> tuple[dict, dict] | None:
        """(committed, end) offsets per partition the group has committed; None when Kafka
        did not answer in time."""
        from trainmon.kafka_client import Consumer, KafkaError, TopicPartition

        try:
            reader = self.readers.get(group) or self.readers.setdefault(
                group, Consumer(group, bootstrap=self.bootstrap))
            parts = [TopicPartition(topics.topic_for(kind), p) for kind in KINDS
                     for p in reader.partitions_for(topics.topic_for(kind))]
            committed = {tp: offset for tp, offset in reader.committed(parts, 5.0).items() if offset is not None}
            return committed, {tp: reader.watermarks(tp, timeout_s=5.0)[1] for tp in committed}
        except KafkaError:
            return None

    def of(self, group: str) -> int | None:
        found = self.offsets(group)
        if found is None:
            return None
        committed, ends = found
        return sum(max(0, ends[tp] - committed[tp]) for tp in committed)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


@dataclass
class Kill:
    service: str
    group: str
    at: float  # monotonic
    restarts_before: int
    lag_before: int | None
    restarted_after_s: float | None = None
    lag_at_restart: int | None = None
    peak_lag: int = 0
    caught_up_after_s: float | None = None  # from the restart
    followed_s: float = GIVE_UP_S  # how long after the restart it was watched for catching up
    ends_at_restart: dict = field(default_factory=dict)


def kill_service(stack: Path, name: str, lag: Lag) -> Kill | None:
    service = read_status(stack).get("services", {}).get(name) or {}
    pid = service.get("pid")
    if not alive(pid):
        print(f"  [{time.strftime('%H:%M:%S')}] {name} is not running (restarting?): no kill this time", flush=True)
        return None
    before = lag.of(service["group"]) if service.get("group") else None
    os.kill(pid, signal.SIGKILL)
    print(f"  [{time.strftime('%H:%M:%S')}] kill -9 {name} (pid {pid}), lag before {before}", flush=True)
    return Kill(name, service.get("group") or "", time.monotonic(), service.get("restarts", 0), before)


def follow_kill(stack: Path, kill: Kill, lag: Lag) -> bool:
    """One look at a killed service; True once it ran again and caught up (or gave up).
    Caught up: it has committed every message that was in Kafka when it was restarted."""
    now = time.monotonic()
    service = read_status(stack).get("services", {}).get(kill.service) or {}
    if kill.restarted_after_s is None:
        if service.get("restarts", 0) > kill.restarts_before and alive(service.get("pid")):
            found = lag.offsets(kill.group)
            if found is not None:
                kill.restarted_after_s = now - kill.at
                committed, kill.ends_at_restart = found
                kill.lag_at_restart = sum(max(0, end - committed[tp]) for tp, end in kill.ends_at_restart.items())
                kill.peak_lag = kill.lag_at_restart
        return now - kill.at > GIVE_UP_S  # never restarted: reported as such
    found = lag.offsets(kill.group)
    if found is None:
        return False
    committed, ends = found
    since_restart = now - kill.at - kill.restarted_after_s
    kill.peak_lag = max(kill.peak_lag, sum(max(0, ends[tp] - committed[tp]) for tp in committed))
    if all(committed.get(tp, -1) >= end for tp, end in kill.ends_at_restart.items()):
        kill.caught_up_after_s = since_restart
        return True
    return since_restart > GIVE_UP_S


# -- the soak --------------------------------------------------------------------------------

def query_rows(stack: Path, sql: str) -> list[list]:
    from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint, query_endpoint

    info = find_endpoint(stack / "clickhouse")
    if info is None:
        raise ConnectionError("no SQL endpoint (the loader is restarting)")
    return json.loads(query_endpoint(info, sql, "JSONCompact", timeout=60))["data"]


def wait_loaded(stack: Path, run_id: str, logged: dict[str, int], timeout: float) -> list[KindCheck]:
    deadline = time.monotonic() + timeout
    checks: list[KindCheck] = []
    while time.monotonic() < deadline:
        try:
            checks = exactly_once_checks(query_rows(stack, exactly_once_sql(run_id)), logged)
            if all(c.distinct >= c.logged for c in checks):
                return checks
        except (ConnectionError, urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(2)
    return checks


def wait_groups_drained(stack: Path, lag: Lag, since: float, timeout: float) -> dict[str, float | None]:
    """Seconds from ``since`` until each consumer group had committed every message."""
    groups = {name: s["group"] for name, s in read_status(stack).get("services", {}).items() if s.get("group")}
    drained: dict[str, float | None] = dict.fromkeys(groups)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and None in drained.values():
        for name, group in groups.items():
            if drained[name] is None and lag.of(group) == 0:
                drained[name] = time.monotonic() - since
        time.sleep(0.5)
    return drained


def on_signal(signum, _frame):
    for sig in STOP_SIGNALS:  # a second signal must not cut the stop short
        signal.signal(sig, signal.SIG_IGN)
    print(f"soak: stopped by {signal.Signals(signum).name}; stopping the producers and the stack", flush=True)
    raise SystemExit(128 + signum)  # through the finally blocks: producers, trainmon down


def verdict(ok: bool, text: str) -> None:
    print(f"  {'met   ' if ok else 'MISSED'}  {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the producers log (default 30)")
    parser.add_argument("--rate", type=float, default=5_000, help="records/s, all ranks together (default 5000)")
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between kill -9s (default 300)")
    parser.add_argument("--ranks", type=int, default=4, help="producer processes, one rank each (default 4)")
    parser.add_argument("--samples", type=Path, help="also write every resource sample to this JSON file")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress as it happens, also into a file
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    from trainmon.broker import free_port

    tmp = Path(tempfile.mkdtemp(prefix="trainmon-soak-"))
    stack = tmp / "stack"
    watchdog = start_watchdog(stack, tmp)
    producers: list = []
    lag = None
    try:
        port = free_port()
        began_up = time.monotonic()
        up = trainmon("up", "--dir", str(stack), "--port", str(port), "--with", FORWARDER, timeout=UP_TIMEOUT_S)
        if up.returncode != 0:
            print(up.stdout + up.stderr, file=sys.stderr)
            for log in sorted(stack.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
            return 1
        bootstrap = f"127.0.0.1:{port}"
        print(f"trainmon up in {time.monotonic() - began_up:.1f} s: {', '.join(processes(stack))} "
              f"(stack {stack})", flush=True)
        run_id = f"soak-{uuid.uuid4().hex[:8]}"
        seconds = args.minutes * 60
        steps_per_s = args.rate / args.ranks / RECORDS_PER_STEP
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        start_at = time.time() + 5.0  # imports and connections before the clock starts
        producers = [ctx.Process(target=produce, daemon=True,
                                 args=(bootstrap, run_id, rank, args.ranks, steps_per_s, seconds, start_at,
                                       str(tmp / "spill"), results))
                     for rank in range(args.ranks)]
        for p in producers:
            p.start()
        while time.time() < start_at:
            time.sleep(0.05)
        began = time.monotonic()
        print(f"run {run_id}: {args.ranks} ranks, {args.rate:,.0f} records/s for {args.minutes:g} min, "
              f"kill -9 every {args.kill_every:g} s ({', '.join(KILL_ORDER)} in turn)", flush=True)

        sampler, lag = Sampler(stack, began, max(SETTLE_MIN_S, SETTLE_SHARE * seconds)), Lag(bootstrap)
        kills: list[Kill] = []
        following: Kill | None = None
        next_sample, next_progress, next_kill = began, began + PROGRESS_EVERY_S, began + args.kill_every
        while time.monotonic() - began < seconds:
            now = time.monotonic()
            if now >= next_sample:
                sampler.sample()
                next_sample += SAMPLE_EVERY_S
            if now >= next_progress:
                next_progress += PROGRESS_EVERY_S
                lags = ", ".join(f"{name} {lag.of(s['group'])}" for name, s in
                                 read_status(stack).get("services", {}).items() if s.get("group"))
                print(f"  [{time.strftime('%H:%M:%S')}] {(now - began) / 60:.0f} min: {sampler.latest()}; "
                      f"lag (messages): {lags}; load average {os.getloadavg()[0]:.1f}")
            if now >= next_kill:
                next_kill += args.kill_every
                if following is not None:  # the schedule goes on: reported as not caught up by now
                    following.followed_s = time.monotonic() - following.at - (following.restarted_after_s or 0)
                    print(f"  {following.service} has not caught up by the next kill", flush=True)
                    following = None
                if kill := kill_service(stack, KILL_ORDER[len(kills) % len(KILL_ORDER)], lag):
                    kills.append(kill)
                    following = kill
            if following is not None and follow_kill(stack, following, lag):
                caught = (f"caught up {following.caught_up_after_s:.1f} s after it"
                          if following.caught_up_after_s is not None else f"not caught up within {GIVE_UP_S:.0f} s")
                print(f"  [{time.strftime('%H:%M:%S')}] {following.service}: restarted after "
                      f"{following.restarted_after_s or math.nan:.1f} s, lag at restart "
                      f"{following.lag_at_restart} messages, {caught}", flush=True)
                following = None
            time.sleep(1.0)
        produced_s = time.monotonic() - began

        reports = [results.get(timeout=300) for _ in producers]
        for p in producers:
            p.join(30)
        while following is not None and not follow_kill(stack, following, lag):
            time.sleep(1.0)
        if following is not None and following.caught_up_after_s is None:
            following.followed_s = time.monotonic() - following.at - (following.restarted_after_s or 0)
        sampler.sample()
        logged = {kind: sum(r["logged"][kind] for r in reports) for kind in KINDS}
        total = sum(logged.values())
        drain_began = time.monotonic()
        checks = wait_loaded(stack, run_id, logged, DRAIN_TIMEOUT_S)
        drained_s = time.monotonic() - drain_began
        drained = wait_groups_drained(stack, lag, drain_began, DRAIN_TIMEOUT_S)
        sampler.sample()
        status = read_status(stack).get("services", {})
        measured_h = (time.monotonic() - began) / 3600

        print(f"\nproducers: {total:,} records logged ({', '.join(f'{k} {v:,}' for k, v in logged.items())}) "
              f"in {produced_s:.0f} s = {total / produced_s:,.0f} records/s (asked {args.rate:,.0f}); "
              f"closed delivered: {sum(r['delivered'] for r in reports)}/{len(reports)}, "
              f"dropped {sum(r['dropped'] for r in reports)}, spilled {sum(r['spilled'] for r in reports)}")
        print(f"ClickHouse for the run, {drained_s:.1f} s after the producers closed "
              f"(rows without FINAL / distinct event ids / logged):")
        for c in checks:
            print(f"  {c.kind:<10} {c.stored:>12,} {c.distinct:>12,} {c.logged:>12,}")
        restarts = ", ".join(f"{name} {s.get('restarts', 0)}" for name, s in status.items())
        print(f"kills: {len(kills)} (kill -9), supervisor restarts per service: {restarts}")
        print("  service       restarted after   lag (messages): before   at restart    peak   caught up after restart")
        for k in kills:
            restarted = f"{k.restarted_after_s:.1f} s" if k.restarted_after_s is not None else "never"
            caught = (f"{k.caught_up_after_s:.0f} s" if k.caught_up_after_s is not None
                      else f"not within {k.followed_s:.0f} s")
            print(f"  {k.service:<13} {restarted:>15} {k.lag_before!s:>24} {k.lag_at_restart!s:>12} "
                  f"{k.peak_lag:>7,}   {caught}")
        print("  every group's lag 0 after the producers closed: " + ", ".join(
            f"{name} after {after:.1f} s" if after is not None else f"{name} not within {DRAIN_TIMEOUT_S:.0f} s"
            for name, after in drained.items()))
        print(f"resources, sampled every {SAMPLE_EVERY_S:.0f} s, slope per hour within each process life "
              f"(first {sampler.settle_s:.0f} s of each left out); flat: |slope| <= max({NOISE_SIGMAS:g} standard "
              f"errors, {FLOOR_COUNT_OVER_RUN} files/threads or {FLOOR_RSS_OVER_RUN:.0%} of RSS over the run):")
        print("  process      metric    median  first->last settled      slope/h     bound/h  lives samples  flat"
              "   2nd half slope/h")
        half = (time.monotonic() - began) / 2
        grows, unfitted = [], []
        for name in sampler.samples:
            for metric in Sampler.METRICS:
                points = sampler.settled(name, metric)
                fit = slope_within_lives(points)
                if fit is None:
                    unfitted.append(f"{name} {metric}")
                    continue
                median = statistics.median(v for _, _, v in points)
                floor = FLOOR_RSS_OVER_RUN * median if metric == "rss_mib" else FLOOR_COUNT_OVER_RUN
                flat = is_flat(fit, floor, measured_h)
                if not flat and fit.slope_per_h > 0:
                    grows.append(f"{name} {metric}")
                # The second half alone tells growth that levels off (a warm-up) from growth that goes on.
                later = slope_within_lives([p for p in points if p[1] >= half])
                print(f"  {name:<12} {metric:<8} {median:>8.1f} {points[0][2]:>9.1f}->{points[-1][2]:<9.1f} "
                      f"{fit.slope_per_h:>+12.2f} {noise_bound(fit, floor, measured_h):>11.2f} {fit.lives:>6} "
                      f"{fit.samples:>7}  {'flat ' if flat else 'GROWS' if fit.slope_per_h > 0 else 'falls'}"
                      f"  {later.slope_per_h if later else math.nan:>+12.2f}")
        if unfitted:
            print(f"  too few settled samples for a slope: {', '.join(unfitted)}")
        bounded = []
        for name, samples in sampler.samples.items():
            handles, threads = most_thread_handles(samples)
            if handles:
                print(f"  {name:<12} thread handles (not in open files): {samples[0][2]['thread_fds']:.0f}"
                      f"->{samples[-1][2]['thread_fds']:.0f}, at most {handles} on {threads} threads")
            bounded.append((name, handles <= THREAD_HANDLES_PER_THREAD * threads))
        if args.samples:
            args.samples.write_text(json.dumps({"settle_s": sampler.settle_s, "samples": sampler.samples}))
        print("CPU, cores kept busy (of this machine's " + f"{os.cpu_count()}, shared with whatever else runs): "
              + ", ".join(f"{name} {sampler.cpu_share(name):.2f}" for name in sampler.samples))

        print("targets:")
        verdict(bool(checks) and all(c.exactly_once and c.logged for c in checks),
                "every record in ClickHouse exactly once: "
                + "; ".join(f"{c.kind} {c.stored:,}/{c.distinct:,}/{c.logged:,}" for c in checks))
        rate = total / produced_s
        verdict(rate >= RATE_TARGET * args.rate, f"rate >= {RATE_TARGET:.0%} of {args.rate:,.0f} records/s: {rate:,.0f}")
        verdict(bool(kills) and all(k.restarted_after_s is not None for k in kills),
                f"each kill -9 restarted by the supervisor: {sum(k.restarted_after_s is not None for k in kills)}"
                f"/{len(kills)}")
        verdict(bool(kills) and all(k.caught_up_after_s is not None and k.caught_up_after_s <= CATCH_UP_TARGET_S
                                    for k in kills),
                f"each caught up within {CATCH_UP_TARGET_S:.0f} s of its restart: "
                + ", ".join(f"{k.service} {k.caught_up_after_s:.0f} s" if k.caught_up_after_s is not None
                            else f"{k.service} never" for k in kills))
        verdict(all(ok for _, ok in bounded),
                f"thread handles <= {THREAD_HANDLES_PER_THREAD} per live thread in every sample"
                + "".join(f": {name} has more" for name, ok in bounded if not ok))
        verdict(not grows and not unfitted, "no RSS, open files or threads of any process grows beyond its bound"
                + (f": {', '.join(grows)} grow" if grows else "")
                + (f"; no slope for {', '.join(unfitted)}" if unfitted else ""))
        return 0
    finally:
        for p in producers:
            if p.is_alive():
                p.terminate()
        if lag is not None:
            lag.close()
        down_began = time.monotonic()
        down = trainmon("down", "--dir", str(stack), timeout=120)
        print(f"trainmon down: exit {down.returncode} in {time.monotonic() - down_began:.1f} s", flush=True)
        watchdog.kill()
        watchdog.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
