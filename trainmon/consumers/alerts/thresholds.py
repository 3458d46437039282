"""Threshold rules as data: one entry per rule, in this one place, with its docs.

A threshold rule is a Prometheus-style alerting rule over one field of one record kind:
``<field> <op> <threshold>`` holding for ``fire_after`` records in a row (and
``fire_after_s`` seconds of record time), at a severity. Its settings (``enabled``,
``severity``, ``fire_after``, ``fire_after_s``, ``clear_after``, ``cooldown_s`` and the
threshold under its ``param`` name) come from this table and can be overridden like any
rule's (YAML ``rules: {gpu_memory_low: {min_free_bytes: 2147483648}}`` or
``TRAINMON_ALERT_GPU_MEMORY_LOW_MIN_FREE_BYTES``).

Adding one: an entry in ``THRESHOLD_RULES`` below and a case in
``tests/test_alerts_thresholds.py`` (a record that fires it and its healthy twin); the
rules table of docs/alerts.md is generated from here
(``python -m trainmon.consumers.alerts --write docs/alerts.md``). Rules with real logic (a
baseline of the run's own values, a trend, a warm-up, several ranks) are classes in the
modules of rules/; rules/thresholds.py registers these entries and runs them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
}


@dataclass(frozen=True)
class ThresholdSpec:
    name: str
    kind: str  # the record kind it reads: step, gpu, moe
    field: str  # a field of that record, or "a/b" for the ratio of two fields (b > 0)
    op: str  # one of OPS: bad when ``value <op> threshold``
    threshold: float
    what: str  # what is measured, for the message: "free device memory"
    catches: str  # docs: what going wrong looks like
    checked_on: str  # docs: the real corpus log (tests/data/logs) or the test it was checked on
    param: Optional[str] = "threshold"  # the setting's name; None: a constant, not a setting
    unit: str = ""  # "bytes" (shown in MiB), "%" (a 0-100 value), "fraction" (shown in %)
    severity: str = "warning"
    fire_after: int = 1
    fire_after_s: float = 0.0
    clear_after: int = 1
    cooldown_s: float = 60.0
    per_gpu: bool = False  # one incident per GPU (rank3/gpu0) instead of one per run
    detail: Optional[str] = None  # a field shown in the message as it is (the XID codes)
    # The field is a running count (records dropped since the producer started): judged is
    # its growth since the rank's previous record of the kind, so the incident resolves once
    # it stops growing. A count below the previous one is a new process's, counted from 0.
    running_count: bool = False
    bounds: tuple = ()  # pydantic Field constraints for the setting: (("ge", 0), ("le", 1))

    def value(self, record) -> float | None:
        """The record's value, None when it does not carry it (no data)."""
        num, _, den = self.field.partition("/")
        value = getattr(record, num, None)
        if value is None or not den:
            return value
        base = getattr(record, den, None)
        if not base:  # absent or 0: no ratio
            return None
        return value / base

    def show(self, x: float) -> str:
        if self.unit == "bytes":
            return f"{x / 2**20:,.0f} MiB"
        if self.unit == "%":
            return f"{x:g}%"
        if self.unit == "fraction":
            return f"{100 * x:.3g}%"
        return f"{x:.4g}"


