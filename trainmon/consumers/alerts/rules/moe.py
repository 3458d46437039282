"""MoE router losses, judged against the run's own level: their scale is the framework's
(Megatron's load-balancing loss sits near 1.0 when balanced, others report it times a
coefficient)."""

from __future__ import annotations

from pydantic import Field

from ..rule_config import RuleConfig
from .base import history, sig4
from .baseline import MedianRiseRule


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


class MoeRouterLossRule(MedianRiseRule):
    kinds = ("moe",)
    fires_when = ("{label} >= (1 + {rise}) x the median of its last {window} values (from "
                  "{min_samples}) on {fire_after.value} records in a row")

    def rise_detail(self, value, med, n):
        return (f"{sig4(value)} is {100 * (value / med - 1):.0f}% above the median {sig4(med)} of "
                f"{history(n)}, on {self.cfg.fire_after} records in a row (limit "
                f"+{100 * self.cfg.rise:g}%)")


class MoeAuxLoss(MoeRouterLoss):
    pass


class MoeAuxLossRule(MoeRouterLossRule, name="moe_aux_loss", config=MoeAuxLoss):
    field, what = "aux_loss", "MoE aux (load-balancing) loss rising"
    fires_when = MoeRouterLossRule.fires_when.replace("{label}", "aux (load-balancing) loss")
    catches = ("the router collapsing onto a few experts; its scale is the framework's (Megatron's "
               "sits near 1.0 when balanced), so it is judged against the run's own")
    checked_on = ("silent on megatron-core-mixtral-8x7b-moe-lbl.log (1.011-1.020: the old absolute "
                  "limit of 1.0 fired)")


class MoeZLoss(MoeRouterLoss):
    rise: float = Field(1.0, gt=0)


class MoeZLossRule(MoeRouterLossRule, name="moe_z_loss", config=MoeZLoss):
    field, what = "z_loss", "MoE router z-loss rising"
    fires_when = MoeRouterLossRule.fires_when.replace("{label}", "router z-loss")
    catches = "router logits growing"
    checked_on = "tests (no corpus log prints it)"
