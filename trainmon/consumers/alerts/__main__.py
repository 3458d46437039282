"""``python -m trainmon.consumers.alerts``: print the rules tables of docs/alerts.md, each
generated from the rules (rules/docs.py) or, for the threshold rules, from
thresholds.THRESHOLD_RULES."""

from .rules.docs import class_rule_families, markdown_table
from .thresholds import markdown_table as threshold_table

LOGIC = [f for f in class_rule_families() if f != "health"]
print(f"<!-- rules with logic of their own: rules/{', rules/'.join(LOGIC)} -->")
print(markdown_table(LOGIC))
print("\n<!-- GPU health, checkpoints, warnings in the log: rules/health.py -->")
print(markdown_table(["health"]))
print("\n<!-- threshold rules: thresholds.py -->")
print(threshold_table())
