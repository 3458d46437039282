"""GPU telemetry for the framework callbacks, as W&B's system metrics come with its
callbacks: nothing to add to the training code.

- ``start``: the run's gpu_model record (CUDA only) and a GpuSampler (NVML every
  TRAINMON_GPU_INTERVAL_S seconds; it turns itself off with one line without a GPU or
  nvidia-ml-py, and 0 turns it off);
- ``step``: the latest step for the sampler's records, and on CUDA an allocator record
  (torch.cuda's counters and, given the model and optimizer, their segments), at the
  callback's logging cadence;
- ``stop``: the sampler's thread ends.

A job without CUDA sends none of these (the sampler reads NVML, not torch)."""

from __future__ import annotations

from typing import Any

import torch

from .nvml import GpuSampler
from .torch import allocator_fields, gpu_model_fields


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class GpuTelemetry:
    def __init__(self, producer: Any):
        self.producer = producer
        self.sampler: GpuSampler | None = None

    def start(self) -> None:
        if self.sampler is not None:
            return  # (a Trainer's train() called again: one sampler)
        fields = gpu_model_fields()
        if fields is not None:
            self.producer.log_gpu_model(**fields)
        self.sampler = GpuSampler(self.producer).start()

    def step(self, step: int, model: Any = None, optimizer: Any = None) -> None:
        if self.sampler is not None:
            self.sampler.set_step(step)
        if _cuda_in_use():
            if not isinstance(getattr(optimizer, "state", None), dict):
                optimizer = None  # a wrapper without torch's per-parameter state: no segment
            self.producer.log_allocator(step, **allocator_fields(model, optimizer))

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
