"""Alert rule settings: defaults from the healthy ranges, one YAML file, env overrides.

Precedence: built-in defaults < the YAML file (``--config`` or TRAINMON_ALERT_CONFIG)
< environment variables. Env vars are ``TRAINMON_ALERT_<SETTING>`` for the engine-wide
settings and ``TRAINMON_ALERT_<RULE>_<PARAM>`` for a rule, both upper case, e.g.
``TRAINMON_ALERT_GRAD_SPIKE_FACTOR=8`` or ``TRAINMON_ALERT_GPU_THROTTLE_ENABLED=false``.
Lists (``ignore``) are comma separated. Every name and value is validated; a mistake is
reported with the file key or env var that holds it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from .thresholds import THRESHOLD_RULES, ThresholdSpec

Severity = Literal["info", "warning", "critical"]
ENV_PREFIX = "TRAINMON_ALERT_"
CONFIG_ENV = "TRAINMON_ALERT_CONFIG"


class RuleConfig(BaseModel):
    """Settings every rule has. A condition must hold for ``fire_after`` observations in a
    row (and ``fire_after_s`` seconds of record time) to fire; ``clear_after`` healthy
    observations resolve it; after resolving, the same incident waits ``cooldown_s``
    before it may fire again. ``escalate_factor``: while an incident is open, a value that
    many times worse than the one it fired with notifies again (the open incident resolves
    as superseded and a new one fires); None: never."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    severity: Severity = "warning"
    fire_after: int = Field(1, ge=1)
    fire_after_s: float = Field(0.0, ge=0)
    clear_after: int = Field(1, ge=1)
    cooldown_s: float = Field(60.0, ge=0)
    escalate_factor: Optional[float] = Field(None, gt=1)


# -- grad norm ----------------------------------------------------------------------------

class GradSpike(RuleConfig):
    # norm >= factor x the median of the run's last `window` accepted norms (from
    # `min_samples` on) and a robust z-score >= min_z over them; or >= jump x that median
    # from the first earlier record on (an order-of-magnitude jump needs no statistics).
    factor: float = Field(3.0, gt=1)
    jump: float = Field(10.0, gt=1)
    min_z: float = Field(3.5, ge=0)
    window: int = Field(50, ge=3)
    min_samples: int = Field(3, ge=1)
    escalate_factor: Optional[float] = Field(10.0, gt=1)


class ExplodingGrad(RuleConfig):
    severity: Severity = "critical"
    factor: float = Field(10.0, gt=1)  # norm >= factor x the run's own median ...
    window: int = Field(50, ge=1)
    fire_after: int = Field(3, ge=1)  # ... on this many records in a row
    escalate_factor: Optional[float] = Field(10.0, gt=1)


class NonFinite(RuleConfig):
    severity: Severity = "critical"


class FrozenGradNorm(RuleConfig):
    repeats: int = Field(5, ge=2)  # the same grad norm on this many new steps in a row


# -- loss ----------------------------------------------------------------------------------

class LossSpike(RuleConfig):
    # loss >= (1 + rise) x the median of the last `window` accepted losses (from
    # `min_samples` on) with a robust z-score >= min_z, on `fire_after` records in a row;
    # or >= (1 + jump) x that median on one record, from the first earlier record on.
    rise: float = Field(0.2, gt=0)
    jump: float = Field(1.0, gt=0)
    min_z: float = Field(3.5, ge=0)
    window: int = Field(50, ge=3)
    min_samples: int = Field(3, ge=1)
    fire_after: int = Field(2, ge=1)


class LossDivergence(RuleConfig):
    # The median of the newer half of the last `window` losses is >= (1 + rise) x the lowest
    # such median of the run so far, and above the older half's: a sustained rise.
    rise: float = Field(0.1, gt=0)
    window: int = Field(20, ge=4)
    clear_after: int = Field(5, ge=1)
    cooldown_s: float = Field(600.0, ge=0)


class LossPlateau(RuleConfig):
    severity: Severity = "info"
    window: int = Field(1000, ge=4)  # compares the median of its newer half with its older
    min_decrease: float = Field(0.0, ge=0)  # fraction the loss must fall by, half to half
    fire_after: int = Field(50, ge=1)
    clear_after: int = Field(50, ge=1)
    cooldown_s: float = Field(3600.0, ge=0)


class FrozenLoss(RuleConfig):
    severity: Severity = "critical"
    repeats: int = Field(8, ge=2)  # the same non-zero loss on this many new steps in a row


