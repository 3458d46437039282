"""A simulated 1,024- or 16,384-rank run through the real pipeline: ingest lag, alert
latency, the alerts engine's cost, ClickHouse bytes per row, and exactly the injected
incidents firing.

    .venv/bin/python benchmarks/scale.py [--ranks 1024] [--steps 1000] [--speedup 8] [--processes 4]
    .venv/bin/python benchmarks/scale.py --llama3    # 16,384 ranks, 4 s steps, real time, 10 min
    .venv/bin/python benchmarks/scale.py --quick     # 16 ranks, 120 steps, 30x: a smoke run

What runs: a real Kafka broker (its own, unless TRAINMON_KAFKA_BOOTSTRAP is set), the
ClickHouse service (``trainmon consume clickhouse`` on a fresh chDB directory) and the
alerts service (``trainmon consume alerts``), each its own process, and ``--processes``
sender processes, each logging for its share of the ranks through one trainmon Producer
(``send_record``: every record carries its own rank's envelope, host = node of 8 GPUs).

The simulated job, per rank: a step record every ``--step-s`` (1 s; 4 s with --llama3), a
GPU record every ``--gpu-every-s`` (5 s; 10 s), an allocator record every
``--allocator-every-s`` (10 s; 30 s), staggered over the ranks; a run start when its
sender process starts (before the simulated clock does, as a job logs its start before
loading the model: the producers are connected by step 0) and a run end. Jitter: each rank logs its step 0-50 ms after the step's end plus its node's own
0-20 ms; its step time (``duration_ms``, the rank's own compute, ~800 ms of each 1 s step)
varies per GPU (1 %), per step for all ranks (3 %) and per rank and step (2 %), and one
rank-step in 1,000 is a 1.3-2.5x hiccup (one slow step is no straggler). Loss, grad norm,
lr, GPU clocks, power and temperatures move as in a healthy bf16 run.

Time is compressed: one simulated second lasts 1 / ``--speedup`` s of wall time, and every
record's ``time`` is the simulated clock at its log call, ``t0 + (wall - t0) x speedup``.
So the rules see a 1 Hz run and judge it on record time with their default settings (a
60 s grace is 60 simulated seconds); only the wall-clock fallback of the silence rules
(the whole job silent) is out of play, since record time runs ahead of the wall clock.
Wall times are recovered exactly as ``t0 + (time - t0) / speedup``.

Injected incidents (nothing else may fire):
- stop: one rank goes silent at 30 % of the steps (no step, GPU, allocator record, no run
  end) while the others go on: ``rank_mismatch`` must fire naming it;
- straggler: one rank's step time 20 % longer from 55 % of the steps on (``--stragglers``
  spreads more over 55-85 %): ``straggler`` must fire naming it. The rule's default factor
  is 1.3 (30 % slower); the run sets TRAINMON_ALERT_STRAGGLER_FACTOR=1.15 to see 20 %;
- NaN: one rank logs a NaN loss at 40 % of the steps: ``non_finite`` must fire naming it;
- heat: one rank's GPU is in thermal slowdown from 70 % of the steps on (throttle reason
  ``sw_thermal``, clocks held at 1,410 of 1,980 MHz, 86 C: under its 87 C slowdown limit,
  as a software thermal slowdown starts below it): ``gpu_throttle`` must fire naming it.

Figures:
- ingest lag: a step row's ``_inserted_at`` (ClickHouse's clock at the insert) minus the
  wall time of its log call, p50 / p99 over every step row of the run;
- alert latency: the alert's publication (its Kafka message timestamp on the alert topic)
  minus the wall moment the rule's evidence was complete in the logged records: for a
  straggler, the last rank's record of its ``fire_after``-th slow step (the rule judges a
  step once the ranks have reported it, and needs that many in a row); for the stop, the
  moment the run is ``grace_s`` of record time past the silent rank's last step. The time
  from the incident's start (the first slow step; the step the silent rank should have
  reported) is printed as well, in simulated seconds: that part is the rules' settings;
- the alerts service process: RSS growth over the run (/proc VmHWM minus VmRSS before the
  first record) and CPU seconds per record (its utime + stime over the run / the records
  of the kinds it reads: decode, rules, publish, commit);
- ClickHouse: bytes on disk per step row (system.parts, active parts of ``step``), as
  loaded and after OPTIMIZE FINAL.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import broker_bootstrap, percentile, wait_joined  # noqa: E402

from trainmon import topics  # noqa: E402

COMPUTE_SHARE = 0.8  # a rank's own step time (duration_ms), of each step's, before jitter
LOG_JITTER_S = 0.05  # a rank logs its step 0-50 ms after the step ends ...
NODE_SKEW_S = 0.02  # ... plus its node's own 0-20 ms
GPUS_PER_NODE = 8
HOT_CLOCK_MHZ, HOT_TEMP_C = 1410, 86  # a GPU in thermal slowdown: clocks held down, below the 87 C limit
HICCUP_P = 0.001  # one rank-step in 1,000 is a single slow step (1.3-2.5x)
MESSAGE_LIMIT = 300  # characters: an alert about 1,024 ranks a person still reads
TARGET_S = 2.0
ENGINE_RSS_TARGET, CHECKPOINT_TARGET = 2**30, 50e6  # issue #30, at 16,384 ranks
ALERT_KINDS = ("run", "step", "gpu")  # of what is sent, the kinds the alerts service reads


@dataclass
class Scenario:
    ranks: int = 1024
    steps: int = 1000
    speedup: float = 8.0
    step_s: float = 1.0  # simulated seconds per step
    gpu_every_s: float = 5.0  # a GPU record per rank every so many simulated seconds
    allocator_every_s: float = 10.0
    processes: int = 4
    stragglers: int = 1
    slow: float = 1.2  # the straggler's step time factor
    straggler_factor: float = 1.15  # TRAINMON_ALERT_STRAGGLER_FACTOR for the run
    seed: int = 14
    run_id: str = field(default_factory=lambda: f"scale-{uuid.uuid4().hex[:8]}")
    stop_rank: int = -1
    stop_step: int = -1  # the silent rank's first step not logged
    straggler_ranks: list[int] = field(default_factory=list)
    straggler_onsets: list[int] = field(default_factory=list)
    nan_rank: int = -1  # logs a NaN loss at nan_step
    nan_step: int = -1
    hot_rank: int = -1  # its GPU in thermal slowdown from hot_step on
    hot_step: int = -1

    def __post_init__(self) -> None:
        if self.ranks < 4 or self.processes < 1 or self.stragglers < 1:
            raise ValueError("needs at least 4 ranks, 1 process and 1 straggler")
        self.processes = min(self.processes, self.ranks)
        rng = random.Random(self.seed)
        chosen = rng.sample(range(self.ranks), 3 + self.stragglers)
        if self.stop_rank < 0:
            self.stop_rank = chosen[0]
        others = [r for r in chosen if r != self.stop_rank]
        if not self.straggler_ranks:
            self.straggler_ranks = others[:self.stragglers]
        if self.nan_rank < 0:
            self.nan_rank = others[self.stragglers]
        if self.hot_rank < 0:
            self.hot_rank = others[self.stragglers + 1]
        if self.stop_step < 0:
            self.stop_step = int(0.3 * self.steps)
        if self.nan_step < 0:
            self.nan_step = int(0.4 * self.steps)
        if self.hot_step < 0:
            self.hot_step = int(0.7 * self.steps)
        if not self.straggler_onsets:
            n = self.stragglers
            self.straggler_onsets = [int(self.steps * (0.55 + (0.3 * i / (n - 1) if n > 1 else 0)))
                                     for i in range(n)]

    def ranks_of(self, index: int) -> list[int]:
        """A contiguous share of the ranks (whole nodes where the counts allow)."""
        return list(range(self.ranks * index // self.processes, self.ranks * (index + 1) // self.processes))

    def due(self, every_s: float, rank: int, step: int) -> bool:
        """Whether a rank's sample every ``every_s`` falls in this step (staggered over the
        ranks, so they do not all sample at once)."""
        start = step * self.step_s + (rank * 0.6180339887) % 1.0 * every_s
        return (start + self.step_s) // every_s > start // every_s

    def slow_from(self, rank: int) -> int | None:
        for r, onset in zip(self.straggler_ranks, self.straggler_onsets):
            if r == rank:
                return onset
        return None


def quick() -> Scenario:
    return Scenario(ranks=16, steps=120, speedup=30.0, processes=2)


def llama3() -> Scenario:
    """Issue #30's run: 16,384 ranks (Llama 3 405B's GPUs), a step every 4 s, GPU samples
    every 10 s and allocator every 30 s, on real time, 150 steps (10 minutes)."""
    return Scenario(ranks=16384, steps=150, speedup=1.0, step_s=4.0, gpu_every_s=10.0,
                    allocator_every_s=30.0, processes=4)


# -- the simulated job: one process per share of the ranks ------------------------------------

def step_mood(seed: int, step: int) -> tuple[float, float, float]:
    """What all ranks share at a step (same in every sender process): the batch's effect
    on step time, the batch's loss offset and the global grad norm after all-reduce."""
    rng = random.Random(seed * 1_000_003 + step)
    return rng.gauss(1.0, 0.03), rng.gauss(0.0, 0.01), (0.8 + 0.4 * math.exp(-step / 300)) * rng.lognormvariate(0, 0.05)


