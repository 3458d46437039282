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
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from .rule_config import RuleConfig, Severity
from .rules import RULES

__all__ = ["AlertsConfig", "ConfigError", "RULE_CONFIGS", "RULE_NAMES", "RuleConfig", "Rules",
           "Severity", "env_location", "env_var", "load_config"]
ENV_PREFIX = "TRAINMON_ALERT_"
CONFIG_ENV = "TRAINMON_ALERT_CONFIG"


# Every rule's settings, in the order of the docs: each rule registers its settings model
# with itself (rules/), the threshold rules theirs generated from thresholds.py's table.
RULE_CONFIGS: dict[str, type[RuleConfig]] = {name: entry.config for name, entry in RULES.items()}


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
