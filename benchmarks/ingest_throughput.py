"""``trainmon ingest``: backfill lines/s of a large Megatron log, and follow latency.

    python benchmarks/ingest_throughput.py [--lines 400000] [--follow-steps 200]

1. backfill: a large Megatron log (iteration and timer lines shaped like a corpus log,
   renumbered) read by ``trainmon ingest FILE`` into a real broker. Figures: lines per
   second of wall time, per second of the command's own CPU time (all threads: parsing,
   records, encoding, Kafka), and of wall time with the command pinned to one core
   (taskset), which is the target's "on one core". For reference, the parser alone
   (``--dry-run`` into /dev/null) in the same session.
2. follow: ``trainmon ingest --follow`` on a file a writer appends one step (an iteration
   line and its timer line) to every 50 ms; latency is from the line's write to the
   broker appending the record (the topic uses LogAppendTime), p50 / p99, after one
   warm-up step (the follower's start and first connection are not a line's latency).

Targets (issue "Real training logs in"): backfill >= 50,000 lines/s on one core; follow
p99 <= 500 ms.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import broker_bootstrap, percentile  # noqa: E402
from trainmon.schemas import decode, unpack  # noqa: E402

# A Megatron-LM iteration line and timer line as the corpus has them (the iteration
# number and loss are filled in per step).
ITERATION = (" iteration {step:8d}/  500000 | consumed samples: {samples:12d} | elapsed time per "
             "iteration (ms): {ms:.1f} | learning rate: 1.500E-04 | global batch size:   512 | "
             "lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {norm:.3f} | number of skipped "
             "iterations:   0 | number of nan iterations:   0 |\n")
TIMERS = ("time (ms) | forward-backward: {fb:.2f} | forward-compute: 401.23 | backward-compute: "
          "790.45 | optimizer: 35.12 | batch-generator: 1.20\n")


def write_log(path: Path, lines: int) -> int:
    with open(path, "w") as f:
        f.write("------------------------ arguments ------------------------\n"
                "  seq_length ...................................... 2048\n"
                "  world_size ...................................... 64\n"
                "-------------------- end of arguments ---------------------\n")
        for step in range(1, lines // 2 + 1):
            f.write(ITERATION.format(step=step, samples=step * 512, ms=1200 + step % 50,
                                     loss=2.5 + (step % 100) / 1000, norm=0.8 + step % 7 / 10))
            f.write(TIMERS.format(fb=1190 + step % 40))
    return sum(1 for _ in open(path))


def trainmon(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainmon", "ingest", *args], env=env, **kw)


def timed(*args: str, env: dict, pin: bool = False) -> tuple[float, float]:
    """(wall s, CPU s of the command) for one ``trainmon ingest`` run; ``pin`` runs it on
    one core (taskset), where its threads share that core as they would on a busy node."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    prefix = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[-1])] if pin else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "trainmon", "ingest", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"trainmon ingest failed: {err.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def follow_latency(bootstrap: str, env: dict, tmp: Path, steps: int) -> list[float]:
    from trainmon.kafka_client import Consumer, TopicPartition, create_topics

    prefix = env["TRAINMON_TOPIC_PREFIX"]
    # The broker stamps each message when it appends it (LogAppendTime): "on Kafka" is
    # that stamp, whatever the measuring consumer's own fetch timing adds.
    create_topics([f"{prefix}step"], 4, bootstrap=bootstrap,
                  config={"message.timestamp.type": "LogAppendTime"})
    log = tmp / "live.log"
    log.touch()
    consumer = Consumer(None, bootstrap=bootstrap)
    consumer.assign({TopicPartition(f"{prefix}step", p): 0 for p in range(4)})
    follower = trainmon("--follow", str(log), "--run-id", "live", env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    written: dict[int, float] = {}
    arrived: dict[int, float] = {}
    try:
        with open(log, "a") as f:
            # Step 0 warms up: the follower's start and its producer's first connection
            # (metadata for the topic) are not the per-line latency.
            f.write(ITERATION.format(step=0, samples=0, ms=1200.0, loss=2.5, norm=1.0))
            f.flush()
            deadline = time.monotonic() + 60
            while 0 not in arrived and time.monotonic() < deadline:
                poll(consumer, arrived, timeout_ms=100)
            for step in range(1, steps + 1):
                f.write(ITERATION.format(step=step, samples=step * 512, ms=1200.0, loss=2.5, norm=1.0))
                f.write(TIMERS.format(fb=1190.0))
                f.flush()
                written[step] = time.time()
                end = time.monotonic() + 0.05
                while time.monotonic() < end:
                    poll(consumer, arrived, timeout_ms=int(max(1, (end - time.monotonic()) * 1000)))
        deadline = time.monotonic() + 30
        while len(arrived) <= steps and time.monotonic() < deadline:  # steps 0..steps
            poll(consumer, arrived, timeout_ms=100)
    finally:
        follower.terminate()
        follower.wait(30)
        consumer.close()
    return sorted(arrived[s] - written[s] for s in written if s in arrived)  # step 0 not in written


def poll(consumer, arrived: dict, timeout_ms: int) -> None:
    for message in consumer.poll(timeout_ms / 1000):
        for data in unpack(message.value):
            record = decode("step", data)
            if record.run_id == "live":
                arrived.setdefault(record.step, message.timestamp_ms / 1000.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--follow-steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainmon-ingest-bench-") as tmp_name, \
            broker_bootstrap() as bootstrap:
        tmp = Path(tmp_name)
        log = tmp / "megatron-large.log"
        print(f"writing a Megatron log of {args.lines:,} lines ...", flush=True)
        lines = write_log(log, args.lines)
        env = dict(os.environ, PYTHONPATH=str(REPO), TRAINMON_KAFKA_BOOTSTRAP=bootstrap,
                   TRAINMON_TOPIC_PREFIX=f"b{uuid.uuid4().hex[:8]}.",
                   TRAINMON_SPILL_DIR=str(tmp / "spill"))
        parse_wall, parse_cpu = timed("--dry-run", str(log), env=env)
        wall, cpu = timed(str(log), "--run-id", "backfill", env=env)
        pinned_wall, _ = timed(str(log), "--run-id", "backfill-pinned", env=env,
                               pin=shutil.which("taskset") is not None)
        # Its own topics: the consumer must not first read the backfill's records.
        follow_env = dict(env, TRAINMON_TOPIC_PREFIX=f"f{uuid.uuid4().hex[:8]}.")
        latencies = follow_latency(bootstrap, follow_env, tmp, args.follow_steps)

    print(f"\nbackfill of {lines:,} lines ({lines // 2:,} steps with their timer lines)")
    print(f"  parse only (--dry-run)  {lines / parse_wall:10,.0f} lines/s wall  "
          f"{lines / parse_cpu:10,.0f} lines/s per CPU second")
    print(f"  into Kafka              {lines / wall:10,.0f} lines/s wall  "
          f"{lines / cpu:10,.0f} lines/s per CPU second  ({wall:.1f} s, {cpu:.1f} CPU s)")
    print(f"  into Kafka, one core    {lines / pinned_wall:10,.0f} lines/s wall  "
          f"(taskset to one core: its parsing, sender and Kafka client threads share it)")
    p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
    print(f"\nfollow: {len(latencies)} of {args.follow_steps} steps read back from Kafka; "
          f"line written -> record on Kafka p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
          f"max {max(latencies, default=float('nan')) * 1000:.0f} ms")
    targets = [("backfill into Kafka >= 50,000 lines/s on one core",
                lines / pinned_wall >= 50_000),
               ("follow p99 <= 500 ms", p99 <= 500 and len(latencies) == args.follow_steps)]
    print("\ntargets")
    for name, met in targets:
        print(f"  {'met   ' if met else 'MISSED'}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