def lr_at(step: int, steps: int) -> float:
    warmup = max(1, min(100, steps // 10))
    if step < warmup:
        return 3e-4 * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 3e-5 + (3e-4 - 3e-5) * 0.5 * (1 + math.cos(math.pi * progress))


def sender(scn: Scenario, prefix: str, bootstrap: str, spill_dir: str, index: int, conn) -> None:
    from datetime import datetime, timezone

    from trainmon.producer import Producer, ProducerConfig
    from trainmon.schemas import AllocatorRecord, AllocatorSegment, GpuRecord, RunRecord, StepRecord

    utc = timezone.utc
    ranks = scn.ranks_of(index)
    # The record clock runs `speedup` times faster than the wall clock, so the producer's
    # pack window shrinks by as much: records are packed over as much record time as in a
    # real run (the default window), not `speedup` times more.
    window_ms = ProducerConfig.pack_window_ms / scn.speedup
    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id=scn.run_id,
                                       rank=ranks[0], world_size=scn.ranks, spill_dir=Path(spill_dir),
                                       queue_size=2_000_000, pack_window_ms=window_ms))
    rng = random.Random(scn.seed * 7919 + index)
    host = {r: f"node{r // GPUS_PER_NODE:04d}" for r in ranks}
    skew = {n: rng.uniform(0, NODE_SKEW_S) for n in set(host.values())}
    gpu_speed = {r: rng.gauss(1.0, 0.01) for r in ranks}
    gpu_temp = {r: rng.uniform(55, 68) for r in ranks}
    energy = {r: rng.randrange(10**9, 2 * 10**9) for r in ranks}
    counts = {"run": 0, "step": 0, "gpu": 0, "allocator": 0}
    marks: dict[str, list[float]] = {"nan": [], "hot": []}  # record times of the NaN, the hot GPU's samples
    first = [math.inf] * scn.steps  # earliest / latest record time of each step here
    last = [-math.inf] * scn.steps
    late: list[float] = []  # wall seconds a log call came after its planned moment
    key = scn.run_id

    def ident(r: int, kind: str, step: int) -> dict:
        return dict(run_id=scn.run_id, rank=r, world_size=scn.ranks, host=host[r],
                    event_id=f"{key}-{kind}-{r}-{step}")

    config = {"model": "llama-70b", "world_size": scn.ranks, "tp": 8, "pp": 4, "seq_len": 4096,
              "micro_batch": 2, "global_batch": 2 * scn.ranks, "lr": 3e-4, "precision": "bf16"}
    # The run starts as a job does, a while before its first step (loading the model): the
    # producers have connected and the services have loaded a first batch by step 0.
    for r in ranks:
        producer.send_record(RunRecord(**ident(r, "start", 0), time=datetime.now(utc), event="start",
                                       status="running", name="scale", config=config))
        counts["run"] += 1
    producer.flush(60)
    conn.send("ready")
    t0 = conn.recv()
    cpu0 = sum(os.times()[:2])

    def sim_now() -> float:
        return t0 + (time.time() - t0) * scn.speedup

    def at(sim_t: float) -> float:
        """Wait for a simulated moment; the simulated time of the log call."""
        wait = (sim_t - sim_now()) / scn.speedup
        if wait > 0.0005:
            time.sleep(wait)
        now = sim_now()
        late.append(max(0.0, (now - sim_t) / scn.speedup))
        return now

    def stamp(t: float) -> datetime:
        return datetime.fromtimestamp(t, utc)

    for step in range(scn.steps):
        mood, loss_shift, norm = step_mood(scn.seed, step)
        end = t0 + (step + 1) * scn.step_s
        plan = sorted((end + skew[host[r]] + rng.uniform(0, LOG_JITTER_S), r) for r in ranks
                      if not (r == scn.stop_rank and step >= scn.stop_step))
        lr = lr_at(step, scn.steps)
        for due, r in plan:
            compute = COMPUTE_SHARE * scn.step_s * gpu_speed[r] * mood * rng.gauss(1.0, 0.02)
            if rng.random() < HICCUP_P:
                compute *= rng.uniform(1.3, 2.5)
            onset = scn.slow_from(r)
            if onset is not None and step >= onset:
                compute *= scn.slow
            now = at(due)
            t = stamp(now)
            first[step] = min(first[step], now)
            last[step] = max(last[step], now)
            ms = 1000.0 * compute
            loss = 2.0 + 1.5 * math.exp(-step / 600) + loss_shift + rng.gauss(0, 0.02)
            if r == scn.nan_rank and step == scn.nan_step:
                loss = math.nan
                marks["nan"].append(now)
            producer.send_record(StepRecord(
                **ident(r, "step", step), time=t, step=step, epoch=step / 500, step_tokens=8192,
                duration_ms=ms, loss=loss,
                norm=norm, lr=lr, total_steps=scn.steps, loss_scale=1.0,
                consumed_samples=(step + 1) * 2 * scn.ranks, global_batch_size=2 * scn.ranks,
                tflops_per_gpu=400.0 * 800.0 * scn.step_s / ms, timers={"forward-backward": 0.9 * ms, "optimizer": 0.1 * ms}))
            counts["step"] += 1
            if scn.due(scn.gpu_every_s, r, step):
                temp = int(round(gpu_temp[r] + 4 * min(1.0, step / 200) + rng.gauss(0, 0.7)))
                clock, throttle = int(rng.uniform(1830, 1980)), ""
                if r == scn.hot_rank and step >= scn.hot_step:
                    temp, clock, throttle = HOT_TEMP_C, HOT_CLOCK_MHZ, "sw_thermal"
                    marks["hot"].append(now)
                power = int(rng.uniform(560_000, 690_000))
                energy[r] += int(power * scn.gpu_every_s)
                producer.send_record(GpuRecord(
                    **ident(r, "gpu", step), time=t, step=step, id=r % GPUS_PER_NODE, throttle=throttle,
                    clock=clock, max_clock=1980, power=power, power_limit=700_000,
                    temperature=temp, temp_slowdown=87, gpu_util=int(rng.uniform(94, 100)),
                    mem_util=int(rng.uniform(35, 70)), dram_free=int(rng.uniform(6, 14) * 2**30),
                    pcie_rx=int(rng.uniform(1e8, 3e9)), pcie_tx=int(rng.uniform(1e8, 3e9)), fan=0,
                    energy=energy[r]))
                counts["gpu"] += 1
            if scn.due(scn.allocator_every_s, r, step):
                act = int(rng.uniform(52, 58) * 2**30)
                producer.send_record(AllocatorRecord(
                    **ident(r, "allocator", step), time=t, step=step,
                    stats=[AllocatorSegment(name=name, device=size, managed=0, pinned=pinned, pageable=0)
                           for name, size, pinned in (("params", 17 * 2**30, 0), ("grads", 17 * 2**30, 0),
                                                      ("optimizer", 9 * 2**30, 0),
                                                      ("activations", act - 43 * 2**30, 256 * 2**20))],
                    allocated=act, peak_allocated=act + 2**30, active=act, inactive=int(0.3 * 2**30),
                    reserved=act + 2**31, peak_reserved=act + 2**31 + 2**29, alloc_retries=0))
                counts["allocator"] += 1
    end = t0 + (scn.steps + 1) * scn.step_s
    for r in ranks:
        if r == scn.stop_rank:
            continue
        now = at(end + rng.uniform(0, LOG_JITTER_S))
        producer.send_record(RunRecord(**ident(r, "end", scn.steps), time=stamp(now), event="end",
                                       status="success"))
        counts["run"] += 1
    ok = producer.close(timeout=120)
    late.sort()
    conn.send({"counts": counts, "first": first, "last": last, "ok": ok, "spilled": producer.spilled,
               "marks": marks,
               "cpu_s": sum(os.times()[:2]) - cpu0,
               "dropped": producer.dropped, "rejected": dict(producer.rejected),
               "late_p99": percentile(late, 99), "late_max": late[-1] if late else 0.0})
    conn.close()


