"""Records -> named scalars, named as Surogate names them for W&B and Aim.

One mapping shared by the W&B, Aim and TensorBoard forwarders, so the three dashboards
show the same series: train/loss, train/norm, train/lr, train/tokens_per_second,
eval/loss, train/aux_loss, gpu/clock, gpu/power, ... with dram_free in MiB and
pcie_rx / pcie_tx in MiB/s, and allocator/{segment}_mib per allocator segment. GPU health
counters go under gpu/ too (gpu/ecc_volatile_uncorrected, gpu/xid_count, ...; a flag as
0 / 1), a finished checkpoint save as checkpoint/duration_ms and checkpoint/size_mib,
checkpoint free space as disk/free_mib, disk/used_mib, disk/total_mib.

Two spellings of a name, because the backends differ in how they tell series apart:
- ``flat_name`` (W&B, TensorBoard): everything in the name. Rank 0 gets the plain
  Surogate names; rank r > 0 gets a ``rank{r}/`` prefix; a GPU other than id 0 gets
  ``gpu/{id}/{metric}`` (Surogate's W&B names have no GPU id, Surogate's Aim ones do).
- ``aim_name`` (Aim): Surogate's Aim names (``gpu/{id}/{metric}``); the rank and the
  subset go into the Aim context instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas import STEP_KINDS  # noqa: F401 (the forwarders' kinds, derived from the models)
from ..schemas import (AllocatorRecord, CheckpointRecord, DiskRecord, EvalRecord, GpuHealthRecord,
                       GpuRecord, MoeRecord, Record, StepRecord)

MIB = 1024 ** 2

# StepRecord fields forwarded as train/<field>; step_tokens, total_steps and num_params
# are left out as Surogate does (a count per step or a constant, not a curve).
_STEP_FIELDS = ("loss", "norm", "lr", "tokens_per_second", "epoch", "duration_ms",
                "loss_scale", "params_norm", "num_zeros", "consumed_samples", "skipped", "nan_iterations",
                "global_batch_size", "tflops_per_gpu", "sol_percent")
_EVAL_FIELDS = ("loss", "tokens_per_second", "epoch", "duration_ms", "perplexity")
_MOE_FIELDS = ("aux_loss", "z_loss", "expert_utilization", "load_imbalance")
_GPU_FIELDS = ("clock", "max_clock", "power", "power_limit", "temperature", "temp_slowdown",
               "gpu_util", "mem_util", "fan", "energy")
_GPU_MIB_FIELDS = ("dram_free", "pcie_rx", "pcie_tx")  # bytes -> MiB, bytes/s -> MiB/s
_TORCH_MEMORY_FIELDS = ("allocated", "peak_allocated", "active", "inactive", "reserved",
                        "peak_reserved")
# GpuHealthRecord fields forwarded as gpu/<field> (counts; the flags as 0 / 1). The list
# of XID codes is not a curve: xid_count is.
_GPU_HEALTH_FIELDS = ("ecc_volatile_corrected", "ecc_volatile_uncorrected",
                      "ecc_aggregate_corrected", "ecc_aggregate_uncorrected",
                      "remapped_rows_correctable", "remapped_rows_uncorrectable",
                      "remapped_rows_pending", "remapped_rows_failed",
                      "retired_pages_single_bit", "retired_pages_double_bit",
                      "retired_pages_pending", "xid_count", "pcie_replays",
                      "nvlink_crc_flit_errors", "nvlink_crc_data_errors", "nvlink_replay_errors",
                      "nvlink_recovery_errors")
_DISK_MIB_FIELDS = ("free_bytes", "used_bytes", "total_bytes")  # -> disk/free_mib, ...



ENVELOPE = frozenset(Record.model_fields)


@dataclass(frozen=True)
class Scalar:
    metric: str  # Surogate name without rank or GPU id: "train/loss", "gpu/clock", ...
    value: float
    subset: str = "train"  # "train" | "eval", Aim's context
    gpu: int | None = None  # GPU id for gpu/* metrics

    def flat_name(self, rank: int) -> str:
        name = self.metric
        if self.gpu:  # GPU 0 keeps Surogate's plain gpu/<metric>
            name = f"gpu/{self.gpu}/{self.metric.removeprefix('gpu/')}"
        return name if rank == 0 else f"rank{rank}/{name}"

    def aim_name(self) -> str:
        if self.gpu is None:
            return self.metric
        return f"gpu/{self.gpu}/{self.metric.removeprefix('gpu/')}"


def scalars(record: Record) -> list[Scalar]:
    """The scalars of one record; empty for kinds that carry no step (run, dataset, ...)."""
    if isinstance(record, StepRecord):
        out = _fields(record, _STEP_FIELDS, "train/")
        for name, value in (record.losses or {}).items():
            out.append(Scalar(f"train/losses/{name}", float(value)))
        for name, ms in (record.timers or {}).items():
            out.append(Scalar(f"timers/{name}_ms", float(ms)))
        return out
    if isinstance(record, EvalRecord):
        return _fields(record, _EVAL_FIELDS, "eval/", subset="eval")
    if isinstance(record, MoeRecord):
        return _fields(record, _MOE_FIELDS, "train/")
    if isinstance(record, GpuRecord):
        out = [Scalar(f"gpu/{f}", float(v), gpu=record.id) for f in _GPU_FIELDS
               if (v := getattr(record, f)) is not None and not (f == "fan" and v == 0)]
        out += [Scalar(f"gpu/{f}", getattr(record, f) / MIB, gpu=record.id) for f in _GPU_MIB_FIELDS]
        return out
    if isinstance(record, GpuHealthRecord):
        return [Scalar(f"gpu/{f}", float(v), gpu=record.id) for f in _GPU_HEALTH_FIELDS
                if (v := getattr(record, f)) is not None]
    if isinstance(record, CheckpointRecord):
        if record.event != "saved":
            return []
        out = _fields(record, ("duration_ms",), "checkpoint/")
        if record.bytes is not None:
            out.append(Scalar("checkpoint/size_mib", record.bytes / MIB))
        return out  # free space: the disk records' series
    if isinstance(record, DiskRecord):
        return [Scalar(f"disk/{f.removesuffix('_bytes')}_mib", getattr(record, f) / MIB)
                for f in _DISK_MIB_FIELDS]
    if isinstance(record, AllocatorRecord):
        out = [Scalar(f"allocator/{segment.name}_mib", segment.device / MIB)
               for segment in record.stats]
        out += [Scalar(f"allocator/{f}_mib", v / MIB) for f in _TORCH_MEMORY_FIELDS
                if (v := getattr(record, f)) is not None]
        if record.alloc_retries is not None:
            out.append(Scalar("allocator/alloc_retries", float(record.alloc_retries)))
        return out
    if record.per_step():  # a kind with no names of its own above: <kind>/<field>
        return [Scalar(f"{record.kind}/{name}", float(value)) for name in type(record).model_fields
                if name not in ENVELOPE and name != "step"
                and isinstance(value := getattr(record, name), (int, float))]
    return []


def allocator_breakdown(record: AllocatorRecord) -> list[tuple[str, float]]:
    """(segment, device MiB) pairs for the pie chart, largest first."""
    pairs = [(s.name, s.device / MIB) for s in record.stats]
    return sorted(pairs, key=lambda p: -p[1])


def stream_key(record: Record) -> str:
    """The ordered stream a record belongs to within its run: records of one rank, kind
    and the values of the fields its model names in ``stream_fields`` (a GPU's id, a
    checkpoint's event) share a Kafka partition and arrive in the order sent."""
    return "/".join([str(record.rank), record.kind,
                     *(str(getattr(record, field)) for field in record.stream_fields)])


def _fields(record: Record, names: tuple[str, ...], prefix: str, subset: str = "train") -> list[Scalar]:
    return [Scalar(prefix + name, float(value), subset) for name in names
            if (value := getattr(record, name)) is not None]
