"""Anomaly rules over the record streams: alerts as events on the alert topic and as
Grafana annotations.

    from trainmon.consumers.alerts import AlertEngine, load_config
    engine = AlertEngine(load_config())          # defaults < YAML file < TRAINMON_ALERT_* env
    alerts = engine.process(record) + engine.tick(now)

``trainmon consume alerts`` runs it as a service (service.py). The rules are classes in
rules/, one module per family, each registered with its name and settings; docs/alerts.md
lists them (tables generated from them).
"""

from .config import AlertsConfig, ConfigError, load_config
from .engine import RULE_CLASSES, AlertEngine

__all__ = ["AlertEngine", "AlertsConfig", "ConfigError", "RULE_CLASSES", "load_config"]
