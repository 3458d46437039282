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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Severity = Literal["info", "warning", "critical"]
ENV_PREFIX = "TRAINMON_ALERT_"
CONFIG_ENV = "TRAINMON_ALERT_CONFIG"


class RuleConfig(BaseModel):
    """Settings every rule has. A condition must hold for ``fire_after`` observations in a
    row (and ``fire_after_s`` seconds of record time) to fire; ``clear_after`` healthy
    observations resolve it; after resolving, the same incident waits ``cooldown_s``
    before it may fire again."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    severity: Severity = "warning"
    fire_after: int = Field(1, ge=1)
    fire_after_s: float = Field(0.0, ge=0)
    clear_after: int = Field(1, ge=1)
    cooldown_s: float = Field(60.0, ge=0)


class GradSpike(RuleConfig):
    factor: float = Field(5.0, gt=1)  # norm > factor x moving average (Surogate's "!")
    window: int = Field(100, ge=2)
    min_samples: int = Field(20, ge=1)


class NonFinite(RuleConfig):
    severity: Severity = "critical"


class ExplodingGrad(RuleConfig):
    severity: Severity = "critical"
    threshold: float = Field(100.0, gt=0)


class DeadGradients(RuleConfig):
    fire_after: int = Field(3, ge=1)


class LossSpike(RuleConfig):
    rise: float = Field(0.2, gt=0)  # loss > (1 + rise) x median of the window
    window: int = Field(50, ge=2)
    min_samples: int = Field(20, ge=1)


class LossPlateau(RuleConfig):
    severity: Severity = "info"
    window: int = Field(1000, ge=4)  # compares the median of its newer half with its older
    min_decrease: float = Field(0.0, ge=0)  # fraction the loss must fall by, half to half
    fire_after: int = Field(50, ge=1)
    clear_after: int = Field(50, ge=1)
    cooldown_s: float = Field(3600.0, ge=0)


class RankMismatch(RuleConfig):
    severity: Severity = "critical"
    grace_s: float = Field(60.0, gt=0)
    min_steps_behind: int = Field(1, ge=1)


class Straggler(RuleConfig):
    factor: float = Field(1.3, gt=1)  # step time > factor x median of all ranks at that step
    min_ranks: int = Field(3, ge=2)
    timer: Optional[str] = None  # compare timers[timer] instead of duration_ms
    fire_after: int = Field(5, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class IterationTimeSpike(RuleConfig):
    severity: Severity = "info"
    factor: float = Field(3.0, gt=1)
    window: int = Field(50, ge=2)
    min_samples: int = Field(10, ge=1)


class ThroughputDrop(RuleConfig):
    drop: float = Field(0.3, gt=0, lt=1)  # tokens/s < (1 - drop) x recent median
    window: int = Field(100, ge=2)
    min_samples: int = Field(10, ge=1)
    fire_after: int = Field(5, ge=1)


class LrZero(RuleConfig):
    after_step: int = Field(100, ge=0)  # warmup: lr may be 0 before this step
    final_fraction: float = Field(0.01, ge=0, lt=1)  # schedules may reach 0 at the very end
    fire_after: int = Field(3, ge=1)


class LossScaleCollapse(RuleConfig):
    severity: Severity = "critical"
    min_scale: float = Field(1.0, gt=0)


class NumZeros(RuleConfig):
    max_fraction: float = Field(0.5, gt=0, le=1)


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


class GpuUnderutilized(RuleConfig):
    min_util: float = Field(50.0, ge=0, le=100)
    fire_after_s: float = Field(60.0, ge=0)
    fire_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class GpuMemoryLow(RuleConfig):
    min_free_bytes: int = Field(1 << 30, ge=0)


class MoeRule(RuleConfig):
    fire_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class MoeAuxLoss(MoeRule):
    threshold: float = 1.0  # fires above


class MoeZLoss(MoeRule):
    threshold: float = 0.1  # fires above


class MoeExpertUtilization(MoeRule):
    threshold: float = Field(0.5, ge=0, le=1)  # fires below


class MoeLoadImbalance(MoeRule):
    threshold: float = Field(3.0, ge=1)  # fires above


class Stalled(RuleConfig):
    severity: Severity = "critical"
    factor: float = Field(10.0, gt=1)  # no new step for factor x median step time ...
    min_s: float = Field(300.0, gt=0)  # ... and at least this long


class Rules(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    grad_spike: GradSpike = GradSpike()
    non_finite: NonFinite = NonFinite()
    exploding_grad: ExplodingGrad = ExplodingGrad()
    dead_gradients: DeadGradients = DeadGradients()
    loss_spike: LossSpike = LossSpike()
    loss_plateau: LossPlateau = LossPlateau()
    rank_mismatch: RankMismatch = RankMismatch()
    straggler: Straggler = Straggler()
    iteration_time_spike: IterationTimeSpike = IterationTimeSpike()
    throughput_drop: ThroughputDrop = ThroughputDrop()
    lr_zero: LrZero = LrZero()
    loss_scale_collapse: LossScaleCollapse = LossScaleCollapse()
    num_zeros: NumZeros = NumZeros()
    gpu_temperature: GpuTemperature = GpuTemperature()
    gpu_throttle: GpuThrottle = GpuThrottle()
    gpu_underutilized: GpuUnderutilized = GpuUnderutilized()
    gpu_memory_low: GpuMemoryLow = GpuMemoryLow()
    moe_aux_loss: MoeAuxLoss = MoeAuxLoss()
    moe_z_loss: MoeZLoss = MoeZLoss()
    moe_expert_utilization: MoeExpertUtilization = MoeExpertUtilization()
    moe_load_imbalance: MoeLoadImbalance = MoeLoadImbalance()
    stalled: Stalled = Stalled()


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
    grafana_dashboard_uid: Optional[str] = None
    grafana_timeout_s: float = Field(5.0, gt=0)
    grafana_group_id: str = "trainmon-alerts-grafana"

    rules: Rules = Rules()


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