# -- the services: own processes, measured from /proc ---------------------------------------

def proc_sample(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, RSS bytes, peak RSS bytes) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                mem[name] = int(value.split()[0]) * 1024
    return cpu, mem["VmRSS"], mem["VmHWM"]


def machine_sample() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / ticks, sum(values[:8]) / ticks


def service_env(bootstrap: str, prefix: str) -> dict:
    return dict(os.environ, TRAINMON_KAFKA_BOOTSTRAP=bootstrap, TRAINMON_TOPIC_PREFIX=prefix,
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start_clickhouse(work: Path, bootstrap: str, prefix: str):
    from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint

    with open(work / "clickhouse.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainmon", "consume", "clickhouse", "--path",
                                 str(work / "chdb"), "--topic-prefix", prefix, "--group", f"{prefix}clickhouse"],
                                env=service_env(bootstrap, prefix), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while (endpoint := find_endpoint(work / "chdb")) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the ClickHouse service did not start:\n" + (work / "clickhouse.log").read_text())
        time.sleep(0.05)
    return proc, endpoint


def alerts_env(scn: Scenario, bootstrap: str, prefix: str, work: Path) -> dict:
    """The alerts service's settings: the defaults, the straggler factor, and where the
    compression would make it so, a shorter wall-clock slack (see below)."""
    from trainmon.consumers.alerts.config import load_config

    env = dict(service_env(bootstrap, prefix), TRAINMON_ALERT_STATE_DIR=str(work / "alerts-state"),
               TRAINMON_ALERT_GROUP_ID=f"{prefix}alerts",
               TRAINMON_ALERT_STRAGGLER_FACTOR=f"{scn.straggler_factor:g}")
    # rank_mismatch counts a rank's lag only once the records proving it have been in the
    # engine's hands for wall_clock_slack_s of *wall* time (a burst read partition by
    # partition is no silence). The grace (record time) lasts grace_s / speedup of wall
    # time; where that is not well above the slack, the slack would decide instead.
    cfg = load_config(env=env)
    grace_wall = cfg.rules.rank_mismatch.grace_s / scn.speedup
    if grace_wall < cfg.wall_clock_slack_s + 2.0:
        env["TRAINMON_ALERT_WALL_CLOCK_SLACK_S"] = f"{grace_wall / 2:.3g}"
    return env


def start_alerts(scn: Scenario, bootstrap: str, prefix: str, work: Path):
    with open(work / "alerts.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "trainmon", "consume", "alerts", "-v"],
                                env=alerts_env(scn, bootstrap, prefix, work), stdout=log,
                                stderr=subprocess.STDOUT)


class GroupLag:
    """A consumer group's lag per record kind: Kafka messages on the kind's topic past the
    group's committed offsets (the services commit after every batch), asked of the broker
    without joining the group."""

    def __init__(self, group: str, kinds: tuple[str, ...], prefix: str, bootstrap: str):
        from trainmon.kafka_client import Consumer, TopicPartition

        self._reader = Consumer(group, bootstrap=bootstrap)
        self.parts = {kind: [TopicPartition(topics.topic_for(kind, prefix), p)
                             for p in self._reader.partitions_for(topics.topic_for(kind, prefix))]
                      for kind in kinds}

    def sample(self) -> dict[str, int]:
        behind = self._reader.uncommitted([tp for parts in self.parts.values() for tp in parts], 5.0)
        return {kind: sum(behind[tp] for tp in parts) for kind, parts in self.parts.items()}

    def close(self) -> None:
        self._reader.close()


class CpuTimeline(threading.Thread):
    """Once a second: CPU seconds of the given processes and of the whole machine, and the
    services' lag per kind (messages not committed yet), into a CSV in the work directory
    (what competed for the cores when, and who fell behind, for a run kept with --keep)."""

    def __init__(self, path: Path, pids: dict[str, int], lags: dict[str, GroupLag]):
        super().__init__(daemon=True)
        self.path, self.pids, self.lags = path, pids, lags
        self.max_lag: dict[str, tuple[int, float]] = {}  # "service kind" -> (messages, wall)
        self.done = threading.Event()

    def run(self) -> None:
        lag_columns = [f"{name}_lag_{kind}" for name, lag in self.lags.items() for kind in lag.parts]
        with open(self.path, "w") as f:
            f.write("wall," + ",".join(self.pids) + ",machine_busy,machine_total," + ",".join(lag_columns) + "\n")
            while not self.done.wait(1.0):
                now = time.time()
                row = [f"{now:.3f}"]
                for pid in self.pids.values():
                    try:
                        row.append(f"{proc_sample(pid)[0]:.2f}")
                    except OSError:
                        row.append("")
                busy, total = machine_sample()
                row += [f"{busy:.2f}", f"{total:.2f}"]
                for name, lag in self.lags.items():
                    try:
                        behind = lag.sample()
                    except Exception:  # noqa: BLE001 -- a figure missed, not the run
                        row += [""] * len(lag.parts)
                        continue
                    for kind, n in behind.items():
                        row.append(str(n))
                        key = f"{name} {kind}"
                        if n > self.max_lag.get(key, (-1, 0.0))[0]:
                            self.max_lag[key] = (n, now)
                f.write(",".join(row) + "\n")
                f.flush()


class AlertWatcher(threading.Thread):
    """Reads the alert topic from its start: (alert, publication wall time) pairs."""

    def __init__(self, bootstrap: str, topic: str):
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.alerts: list = []
        self.last_seen = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        from trainmon.kafka_client import Consumer, TopicPartition
        from trainmon.schemas import decode, unpack

        consumer = Consumer(None, bootstrap=self.bootstrap)
        try:
            while not (parts := consumer.partitions_for(self.topic)) and not self.done.wait(0.2):
                pass
            consumer.assign({TopicPartition(self.topic, p): 0 for p in parts})
            while not self.done.is_set():
                for m in consumer.poll(0.2):
                    for value in unpack(m.value or b""):
                        self.alerts.append((decode("alert", value), m.timestamp_ms / 1000.0))
                        self.last_seen = time.monotonic()
        finally:
            consumer.close()


def sql(endpoint, query: str) -> str:
    from trainmon.consumers.clickhouse.sql_endpoint import query_endpoint

    return query_endpoint(endpoint, query, "TabSeparated").decode().strip()


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- one run -----------------------------------------------------------------------------------

@dataclass
class Incident:
    rule: str
    rank: int
    start_sim: float  # the incident's start: the first slow step, the step the rank missed
    detectable_sim: float  # when the rule's evidence was complete in the logged records
    alert: object = None  # the firing AlertRecord that names it
    published: float | None = None  # its Kafka timestamp (wall)
    latency: float | None = None  # published - wall(detectable_sim)


@dataclass
class Result:
    scn: Scenario
    t0: float
    wall_s: float
    counts: dict
    senders: list
    incidents: list
    extra: list  # firing alerts nobody injected
    alerts: list  # every alert event of the run, in publication order
    lag: tuple | None = None  # ingest lag p50, p99, max (s)
    rows: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def wall(self, sim_t: float) -> float:
        return self.t0 + (sim_t - self.t0) / self.scn.speedup

    @property
    def exact(self) -> bool:
        return not self.extra and all(i.alert is not None for i in self.incidents)


def run(scn: Scenario, bootstrap: str, work: Path, progress=print) -> Result:
    from trainmon.consumers.alerts.config import load_config
    from trainmon.consumers.alerts.engine import INPUT_KINDS
    from trainmon.kafka_client import create_topics, group_lag

    work.mkdir(parents=True, exist_ok=True)
    prefix = f"scale{uuid.uuid4().hex[:8]}."
    cfg = load_config(env=alerts_env(scn, bootstrap, prefix, work))
    grace, fire_after = cfg.rules.rank_mismatch.grace_s, cfg.rules.straggler.fire_after
    throttle_after = cfg.rules.gpu_throttle.fire_after
    gpu_steps = math.ceil(scn.gpu_every_s / scn.step_s)
    if (scn.stop_step + grace / scn.step_s + 5 > scn.steps or max(scn.straggler_onsets) + fire_after + 2 > scn.steps
            or scn.hot_step + (throttle_after + 1) * gpu_steps > scn.steps or scn.nan_step + 2 > scn.steps):
        raise ValueError(f"{scn.steps} steps leave no room to see the injected incidents")
    create_topics(topics.all_topics(prefix), bootstrap=bootstrap)
    ch, endpoint = start_clickhouse(work, bootstrap, prefix)
    alerts = start_alerts(scn, bootstrap, prefix, work)
    watcher = AlertWatcher(bootstrap, topics.topic_for("alert", prefix))
    watcher.start()
    ctx = mp.get_context("spawn")
    senders, conns = [], []
    try:
        for index in range(scn.processes):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=sender, args=(scn, prefix, bootstrap, str(work / "spill"), index, child),
                            daemon=True)
            p.start()
            senders.append(p)
            conns.append(parent)
        for c in conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("a sender process did not start")
        wait_joined(f"{prefix}alerts", bootstrap, alerts)
        if alerts.poll() is not None:
            raise RuntimeError("the alerts service exited:\n" + (work / "alerts.log").read_text())
        cpu0, rss0, _ = proc_sample(alerts.pid)
        ch_cpu0 = proc_sample(ch.pid)[0]
        machine0 = machine_sample()
        lags = {"alerts": GroupLag(f"{prefix}alerts", ("step", "gpu"), prefix, bootstrap),
                "clickhouse": GroupLag(f"{prefix}clickhouse", ("step", "gpu"), prefix, bootstrap)}
        timeline = CpuTimeline(work / "cpu.csv", {"clickhouse": ch.pid, "alerts": alerts.pid,
                                                  **{f"sender{i}": p.pid for i, p in enumerate(senders)}},
                               lags)
        timeline.start()
        t0 = time.time() + 0.5
        for c in conns:
            c.send(t0)
        progress(f"  {scn.ranks} ranks x {scn.steps} steps at {scn.speedup:g}x from {scn.processes} "
                 f"processes: about {scn.steps * scn.step_s / scn.speedup:.0f} s of sending")
        results = []
        for c in conns:
            if not c.poll(scn.steps * scn.step_s / scn.speedup + 300):
                raise TimeoutError("a sender process did not finish")
            results.append(c.recv())
        sent_wall = time.time() - t0
        ch_cpu1 = proc_sample(ch.pid)[0]
        machine1 = machine_sample()
        load = os.getloadavg()
        timeline.done.set()
        timeline.join(10)
        for lag in lags.values():
            lag.close()
        a_cpu_sent = proc_sample(alerts.pid)[0]
        for p in senders:
            p.join(30)
        counts = {k: sum(r["counts"][k] for r in results) for k in results[0]["counts"]}

        # The alerts service: caught up (its commits reach the ends), then measured and stopped.
        alert_topics = [topics.topic_for(k, prefix) for k in INPUT_KINDS]
        wait_until(lambda: group_lag(f"{prefix}alerts", alert_topics, bootstrap=bootstrap) == 0, 600,
                   "the alerts service catching up")
        time.sleep(1.0)  # its last ticks (run ends) publish before it commits; this is margin
        cpu1, rss1, peak = proc_sample(alerts.pid)
        stop_process(alerts)
        wait_until(lambda: time.monotonic() - watcher.last_seen > 1.5, 60, "the alert topic going quiet")
        watcher.done.set()
        watcher.join(10)
        processed = sum(counts[k] for k in ALERT_KINDS)
        log_text = (work / "alerts.log").read_text(errors="replace")
        said = [line for line in log_text.splitlines() if "stopped after" in line]
        state_bytes = sum(f.stat().st_size for f in (work / "alerts-state").rglob("*") if f.is_file())
        engine = {"records": processed, "cpu_s": cpu1 - cpu0, "rss_before": rss0, "rss_end": rss1,
                  "rss_peak": peak, "checkpoint_bytes": state_bytes, "log": said[-1] if said else "",
                  "cpu_share": (cpu1 - cpu0) / max(1e-9, sent_wall),
                  "clickhouse_share": (ch_cpu1 - ch_cpu0) / max(1e-9, sent_wall),
                  "alerts_share_sent": (a_cpu_sent - cpu0) / max(1e-9, sent_wall),
                  "senders_share": sum(r["cpu_s"] for r in results) / max(1e-9, sent_wall),
                  "machine_busy": (machine1[0] - machine0[0]) / max(1e-9, machine1[1] - machine0[1]),
                  "loadavg": load,
                  "cores": os.cpu_count(),
                  "max_lag": {k: (n, at - t0) for k, (n, at) in timeline.max_lag.items()}}

        # ClickHouse: every row in, then the figures.
        where = f"run_id = '{scn.run_id}'"
        wait_until(lambda: int(sql(endpoint, f"SELECT count() FROM trainmon.step WHERE {where}")) >= counts["step"],
                   600, "the step rows")
        rows = {k: int(sql(endpoint, f"SELECT count() FROM trainmon.{k} WHERE {where}"))
                for k in ("step", "gpu", "allocator", "run")}
        wall_of_time = f"({t0!r} + (toUnixTimestamp64Micro(time) / 1e6 - {t0!r}) / {scn.speedup!r})"
        out = sql(endpoint, "SELECT quantilesExact(0.5, 0.99, 1)(toUnixTimestamp64Micro(_inserted_at) / 1e6 - "
                            f"{wall_of_time}) FROM trainmon.step WHERE {where}")
        lag = tuple(float(x) for x in out.strip("[]").split(","))
        parts = {"loaded": step_parts(endpoint)}
        sql(endpoint, "OPTIMIZE TABLE trainmon.step FINAL")
        parts["optimized"] = step_parts(endpoint)
    finally:
        for p in senders:
            if p.is_alive():
                p.kill()
        stop_process(alerts)
        stop_process(ch)
        watcher.done.set()

    firsts = [min(r["first"][s] for r in results) for s in range(scn.steps)]
    lasts = [max(r["last"][s] for r in results) for s in range(scn.steps)]
    incidents = [Incident("rank_mismatch", scn.stop_rank, start_sim=firsts[scn.stop_step],
                          detectable_sim=firsts[scn.stop_step] + grace)]
    for rank, onset in zip(scn.straggler_ranks, scn.straggler_onsets):
        incidents.append(Incident("straggler", rank, start_sim=lasts[onset],
                                  detectable_sim=lasts[onset + fire_after - 1]))
    (nan_at,) = [t for r in results for t in r["marks"]["nan"]]
    incidents.append(Incident("non_finite", scn.nan_rank, start_sim=nan_at, detectable_sim=nan_at))
    hot = sorted(t for r in results for t in r["marks"]["hot"])
    incidents.append(Incident("gpu_throttle", scn.hot_rank, start_sim=hot[0],
                              detectable_sim=hot[throttle_after - 1]))
    events = sorted(((a, published) for a, published in watcher.alerts if a.run_id == scn.run_id),
                    key=lambda x: x[1])
    extra = []
    for alert, published in events:
        if alert.state != "firing":
            continue
        match = next((i for i in incidents if i.alert is None and i.rule == alert.rule
                      and alert.ranks == [i.rank]), None)
        if match is None:
            extra.append(alert)
            continue
        match.alert, match.published = alert, published
        match.latency = published - (t0 + (match.detectable_sim - t0) / scn.speedup)
    return Result(scn=scn, t0=t0, wall_s=sent_wall, counts=counts, senders=results, incidents=incidents,
                  extra=extra, alerts=[a for a, _ in events], lag=lag, rows=rows, parts=parts, engine=engine,
                  settings={"grace_s": grace, "fire_after": fire_after, "factor": cfg.rules.straggler.factor,
                            "throttle_after": throttle_after,
                            "slack_s": cfg.wall_clock_slack_s})