THRESHOLD_RULES: tuple[ThresholdSpec, ...] = (
    ThresholdSpec(
        "dead_gradients", "step", "norm", "==", 0.0, "grad norm", param=None, fire_after=3,
        catches="the grad norm is exactly 0 on several steps in a row: no parameter gets a "
                "gradient (a detached graph, a frozen model, a loss that does not depend on it)",
        checked_on="tests/test_alerts_thresholds.py (no corpus log has one)"),
    ThresholdSpec(
        "zero_loss", "step", "loss", "==", 0.0, "training loss", param=None, severity="critical",
        catches="the training loss is exactly 0: every label masked or ignored, an empty "
                "batch, a loss that is not computed; nothing is learned",
        checked_on="hf-trainer-llamafactory-zero-loss-line-numbered.log (step 20), "
                   "hf-trainer-modernbert-nan-gradnorm-zero-loss.log"),
    ThresholdSpec(
        "nan_iterations", "step", "nan_iterations", ">", 0.0, "NaN iterations (Megatron's "
        "counter)", severity="critical", bounds=(("ge", 0),),
        catches="Megatron counted iterations with a NaN or infinite loss in the logged "
                "interval (`number of nan iterations`), even when the averaged loss it prints "
                "is finite",
        checked_on="tests/test_alerts_thresholds.py; every Megatron log of the corpus prints "
                   "0 (megatron-core-bridge-dsv4-fp8mx-gradnorm-nan-wrapped.log prints 0 next "
                   "to a NaN grad norm, which `non_finite` catches)"),
    ThresholdSpec(
        "num_zeros", "step", "num_zeros/num_params", ">", 0.5, "zero gradients", param="max_fraction",
        unit="fraction", bounds=(("gt", 0), ("le", 1)),
        catches="more than `max_fraction` of the gradient elements are zero (Megatron's "
                "`num zeros` over the parameter count): most of the model gets no gradient",
        checked_on="megatron-core-mixtral-8x7b-moe-lbl.log (num zeros 0: silent)"),
    ThresholdSpec(
        "gpu_underutilized", "gpu", "gpu_util", "<", 50.0, "utilization", param="min_util",
        unit="%", fire_after=3, fire_after_s=60.0, cooldown_s=300.0, per_gpu=True,
        bounds=(("ge", 0), ("le", 100)),
        catches="a GPU busy less than `min_util` % for a minute: the input pipeline, the host "
                "or communication starves it",
        checked_on="tests/test_alerts_thresholds.py (the corpus logs carry no GPU telemetry)"),
    ThresholdSpec(
        "gpu_memory_low", "gpu", "dram_free", "<", float(1 << 30), "free device memory",
        param="min_free_bytes", unit="bytes", per_gpu=True, bounds=(("ge", 0),),
        catches="less than `min_free_bytes` of device memory left: the next larger batch or "
                "activation spike runs out of memory",
        checked_on="tests/test_alerts_thresholds.py (the corpus logs carry no GPU telemetry)"),
    ThresholdSpec(
        "moe_expert_utilization", "moe", "expert_utilization", "<", 0.5,
        "fraction of experts that got tokens", unit="fraction", fire_after=3, cooldown_s=300.0,
        bounds=(("ge", 0), ("le", 1)),
        catches="fewer than half of the experts receive tokens: the router collapsed onto a "
                "few experts",
        checked_on="tests/test_alerts_thresholds.py (no corpus log prints it)"),
    ThresholdSpec(
        "moe_load_imbalance", "moe", "load_imbalance", ">", 3.0, "max / mean expert load",
        fire_after=3, cooldown_s=300.0, bounds=(("ge", 1),),
        catches="the busiest expert gets more than 3x the mean load: its GPU holds up every "
                "step and drops tokens at its capacity",
        checked_on="tests/test_alerts_thresholds.py (no corpus log prints it)"),
    ThresholdSpec(
        "ecc_uncorrected", "gpu_health", "ecc_volatile_uncorrected", ">", 0.0,
        "uncorrected ECC errors since the driver loaded", param=None, severity="critical",
        per_gpu=True, cooldown_s=3600.0,
        catches="a double-bit memory error the GPU could not correct: the data on it may be "
                "wrong and the job will likely crash; drain the GPU (naming GPU, host and rank)",
        checked_on="tests/test_alerts_thresholds.py (NVML values; the corpus logs carry none)"),
    ThresholdSpec(
        "remapped_rows_failed", "gpu_health", "remapped_rows_failed", ">", 0.0,
        "a failed row remapping", param=None, severity="critical", per_gpu=True,
        cooldown_s=3600.0,
        catches="the GPU could not remap a row with an uncorrectable error (Ampere and later): "
                "the memory is bad and the GPU needs service",
        checked_on="tests/test_alerts_thresholds.py (NVML values; the corpus logs carry none)"),
    ThresholdSpec(
        "xid_critical", "gpu_health", "xid_count", ">", 0.0, "critical XID events",
        param=None, severity="critical", per_gpu=True, detail="xids",
        catches="NVML reported critical XID errors (GPU fell off the bus, double-bit ECC, page "
                "retirement, ...) since the GPU's previous health record; the codes are in the "
                "message",
        checked_on="tests/test_alerts_thresholds.py (NVML values; the corpus logs carry none)"),
    ThresholdSpec(
        "checkpoint_disk_low", "disk", "free_bytes", "<", float(50 << 30),
        "free space on the checkpoint filesystem", param="min_free_bytes", unit="bytes",
        cooldown_s=3600.0, bounds=(("ge", 0),),
        catches="less than `min_free_bytes` left where checkpoints are written "
                "(TRAINMON_CHECKPOINT_DIR): the next save fails",
        checked_on="tests/test_alerts_thresholds.py (disk records come from the producer)"),
    ThresholdSpec(
        "producer_dropped_records", "producer_health", "dropped", ">", 0.0,
        "records the producer dropped since its previous health record", param=None, severity="critical",
        cooldown_s=3600.0, running_count=True,
        catches="a rank's producer lost records: Kafka did not take them, the spill directory "
                "could not and memory was at its bound; the run's tables miss them for good. "
                "`dropped` counts from the producer's start: judged is its growth, so the "
                "incident resolves once no more are lost",
        checked_on="tests/test_alerts_thresholds.py (producer_health records, docs/metrics.md)"),
    ThresholdSpec(
        "producer_spill_refused", "producer_health", "held_in_memory", ">", 0.0,
        "records waiting in memory", param=None, cooldown_s=3600.0,
        catches="the spill directory refuses records (full, read-only): those Kafka has not "
                "taken wait in memory, and a rank killed now loses them",
        checked_on="tests/test_alerts_thresholds.py (producer_health records, docs/metrics.md)"),
    ThresholdSpec(
        "producer_not_sending", "producer_health", "last_sent_age_s", ">", 300.0,
        "seconds since records last left for Kafka", param="max_age_s", cooldown_s=3600.0,
        bounds=(("gt", 0),),
        catches="a rank's producer handed nothing to Kafka for `max_age_s` (its own health "
                "records go every minute): Kafka unreachable from the node; records wait in the "
                "spill file and this alert arrives with them, once the broker is back",
        checked_on="tests/test_alerts_thresholds.py (producer_health records, docs/metrics.md)"),
)
BY_NAME = {spec.name: spec for spec in THRESHOLD_RULES}


