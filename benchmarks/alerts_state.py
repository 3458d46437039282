"""The alerts engine's memory and checkpoint at 16,384 ranks, and per rank as history grows.

The engine in this process (no Kafka: its state is the question), fed a run as
``scale.py`` logs it at that size: a step record per rank every 4 s of record time (loss
with a rank's own noise, the global grad norm, the rank's step time), a GPU record every
10 s; nothing fires. Printed:

- the process's RSS growth over the records (/proc/self/statm, from before the first);
- the checkpoint: its size on disk (checkpoint.save: gzipped JSON), the JSON's size, the
  time to build and write it (what a checkpoint costs; the service pays it in a forked
  child), and the time the service's loop stops for it (``checkpoint.Writer.write``: the
  fork), when this code has the writer;
- per rank, the same at several history lengths (``--history`` steps on ``--history-ranks``
  ranks), to show what grows with history and what does not.

Targets (issue #30): RSS <= 1 GiB and checkpoint <= 50 MB at 16,384 ranks, independent
of history length.

    .venv/bin/python benchmarks/alerts_state.py [--ranks 16384 --steps 150]
    .venv/bin/python benchmarks/alerts_state.py --quick   # 1,024 ranks, 40 steps; history 64 ranks
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainmon.consumers.alerts import checkpoint  # noqa: E402
from trainmon.consumers.alerts.config import load_config  # noqa: E402
from trainmon.consumers.alerts.engine import AlertEngine  # noqa: E402
from trainmon.schemas import GpuRecord, RunRecord, StepRecord  # noqa: E402

STEP_S, GPU_EVERY_S = 4.0, 10.0
RSS_TARGET, CHECKPOINT_TARGET = 2**30, 50e6
UTC = timezone.utc


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Run:
    """A healthy run of ``ranks`` ranks fed to ``engine`` step by step."""

    def __init__(self, engine: AlertEngine, ranks: int, seed: int = 5):
        self.engine, self.ranks, self.rng = engine, ranks, random.Random(seed)
        self.t0, self.step, self.records = time.time() - 86_400, 0, 0
        self.speed = [self.rng.gauss(1.0, 0.01) for _ in range(ranks)]
        for r in range(ranks):
            self.feed(RunRecord(**self.ident(r, "start"), time=self.at(0.0), event="start", status="running"))

    def ident(self, r: int, what: str) -> dict:
        return dict(run_id="state-bench", rank=r, world_size=self.ranks, host=f"node{r // 8:05d}",
                    event_id=f"{what}-{r}-{self.step}")

    def at(self, t: float) -> datetime:
        return datetime.fromtimestamp(self.t0 + t, UTC)

    def feed(self, record) -> None:
        self.engine.process(record)
        self.records += 1

    def steps(self, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            step, end = self.step, (self.step + 1) * STEP_S
            norm = 1.0 + 0.3 * rng.random()
            for r in range(self.ranks):
                t = self.at(end + rng.uniform(0, 0.05))
                ms = 3200.0 * self.speed[r] * rng.gauss(1.0, 0.02)
                self.feed(StepRecord(**self.ident(r, "step"), time=t, step=step, duration_ms=ms,
                                     loss=2.0 + 1.5 * 0.999 ** step + rng.gauss(0, 0.02), norm=norm,
                                     lr=3e-4, step_tokens=8192, loss_scale=1.0,
                                     timers={"forward-backward": 0.9 * ms, "optimizer": 0.1 * ms}))
                if int((end + r) // GPU_EVERY_S) != int((end + r - STEP_S) // GPU_EVERY_S):
                    self.feed(GpuRecord(**self.ident(r, "gpu"), time=t, step=step, id=r % 8, clock=1900,
                                        max_clock=1980, power=600_000, power_limit=700_000,
                                        temperature=65, temp_slowdown=87, gpu_util=97, mem_util=50,
                                        dram_free=2**33, pcie_rx=10**9, pcie_tx=10**9, fan=0,
                                        energy=10**9 + step))
            self.step += 1
            self.engine.tick(self.t0 + end + 1)


def measure_checkpoint(engine: AlertEngine, directory: Path) -> dict:
    # (The hasattr tests let this script measure code from before the gzipped checkpoint
    # and its forked writer, for the reference figures of the same session.)
    path = directory / f"bench{checkpoint.SUFFIX if hasattr(checkpoint, 'SUFFIX') else '.json'}"
    t = time.perf_counter()
    state = engine.dump()
    saved = checkpoint.Checkpoint(engine=state, offsets={}, alert_offsets={}, run_partitions={})
    checkpoint.save(path, saved)
    write_s = time.perf_counter() - t
    out = {"file": path.stat().st_size, "json": len(json.dumps(state, separators=(",", ":"))),
           "write_s": write_s, "stall_s": write_s}
    if hasattr(checkpoint, "Writer"):
        writer = checkpoint.Writer()
        t = time.perf_counter()
        writer.write(path, lambda: checkpoint.Checkpoint(engine=engine.dump(), offsets={}, alert_offsets={},
                                                         run_partitions={}))
        out["stall_s"] = time.perf_counter() - t
        writer.wait()
    return out


def big_run(ranks: int, steps: int, queue) -> None:
    """In a process of its own, so that its RSS growth is the engine's alone."""
    with tempfile.TemporaryDirectory(prefix="trainmon-state-") as tmp:
        base, cpu = rss(), time.process_time()
        engine = AlertEngine(load_config())
        run = Run(engine, ranks)
        run.steps(steps)
        grown, cpu = rss() - base, time.process_time() - cpu
        ck = measure_checkpoint(engine, Path(tmp))
    print(f"  {run.records:,} records, {1e6 * cpu / run.records:.1f} us CPU each (records built included)")
    print(f"  RSS growth {grown / 2**20:,.0f} MiB ({grown / ranks / 1024:.1f} KiB per rank)")
    print(f"  checkpoint {ck['file'] / 1e6:,.1f} MB on disk ({ck['json'] / 1e6:,.1f} MB of JSON), built and "
          f"written in {ck['write_s']:.2f} s; the engine's loop stops {1000 * ck['stall_s']:.0f} ms for it",
          flush=True)
    queue.put((grown, ck["file"]))


