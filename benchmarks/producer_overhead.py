"""What logging costs a training process: trainmon's ``log_step`` beside ``wandb.log`` (offline).

Each case runs in a process of its own, one after the other, against the same broker:

- whole-process CPU (every thread, plus child processes: wandb's wandb-core service) per
  logged step while the loop logs at 1, 10 and 100 steps/s and sleeps in between, as a
  training loop waits on its GPU;
- idle: CPU while connected and nothing is logged;
- a tight loop of calls back to back: the caller's mean and p99, and CPU per step.

It prints each figure, the ratios trainmon / wandb, and the targets with met / missed.

    .venv/bin/python benchmarks/producer_overhead.py [--seconds 20] [--client kafka-python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import broker_bootstrap, percentile  # noqa: E402

RATES = (1, 10, 100)
TIGHT_CALLS = 20_000


def step_fields(i: int) -> dict:
    return dict(epoch=i / 1e4, step_tokens=524288, duration_ms=812.0, loss=2.0 - i * 1e-6,
                norm=0.9, lr=3e-4)


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

    def used_s(self) -> float:
        own = self._own_s()
        total = own + self._children_s()
        # A child started during the interval counts whole.
        now = self._psutil.Process().children(recursive=True)
        total += self._children_s([c for c in now if c not in self._children])
        return total - self._start


def make_logger(library: str, bootstrap: str, tmp: str):
    """(log(i), close()) for the library, connected and warmed up."""
    if library == "trainmon":
        from trainmon.producer import Producer, ProducerConfig

        producer = Producer(ProducerConfig(bootstrap=bootstrap, run_id="bench",
                                           spill_dir=Path(tmp) / "spill"))
        producer.log_step(0, **step_fields(0))
        assert producer.flush(30), "the broker did not take the warm-up record"
        return (lambda i: producer.log_step(i, **step_fields(i))), producer.close
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
    import wandb

    run = wandb.init(project="trainmon-bench", dir=tmp, mode="offline")

    def log(i: int) -> None:
        f = step_fields(i)
        wandb.log({"train/loss": f["loss"], "train/norm": f["norm"], "train/lr": f["lr"],
                   "train/epoch": f["epoch"], "train/step_tokens": f["step_tokens"],
                   "train/duration_ms": f["duration_ms"]}, step=i)

    log(0)
    return log, run.finish


def run_case(library: str, case: str, seconds: float, bootstrap: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log, close = make_logger(library, bootstrap, tmp)
        time.sleep(1.0)  # let start-up work (connections, the first delivery) settle
        clock = time.perf_counter_ns
        timings: list[float] = []
        cpu, t0 = ProcessCpu(), time.monotonic()
        if case == "idle":
            time.sleep(seconds)
            steps = 0
        elif case == "tight":
            for i in range(1, TIGHT_CALLS + 1):
                started = clock()
                log(i)
                timings.append((clock() - started) / 1000.0)
            steps = TIGHT_CALLS
        else:
            rate = float(case)
            steps = max(1, int(seconds * rate))
            for i in range(1, steps + 1):
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                started = clock()
                log(i)
                timings.append((clock() - started) / 1000.0)
            time.sleep(max(0.0, t0 + (steps + 1) / rate - time.monotonic()))  # its last interval
        cpu, elapsed = cpu.used_s(), time.monotonic() - t0
        close()
    timings.sort()
    return {"cpu_s": cpu, "elapsed_s": elapsed, "steps": steps,
            "mean_us": statistics.fmean(timings) if timings else None,
            "p99_us": percentile(timings, 99) if timings else None}


# -- the driver --------------------------------------------------------------------------

def measure(library: str, case: str, seconds: float, bootstrap: str, client: str) -> dict:
    env = dict(os.environ, TRAINMON_KAFKA_CLIENT=client)
    done = subprocess.run([sys.executable, __file__, "--one", library, case, str(seconds), bootstrap],
                          env=env, capture_output=True, text=True, timeout=seconds + 300)
    if done.returncode != 0:
        raise SystemExit(f"{library} {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_step_us(r: dict) -> float:
    return r["cpu_s"] / r["steps"] * 1e6


def core_pct(r: dict) -> float:
    return r["cpu_s"] / r["elapsed_s"] * 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of each paced and idle case (default 20)")
    parser.add_argument("--client", default="confluent-kafka", choices=["confluent-kafka", "kafka-python"],
                        help="trainmon's transport (default confluent-kafka)")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        library, case, seconds, bootstrap = args.one
        print(json.dumps(run_case(library, case, float(seconds), bootstrap)))
        return

    results: dict[tuple[str, str], dict] = {}
    cases = ["idle", *map(str, RATES), "tight"]
    with broker_bootstrap() as bootstrap:
        for case in cases:
            for library in ("trainmon", "wandb"):
                print(f"  measuring {library} {case} ...", file=sys.stderr, flush=True)
                results[(library, case)] = measure(library, case, args.seconds, bootstrap, args.client)

    print(f"trainmon ({args.client}) beside wandb.log (offline), each case in its own process; "
          f"CPU = whole process, all threads and child processes")
    print(f"  {'case':<16} {'trainmon':>22} {'wandb':>22} {'trainmon / wandb':>18}")
    idle_t, idle_w = results[("trainmon", "idle")], results[("wandb", "idle")]
    print(f"  {'idle, connected':<16} {core_pct(idle_t):>19.3f} %c {core_pct(idle_w):>19.3f} %c "
          f"{core_pct(idle_t) / core_pct(idle_w):>17.2f}x")
    for case in [*map(str, RATES), "tight"]:
        t, w = results[("trainmon", case)], results[("wandb", case)]
        label = "tight loop" if case == "tight" else f"{case} steps/s"
        print(f"  {label:<16} {per_step_us(t):>15.0f} us/step {per_step_us(w):>15.0f} us/step "
              f"{per_step_us(t) / per_step_us(w):>17.2f}x   ({core_pct(t):.2f} % vs {core_pct(w):.2f} % of a core)")
    print("  caller's time per call (tight loop):")
    for library in ("trainmon", "wandb"):
        r = results[(library, "tight")]
        print(f"    {library:<10} mean {r['mean_us']:8.1f} us   p99 {r['p99_us']:8.1f} us")
    for case in map(str, RATES):
        t, w = results[("trainmon", case)], results[("wandb", case)]
        print(f"  caller at {case:>3} steps/s: trainmon mean {t['mean_us']:.1f} us p99 {t['p99_us']:.1f} us; "
              f"wandb mean {w['mean_us']:.1f} us p99 {w['p99_us']:.1f} us")

    print("targets:")
    for case in ("1", "10"):
        ratio = per_step_us(results[("trainmon", case)]) / per_step_us(results[("wandb", case)])
        print(f"  CPU per step at {case} steps/s <= 1/5 of wandb's: {ratio:.2f}x "
              f"({'met' if ratio <= 0.2 else 'MISSED'})")
    idle = core_pct(idle_t)
    print(f"  idle <= 0.05 % of a core: {idle:.3f} % ({'met' if idle <= 0.05 else 'MISSED'})")
    tight = results[("trainmon", "tight")]
    print(f"  tight-loop caller mean <= 10 us: {tight['mean_us']:.1f} us "
          f"({'met' if tight['mean_us'] <= 10 else 'MISSED'})")
    print(f"  tight-loop caller p99 <= 50 us: {tight['p99_us']:.1f} us "
          f"({'met' if tight['p99_us'] <= 50 else 'MISSED'})")


if __name__ == "__main__":
    main()
