"""A small, representative run for the dashboard tests: two ranks, 30 steps, evals, MoE,
GPU, GPU-health, allocator and GPU-model records, checkpoints and the disk they go to,
producer health, warnings from the logs, and alerts (one resolved, two still open). And a bigger run
(BIG_RANKS ranks, more than the dashboards draw one line each for) with rank 7 slow."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from trainmon.schemas import (AlertRecord, AllocatorRecord, CheckpointRecord, DatasetRecord,
                              DiskRecord, EvalRecord, GpuHealthRecord, GpuModelRecord, GpuRecord,
                              LogEventRecord, MoeRecord, ProducerHealthRecord, Record, RunRecord,
                              StepRecord)

RUN_ID = "dash-run"
BIG_RUN_ID = "dash-big"
BIG_RANKS = 24
SLOW_RANK = 7
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
STEPS = 30
RANKS = (0, 1)


def records() -> list[Record]:
    out: list[Record] = []
    ids = iter(range(10**9))

    def env(rank: int, seconds: float) -> dict:
        return dict(run_id=RUN_ID, rank=rank, world_size=len(RANKS), host=f"node-{rank}",
                    time=T0 + timedelta(seconds=seconds), event_id=f"ev-{next(ids)}")

    out.append(RunRecord(**env(0, 0), event="start", name="dash", project="tests",
                         config={"lr": 3e-4}, hostnames=["node-0", "node-1"]))
    out.append(DatasetRecord(**env(0, 0), split="train", files=4, tokens=10**6))
    for rank in RANKS:
        out.append(GpuModelRecord(**env(rank, 0), id=rank, name="NVIDIA H100 80GB HBM3",
                                  sm_count=132, major=9, minor=0, memory=80 * 2**30,
                                  free=79 * 2**30, l2_size=50 * 2**20, uuid=f"GPU-{rank}",
                                  ecc=True, cuda_driver="12.4", cuda_runtime="12.4"))
    for step in range(STEPS):
        t = step + 1.0
        for rank in RANKS:
            stalled = rank == 1 and 20 <= step <= 22
            loss = math.nan if step == 25 else 4.0 - step * 0.05 + rank * 0.01
            out.append(StepRecord(
                **env(rank, t), step=step, epoch=step / STEPS, step_tokens=4096,
                duration_ms=900.0 if stalled else 100.0 + rank, loss=loss,
                norm=25.0 if step == 15 else 1.0, lr=3e-4 * min(1.0, (step + 1) / 10),
                total_steps=100, params_norm=50.0, num_zeros=0, tflops_per_gpu=300.0,
                sol_percent=30.3, timers={"forward": 40.0, "backward": 55.0}))
            out.append(MoeRecord(**env(rank, t), step=step, aux_loss=1.02, z_loss=0.3,
                                 expert_utilization=0.875, load_imbalance=1.6,
                                 layer_aux_loss=[1.01, 1.03], layer_z_loss=[0.2, 0.4],
                                 layer_utilization=[1.0, 0.75], layer_imbalance=[1.2, 1.6]))
            if step % 5 == 0:
                out.append(GpuRecord(
                    **env(rank, t), step=step, id=rank, clock=1755, max_clock=1980,
                    power=650_000, power_limit=700_000, temperature=70 + step // 5, temp_slowdown=87,
                    gpu_util=97, mem_util=40, dram_free=10 * 2**30, pcie_rx=10**6, pcie_tx=2 * 10**6,
                    fan=0, throttle="sw_power_cap,hw_slowdown" if step == 10 else "", energy=10**9 + step))
                out.append(AllocatorRecord(
                    **env(rank, t), step=step,
                    stats=[dict(name=name, device=size, managed=0, pinned=0, pageable=4096)
                           for name, size in (("weights", 2**30), ("gradients", 2**30),
                                              ("optimizer", 2**31), ("activations", 3 * 2**30))],
                    allocated=7 * 2**30, peak_allocated=9 * 2**30, active=7 * 2**30,
                    inactive=2**20, reserved=10 * 2**30, alloc_retries=0))
            if step % 10 == 0:
                out.append(GpuHealthRecord(
                    **env(rank, t), step=step, id=rank, ecc_volatile_corrected=step * rank,
                    ecc_volatile_uncorrected=0, ecc_aggregate_corrected=100 + step * rank,
                    ecc_aggregate_uncorrected=0, remapped_rows_correctable=0,
                    remapped_rows_uncorrectable=0, remapped_rows_pending=False,
                    remapped_rows_failed=False, xids=[79] if (rank, step) == (1, 20) else [],
                    pcie_replays=0))
                out.append(DiskRecord(**env(rank, t), step=step, path="/ckpt", free_bytes=(500 - step) * 2**30,
                                      total_bytes=2**40, used_bytes=2**40 - (500 - step) * 2**30))
                # Rank 1's producer could not reach Kafka around step 20: records spilled.
                out.append(ProducerHealthRecord(
                    **env(rank, t), step=step, queued=0, in_flight=1, spilled=300 if (rank, step) == (1, 20) else 0,
                    held_in_memory=0, sent=100 * step, dropped=0, rejected=0, spill_errors=0,
                    last_sent_age_s=95.0 if (rank, step) == (1, 20) else 0.5))
            if step in (7, 19):
                out.append(LogEventRecord(
                    **env(rank, t), level="warning", source="nccl", count=1 if step == 7 else 4,
                    signature="NCCL WARN NET/IB : Got completion from peer # with status=#",
                    text="NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1234> with status=12",
                    first_step=7, last_step=step))
        if step % 10 == 9:
            out.append(CheckpointRecord(**env(0, t + 0.2), step=step, path=f"/ckpt/iter_{step:07d}",
                                        bytes=40 * 2**30, duration_ms=20_000.0 + 100 * step,
                                        free_bytes=(500 - step) * 2**30, total_bytes=2**40))
            out.append(EvalRecord(**env(0, t + 0.5), step=step, epoch=step / STEPS,
                                  eval_tokens=1024, duration_ms=50.0, loss=3.9 - step * 0.04))
    out += [
        AlertRecord(**env(0, 16), ranks=[0, 1], rule="grad_norm_spike",
                    severity="warning", state="firing", incident_id="inc-spike", step=15,
                    value=25.0, threshold=5.0, message="grad norm 25 is 25x the median"),
        AlertRecord(**env(0, 18), ranks=[0, 1], rule="grad_norm_spike",
                    severity="warning", state="resolved", incident_id="inc-spike", step=17,
                    value=1.0, threshold=5.0, message="grad norm back to normal"),
        AlertRecord(**env(0, 22), ranks=[1], rule="straggler",
                    severity="warning", state="firing", incident_id="inc-straggler", step=21,
                    value=9.0, threshold=2.0, message="rank 1 is 9x slower than the mean"),
        AlertRecord(**env(0, 26), ranks=[0, 1], rule="loss_not_finite",
                    severity="critical", state="firing", incident_id="inc-nan", step=25,
                    value=math.nan, message="loss is NaN"),
    ]
    out.append(RunRecord(**env(0, STEPS + 1), event="end", status="failed"))
    return out + big_run()


def big_run() -> list[Record]:
    out: list[Record] = []
    ids = iter(range(10**9))

    def env(rank: int, seconds: float) -> dict:
        return dict(run_id=BIG_RUN_ID, rank=rank, world_size=BIG_RANKS, host=f"node-{rank // 8}",
                    time=T0 + timedelta(seconds=seconds), event_id=f"big-{next(ids)}")

    out.append(RunRecord(**env(0, 0), event="start", name="big", project="tests"))
    for step in range(6):
        for rank in range(BIG_RANKS):
            ms = 150.0 if rank == SLOW_RANK else 100.0 + rank / 10
            out.append(StepRecord(**env(rank, step + 1.0), step=step, step_tokens=4096, duration_ms=ms,
                                  tokens_per_second=4096 * 1000 / ms, loss=3.0, norm=1.0, lr=1e-4,
                                  total_steps=10))
            out.append(MoeRecord(**env(rank, step + 1.0), step=step, aux_loss=1.0, z_loss=0.1,
                                 expert_utilization=1.0, load_imbalance=1.1 + rank / 100,
                                 layer_aux_loss=[1.0], layer_z_loss=[0.1], layer_utilization=[1.0],
                                 layer_imbalance=[1.1]))
            out.append(GpuRecord(**env(rank, step + 1.0), step=step, id=rank % 8, clock=1700, max_clock=1980,
                                 power=600_000 + rank, power_limit=700_000, temperature=60 + rank % 5,
                                 temp_slowdown=87, gpu_util=95, mem_util=40, dram_free=2**30,
                                 pcie_rx=10**6, pcie_tx=10**6, fan=0, throttle=""))
            out.append(GpuHealthRecord(**env(rank, step + 1.0), step=step, id=rank % 8,
                                       ecc_volatile_corrected=0, ecc_volatile_uncorrected=0))
            out.append(AllocatorRecord(**env(rank, step + 1.0), step=step,
                                       stats=[dict(name="weights", device=2**30, managed=0, pinned=0, pageable=0)],
                                       allocated=2**30, peak_allocated=2**30, active=2**30, inactive=0,
                                       reserved=2**31, alloc_retries=0))
    return out


# A run of 16,384 ranks (Llama 3 405B's size), generated in SQL: 3 steps of every rank,
# WIDE_SLOW_RANK 50 % slower, WIDE_STOPPED_RANK stopped after the first step, an alert
# naming WIDE_ALERT_RANK and one naming every rank. For the template variables: how many
# options they list for a run this wide.
WIDE_RUN_ID = "dash-wide"
WIDE_RANKS = 16_384
WIDE_STEPS = 3
WIDE_SLOW_RANK, WIDE_STOPPED_RANK, WIDE_ALERT_RANK = 9_001, 123, 16_000


def wide_run_sql(db: str = "trainmon") -> list[str]:
    t0 = T0.strftime("%Y-%m-%d %H:%M:%S")
    envelope = (f"'{WIDE_RUN_ID}', number % {WIDE_RANKS} AS r, {WIDE_RANKS}, concat('node-', toString(intDiv(r, 8))), "
                f"toDateTime64('{t0}', 6, 'UTC') + toIntervalSecond(intDiv(number, {WIDE_RANKS}) + 1)")

    def alert(ranks: str, event_id: str) -> str:
        return (f"INSERT INTO {db}.alert (run_id, rank, world_size, host, time, event_id, rule, severity, state, "
                f"incident_id, ranks, step, message) SELECT {envelope}, '{event_id}', 'straggler', 'warning', "
                f"'firing', '{event_id}', {ranks}, 1, 'slow' FROM numbers(1)")

    return [
        f"INSERT INTO {db}.step (run_id, rank, world_size, host, time, event_id, step, duration_ms, loss, "
        f"tokens_per_second, step_tokens) SELECT {envelope}, concat('wide-', toString(number)), "
        f"intDiv(number, {WIDE_RANKS}) AS s, if(r = {WIDE_SLOW_RANK}, 150, 100 + r % 7) AS ms, 3.0, "
        f"4096 * 1000 / ms, 4096 FROM numbers({WIDE_RANKS * WIDE_STEPS}) "
        f"WHERE NOT (r = {WIDE_STOPPED_RANK} AND s > 0)",
        alert(f"[{WIDE_ALERT_RANK}]", "wide-alert-1"),
        alert(f"range({WIDE_RANKS})", "wide-alert-all"),
    ]