def history(ranks: int, lengths: list[int], queue) -> None:
    with tempfile.TemporaryDirectory(prefix="trainmon-state-") as tmp:
        base = rss()
        engine = AlertEngine(load_config())
        run = Run(engine, ranks, seed=6)
        for n in lengths:
            run.steps(n - run.step)
            ck = measure_checkpoint(engine, Path(tmp))
            print(f"  after {n:>5} steps: RSS {(rss() - base) / ranks / 1024:6.1f} KiB, "
                  f"checkpoint {ck['file'] / ranks / 1024:5.2f} KiB on disk "
                  f"({ck['json'] / ranks / 1024:5.1f} KiB of JSON) per rank", flush=True)
    queue.put(None)


def in_own_process(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--steps", type=int, default=150, help="steps of the big run (150: 10 min at 4 s)")
    p.add_argument("--history-ranks", type=int, default=256)
    p.add_argument("--history", default="150,500,1000,2000,4000",
                   help="history lengths (steps) at which to measure per rank")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.steps, args.history_ranks, args.history = 1024, 40, 64, "40,400,1200"
    print(f"{args.ranks:,} ranks x {args.steps} steps (4 s each, GPU every 10 s):", flush=True)
    grown, size = in_own_process(big_run, args.ranks, args.steps)
    print(f"\nper rank as history grows ({args.history_ranks} ranks):", flush=True)
    in_own_process(history, args.history_ranks, [int(x) for x in args.history.split(",")])
    scale = 16384 / args.ranks
    print(f"\ntargets at 16,384 ranks{'' if scale == 1 else f' (scaled from {args.ranks:,})'}:")
    for name, value, target, shown in (("RSS <= 1 GiB", grown * scale, RSS_TARGET, f"{grown * scale / 2**20:,.0f} MiB"),
                                       ("checkpoint <= 50 MB", size * scale, CHECKPOINT_TARGET,
                                        f"{size * scale / 1e6:,.1f} MB")):
        print(f"  {name:<22} {shown:>10}  {'met' if value <= target else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
