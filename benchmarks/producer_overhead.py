"""What logging costs a training process: trainmon's ``log_step`` beside the trackers people pick.

The peers, each the way a training script uses it on one machine: TensorBoard's
``SummaryWriter`` (tensorboardX), trackio (local), MLflow (a local store, its asynchronous
logging on) and ``wandb.log`` offline; they come with ``pip install 'trainmon[bench]'``. The
same step of 8 scalars (the step and 7 values) for each. Each case runs in a process of its
own, one after the other, trainmon against a broker:

- whole-process CPU (every thread, plus child processes: wandb's wandb-core service) per
  logged step while the loop logs at 1, 10 and 100 steps/s and sleeps in between, as a
  training loop waits on its GPU;
- idle: CPU while connected and nothing is logged;
- a tight loop of calls back to back: the caller's mean and p99, and CPU per step; beside
  the p99, that of a bare computation as long as the median call, timed in the same
  process: what the machine alone adds to a call of that length;
- the floor: a no-op Python call made the same way (``no-op``), what a caller costs on this
  machine with nothing in it;
- a tight loop's CPU is read once the process has gone quiet after it (1 % of a core over
  a second at most): what its last calls left queued in the library's threads or children
  is part of their cost (20,000 calls left trainmon half its sending);
- the caller's figures time the library's call alone: the step's values are made before
  it, as a training loop has them in hand (the same work for every library);
- ``trainmon-relay``: trainmon through a node's relay (``trainmon relay``, its own process,
  started per case): ``--relay-ranks`` rank processes (8, a node's GPUs; 1 for the tight
  loop) log at once through one relay, and each rank's figure is its own process's CPU
  plus its share of the relay's: the relay's CPU per second over the interval all ranks
  were measuring (sampled from /proc), times a rank's interval, divided by the ranks. The
  ranks log each step together, as a data-parallel job's do (every step ends in an
  all-reduce): their loops start at one time (``--relay-ranks-apart``: each at its own).

It prints each figure, the machine's load average, the ratios of trainmon to the cheapest
peer and to wandb, and the targets (issue 30) with met / missed.

``--repeats N`` measures every case N times, the libraries' order reversed every other
round, and reports each case's median run (every run's figure printed beside it): on a
shared machine one run of a case varies by a tenth to a third (wandb at 1 step/s: 3,451
to 5,154 us in four runs of one hour), as much as the margins the targets are judged by.

    .venv/bin/python benchmarks/producer_overhead.py [--seconds 20] [--client kafka-python]
        [--libraries trainmon,tensorboard,...] [--cases idle,1,10,100,tight] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import broker_bootstrap, percentile  # noqa: E402

RATES = (1, 10, 100)
CASES = ("idle", *map(str, RATES), "tight")
TIGHT_CALLS = 20_000
# After a tight loop, its CPU is read once the process has gone quiet (ProcessCpu.settle):
# at most 1 % of a core over 1 s (every library's idle is under a third of that), sampled
# every 0.1 s, waiting 120 s at most.
SETTLE_QUIET_S, SETTLE_SAMPLE_S, SETTLE_CPU_SHARE, SETTLE_TIMEOUT_S = 1.0, 0.1, 0.01, 120.0
PEERS = ("tensorboard", "trackio", "mlflow", "wandb")
# The floor: a Python function that does nothing, called as log_step is. After the loop's
# sleep the interpreter runs with cold caches; on a shared VM even this call takes
# microseconds, which is the least any Python logger's caller can cost at 1-100 steps/s.
FLOOR = "no-op"
RELAY = "trainmon-relay"
OURS = ("trainmon", RELAY)
LIBRARIES = (*OURS, *PEERS, FLOOR)
RELAY_RANKS = 8


def step_fields(i: int) -> dict:
    """The step's 7 values (with the step itself, 8 scalars)."""
    return dict(epoch=i / 1e4, step_tokens=524288, duration_ms=812.0, loss=2.0 - i * 1e-6,
                norm=0.9, lr=3e-4, tokens_per_second=524288 / 0.812)


def peer_metrics(i: int) -> dict:
    return {f"train/{name}": value for name, value in step_fields(i).items()}


def metrics_for(library: str):
    """i -> what the library's log call takes for step i: made before the call is timed,
    as a training loop has its values in hand (its own work, the same for every library,
    whose cost with cold caches, ~20 µs here, would otherwise count as the library's)."""
    return step_fields if library in OURS or library == FLOOR else peer_metrics


