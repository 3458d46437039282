"""GPU records: one incident per GPU, for heat and throttled clocks."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from ..rule_config import RuleConfig
from .base import Rule


class GpuRule(Rule):
    kinds = ("gpu",)

    def observe(self, r, t, run, rank):
        subject = f"rank{rank.rank}/gpu{r.id}"
        problem = self.problem(r)
        if problem is None:
            return self.good(run, rank, step=r.step, t=t, subject=subject)
        value, threshold, text = problem
        return self.bad(run, rank, step=r.step, t=t, value=value, threshold=threshold, subject=subject,
                        message=f"GPU {r.id} of rank {rank.rank} on {rank.host} (run {run.run_id}, "
                                f"step {r.step}): {text}")

    def problem(self, r) -> tuple[float, float | None, str] | None:
        raise NotImplementedError


class GpuTemperature(RuleConfig):
    margin_c: float = Field(0.0, ge=0)  # fire at temp_slowdown - margin_c
    clear_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)


class GpuTemperatureRule(GpuRule, name="gpu_temperature", config=GpuTemperature):
    fires_when = "temperature >= `temp_slowdown` - {margin_c}"
    catches = "a GPU about to slow down for heat"
    checked_on = "tests; silent on a healthy H200 run's NVML records (tests/data/gpu)"

    def problem(self, r):
        if r.temp_slowdown <= 0:
            return None
        limit = r.temp_slowdown - self.cfg.margin_c
        if r.temperature >= limit:
            return r.temperature, limit, (f"temperature {r.temperature} C at or above "
                                          f"{limit:g} C (slowdown at {r.temp_slowdown} C)")
        return None


class GpuThrottle(RuleConfig):
    # sw_power_cap is how a busy GPU runs, not a fault: a healthy H200 training run set it
    # on 89 of 121 samples, from 155 W, at 93-99 % of its maximum clock
    # (tests/data/gpu/h200-gpu-check.jsonl). Firing on it paged every busy GPU.
    ignore: list[str] = Field(default_factory=lambda: ["app_clocks", "display_clocks", "sync_boost",
                                                       "sw_power_cap"])
    clear_after: int = Field(3, ge=1)
    cooldown_s: float = Field(300.0, ge=0)

    @field_validator("ignore", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


class GpuThrottleRule(GpuRule, name="gpu_throttle", config=GpuThrottle):
    fires_when = "a throttle reason other than {ignore}"
    catches = "clocks held down (heat, hardware slowdown, power brake)"
    checked_on = "tests; silent on a healthy H200 run's NVML records (tests/data/gpu)"

    def problem(self, r):
        reasons = [x for x in r.throttle.split(",") if x and x not in self.cfg.ignore]
        if reasons:
            return float(len(reasons)), None, (f"clocks throttled ({', '.join(reasons)}), "
                                               f"{r.clock} of {r.max_clock} MHz")
        return None
