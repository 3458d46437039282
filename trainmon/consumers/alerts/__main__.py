"""``python -m trainmon.consumers.alerts``: print the threshold rules' table of
docs/alerts.md, generated from thresholds.THRESHOLD_RULES."""

from .thresholds import markdown_table

print(markdown_table())