def _no_op(i: int, **fields) -> None:
    pass


# -- one case, in its own process ------------------------------------------------------

class ProcessCpu:
    """CPU seconds of this process (all threads, at nanosecond resolution) and of its child
    processes (in clock ticks, 10 ms: the cases last long enough to hold many).

    Finding the children walks every process on the machine (milliseconds of CPU), so it
    is done outside the measured interval: this process's clock is read last at the start
    and first at the end, and the children's times around it."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._children = psutil.Process().children(recursive=True)
        self._start = self._children_s() + self._own_s()

    def _own_s(self) -> float:
        return time.process_time()

    def _children_s(self, children=None) -> float:
        total = 0.0
        for child in self._children if children is None else children:
            try:
                total += sum(child.cpu_times()[:2])
            except self._psutil.Error:
                pass
        return total

    def _now_s(self) -> float:
        """Now, cheaply: this process and the children known at the start (no walk)."""
        return self._own_s() + self._children_s()

    def settle(self, quiet_s: float = SETTLE_QUIET_S, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
        """Wait until the process (threads and children) has gone quiet: at most
        ``SETTLE_CPU_SHARE`` of a core over the last ``quiet_s``. The loop's last calls
        leave work behind in the library's threads and children (its queue, a pack window,
        a service process); without waiting for it a tight loop of 20,000 trainmon calls
        measured 6-8 µs a step, and 14-16 with its queue sent. ``quiet_s`` outlasts
        trainmon's 0.5 s pack window. False if still busy after ``timeout_s``."""
        samples = [(time.monotonic(), self._now_s())]
        deadline = samples[0][0] + timeout_s
        while time.monotonic() < deadline:
            time.sleep(SETTLE_SAMPLE_S)
            samples.append((time.monotonic(), self._now_s()))
            while len(samples) > 2 and samples[-1][0] - samples[1][0] >= quiet_s:
                samples.pop(0)
            (t_first, cpu_first), (t_last, cpu_last) = samples[0], samples[-1]
            if t_last - t_first >= quiet_s and cpu_last - cpu_first <= SETTLE_CPU_SHARE * (t_last - t_first):
                return True
        return False

    def used_s(self) -> float:
        own = self._own_s()
        total = own + self._children_s()
        # A child started during the interval counts whole.
        now = self._psutil.Process().children(recursive=True)
        total += self._children_s([c for c in now if c not in self._children])
        return total - self._start