class EvalLossSpike(RuleConfig):
    rise: float = Field(0.1, gt=0)  # eval loss >= (1 + rise) x the median of recent evals
    window: int = Field(5, ge=2)
    min_samples: int = Field(2, ge=1)


class EvalDivergence(RuleConfig):
    # eval loss >= (1 + rise) x its best so far while the train loss (median of the last
    # `train_window` step losses) is below what it was at that best eval: overfitting.
    rise: float = Field(0.02, gt=0)
    train_window: int = Field(20, ge=1)
    fire_after: int = Field(2, ge=1)  # evals in a row
    clear_after: int = Field(1, ge=1)


# -- fp16 loss scaling, skipped iterations --------------------------------------------------

class LossScaleCollapse(RuleConfig):
    # fp16 only (a run whose loss scale was ever other than 1.0; bf16 prints a constant 1.0):
    # the scale fell to <= max over the last `window_steps` iterations / drop_factor, or to
    # <= min_scale; not judged before iteration `warmup_steps` (the scaler calibrates).
    severity: Severity = "critical"
    drop_factor: float = Field(8.0, gt=1)
    window_steps: int = Field(100, ge=1)
    min_scale: float = Field(1.0, gt=0)
    warmup_steps: int = Field(100, ge=0)
    escalate_factor: Optional[float] = Field(10.0, gt=1)


class SkippedIterations(RuleConfig):
    # >= max_skipped iterations skipped within the last `window_steps` iterations;
    # before iteration `warmup_steps` (fp16 loss-scale calibration) at severity info.
    severity: Severity = "critical"
    max_skipped: int = Field(3, ge=1)
    window_steps: int = Field(100, ge=1)
    warmup_steps: int = Field(100, ge=0)


# -- speed ----------------------------------------------------------------------------------

class RankMismatch(RuleConfig):
    severity: Severity = "critical"
    grace_s: float = Field(60.0, gt=0)
    min_steps_behind: int = Field(1, ge=1)


