"""Shared by the W&B / Aim / TensorBoard forwarder tests: a small two-rank training run
logged through the real producer, the series a forwarder must show for it (names spelled
out here by hand, not derived from trainmon's mapping), and a loop that drives a
forwarder until it has consumed a given number of records."""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainmon.consumers.forwarding import ForwarderStats, ForwardingSink, ProgressStore
from trainmon.consumers.runtime import SinkRuntime
from trainmon.consumers.serving import attach
from trainmon.consumers.stream import RecordStream

MIB = 1024 ** 2
STEPS = 4
CONFIG = {"lr": 3e-4, "model": {"name": "tiny", "layers": 2}}
SEGMENTS = {"weights": 512 * MIB, "gradients": 256 * MIB, "optimizer": 1024 * MIB}


def loss(rank: int, step: int) -> float:
    return 3.0 - 0.25 * step + 0.01 * rank


def gpu_fields(rank: int, step: int) -> dict:
    return dict(id=rank, clock=1500 + step, max_clock=2100, power=300_000 + step, power_limit=400_000,
                temperature=60 + step, temp_slowdown=90, gpu_util=90, mem_util=40,
                dram_free=(8 + step) * MIB * 1024, pcie_rx=3 * MIB, pcie_tx=MIB // 2, fan=0)


def log_run(make_producer, run_id: str, steps=range(STEPS), start=True, end=True) -> int:
    """Log `steps` of a two-rank run; returns how many records were sent."""
    sent = 0
    for rank in (0, 1):
        tm = make_producer(run_id=run_id, rank=rank, world_size=2)
        if start and rank == 0:
            tm.run_start(config=CONFIG, name=f"{run_id}-name", project="trainmon-tests")
            sent += 1
        for step in steps:
            tm.log_step(step, epoch=step / 10, step_tokens=1000, duration_ms=100.0,
                        loss=loss(rank, step), norm=0.5 + step, lr=1e-4 * (step + 1))
            tm.log_gpu_state(step, **gpu_fields(rank, step))
            sent += 2
            if rank == 0:
                tm.log_moe_stats(step, aux_loss=0.01 * step, z_loss=0.001, expert_utilization=0.9,
                                 load_imbalance=1.5)
                sent += 1
        if rank == 0 and STEPS - 1 in steps:
            tm.log_eval(STEPS - 1, epoch=0.3, eval_tokens=2000, duration_ms=200.0, loss=2.5)
            tm.log_allocator(STEPS - 1, [dict(name=n, device=b, managed=0, pinned=0, pageable=0)
                                         for n, b in SEGMENTS.items()])
            sent += 2
        if end and rank == 0:
            tm.run_end("success")
            sent += 1
        assert tm.flush(30)
    return sent


def expected_series(steps=range(STEPS)) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """rank -> Surogate name -> [(step, value)] for what log_run sent (GPU id == rank)."""
    out: dict[int, dict[str, list]] = {0: {}, 1: {}}

    def add(rank, name, step, value):
        out[rank].setdefault(name, []).append((step, float(value)))

    for rank in (0, 1):
        gpu = "gpu/" if rank == 0 else "gpu/1/"
        for step in steps:
            add(rank, "train/loss", step, loss(rank, step))
            add(rank, "train/norm", step, 0.5 + step)
            add(rank, "train/lr", step, 1e-4 * (step + 1))
            add(rank, "train/tokens_per_second", step, 10_000.0)
            add(rank, "train/epoch", step, step / 10)
            add(rank, "train/duration_ms", step, 100.0)
            g = gpu_fields(rank, step)
            for name in ("clock", "max_clock", "power", "power_limit", "temperature", "temp_slowdown",
                         "gpu_util", "mem_util"):
                add(rank, gpu + name, step, g[name])
            add(rank, gpu + "dram_free", step, (8 + step) * 1024)  # MiB
            add(rank, gpu + "pcie_rx", step, 3.0)  # MiB/s
            add(rank, gpu + "pcie_tx", step, 0.5)
            if rank == 0:
                add(0, "train/aux_loss", step, 0.01 * step)
                add(0, "train/z_loss", step, 0.001)
                add(0, "train/expert_utilization", step, 0.9)
                add(0, "train/load_imbalance", step, 1.5)
        if rank == 0 and STEPS - 1 in steps:
            last = STEPS - 1
            add(0, "eval/loss", last, 2.5)
            add(0, "eval/tokens_per_second", last, 10_000.0)
            add(0, "eval/epoch", last, 0.3)
            add(0, "eval/duration_ms", last, 200.0)
            add(0, "eval/perplexity", last, 12.182493960703473)  # e ** 2.5
            for segment, size in SEGMENTS.items():
                add(0, f"allocator/{segment}_mib", last, size / MIB)
    return out


def flat(series_by_rank) -> dict[str, list[tuple[int, float]]]:
    """W&B / TensorBoard spelling: rank r > 0 under rank{r}/."""
    return {(name if rank == 0 else f"rank{rank}/{name}"): points
            for rank, series in series_by_rank.items() for name, points in series.items()}


@dataclass
class Forwarding:
    """A forwarder attached to its runtime, for a test to step."""

    runtime: SinkRuntime

    @property
    def stream(self) -> RecordStream:
        return self.runtime.stream

    @property
    def stats(self) -> ForwarderStats:
        return self.runtime.sink.stats


def make_forwarder(tracker, bootstrap, topic_prefix, group, state_dir, **settings) -> Forwarding:
    sink = ForwardingSink(tracker, ProgressStore(state_dir), linger_ms=200, **settings)
    return Forwarding(attach(sink, group=group, topic_prefix=topic_prefix,
                             env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}))