def thread_activity() -> dict[int, tuple[str, int, int]]:
    """This process's threads, tid -> (name, context switches, CPU ns), from /proc (Linux;
    {} elsewhere). While a thread has nothing to do, each of its switches is a wake-up."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    threads = {}
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/status") as status, \
                    open(f"/proc/self/task/{tid}/schedstat") as schedstat:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
                cpu_ns = int(schedstat.read().split()[0])
        except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile)
            continue
        switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        threads[tid] = (names.get(tid) or fields["Name"].strip(), switches, cpu_ns)
    return threads


def wakeups(before: dict, after: dict, seconds: float) -> dict[str, list[float]]:
    """Thread name -> [wake-ups per second, CPU µs per second], threads of one name summed."""
    by_name: dict[str, list[float]] = {}
    for tid, (name, switches, cpu_ns) in after.items():
        _, switches_before, cpu_before = before.get(tid, (name, 0, 0))
        rates = by_name.setdefault(name, [0.0, 0.0])
        rates[0] += (switches - switches_before) / seconds
        rates[1] += (cpu_ns - cpu_before) / 1e3 / seconds
    return by_name


def make_logger(library: str, bootstrap: str, tmp: str):
    """(log(i, metrics), close()) for the library, connected and warmed up (a step
    logged); ``metrics``: ``metrics_for(library)(i)``."""
    if library in OURS:
        from trainmon.producer import Producer, ProducerConfig

        producer = Producer(ProducerConfig(bootstrap=bootstrap, run_id="bench",
                                           rank=int(os.environ.get("BENCH_RANK", "0")),
                                           relay=os.environ["TRAINMON_RELAY"] if library == RELAY else None,
                                           spill_dir=Path(tmp) / "spill"))
        # Warmed up to what every later step does: the first record connects (through a
        # relay, it learns there whether the relay writes records from a call's values),
        # the second goes as a later one does (through a relay, laying out the step's
        # shape once, relay/values.py).
        for _ in range(2):
            producer.log_step(0, **step_fields(0))
            assert producer.flush(30), "the broker did not take the warm-up record"
        return (lambda i, metrics: producer.log_step(i, **metrics)), producer.close
    if library == FLOOR:
        return (lambda i, metrics: _no_op(i, **metrics)), (lambda: None)
    log, close = _PEERS[library](tmp)
    log(0, peer_metrics(0))
    return log, close


def _tensorboard(tmp: str):
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir=tmp)

    def log(i: int, metrics: dict) -> None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, i)

    return log, writer.close


def _trackio(tmp: str):
    os.environ["TRACKIO_DIR"] = tmp  # read at import
    import trackio

    trackio.init(project="trainmon-bench", auto_log_gpu=False, auto_log_cpu=False)
    return (lambda i, metrics: trackio.log(metrics, step=i)), trackio.finish


def _mlflow(tmp: str):
    # The local file store (no database server), telemetry off (no network here).
    os.environ.update(MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_DISABLE_TELEMETRY="true")
    import mlflow

    mlflow.set_tracking_uri(Path(tmp, "mlruns").as_uri())
    mlflow.start_run()
    return (lambda i, metrics: mlflow.log_metrics(metrics, step=i, synchronous=False)), mlflow.end_run


def _wandb(tmp: str):
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
    import wandb

    run = wandb.init(project="trainmon-bench", dir=tmp, mode="offline")
    return (lambda i, metrics: wandb.log(metrics, step=i)), run.finish


_PEERS = {"tensorboard": _tensorboard, "trackio": _trackio, "mlflow": _mlflow, "wandb": _wandb}


def aligned_start() -> float | None:
    """With ranks sharing a relay: say ready on stdout, then read the time
    (``time.monotonic()``, the same clock in every process) at which every rank starts its
    loop, so that they log each step together, as a data-parallel job's ranks do (each
    step ends in an all-reduce). None when this process runs alone."""
    if not os.environ.get("BENCH_ALIGNED"):
        return None
    print("ready", flush=True)
    return float(sys.stdin.readline())


def run_case(library: str, case: str, seconds: float, bootstrap: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log, close = make_logger(library, bootstrap, tmp)
        metrics = metrics_for(library)
        time.sleep(1.0)  # let start-up work (connections, the first delivery) settle
        start_at = aligned_start()
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.monotonic()))
        clock = time.perf_counter_ns
        timings: list[float] = []
        # (Around the CPU figure, not inside it; the main thread's own count is the loop's.)
        threads_before = thread_activity()
        cpu = ProcessCpu()
        t0 = time.monotonic() if start_at is None else start_at
        if case == "idle":
            time.sleep(seconds)
            steps = 0
        elif case == "tight":
            for i in range(1, TIGHT_CALLS + 1):
                values = metrics(i)
                started = clock()
                log(i, values)
                timings.append((clock() - started) / 1000.0)
            steps = TIGHT_CALLS
        else:
            rate = float(case)
            steps = max(1, int(seconds * rate))
            for i in range(1, steps + 1):
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                values = metrics(i)
                started = clock()
                log(i, values)
                timings.append((clock() - started) / 1000.0)
            time.sleep(max(0.0, t0 + (steps + 1) / rate - time.monotonic()))  # its last interval
        # A tight loop leaves much of its work queued, which is part of its cost. A paced
        # one leaves at most a pack window's records uncounted (2.5 % of them at 10 steps/s),
        # and waiting for quiet would count the library's idle over the wait instead, unevenly
        # (wandb's: ~150 us a step at 1 step/s; TensorBoard's: none).
        settled = case != "tight" or cpu.settle()
        cpu, elapsed = cpu.used_s(), time.monotonic() - t0
        threads = wakeups(threads_before, thread_activity(), elapsed)
        threads.pop(threading.main_thread().name, None)
        close()
    timings.sort()
    return {"cpu_s": cpu, "elapsed_s": elapsed, "steps": steps, "threads": threads, "settled": settled,
            "t0": t0, "t1": t0 + elapsed,  # (CLOCK_MONOTONIC: the same in every process)
            "mean_us": statistics.fmean(timings) if timings else None,
            "p99_us": percentile(timings, 99) if timings else None,
            "same_length_p99_us": same_length_p99(timings) if case == "tight" else None}


def same_length_p99(timings: list[float]) -> float | None:
    """The p99 of a computation that takes as long as the calls' median and does nothing
    else (no allocation, no thread, no lock): what this machine alone adds to a call of
    that length (interrupts, a shared core's other tenants). A caller's p99 cannot be
    below it here. Timed once the library is closed. None for calls too short to tell."""
    def spin(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    clock = time.perf_counter_ns
    median = timings[len(timings) // 2]
    probe = []
    for _ in range(2_000):
        started = clock()
        spin(1_000)
        probe.append((clock() - started) / 1000.0)
    per_step = sorted(probe)[len(probe) // 2] / 1_000
    n = int(median / per_step)
    if n < 10:
        return None
    spun = []
    for _ in range(TIGHT_CALLS):
        started = clock()
        spin(n)
        spun.append((clock() - started) / 1000.0)
    return percentile(sorted(spun), 99)


# -- the driver --------------------------------------------------------------------------

def measure(library: str, case: str, seconds: float, bootstrap: str, client: str,
            relay_ranks: int = RELAY_RANKS, aligned_ranks: bool = True) -> dict:
    env = dict(os.environ, TRAINMON_KAFKA_CLIENT=client)
    command = [sys.executable, __file__, "--one", library, case, str(seconds), bootstrap]
    if library != RELAY:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds + 300)
        if done.returncode != 0:
            raise SystemExit(f"{library} {case} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    ranks = 1 if case == "tight" else relay_ranks  # (tight loops would only fight for the cores)
    with tempfile.TemporaryDirectory(prefix="trainmon-relay-") as tmp:
        path = os.path.join(tmp, "relay.sock")
        relay = subprocess.Popen([sys.executable, "-m", "trainmon", "relay", "--socket", path],
                                 env=dict(env, TRAINMON_KAFKA_BOOTSTRAP=bootstrap),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if relay.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the relay did not start:\n{relay.stderr.read()[-3000:]}")
                time.sleep(0.05)
            aligned = {"BENCH_ALIGNED": "1"} if aligned_ranks and ranks > 1 else {}
            running = [subprocess.Popen(command, env=dict(env, TRAINMON_RELAY=path, BENCH_RANK=str(rank), **aligned),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                       for rank in range(ranks)]
            if aligned:
                for process in running:
                    if process.stdout.readline().strip() != "ready":
                        raise SystemExit(f"{library} {case}: a rank failed to start:\n{process.stderr.read()[-3000:]}")
                start_at = f"{time.monotonic() + 0.5}\n"
                for process in running:
                    process.stdin.write(start_at)
                    process.stdin.flush()
            # The relay's CPU over time, to take the interval every rank measured.
            relay_cpu = [(time.monotonic(), process_cpu_s(relay.pid))]
            while any(p.poll() is None for p in running):
                time.sleep(0.2)
                relay_cpu.append((time.monotonic(), process_cpu_s(relay.pid)))
            outputs = [p.communicate(timeout=60) for p in running]
        finally:
            relay.terminate()
            relay.wait(30)
    for process, (_, err) in zip(running, outputs):
        if process.returncode != 0:
            raise SystemExit(f"{library} {case} failed:\n{err[-3000:]}")
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    relay_s = relay_cpu_while_measured(relay_cpu, results)
    return {**merge_ranks(results, relay_s), "together": bool(aligned)}


def relay_cpu_while_measured(samples: list[tuple[float, float]], results: list[dict]) -> float:
    """The relay's CPU seconds over one rank's measured interval: its CPU per second over
    the interval every rank was measuring (their start-up and close left out, as each
    rank's own are), times that interval's mean length. ``samples``: (monotonic, CPU s)."""
    start, end = max(r["t0"] for r in results), min(r["t1"] for r in results)
    if end <= start:
        raise SystemExit("the ranks sharing the relay did not measure at the same time")

    def cpu_at(t: float) -> float:
        for (t_a, c_a), (t_b, c_b) in zip(samples, samples[1:]):
            if t_a <= t <= t_b:
                return c_a + (c_b - c_a) * (t - t_a) / (t_b - t_a) if t_b > t_a else c_b
        raise SystemExit("the relay's CPU was not sampled over the ranks' interval")

    per_second = (cpu_at(end) - cpu_at(start)) / (end - start)
    return per_second * statistics.fmean(r["elapsed_s"] for r in results)


def merge_ranks(results: list[dict], relay_s: float) -> dict:
    """Ranks that shared a relay -> one rank's figures: its mean CPU plus its share of the
    relay's (``relay_s``: the relay's CPU over one rank's interval); the mean caller time
    and the worst p99."""
    ranks = len(results)
    mean = statistics.fmean
    return {"cpu_s": (sum(r["cpu_s"] for r in results) + relay_s) / ranks,
            "elapsed_s": mean(r["elapsed_s"] for r in results), "steps": mean(r["steps"] for r in results),
            "threads": results[0]["threads"], "ranks": ranks, "relay_cpu_s": relay_s / ranks,
            "settled": all(r.get("settled", True) for r in results),
            "mean_us": mean(r["mean_us"] for r in results) if results[0]["mean_us"] is not None else None,
            "p99_us": max(r["p99_us"] for r in results) if results[0]["p99_us"] is not None else None,
            "same_length_p99_us": max((r.get("same_length_p99_us") or 0 for r in results), default=0) or None}


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of a process, at nanosecond resolution (/proc schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile)
            pass
    return total / 1e9


def per_step_us(r: dict) -> float:
    return r["cpu_s"] / r["steps"] * 1e6


def core_pct(r: dict) -> float:
    return r["cpu_s"] / r["elapsed_s"] * 100


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of each paced and idle case (default 20)")
    parser.add_argument("--client", default="confluent-kafka", choices=["confluent-kafka", "kafka-python"],
                        help="trainmon's transport (default confluent-kafka)")
    parser.add_argument("--relay-ranks", type=int, default=RELAY_RANKS,
                        help="rank processes sharing the relay in the trainmon-relay cases (default %(default)s)")
    parser.add_argument("--relay-ranks-apart", action="store_true",
                        help="start each rank sharing the relay on its own, at its own time, instead of "
                             "every rank logging each step together, as data-parallel ranks do")
    parser.add_argument("--libraries", default=",".join(LIBRARIES),
                        help=f"which to measure, comma-separated (default {','.join(LIBRARIES)})")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"which to measure, comma-separated (default {','.join(CASES)})")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each case, reported by their median (default 1)")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        library, case, seconds, bootstrap = args.one
        print(json.dumps(run_case(library, case, float(seconds), bootstrap)))
        return
    libraries = [name.strip() for name in args.libraries.split(",") if name.strip()]
    unknown = sorted(set(libraries) - set(LIBRARIES))
    if unknown:
        parser.error(f"--libraries: unknown {', '.join(unknown)} (known: {', '.join(LIBRARIES)})")

    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")

    runs: dict[tuple[str, str], list[dict]] = {}
    load_before = load()
    with broker_bootstrap() as bootstrap:
        for repeat in range(args.repeats):
            for case in cases:
                for library in (libraries if repeat % 2 == 0 else libraries[::-1]):
                    print(f"  measuring {library} {case} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
                    run = measure(library, case, args.seconds, bootstrap, args.client,
                                  args.relay_ranks, not args.relay_ranks_apart)
                    if not run.get("settled", True):
                        print(f"  {library} {case}: still busy {SETTLE_TIMEOUT_S:g} s after its loop; "
                              f"its CPU was read as it stood", file=sys.stderr, flush=True)
                    runs.setdefault((library, case), []).append(run)
    results = {key: median_run(case_runs, key[1]) for key, case_runs in runs.items()}
    report(results, libraries, args.client, load_before, load(), cases, runs)


def figure(run: dict, case: str) -> float:
    """A run's figure: % of a core when idle, else CPU us per step."""
    return core_pct(run) if case == "idle" else per_step_us(run)


def median_run(runs: list[dict], case: str) -> dict:
    """The run whose figure is the median (of an even count, the lower of the middle two):
    one run's own figures all reported together (its threads, its caller's p99)."""
    return sorted(runs, key=lambda run: figure(run, case))[(len(runs) - 1) // 2]


def report(results: dict, libraries: list[str], client: str, load_before: str, load_after: str,
           cases: list[str] = CASES, runs: dict | None = None) -> None:
    """``results``: (library, case) -> the run reported (the median one); ``runs``: every
    run of each, printed beside it where there were several."""
    print(f"each case in its own process; CPU = whole process, all threads and child processes; "
          f"trainmon on {client}; {load_before} at the start, {load_after} at the end")
    repeats = max((len(r) for r in (runs or {}).values()), default=1)
    if repeats > 1:
        print(f"each case run {repeats} times, the libraries' order reversed every other round: "
              "the median run reported")
    width = 14
    print(f"  {'case':<16}" + "".join(" " + name.rjust(width - 1) for name in libraries))
    for case in cases:
        label = ("idle (% core)" if case == "idle" else "tight (us/step)" if case == "tight"
                 else f"{case}/s (us/step)")
        spec = ".3f" if case == "idle" else ".0f"
        print(f"  {label:<16}" + "".join(f"{figure(results[(n, case)], case):>{width}{spec}}" for n in libraries))
        if repeats > 1:
            print(f"  {'  (runs)':<16}" + "".join(
                " " + "/".join(format(figure(r, case), spec) for r in runs[(n, case)]).rjust(width - 1)
                for n in libraries))
    if "idle" in cases:
        print("  what wakes when idle (the library's threads in this process; a child process, "
              "wandb's service, not counted): wake-ups/s, CPU us/s")
        for name in libraries:
            threads = sorted(results[(name, "idle")].get("threads", {}).items(), key=lambda t: -t[1][0])
            total = sum(rate for rate, _ in dict(threads).values())
            print(f"    {name:<12} {total:5.1f}/s: " + ", ".join(
                f"{thread} {rate:.2f}/s {cpu:.0f} us/s" for thread, (rate, cpu) in threads if rate >= 0.05))
    for case in [c for c in cases if c != "idle"]:
        label = "tight loop" if case == "tight" else f"{case} steps/s"
        print(f"  caller at {label}, mean / p99 us: " + "; ".join(
            f"{n} {results[(n, case)]['mean_us']:.1f} / {results[(n, case)]['p99_us']:.1f}" for n in libraries))

    if RELAY in libraries:
        shares = "; ".join(f"{case} {results[(RELAY, case)]['relay_cpu_s'] / max(1, results[(RELAY, case)]['steps']) * 1e6:.0f} us"
                           + f" ({results[(RELAY, case)]['ranks']} rank(s)"
                           + (", logging each step together)" if results[(RELAY, case)]["together"] else ")")
                           for case in cases if case != "idle")
        print(f"  {RELAY}: the relay's share per rank step (included above): {shares}")
    for ours in OURS:
        if ours in libraries:
            report_targets(results, libraries, ours, cases)


def report_targets(results: dict, libraries: list[str], ours: str, cases: list[str] = CASES) -> None:
    print(f"targets ({ours}):")
    peers = [n for n in libraries if n in PEERS]
    rates = [case for case in map(str, RATES) if case in cases]
    for case in rates:
        own = per_step_us(results[(ours, case)])
        if peers:
            cheapest = min(peers, key=lambda n: per_step_us(results[(n, case)]))
            ratio = own / per_step_us(results[(cheapest, case)])
            print(f"  CPU per step at {case} steps/s <= 1/2 of the cheapest peer's ({cheapest}): "
                  f"{ratio:.2f}x ({'met' if ratio <= 0.5 else 'MISSED'})")
        if case in ("1", "10") and "wandb" in libraries:
            ratio = own / per_step_us(results[("wandb", case)])
            print(f"  CPU per step at {case} steps/s <= 1/10 of wandb's: {ratio:.2f}x "
                  f"({'met' if ratio <= 0.1 else 'MISSED'})")
    if "idle" in cases:
        idle = core_pct(results[(ours, "idle")])
        print(f"  idle <= 0.02 % of a core: {idle:.3f} % ({'met' if idle <= 0.02 else 'MISSED'})")
    if "tight" in cases:
        tight = results[(ours, "tight")]
        floor = tight.get("same_length_p99_us")
        floor = f"; a bare computation as long as its median call: {floor:.1f} us" if floor else ""
        print(f"  caller p99 <= 20 us (tight loop): {tight['p99_us']:.1f} us "
              f"({'met' if tight['p99_us'] <= 20 else 'MISSED'}{floor})")
    for case in rates:
        p99 = results[(ours, case)]["p99_us"]
        floor = f"; a no-op call's: {results[(FLOOR, case)]['p99_us']:.1f} us" if FLOOR in libraries else ""
        print(f"  caller p99 <= 20 us at {case} steps/s: {p99:.1f} us ({'met' if p99 <= 20 else 'MISSED'}{floor})")


if __name__ == "__main__":
    main()