class Straggler(RuleConfig):
    factor: float = Field(1.3, gt=1)  # step time > factor x median of all ranks at that step
    min_ranks: int = Field(3, ge=2)
    timer: Optional[str] = None  # compare timers[timer] instead of duration_ms
    # A step still missing ranks this long (record time) after its first report is judged
    # with the ranks it has; the missing ones are not waited for until they report again.
    wait_s: float = Field(30.0, gt=0)
    # An open incident resolves once the rank's step time is back within clear_factor x
    # the median (None: halfway between 1 and factor, 1.15 for 1.3): no flapping on jitter.
    clear_factor: Optional[float] = Field(None, gt=1)
    fire_after: int = Field(5, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class IterationTimeSpike(RuleConfig):
    severity: Severity = "info"
    factor: float = Field(3.0, gt=1)  # step time > factor x median of the last `window`
    window: int = Field(50, ge=2)
    # The first steps of a run (compilation, allocator and data-loader warm-up, ranks
    # settling into lockstep) are no steady state to compare with.
    min_samples: int = Field(10, ge=1)
    fire_after: int = Field(3, ge=1)


class ThroughputDrop(RuleConfig):
    # tokens/s, else TFLOP/s, else samples (global batch) / step time, < (1 - drop) x the
    # median of the last `window` records measured the same way.
    drop: float = Field(0.25, gt=0, lt=1)
    window: int = Field(50, ge=2)
    min_samples: int = Field(3, ge=1)
    fire_after: int = Field(2, ge=1)
    fire_after_s: float = Field(60.0, ge=0)


class LrZero(RuleConfig):
    after_step: int = Field(100, ge=0)  # warmup: lr may be 0 before this step
    final_fraction: float = Field(0.01, ge=0, lt=1)  # schedules may reach 0 at the very end
    fire_after: int = Field(3, ge=1)


class Stalled(RuleConfig):
    severity: Severity = "critical"
    factor: float = Field(10.0, gt=1)  # no new step for factor x median step time ...
    min_s: float = Field(300.0, gt=0)  # ... and at least this long


class RunFailed(RuleConfig):
    severity: Severity = "critical"  # an aborted run (cancelled): warning


# -- GPU, MoE -----------------------------------------------------------------------------------

class GpuTemperature(RuleConfig):
    margin_c: float = Field(0.0, ge=0)  # fire at temp_slowdown - margin_c
    clear_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class GpuThrottle(RuleConfig):
    ignore: list[str] = Field(default_factory=lambda: ["app_clocks", "display_clocks", "sync_boost"])
    clear_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)

    @field_validator("ignore", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


class MoeRouterLoss(RuleConfig):
    # The router loss >= (1 + rise) x the median of its last `window` values (from
    # `min_samples` on): its scale depends on the framework (Megatron's load-balancing loss
    # sits near 1.0 when balanced, others report it times a coefficient), so it is judged
    # against the run's own level.
    rise: float = Field(0.5, gt=0)
    window: int = Field(100, ge=3)
    min_samples: int = Field(3, ge=1)
    fire_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class MoeAuxLoss(MoeRouterLoss):
    pass


class MoeZLoss(MoeRouterLoss):
    rise: float = Field(1.0, gt=0)


# -- GPU health, checkpoints, warnings in the log (health.py) ---------------------------------

class EccCorrectedRising(RuleConfig):
    # Corrected (single-bit) ECC errors at >= max_per_hour, measured over the GPU's health
    # records of the last `window_s` once they span `min_span_s`: memory going bad, usually
    # before the uncorrected error that ends the job.
    max_per_hour: float = Field(100.0, gt=0)
    window_s: float = Field(3600.0, gt=0)
    min_span_s: float = Field(300.0, gt=0)
    cooldown_s: float = Field(3600.0, ge=0)


class CheckpointOverdue(RuleConfig):
    # No checkpoint saved for more than `max_steps` steps or `max_minutes` of record time
    # (either, when set), else for more than `factor` x the run's own median interval in
    # steps between its saves (learned from its first two saves on).
    max_steps: Optional[int] = Field(None, ge=1)
    max_minutes: Optional[float] = Field(None, gt=0)
    factor: float = Field(2.0, gt=1)
    cooldown_s: float = Field(600.0, ge=0)


class CheckpointSlow(RuleConfig):
    # A save that took >= factor x the median duration of the run's last `window` saves
    # (from `min_samples` saves) and at least `min_extra_s` longer than it.
    factor: float = Field(3.0, gt=1)
    min_extra_s: float = Field(30.0, ge=0)
    window: int = Field(20, ge=2)
    min_samples: int = Field(2, ge=1)


class CheckpointDiskFilling(RuleConfig):
    # The checkpoint filesystem has room for fewer than `min_saves_left` more checkpoints
    # of the run's latest size; the message projects the time to full at its cadence.
    min_saves_left: float = Field(3.0, gt=0)
    cooldown_s: float = Field(3600.0, ge=0)


class NcclWarningBurst(RuleConfig):
    # >= max_warnings warning / error lines of `sources` on one rank within `window_s` of
    # record time (log_event counts: the ingest parsers aggregate repeats).
    max_warnings: int = Field(10, ge=1)
    window_s: float = Field(600.0, gt=0)
    sources: list[str] = Field(default_factory=lambda: ["nccl"])
    cooldown_s: float = Field(600.0, ge=0)

    @field_validator("sources", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


def _threshold_config(spec: ThresholdSpec) -> type[RuleConfig]:
    fields: dict[str, Any] = {
        "severity": (Severity, spec.severity),
        "fire_after": (int, Field(spec.fire_after, ge=1)),
        "fire_after_s": (float, Field(spec.fire_after_s, ge=0)),
        "clear_after": (int, Field(spec.clear_after, ge=1)),
        "cooldown_s": (float, Field(spec.cooldown_s, ge=0)),
    }
    if spec.param:
        kind = int if spec.unit == "bytes" else float
        default = kind(spec.threshold)
        fields[spec.param] = (kind, Field(default, **dict(spec.bounds)))
    name = "".join(part.title() for part in spec.name.split("_"))
    return create_model(name, __base__=RuleConfig, __doc__=spec.catches, **fields)


# Every rule's settings, in the order of the docs: class rules, then the threshold rules of
# thresholds.py (their settings are generated from the table).
RULE_CONFIGS: dict[str, type[RuleConfig]] = {
    "non_finite": NonFinite,
    "grad_spike": GradSpike,
    "exploding_grad": ExplodingGrad,
    "frozen_grad_norm": FrozenGradNorm,
    "loss_spike": LossSpike,
    "loss_divergence": LossDivergence,
    "loss_plateau": LossPlateau,
    "frozen_loss": FrozenLoss,
    "eval_loss_spike": EvalLossSpike,
    "eval_divergence": EvalDivergence,
    "loss_scale_collapse": LossScaleCollapse,
    "skipped_iterations": SkippedIterations,
    "lr_zero": LrZero,
    "iteration_time_spike": IterationTimeSpike,
    "throughput_drop": ThroughputDrop,
    "straggler": Straggler,
    "rank_mismatch": RankMismatch,
    "stalled": Stalled,
    "run_failed": RunFailed,
    "gpu_temperature": GpuTemperature,
    "gpu_throttle": GpuThrottle,
    "moe_aux_loss": MoeAuxLoss,
    "moe_z_loss": MoeZLoss,
    "ecc_corrected_rising": EccCorrectedRising,
    "checkpoint_overdue": CheckpointOverdue,
    "checkpoint_slow": CheckpointSlow,
    "checkpoint_disk_filling": CheckpointDiskFilling,
    "nccl_warning_burst": NcclWarningBurst,
    **{spec.name: _threshold_config(spec) for spec in THRESHOLD_RULES},
}


class _RulesBase(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Rules = create_model("Rules", __base__=_RulesBase,
                     **{name: (cls, Field(default_factory=cls)) for name, cls in RULE_CONFIGS.items()})


class AlertsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Engine-wide
    rate_limit_per_minute: int = Field(30, ge=1)  # new incidents per run, record time
    wall_clock_slack_s: float = Field(5.0, ge=0)  # pipeline latency + clock skew allowance
    live_run_max_age_s: float = Field(6 * 3600.0, gt=0)  # older runs get no wall-clock rules
    # Service
    group_id: str = "trainmon-alerts"
    state_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "trainmon" / "alerts")
    checkpoint_interval_s: float = Field(10.0, gt=0)
    rebuild_records: int = Field(2000, ge=0)  # per partition, when there is no checkpoint
    # How long the group waits for an engine that stopped or hangs before handing its runs
    # to the others (the broker allows 6 s to 30 min; librdkafka's default is 45 s).
    session_timeout_s: float = Field(45.0, ge=6, le=1800)
    grafana_dashboard_uid: Optional[str] = None
    grafana_timeout_s: float = Field(5.0, gt=0)
    grafana_group_id: str = "trainmon-alerts-grafana"

    rules: Rules = Field(default_factory=Rules)


RULE_NAMES = tuple(Rules.model_fields)
_SERVICE_ENV = {CONFIG_ENV}


class ConfigError(ValueError):
    """A setting that is unknown or invalid; the message names where it came from."""


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> AlertsConfig:
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV) or None
    data: dict[str, Any] = {}
    if path:
        data = _read_yaml(Path(path))
    sources: dict[tuple, str] = {}
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX) or var in _SERVICE_ENV:
            continue
        loc = env_location(var)
        _set(data, loc, value)
        sources[loc] = var
    try:
        return AlertsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, sources, path)) from None