def make_memory_forwarder(tracker, broker, topic_prefix, group, state_dir, **settings) -> Forwarding:
    """make_forwarder over a MemoryBroker (see trainmon.consumers.memory_stream)."""
    from trainmon.consumers.memory_stream import memory_streams

    sink = ForwardingSink(tracker, ProgressStore(state_dir), linger_ms=20, **settings)
    sink.poll_s = 0.05
    return Forwarding(attach(sink, group=group, topic_prefix=topic_prefix, open_stream=memory_streams(broker)))


class MemoryProducers:
    """A make_producer for log_run whose producers send to a MemoryBroker; ``close()``
    closes them all."""

    def __init__(self, broker, topic_prefix, spill_dir):
        self.broker, self.topic_prefix, self.spill_dir = broker, topic_prefix, spill_dir
        self.made = []

    def __call__(self, **overrides):
        from trainmon.producer import Producer, ProducerConfig

        settings = dict(topic_prefix=self.topic_prefix, run_id="test-run", spill_dir=self.spill_dir, linger_ms=5)
        producer = Producer(ProducerConfig(**{**settings, **overrides}), transport=self.broker.transport)
        self.made.append(producer)
        return producer

    def close(self) -> None:
        for producer in self.made:
            producer.close(timeout=5)


def drain(forwarder: Forwarding, records: int, timeout: float = 60.0) -> None:
    """Drive the forwarder until it consumed `records` more records, then check no more come."""
    target = forwarder.stats.records + records
    deadline = time.monotonic() + timeout
    while forwarder.stats.records < target:
        assert time.monotonic() < deadline, f"forwarded {forwarder.stats.records}, wanted {target}"
        forwarder.runtime.step()
    assert forwarder.runtime.step() == 0, "more records than were sent"


def assert_series(actual: dict[str, list[tuple[int, float]]], expected: dict[str, list[tuple[int, float]]],
                  rel: float = 1e-6) -> None:
    assert sorted(actual) == sorted(expected), (set(actual) ^ set(expected))
    for name, points in expected.items():
        got = sorted(actual[name])
        assert [s for s, _ in got] == [s for s, _ in points], name
        for (step, want), (_, value) in zip(points, got):
            assert abs(value - want) <= rel * max(1.0, abs(want)), (name, step, value, want)