def describe(spec: ThresholdSpec) -> str:
    """The condition, as the docs table shows it: "`gpu_util` < `min_util`=50 %"."""
    field = " / ".join(f"`{f}`" for f in spec.field.split("/"))
    if spec.running_count:
        field = f"{field}'s growth since the previous record"
    limit = _default(spec)
    limit = f"`{spec.param}`={limit}" if spec.param else limit
    return f"{spec.kind} {field} {spec.op} {limit}"


def _default(spec: ThresholdSpec) -> str:
    x = spec.threshold
    if spec.unit == "bytes":
        return f"{x / 2**30:g} GiB"
    if spec.unit == "%":
        return f"{x:g} %"
    return f"{x:g}"


def markdown_table() -> str:
    """The threshold rules' rows of docs/alerts.md."""
    lines = ["| rule | fires when (defaults) | severity | fire / clear / cooldown | catches | checked on |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in THRESHOLD_RULES:
        debounce = f"{s.fire_after} / {s.clear_after} / {s.cooldown_s:g} s"
        held = f" for `fire_after_s`={s.fire_after_s:g} s" if s.fire_after_s else ""
        per = "; per GPU" if s.per_gpu else ""
        lines.append(f"| `{s.name}` | {describe(s)}{held}{per} | {s.severity} | {debounce} | "
                     f"{s.catches} | {s.checked_on} |")
    return "\n".join(lines)
