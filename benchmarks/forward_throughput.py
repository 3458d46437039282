"""Throughput of the W&B (offline), Aim and TensorBoard forwarders: records per second
from Kafka to durable local artefacts, and the cost of a full replay (every record
skipped by the high-water marks).

One run, one rank: per step a step record, a GPU record and a MoE record (about 25
scalars per step). Each sink reads the same topics in its own consumer group.

    .venv/bin/python benchmarks/forward_throughput.py [--steps 2000] [--sinks tensorboard,aim,wandb]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import broker_bootstrap  # noqa: E402

from trainmon.consumers.forwarding import ForwardingSink, ProgressStore  # noqa: E402
from trainmon.consumers.serving import attach  # noqa: E402
from trainmon.producer import Producer, ProducerConfig  # noqa: E402


def produce(bootstrap: str, prefix: str, steps: int, spill: Path) -> int:
    tm = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="bench-run",
                                 spill_dir=spill))
    tm.run_start(config={"lr": 1e-4})
    for step in range(steps):
        tm.log_step(step, epoch=step / steps, step_tokens=4096, duration_ms=120.0, loss=3.0 / (1 + step),
                    norm=0.5, lr=1e-4)
        tm.log_gpu_state(step, id=0, clock=1500, max_clock=2100, power=300_000, power_limit=400_000,
                         temperature=70, temp_slowdown=90, gpu_util=95, mem_util=50, dram_free=8 << 30,
                         pcie_rx=1 << 20, pcie_tx=1 << 20, fan=40)
        tm.log_moe_stats(step, aux_loss=0.01, z_loss=0.001, expert_utilization=0.9, load_imbalance=1.4)
    tm.run_end()
    assert tm.flush(60)
    tm.close()
    return 3 * steps + 2


def make_sink(name: str, root: Path):
    if name == "tensorboard":
        from trainmon.consumers.tensorboard_sink import TensorBoardSink
        sink = TensorBoardSink(root)
        return sink, root / ".trainmon-forwarder"
    if name == "aim":
        from trainmon.consumers.aim_sink import AimSink
        sink = AimSink(root)
        return sink, root / ".trainmon-forwarder"
    from trainmon.consumers.wandb_sink import WandbSink
    sink = WandbSink(directory=root, mode="offline")
    return sink, root / ".trainmon-forwarder"


def forward(name: str, root: Path, bootstrap: str, prefix: str, records: int) -> tuple[float, ForwardingSink]:
    tracker, state = make_sink(name, root)
    forwarder = ForwardingSink(tracker, ProgressStore(state), linger_ms=200)
    runtime = attach(forwarder, group=f"bench-{name}-{uuid.uuid4().hex[:6]}", topic_prefix=prefix,
                     env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    started = None
    while forwarder.stats.records < records:
        if runtime.step() and started is None:
            started = time.perf_counter()
    tracker.close()
    elapsed = time.perf_counter() - started
    runtime.stream.close()
    return elapsed, forwarder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sinks", default="tensorboard,aim,wandb")
    args = parser.parse_args()
    with broker_bootstrap() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        records = produce(bootstrap, prefix, args.steps, Path(tmp) / "spill")
        print(f"{records} records ({args.steps} steps x step+gpu+moe, ~25 scalars per step)")
        for name in args.sinks.split(","):
            root = Path(tmp) / name
            first, fwd = forward(name, root, bootstrap, prefix, records)
            replay, again = forward(name, root, bootstrap, prefix, records)
            print(f"{name:12s} forward {records / first:9.0f} records/s ({first:6.2f} s, "
                  f"{fwd.stats.batches} batches, {fwd.stats.seconds_in_sink:5.2f} s in the sink) | "
                  f"replay {records / replay:9.0f} records/s, {again.stats.skipped} skipped")


if __name__ == "__main__":
    main()
