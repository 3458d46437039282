"""The samples registry: one record of every kind, every field set, edge values included.

``SAMPLES`` maps each kind of ``RECORD_TYPES`` to the fields of one record (the envelope
aside): NaN / Inf where floats allow them, counts past Int32, a negative temperature, a
CUDA version given as an int. tests/test_record_kinds.py checks that it has exactly the
kinds of RECORD_TYPES and sets every field each model has, so a new kind or field is
round-tripped by the producer and ClickHouse tests as soon as it is sampled here.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from trainmon.schemas import RECORD_TYPES, Record

NAN, INF = math.nan, math.inf
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)

SAMPLES: dict[str, dict] = {
    "step": dict(step=7, epoch=0.5, step_tokens=4096, duration_ms=812.5, loss=NAN, norm=INF, lr=-INF,
                 tokens_per_second=5041.2, total_steps=100, loss_scale=65536.0, params_norm=-INF,
                 num_zeros=3, num_params=7_000_000_000, consumed_samples=896, skipped=1, nan_iterations=0,
                 global_batch_size=128, tflops_per_gpu=INF, sol_percent=41.5, losses={"lm": 2.5, "aux": NAN},
                 timers={"fwd": 100.25, "bwd": INF}),
    "eval": dict(step=8, epoch=0.5, eval_tokens=1024, duration_ms=55.0, loss=INF, tokens_per_second=18618.1,
                 perplexity=INF),
    "moe": dict(step=8, aux_loss=NAN, z_loss=0.001, expert_utilization=0.875, load_imbalance=1.5,
                layer_aux_loss=[0.1, NAN], layer_z_loss=[INF, -INF], layer_utilization=[1.0, 0.75],
                layer_imbalance=[1.0, 2.0]),
    "gpu": dict(step=8, id=3, clock=1980, max_clock=1980, power=699_000, power_limit=700_000, temperature=-3,
                temp_slowdown=87, gpu_util=99, mem_util=40, dram_free=2**40, pcie_rx=10**9, pcie_tx=2 * 10**9,
                fan=0, throttle="sw_power_cap", energy=2**50),
    "allocator": dict(step=8, stats=[dict(name="weights", device=1 << 33, managed=0, pinned=4096, pageable=1),
                                     dict(name="activations", device=5, managed=6, pinned=7, pageable=8)],
                      allocated=1, peak_allocated=2, active=3, inactive=4, reserved=5, peak_reserved=6,
                      alloc_retries=0),
    "dataset": dict(split="eval", files=12, tokens=10**12, file_index=3, chunk_index=9, seed=-42),
    "gpu_model": dict(id=3, name="NVIDIA H100 80GB HBM3", sm_count=132, major=9, minor=0,
                      memory=85_000_000_000, free=84_000_000_000, l2_size=52_428_800, uuid="GPU-1234",
                      ecc=True, cuda_driver=12040, cuda_runtime="12.4"),
    "run": dict(event="start", status="running", name="llama-7b", project="p",
                config={"lr": 3e-4, "layers": [1, 2], "nested": {"x": None, "nan": NAN}},
                hostnames=["node-7", "node-8"], versions={"torch": "2.5.0"},
                reason="restarted after a NCCL watchdog timeout", job_id="slurm-4242"),
    "alert": dict(rule="loss_nan", severity="critical", state="firing", incident_id="inc-1", ranks=[0, 3],
                  step=8, value=NAN, threshold=-INF, message="loss is NaN on ranks 0, 3"),
    "gpu_health": dict(step=8, id=3, ecc_volatile_corrected=1, ecc_volatile_uncorrected=0,
                       ecc_aggregate_corrected=2**40, ecc_aggregate_uncorrected=2,
                       remapped_rows_correctable=4, remapped_rows_uncorrectable=1,
                       remapped_rows_pending=True, remapped_rows_failed=False,
                       retired_pages_single_bit=0, retired_pages_double_bit=5, retired_pages_pending=False,
                       xids=[79, 48, 79], xid_count=3, pcie_replays=123, nvlink_crc_flit_errors=6,
                       nvlink_crc_data_errors=7, nvlink_replay_errors=8, nvlink_recovery_errors=0),
    "checkpoint": dict(step=8, event="saved", path="/ckpt/iter_0000008", bytes=14 * 2**30, duration_ms=INF,
                       free_bytes=2**41, total_bytes=2**43),
    "disk": dict(step=8, path="/ckpt", free_bytes=2**41, total_bytes=2**43, used_bytes=2**42),
    "log_event": dict(level="error", source="nccl", signature="NCCL WARN x <N>", text="NCCL WARN x <59840>",
                      count=2**33, first_step=0, last_step=8),
    "producer_health": dict(step=8, queued=3, in_flight=1, spilled=2**33, held_in_memory=0, sent=2**40,
                            dropped=0, rejected=1, spill_errors=2,
                            spill_error="OSError: [Errno 28] No space left on device", last_sent_age_s=INF),
}


def envelope(i: int, rank: int = 1, run_id: str = "rt-run") -> dict:
    """The envelope of a test record: ``i`` makes its time and event id its own."""
    return dict(run_id=run_id, rank=rank, world_size=4, host="node-7",
                time=T0 + timedelta(seconds=i), event_id=f"ev-{i}")


def sample(kind: str, *leave_out: str) -> dict:
    """A copy of a kind's sample fields, without those named."""
    return {name: value for name, value in SAMPLES[kind].items() if name not in leave_out}


def one_of_each(first: int = 1, rank: int = 1) -> list[Record]:
    """One record of every kind, in RECORD_TYPES order, envelopes ``first``, ``first + 1``, ..."""
    return [RECORD_TYPES[kind](**envelope(first + i, rank), **SAMPLES[kind])
            for i, kind in enumerate(RECORD_TYPES)]


def log_one_of_each(producer, step: int = 1) -> None:
    """Log one record of every kind a training job logs (all but alerts) through the
    producer's log calls, each at ``step`` where the kind has one."""
    run = sample("run", "event", "status", "reason")  # a start: run_start sets the first two
    producer.run_start(**run)
    producer.log_dataset(**sample("dataset"))
    producer.log_gpu_model(**sample("gpu_model"))
    producer.log_step(step, **sample("step", "step"))
    # The model derives an eval's rate and perplexity; log_eval does not take them.
    producer.log_eval(step, **sample("eval", "step", "tokens_per_second", "perplexity"))
    producer.log_moe_stats(step, **sample("moe", "step"))
    producer.log_gpu_state(step, **sample("gpu", "step"))
    producer.log_allocator(step, **sample("allocator", "step"))
    producer.log_gpu_health(step, **sample("gpu_health", "step"))
    producer.log_checkpoint(step, **sample("checkpoint", "step"))
    producer.log_disk(step, **sample("disk", "step"))
    producer.log_event(**sample("log_event"))
    producer.report_health()  # (its fields are the producer's own)
    producer.run_end("success")
