"""One pydantic model per record type.

Field names and units follow Surogate's training logger (mW, degrees C, bytes, bytes/s,
ms) with Megatron's optional step fields (loss scale, params norm, num zeros, ...).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from .envelope import Derived, Record

# ClickHouse stores every int field as Int64: a larger value would pass validation here and
# be refused there, far from the caller. So no int field is plain ``int``: each is one of
# these two (or has tighter bounds of its own), and tests/test_producer_never_raises.py
# checks that every int field of every record refuses 2**63.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # non-negative (steps, tokens, bytes, ...)


def _not_negative(value: float) -> float:
    # NaN and +-inf are data (a broken timer, an overflowed epoch counter) and kept, like a
    # NaN loss: ``ge=0`` would refuse NaN and with it the whole record, loss included.
    if value < 0 and math.isfinite(value):
        raise ValueError("must be >= 0 (NaN and +-inf are kept as data)")
    return value


# A float that is >= 0 when finite; NaN, inf and -inf pass.
NonNegativeOrNonFinite = Annotated[float, AfterValidator(_not_negative)]


def _bounded_or_nan(low: float, high: float) -> AfterValidator:
    """Bounds a float that NaN passes (a ratio of nothing: 0 / 0), like NonNegativeOrNonFinite:
    ``Field(ge=.., le=..)`` would refuse NaN and with it the whole record."""
    def check(value: float) -> float:
        if not low <= value <= high and value == value:
            raise ValueError(f"must be between {low} and {high} (NaN is kept as data)")
        return value
    return AfterValidator(check)


Fraction = Annotated[float, _bounded_or_nan(0.0, 1.0)]  # 0..1, or NaN
Imbalance = Annotated[float, _bounded_or_nan(1.0, math.inf)]  # >= 1, or NaN


def _to_the_microsecond(value: float) -> float:
    # A duration is kept to the microsecond, the resolution of every record's time. The
    # digits past it are timer noise (``(time.time() - t0) * 1000`` has 17 of them), and
    # on the broker's disk they were the largest part of a step record: the timers, the
    # step's duration and the tokens/s derived from it took 41 of its 121 bytes,
    # compressed (docs/deploy.md, "Retention and compression"). It runs on the training
    # thread for every duration logged: round(value * 1000) / 1000 takes ~100 ns where
    # round(value, 3) took ~290, and k / 1000 is the float nearest k thousandths, whose
    # repr has at most three decimals. NaN, +-inf and durations beyond 30 years (no
    # digits past the microsecond to drop) are kept as they are.
    if -1e12 < value < 1e12:
        return round(value * 1000.0) / 1000.0
    return value


def _duration(value: float) -> float:
    """_not_negative and _to_the_microsecond in one call: at 1 step/s a log call runs with
    cold caches, where each function it calls costs microseconds."""
    if -1e12 < value < 1e12:
        if value < 0:
            _not_negative(value)  # (raises)
        return round(value * 1000.0) / 1000.0
    return _not_negative(value)


# A duration in milliseconds (kept to the microsecond), and one that is >= 0 when finite.
Milliseconds = Annotated[float, AfterValidator(_to_the_microsecond),
                         Field(description="milliseconds, kept to the microsecond")]
Duration = Annotated[float, AfterValidator(_duration),
                     Field(description="milliseconds, kept to the microsecond; >= 0 unless NaN or infinite")]


def _rate(tokens: int | None, duration_ms: float | None) -> float | None:
    """tokens / second, when both were logged and the duration is a positive number."""
    if tokens is None or duration_ms is None or not (0 < duration_ms < math.inf):
        return None
    return tokens * 1000.0 / duration_ms


def _rate_sql(tokens: str) -> str:
    """:func:`_rate` as ClickHouse computes it: the same IEEE operations, the same value."""
    return (f"if({tokens} IS NOT NULL AND duration_ms > 0 AND duration_ms < inf, "
            f"{tokens} * 1000. / duration_ms, NULL)")


def _rate_description(tokens: str) -> str:
    return f"tokens / s: {tokens} / duration_ms unless given; not written when derived"


class StepRecord(Record):
    kind = "step"

    # Only step and loss are required. The others are None when the framework did not log
    # them (NULL in ClickHouse, no point in W&B / Aim / TensorBoard, "no data" for the alert
    # rules), which is not the same as NaN: logged, and not finite.
    step: Count
    epoch: Optional[NonNegativeOrNonFinite] = None
    step_tokens: Optional[Count] = None
    duration_ms: Optional[Duration] = None
    # Megatron prints no loss for an interval whose iterations were all skipped (fp16
    # overflow): the step is still logged, with its skipped count.
    loss: Optional[float] = None
    norm: Optional[float] = None  # global grad L2 norm before clipping (Megatron's, HF's grad_norm)
    lr: Optional[float] = None
    tokens_per_second: Optional[float] = Field(default=None, description=_rate_description("step_tokens"))
    # Megatron's optional fields.
    total_steps: Optional[Count] = None
    loss_scale: Optional[float] = None
    params_norm: Optional[float] = None
    num_zeros: Optional[Count] = None
    num_params: Optional[Count] = None
    consumed_samples: Optional[Count] = None
    skipped: Optional[Count] = None
    nan_iterations: Optional[Count] = None  # Megatron's "number of nan iterations"
    global_batch_size: Optional[Count] = None
    tflops_per_gpu: Optional[float] = None
    sol_percent: Optional[float] = None
    losses: Optional[dict[str, float]] = None
    timers: Optional[dict[str, Milliseconds]] = None  # name -> ms

    derived = {"tokens_per_second": Derived(lambda r: _rate(r.step_tokens, r.duration_ms),
                                            _rate_sql("step_tokens"))}

    @model_validator(mode="after")
    def _derive(self) -> "StepRecord":
        # (derived["tokens_per_second"], written out: this runs for every step record)
        if self.tokens_per_second is None:
            self.tokens_per_second = _rate(self.step_tokens, self.duration_ms)
        return self


class EvalRecord(Record):
    kind = "eval"

    step: Count
    epoch: Optional[NonNegativeOrNonFinite] = None
    eval_tokens: Optional[Count] = None
    duration_ms: Optional[Duration] = None
    loss: float
    tokens_per_second: Optional[float] = Field(default=None, description=_rate_description("eval_tokens"))
    perplexity: Optional[float] = None

    derived = {"tokens_per_second": Derived(lambda r: _rate(r.eval_tokens, r.duration_ms),
                                            _rate_sql("eval_tokens"))}

    @model_validator(mode="after")
    def _derive(self) -> "EvalRecord":
        if self.tokens_per_second is None:  # (derived["tokens_per_second"])
            self.tokens_per_second = _rate(self.eval_tokens, self.duration_ms)
        if self.perplexity is None:
            try:
                self.perplexity = math.exp(self.loss)
            except OverflowError:
                self.perplexity = math.inf
        return self


class MoeRecord(Record):
    kind = "moe"

    step: Count
    # Logs print some of these and not others (Megatron: the load-balancing loss alone).
    aux_loss: Optional[float] = None
    z_loss: Optional[float] = None
    expert_utilization: Optional[Fraction] = None  # fraction of experts that got tokens
    load_imbalance: Optional[Imbalance] = None  # max expert load / mean expert load
    layer_aux_loss: Optional[list[float]] = None
    layer_z_loss: Optional[list[float]] = None
    layer_utilization: Optional[list[float]] = None
    layer_imbalance: Optional[list[float]] = None


class GpuRecord(Record):
    kind = "gpu"
    low_cardinality = frozenset({"throttle"})
    stream_fields = ("id",)  # one record per GPU of the rank

    step: Count
    id: Count
    clock: Count  # MHz
    max_clock: Count  # MHz
    power: Count  # mW
    power_limit: Count  # mW
    temperature: Int64  # degrees C
    temp_slowdown: Int64  # degrees C
    gpu_util: int = Field(ge=0, le=100)  # %
    mem_util: int = Field(ge=0, le=100)  # %
    dram_free: Count  # bytes
    pcie_rx: Count  # bytes/s
    pcie_tx: Count  # bytes/s
    fan: int = Field(ge=0, le=100)  # %
    throttle: str = ""  # active clock-throttle reasons, "" when none
    energy: Optional[Count] = None  # mJ since driver load


class AllocatorSegment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    low_cardinality: ClassVar[frozenset[str]] = frozenset({"name"})

    name: str
    device: Count  # bytes
    managed: Count  # bytes
    pinned: Count  # bytes
    pageable: Count  # bytes


class AllocatorRecord(Record):
    kind = "allocator"

    step: Count
    stats: list[AllocatorSegment] = Field(default_factory=list)  # none when read from a log
    # torch.cuda.memory_stats(), when the job runs on torch + CUDA.
    allocated: Optional[Count] = None
    peak_allocated: Optional[Count] = None
    active: Optional[Count] = None
    inactive: Optional[Count] = None
    reserved: Optional[Count] = None
    peak_reserved: Optional[Count] = None  # Megatron's "max reserved", torchtitan's memory
    alloc_retries: Optional[Count] = None


class DatasetRecord(Record):
    kind = "dataset"

    split: Literal["train", "eval"]
    files: Count
    tokens: Count
    file_index: Count = 0
    chunk_index: Count = 0
    seed: Int64 = 0


class GpuModelRecord(Record):
    kind = "gpu_model"
    low_cardinality = frozenset({"name", "cuda_driver", "cuda_runtime"})

    id: Count = 0
    name: str
    sm_count: Count
    major: Count
    minor: Count
    memory: Count  # bytes
    free: Count  # bytes
    l2_size: Count  # bytes
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
    low_cardinality = frozenset({"name", "project", "job_id"})

    event: Literal["start", "end"]
    status: Optional[Literal["running", "success", "failed", "aborted"]] = None
    name: Optional[str] = None
    project: Optional[str] = None
    config: dict[str, Any] = Field(default_factory=dict)
    hostnames: list[str] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)  # library -> version
    # Why the run ended, on an end record: "CUDA out of memory", "NCCL watchdog timeout",
    # the last line of a Python traceback. None when not given.
    reason: Optional[str] = None
    # The training job this run is one attempt of: every run of one job across restarts
    # shares it (TRAINMON_JOB_ID, else the Slurm job id, else the torchrun rendezvous id;
    # a log read by trainmon ingest: its session). None: the run is a job of its own.
    # The goodput views group runs by it (docs/goodput.md).
    job_id: Optional[str] = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _default_status(self) -> "RunRecord":
        if self.status is None:
            self.status = "running" if self.event == "start" else "success"
        return self


class AlertRecord(Record):
    kind = "alert"
    low_cardinality = frozenset({"rule"})

    rule: str
    severity: Literal["info", "warning", "critical"]
    state: Literal["firing", "resolved"]
    incident_id: str  # the same for the firing and the resolved event of one incident
    ranks: list[Int64] = Field(default_factory=list)
    step: Optional[Count] = None
    value: Optional[float] = None
    threshold: Optional[float] = None
    message: str


class GpuHealthRecord(Record):
    """One GPU's error counters from NVML, sampled less often than the gpu record
    (``TRAINMON_GPU_HEALTH_INTERVAL_S``, 60 s) and at once when a critical XID arrives.

    A field the GPU does not report (ECC off, no NVLink, row remapping before Ampere,
    page retirement from Ampere on, events refused in a container) is absent (None, NULL
    in ClickHouse), never 0: 0 means "counted, and none"."""

    kind = "gpu_health"
    stream_fields = ("id",)  # one record per GPU of the rank, as the gpu record

    step: Count
    id: Count  # NVML index, as the gpu record's
    # ECC error counts: volatile since the driver loaded, aggregate over the GPU's life.
    ecc_volatile_corrected: Optional[Count] = None
    ecc_volatile_uncorrected: Optional[Count] = None
    ecc_aggregate_corrected: Optional[Count] = None
    ecc_aggregate_uncorrected: Optional[Count] = None
    # Row remapping (Ampere and later): rows remapped for correctable / uncorrectable
    # errors, a remapping waiting for the next GPU reset, a remapping that failed.
    remapped_rows_correctable: Optional[Count] = None
    remapped_rows_uncorrectable: Optional[Count] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failed: Optional[bool] = None
    # Page retirement (before Ampere): pages retired for multiple single-bit / a
    # double-bit ECC error, and pages waiting for the next reset to be retired.
    retired_pages_single_bit: Optional[Count] = None
    retired_pages_double_bit: Optional[Count] = None
    retired_pages_pending: Optional[bool] = None
    # Critical XID errors (NVML events) since this GPU's previous health record, oldest
    # first; None when the GPU's events could not be registered.
    xids: Optional[list[Count]] = None
    xid_count: Optional[Count] = None  # len(xids); NULL where xids is not supported
    pcie_replays: Optional[Count] = None  # PCIe replay counter
    # NVLink data-link error counters, summed over the active links; None without NVLink.
    nvlink_crc_flit_errors: Optional[Count] = None
    nvlink_crc_data_errors: Optional[Count] = None
    nvlink_replay_errors: Optional[Count] = None
    nvlink_recovery_errors: Optional[Count] = None

    @model_validator(mode="after")
    def _derive(self) -> "GpuHealthRecord":
        if self.xid_count is None and self.xids is not None:
            self.xid_count = len(self.xids)
        return self


class CheckpointRecord(Record):
    """A checkpoint save. ``event`` "saved": the save finished (one per save; what
    ``log_checkpoint`` sends by default). "started": a log said a save began (Megatron,
    torchtitan print both lines): a "started" without its "saved" is a save that never
    finished. Formats that print one line per save give a "saved" record for it."""

    kind = "checkpoint"
    stream_fields = ("event",)  # a save's "started" and "saved" share a step

    step: Count
    event: Literal["started", "saved"] = "saved"
    path: Optional[str] = None
    bytes: Optional[Count] = None  # size of what was written
    duration_ms: Optional[Duration] = None
    # The filesystem holding the checkpoint, when the caller measured it.
    free_bytes: Optional[Count] = None
    total_bytes: Optional[Count] = None


class DiskRecord(Record):
    """Space on the filesystem holding the checkpoint directory (TRAINMON_CHECKPOINT_DIR),
    sampled by the producer's disk thread every TRAINMON_DISK_INTERVAL_S and right after
    each ``log_checkpoint``."""

    kind = "disk"

    step: Count  # the latest step the producer had logged (0 before the first)
    path: str  # the checkpoint directory (measured at its nearest existing parent)
    free_bytes: Count  # available to the job (statvfs f_bavail)
    total_bytes: Count
    used_bytes: Count


class LogEventRecord(Record):
    """A warning or error a log printed (NCCL WARN, NCCL / CUDA errors, Python warnings),
    aggregated per rank: repeats of one ``signature`` (the text with numbers, addresses
    and paths masked) are counted, and a record goes out when a signature first appears
    and again at counts 2, 4, 8, ... and at the end of the log, each with the count so far."""

    kind = "log_event"
    low_cardinality = frozenset({"source"})

    level: Literal["warning", "error"]
    source: str  # "nccl", "cuda", "python", "torch", "xid"
    signature: str = Field(max_length=500)
    text: str = Field(max_length=2000)  # the first occurrence, cut
    # (its own bounds: Count's ge=0 would come after a Field(ge=1) here and win)
    count: Annotated[int, Field(ge=1, le=INT64_MAX)]  # occurrences on this rank so far
    first_step: Optional[Count] = None  # the last step logged before the first occurrence
    last_step: Optional[Count] = None  # ... before the latest occurrence


class ProducerHealthRecord(Record):
    """The producer's own health: what waits for Kafka and where, what was lost. Sent by a
    timer on a thread of its own every ``TRAINMON_PRODUCER_HEALTH_INTERVAL_S`` (60; 0: never),
    never by a log call, and once more at close when the run was long enough to send one.

    It travels like every record: while Kafka is away it waits in the spill file with the
    others and arrives once the broker is back, so the records of an outage tell
    afterwards how it went (``spilled`` rising, ``last_sent_age_s`` growing). Counts marked
    "so far" add up from the producer's start; the others are as of the record's time."""

    kind = "producer_health"

    step: Count  # the latest step the producer had logged (0 before the first)
    queued: Count  # records logged and not yet taken by the sender thread
    in_flight: Count  # messages handed to Kafka and not answered yet
    spilled: Count  # records waiting in the spill file for Kafka
    held_in_memory: Count  # records waiting in memory (the spill directory refused them)
    sent: Count  # so far: records handed to Kafka and not reported failed
    dropped: Count  # so far: records lost (neither Kafka, nor the spill file, nor memory took them)
    rejected: Count  # so far: records refused for their values (each said in the job's log)
    spill_errors: Count  # so far: times the spill directory refused records (full, read-only)
    spill_error: Optional[str] = None  # why it refuses them now; None while it takes them
    # Seconds since records last left for Kafka (handed over with nothing waiting before
    # them); None before the first. Grows through an outage, whatever the job logs.
    last_sent_age_s: Optional[NonNegativeOrNonFinite] = None