def env_location(var: str) -> tuple[str, ...]:
    """("rules", "grad_spike", "factor") for TRAINMON_ALERT_GRAD_SPIKE_FACTOR."""
    name = var[len(ENV_PREFIX):].lower()
    if name in AlertsConfig.model_fields and name != "rules":
        return (name,)
    for rule in sorted(RULE_NAMES, key=len, reverse=True):
        if name.startswith(rule + "_"):
            param = name[len(rule) + 1:]
            if param in Rules.model_fields[rule].annotation.model_fields:
                return ("rules", rule, param)
            raise ConfigError(f"{var}: rule {rule!r} has no setting {param!r} (it has: "
                              f"{', '.join(Rules.model_fields[rule].annotation.model_fields)})")
    raise ConfigError(f"{var}: not a setting; use TRAINMON_ALERT_<SETTING> for one of "
                      f"{', '.join(f for f in AlertsConfig.model_fields if f != 'rules')} or "
                      f"TRAINMON_ALERT_<RULE>_<PARAM> with a rule of {', '.join(RULE_NAMES)}")


def env_var(rule: str, param: str) -> str:
    return f"{ENV_PREFIX}{rule}_{param}".upper()


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"alerts config {path}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"alerts config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"alerts config {path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def _set(data: dict, loc: tuple[str, ...], value: Any) -> None:
    node = data
    for key in loc[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[loc[-1]] = value


def _explain(exc: ValidationError, sources: dict[tuple, str], path) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        where = sources.get(loc) or (f"{path}: " if path else "") + ".".join(loc)
        value = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{where}: {err['msg']}{value}")
    return "invalid alerts config: " + "; ".join(lines)
