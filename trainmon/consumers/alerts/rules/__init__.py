"""Every alert rule, one module per family beside the rule base (base.py).

Importing this package imports the families in the order below, and each rule registers
itself there (``class XRule(Rule, name="x", config=X)``): that order is the order of the
settings (config.Rules), of the docs tables and of the rules the engine runs on one record.
A new rule goes into the module of its family; a new family is a module and a line here.
"""

from . import grad, loss, eval, fp16, throughput, ranks, run, gpu, moe, health, thresholds  # noqa: F401
from .base import RULES, RUN, Registered, Rule, TickRule, register
from .baseline import BaselineRule, MedianRiseRule
from .thresholds import ThresholdRule

__all__ = ["BaselineRule", "MedianRiseRule", "RULES", "RUN", "Registered", "Rule",
           "ThresholdRule", "TickRule", "register"]