def step_parts(endpoint) -> tuple[int, int, int, int]:
    """(bytes on disk, uncompressed bytes, rows, parts) of the active parts of ``step``."""
    out = sql(endpoint, "SELECT sum(bytes_on_disk), sum(data_uncompressed_bytes), sum(rows), count() "
                        "FROM system.parts WHERE database = 'trainmon' AND table = 'step' AND active")
    return tuple(int(x) for x in out.split("\t"))


# -- the printout --------------------------------------------------------------------------------

def report(res: Result) -> list[tuple[str, bool]]:
    scn, s = res.scn, res.settings
    total = sum(res.counts.values())
    print(f"simulated run {scn.run_id}: {scn.ranks:,} ranks, {scn.steps:,} steps, {scn.processes} sender processes")
    print(f"  a step every {scn.step_s:g} s, a GPU sample every {scn.gpu_every_s:g} s and an allocator one every "
          f"{scn.allocator_every_s:g} s per rank, "
          + ("on real time (no compression)" if scn.speedup == 1 else
             f"time compressed {scn.speedup:g}x: 1 simulated s = {1000 / scn.speedup:.0f} ms of wall time")
          + f"; record times are on the simulated clock, so every rule runs on record time with its defaults "
          f"(rank_mismatch grace {s['grace_s']:g} s, straggler fire_after {s['fire_after']} steps) except "
          f"straggler factor {s['factor']:g} (default 1.3 does not see a {100 * (scn.slow - 1):.0f} % straggler)")
    if s["slack_s"] != 5.0:
        print(f"  wall_clock_slack_s {s['slack_s']:g} (default 5): the {s['grace_s']:g} s grace lasts only "
              f"{s['grace_s'] / scn.speedup:.1f} s of wall time at {scn.speedup:g}x")
    print(f"  sent {total:,} records in {res.wall_s:.1f} s wall ({total / res.wall_s:,.0f} records/s): "
          + ", ".join(f"{k} {v:,}" for k, v in res.counts.items()))
    late_p99 = max(r["late_p99"] for r in res.senders)
    late_max = max(r["late_max"] for r in res.senders)
    trouble = sum(r["spilled"] + r["dropped"] + sum(r["rejected"].values()) for r in res.senders)
    print(f"  senders behind their schedule: p99 {1000 * late_p99:.0f} ms, max {1000 * late_max:.0f} ms of wall time; "
          f"spilled / dropped / rejected: {trouble}")
    print("  rows in ClickHouse: " + ", ".join(f"{k} {v:,}" for k, v in res.rows.items()))
    e = res.engine
    busy = e["machine_busy"] * e["cores"]
    ours = e["senders_share"] + e["clickhouse_share"] + e["alerts_share_sent"]
    print(f"  CPU while sending, in cores: machine {busy:.2f} of {e['cores']} busy; senders "
          f"{e['senders_share']:.2f}, ClickHouse service {e['clickhouse_share']:.2f}, alerts service "
          f"{e['alerts_share_sent']:.2f}, everything else (the broker, other work on the machine) "
          f"{max(0.0, busy - ours):.2f}" + ("  <- saturated: the figures below are the machine's, not the pipeline's"
                                           if e["machine_busy"] > 0.9 else "")
          + f"; load average at the end of sending {e['loadavg'][0]:.2f} / {e['loadavg'][1]:.2f} / "
            f"{e['loadavg'][2]:.2f} (1 / 5 / 15 min)")
    if e.get("max_lag"):
        print("  most messages a service had not committed (sampled once a second; a message packs "
              "up to 500 records): " + ", ".join(f"{k} {n:,} at {at:.0f} s" for k, (n, at) in sorted(e["max_lag"].items())))
    p50, p99, worst = res.lag
    print(f"ingest lag (step row _inserted_at - wall time of its log call, {res.rows['step']:,} rows): "
          f"p50 {1000 * p50:.0f} ms, p99 {1000 * p99:.0f} ms, max {1000 * worst:.0f} ms")
    print("alert latency (publication on the alert topic - wall moment the rule's evidence was complete):")
    latencies = []
    for inc in res.incidents:
        what = {"rank_mismatch": f"rank {inc.rank} silent from step {scn.stop_step}",
                "straggler": f"rank {inc.rank} {scn.slow:g}x slower from step {scn.slow_from(inc.rank)}",
                "non_finite": f"rank {inc.rank} NaN loss at step {scn.nan_step}",
                "gpu_throttle": f"rank {inc.rank} GPU in thermal slowdown from step {scn.hot_step}"}[inc.rule]
        why = {"rank_mismatch": f"grace {s['grace_s']:g} s", "straggler": f"{s['fire_after']} slow steps in a row",
               "non_finite": "the record itself",
               "gpu_throttle": f"{s['throttle_after']} throttled sample(s), one every {scn.gpu_every_s:g} s"}[inc.rule]
        if inc.alert is None:
            print(f"  {inc.rule:<14} {what}: NO ALERT")
            continue
        latencies.append(inc.latency)
        since_start = (inc.published - res.wall(inc.start_sim)) * scn.speedup
        print(f"  {inc.rule:<14} {what}: {1000 * inc.latency:.0f} ms (fired at step {inc.alert.step}, "
              f"{since_start:.1f} simulated s after the incident began: {why})")
    latencies.sort()
    per_record = e["cpu_s"] / max(1, e["records"])
    print(f"alerts service process ({e['records']:,} records of {', '.join(ALERT_KINDS)}): "
          f"{1e6 * per_record:.1f} us CPU per record ({100 * e['cpu_share']:.0f} % of a core while the run was "
          f"sent); RSS {e['rss_before'] / 2**20:.0f} MiB before the run, {e['rss_end'] / 2**20:.0f} MiB at its "
          f"end, peak {e['rss_peak'] / 2**20:.0f} MiB (+{(e['rss_peak'] - e['rss_before']) / 2**20:.0f} MiB); "
          f"engine checkpoint {e['checkpoint_bytes'] / 2**20:.1f} MiB")
    if e["log"]:
        print(f"  its own count: {e['log'].split('trainmon alerts: ', 1)[-1]}")
    for label, (disk, raw, rows, nparts) in res.parts.items():
        print(f"ClickHouse step table {label}: {disk / max(1, rows):.1f} bytes per row on disk "
              f"({raw / max(1, rows):.0f} uncompressed; {rows:,} rows in {nparts} parts)")
    print("alerts of the run (every event):")
    for a in res.alerts:
        print(f"  {a.state:<8} {a.rule:<14} ranks {a.ranks} step {a.step}: {a.message}")
    firing = [i.alert for i in res.incidents if i.alert is not None] + res.extra
    readable = all(len(a.message) <= MESSAGE_LIMIT for a in firing) and all(
        i.alert is None or f"rank {i.rank}" in i.alert.message for i in res.incidents)
    for a in res.extra:
        print(f"  EXTRA: {a.rule} ranks {a.ranks} step {a.step}: {a.message}")
    growth, ckpt = e["rss_peak"] - e["rss_before"], e["checkpoint_bytes"]
    lag_ok = p99 <= TARGET_S
    worst_alert = latencies[-1] if latencies else math.inf
    got = sum(i.alert is not None for i in res.incidents)
    targets = [
        (f"ingest lag p99 <= {TARGET_S:g} s at {scn.ranks:,} ranks: {p99:.2f} s", lag_ok),
        (f"alert latency p99 <= {TARGET_S:g} s for the injected incidents (p99 of {len(latencies)} = the "
         f"worst): {worst_alert:.2f} s", len(latencies) == len(res.incidents) and worst_alert <= TARGET_S),
        (f"exactly the injected incidents fire, naming the right ranks: {got} of {len(res.incidents)} "
         f"injected, {len(res.extra)} other", res.exact),
        (f"firing messages name their rank and stay under {MESSAGE_LIMIT} characters: longest "
         f"{max((len(a.message) for a in firing), default=0)}", readable),
        (f"alerts engine RSS growth <= {ENGINE_RSS_TARGET / 2**30:g} GiB: {growth / 2**20:,.0f} MiB",
         growth <= ENGINE_RSS_TARGET),
        (f"alerts engine checkpoint <= {CHECKPOINT_TARGET / 1e6:g} MB: {ckpt / 1e6:,.1f} MB", ckpt <= CHECKPOINT_TARGET),
    ]
    print("targets:")
    for name, ok in targets:
        print(f"  {'met   ' if ok else 'MISSED'}  {name}")
    return targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--speedup", type=float, default=8.0, help="simulated seconds per wall second")
    parser.add_argument("--processes", type=int, default=4, help="sender processes")
    parser.add_argument("--stragglers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--step-s", type=float, default=1.0, help="simulated seconds per step")
    parser.add_argument("--gpu-every-s", type=float, default=5.0)
    parser.add_argument("--allocator-every-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="16 ranks, 120 steps, 30x, 2 processes")
    parser.add_argument("--llama3", action="store_true",
                        help="issue #30's run: 16,384 ranks, 150 steps of 4 s on real time (10 min), GPU every "
                             "10 s, allocator every 30 s, 4 processes")
    parser.add_argument("--keep", metavar="DIR", help="keep the services' data and logs in DIR")
    args = parser.parse_args()
    if args.quick:
        scn = quick()
    elif args.llama3:
        scn = llama3()
    else:
        scn = Scenario(ranks=args.ranks, steps=args.steps, speedup=args.speedup, processes=args.processes,
                       stragglers=args.stragglers, seed=args.seed, step_s=args.step_s,
                       gpu_every_s=args.gpu_every_s, allocator_every_s=args.allocator_every_s)
    with broker_bootstrap() as bootstrap, tempfile.TemporaryDirectory(prefix="trainmon-scale-") as tmp:
        result = run(scn, bootstrap, Path(args.keep) if args.keep else Path(tmp))
        targets = report(result)
        if args.keep:
            print(f"kept in {args.keep} (chdb/, service logs, cpu.csv); t0 = {result.t0!r}: a record time T "
                  f"was logged at wall time t0 + (T - t0) / {scn.speedup:g}")
    return 0 if all(ok for _, ok in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
