"""One pydantic model per record type.

Field names and units follow Surogate's training logger (mW, degrees C, bytes, bytes/s,
ms) with Megatron's optional step fields (loss scale, params norm, num zeros, ...).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .envelope import Record



class StepRecord(Record):
    kind = "step"

    step: int = Field(ge=0)
    epoch: float = Field(ge=0)
    step_tokens: int = Field(ge=0)
    duration_ms: float = Field(ge=0)
    loss: float
    norm: float  # global grad L2 norm after clipping
    lr: float
    tokens_per_second: Optional[float] = None  # derived: step_tokens / duration
    # Megatron's optional fields.
    total_steps: Optional[int] = Field(default=None, ge=0)
    loss_scale: Optional[float] = None
    params_norm: Optional[float] = None
    num_zeros: Optional[int] = Field(default=None, ge=0)
    num_params: Optional[int] = Field(default=None, ge=0)
    consumed_samples: Optional[int] = Field(default=None, ge=0)
    skipped: Optional[int] = Field(default=None, ge=0)
    global_batch_size: Optional[int] = Field(default=None, ge=0)
    tflops_per_gpu: Optional[float] = None
    sol_percent: Optional[float] = None
    losses: Optional[dict[str, float]] = None
    timers: Optional[dict[str, float]] = None  # name -> ms

    @model_validator(mode="after")
    def _derive(self) -> "StepRecord":
        if self.tokens_per_second is None and self.duration_ms > 0:
            self.tokens_per_second = self.step_tokens * 1000.0 / self.duration_ms
        return self


class EvalRecord(Record):
    kind = "eval"

    step: int = Field(ge=0)
    epoch: float = Field(ge=0)
    eval_tokens: int = Field(ge=0)
    duration_ms: float = Field(ge=0)
    loss: float
    tokens_per_second: Optional[float] = None
    perplexity: Optional[float] = None

    @model_validator(mode="after")
    def _derive(self) -> "EvalRecord":
        if self.tokens_per_second is None and self.duration_ms > 0:
            self.tokens_per_second = self.eval_tokens * 1000.0 / self.duration_ms
        if self.perplexity is None:
            try:
                self.perplexity = math.exp(self.loss)
            except OverflowError:
                self.perplexity = math.inf
        return self


class MoeRecord(Record):
    kind = "moe"

    step: int = Field(ge=0)
    aux_loss: float
    z_loss: float
    expert_utilization: float = Field(ge=0, le=1)  # fraction of experts that got tokens
    load_imbalance: float = Field(ge=1)  # max expert load / mean expert load
    layer_aux_loss: Optional[list[float]] = None
    layer_z_loss: Optional[list[float]] = None
    layer_utilization: Optional[list[float]] = None
    layer_imbalance: Optional[list[float]] = None


class GpuRecord(Record):
    kind = "gpu"

    step: int = Field(ge=0)
    id: int = Field(ge=0)
    clock: int = Field(ge=0)  # MHz
    max_clock: int = Field(ge=0)  # MHz
    power: int = Field(ge=0)  # mW
    power_limit: int = Field(ge=0)  # mW
    temperature: int  # degrees C
    temp_slowdown: int  # degrees C
    gpu_util: int = Field(ge=0, le=100)  # %
    mem_util: int = Field(ge=0, le=100)  # %
    dram_free: int = Field(ge=0)  # bytes
    pcie_rx: int = Field(ge=0)  # bytes/s
    pcie_tx: int = Field(ge=0)  # bytes/s
    fan: int = Field(ge=0, le=100)  # %
    throttle: str = ""  # active clock-throttle reasons, "" when none
    energy: Optional[int] = Field(default=None, ge=0)  # mJ since driver load


class AllocatorSegment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    device: int = Field(ge=0)  # bytes
    managed: int = Field(ge=0)  # bytes
    pinned: int = Field(ge=0)  # bytes
    pageable: int = Field(ge=0)  # bytes


class AllocatorRecord(Record):
    kind = "allocator"

    step: int = Field(ge=0)
    stats: list[AllocatorSegment]
    # torch.cuda.memory_stats(), when the job runs on torch + CUDA.
    allocated: Optional[int] = Field(default=None, ge=0)
    peak_allocated: Optional[int] = Field(default=None, ge=0)
    active: Optional[int] = Field(default=None, ge=0)
    inactive: Optional[int] = Field(default=None, ge=0)
    reserved: Optional[int] = Field(default=None, ge=0)
    alloc_retries: Optional[int] = Field(default=None, ge=0)


class DatasetRecord(Record):
    kind = "dataset"

    split: Literal["train", "eval"]
    files: int = Field(ge=0)
    tokens: int = Field(ge=0)
    file_index: int = Field(default=0, ge=0)
    chunk_index: int = Field(default=0, ge=0)
    seed: int = 0


class GpuModelRecord(Record):
    kind = "gpu_model"

    id: int = Field(default=0, ge=0)
    name: str
    sm_count: int = Field(ge=0)
    major: int = Field(ge=0)
    minor: int = Field(ge=0)
    memory: int = Field(ge=0)  # bytes
    free: int = Field(ge=0)  # bytes
    l2_size: int = Field(ge=0)  # bytes
    uuid: str = ""
    ecc: bool = False
    cuda_driver: str = ""
    cuda_runtime: str = ""

    @field_validator("cuda_driver", "cuda_runtime", mode="before")
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        # CUDA reports versions as ints (12040) or strings ("12.4"); keep both as text.
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class RunRecord(Record):
    kind = "run"

    event: Literal["start", "end"]
    status: Optional[Literal["running", "success", "failed", "aborted"]] = None
    name: Optional[str] = None
    project: Optional[str] = None
    config: dict[str, Any] = Field(default_factory=dict)
    hostnames: list[str] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)  # library -> version

    @model_validator(mode="after")
    def _default_status(self) -> "RunRecord":
        if self.status is None:
            self.status = "running" if self.event == "start" else "success"
        return self


class AlertRecord(Record):
    kind = "alert"

    rule: str
    severity: Literal["info", "warning", "critical"]
    state: Literal["firing", "resolved"]
    incident_id: str  # the same for the firing and the resolved event of one incident
    ranks: list[int] = Field(default_factory=list)
    step: Optional[int] = Field(default=None, ge=0)
    value: Optional[float] = None
    threshold: Optional[float] = None
    message: str
