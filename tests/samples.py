"""One valid set of fields per record kind, NaN / Inf included where floats allow it."""

from __future__ import annotations

import math

NAN, INF = math.nan, math.inf

STEP = dict(epoch=0.25, step_tokens=524288, duration_ms=812.5, loss=NAN, norm=INF, lr=3e-4,
            total_steps=1000, loss_scale=65536.0, params_norm=-INF, num_zeros=12, num_params=1000,
            consumed_samples=2048, skipped=0, global_batch_size=256, tflops_per_gpu=412.5,
            sol_percent=41.7, losses={"lm": 2.5, "aux": NAN}, timers={"forward": 120.5, "backward": INF})
EVAL = dict(epoch=0.5, eval_tokens=65536, duration_ms=1500.0, loss=2.25)
MOE = dict(aux_loss=0.012, z_loss=NAN, expert_utilization=0.875, load_imbalance=1.4,
           layer_aux_loss=[0.01, INF], layer_utilization=[1.0, 0.75])
GPU = dict(id=0, clock=1980, max_clock=1980, power=650123, power_limit=700000, temperature=71,
           temp_slowdown=87, gpu_util=97, mem_util=64, dram_free=12 * 2**30, pcie_rx=1_200_000,
           pcie_tx=900_000, fan=0, throttle="sw_power_cap", energy=123456789)
ALLOCATOR = dict(stats=[{"name": "weights", "device": 2**30, "managed": 0, "pinned": 0, "pageable": 0},
                        {"name": "activations", "device": 3 * 2**30, "managed": 0, "pinned": 2**20,
                         "pageable": 4096}],
                 allocated=4 * 2**30, peak_allocated=6 * 2**30, active=4 * 2**30, inactive=2**20,
                 reserved=8 * 2**30, alloc_retries=0)
DATASET = dict(files=16, tokens=10**9, file_index=3, chunk_index=7, seed=42)
GPU_HEALTH = dict(id=0, ecc_volatile_corrected=3, ecc_volatile_uncorrected=0,
                  ecc_aggregate_corrected=17, ecc_aggregate_uncorrected=1,
                  remapped_rows_correctable=2, remapped_rows_uncorrectable=0,
                  remapped_rows_pending=False, remapped_rows_failed=False, xids=[79, 48],
                  pcie_replays=5, nvlink_crc_flit_errors=12, nvlink_replay_errors=0)
CHECKPOINT = dict(path="/ckpt/iter_0000007", bytes=14 * 2**30, duration_ms=INF,
                  free_bytes=2 * 2**40, total_bytes=8 * 2**40)
DISK = dict(path="/ckpt", free_bytes=2 * 2**40, total_bytes=8 * 2**40, used_bytes=6 * 2**40)
LOG_EVENT = dict(count=3, signature="NCCL WARN socketProgress: Connection closed by remote peer",
                 first_step=5, last_step=7)
GPU_MODEL = dict(name="NVIDIA H100 80GB HBM3", sm_count=132, major=9, minor=0, memory=80 * 2**30,
                 free=79 * 2**30, l2_size=50 * 2**20, uuid="GPU-1234", ecc=True,
                 cuda_driver=12040, cuda_runtime="12.4")


def log_one_of_each(producer, step: int = 1) -> None:
    """Log one record of every kind a training job logs."""
    producer.run_start(config={"model": "llama-1b", "lr": 3e-4, "layers": [1, 2]}, name="demo",
                       hostnames=["node-0"], versions={"torch": "2.13"})
    producer.log_dataset("train", **DATASET)
    producer.log_gpu_model(**GPU_MODEL)
    producer.log_step(step, **STEP)
    producer.log_eval(step, **EVAL)
    producer.log_moe_stats(step, **MOE)
    producer.log_gpu_state(step, **GPU)
    producer.log_allocator(step, **ALLOCATOR)
    producer.log_gpu_health(step, **GPU_HEALTH)
    producer.log_checkpoint(step, **CHECKPOINT)
    producer.log_disk(step, **DISK)
    producer.log_event("warning", "nccl", "NCCL WARN socketProgress: Connection closed by "
                       "remote peer node-2<59840>", **LOG_EVENT)
    producer.run_end("success")
