"""Writes trainmon/grafana/pipeline/trainmon-pipeline.json: the dashboard of trainmon itself
(its services' Prometheus metrics, docs/metrics.md), as build.py writes the run dashboards.

    python infra/grafana/build_pipeline.py

tests/test_pipeline_metrics_docs.py checks the file is what this writes and that every
metric it asks for is one trainmon exports.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "trainmon" / "grafana" / "pipeline" / "trainmon-pipeline.json"
SOURCE = {"type": "prometheus", "uid": "trainmon-prometheus"}  # provisioning/datasources/prometheus.yaml
SERVICE = 'service=~"$service"'


def panel(pid: int, title: str, exprs: list[tuple[str, str]], *, x: int, y: int, w: int = 12, h: int = 8,
          unit: str = "short", kind: str = "timeseries", description: str = "") -> dict:
    return {
        "id": pid, "type": kind, "title": title, "description": description,
        "gridPos": {"x": x, "y": y, "w": w, "h": h}, "datasource": SOURCE,
        "targets": [{"refId": chr(ord("A") + i), "datasource": SOURCE, "expr": expr, "legendFormat": legend,
                     "range": kind == "timeseries", "instant": kind != "timeseries"}
                    for i, (expr, legend) in enumerate(exprs)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}}
        if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
    }


def rate(metric: str, by: str, extra: str = "") -> str:
    selector = ", ".join(filter(None, [SERVICE, extra]))
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{SERVICE}}}[$__rate_interval])))"


def render() -> dict:
    panels = [
        panel(1, "Services running", [(f"trainmon_service_up{{{SERVICE}}}", "{{service}}")], x=0, y=0, w=6, h=4,
              kind="stat", description="1 while the supervisor sees the service's process"),
        panel(2, "Restarts (time range)", [(f"sum by (service) (increase(trainmon_service_restarts_total"
                                            f"{{{SERVICE}}}[$__range]))", "{{service}}")],
              x=6, y=0, w=6, h=4, kind="stat"),
        panel(3, "Consumer lag (messages)", [(f"sum by (service) (trainmon_consumer_lag{{{SERVICE}}})", "{{service}}")],
              x=12, y=0, w=6, h=4, kind="stat"),
        panel(4, "Dead letters (time range)", [(f"sum by (service) (increase(trainmon_records_dead_lettered_total"
                                                f"{{{SERVICE}}}[$__range]))", "{{service}}")],
              x=18, y=0, w=6, h=4, kind="stat"),
        panel(5, "Consumer lag per partition", [(f"trainmon_consumer_lag{{{SERVICE}}}",
                                                 "{{service}} {{topic}}[{{partition}}]")], x=0, y=4,
              description="Messages in each assigned partition not read yet; rising for minutes: the "
                          "service falls behind"),
        panel(6, "Records read / s", [(rate("trainmon_records_read_total", "service, kind"), "{{service}} {{kind}}")],
              x=12, y=4, unit="rps"),
        panel(7, "Records written / s", [(rate("trainmon_records_written_total", "service, kind"),
                                          "{{service}} {{kind}}")], x=0, y=12, unit="rps"),
        panel(8, "Dead letters / s", [(rate("trainmon_records_dead_lettered_total", "service, kind"),
                                       "{{service}} {{kind}}")], x=12, y=12, unit="rps",
              description="Records the service could not use, sent to the dead-letter topic with why"),
        panel(9, "ClickHouse insert latency", [(quantile(0.5, "trainmon_clickhouse_insert_seconds", "kind"),
                                                "p50 {{kind}}"),
                                               (quantile(0.99, "trainmon_clickhouse_insert_seconds", "kind"),
                                                "p99 {{kind}}")], x=0, y=20, unit="s"),
        panel(10, "Kafka commit latency (p99)", [(quantile(0.99, "trainmon_commit_seconds", "service"),
                                                  "{{service}}")], x=12, y=20, unit="s"),
        panel(11, "Batch size (records per flush, p50)", [(quantile(0.5, "trainmon_batch_records", "service"),
                                                           "{{service}}")], x=0, y=28),
        panel(12, "Flush latency (p99)", [(quantile(0.99, "trainmon_flush_seconds", "service"), "{{service}}")],
              x=12, y=28, unit="s"),
        panel(13, "Alerts published / s", [(rate("trainmon_alerts_total", "rule, state"), "{{rule}} {{state}}")],
              x=0, y=36, unit="rps"),
        panel(14, "Notifications", [(rate("trainmon_notifications_sent_total", "service"), "sent"),
                                    (rate("trainmon_notifications_failed_total", "service"), "failed"),
                                    (rate("trainmon_notifications_given_up_total", "service"), "given up")],
              x=12, y=36, unit="rps"),
        panel(15, "Resident memory", [(f"process_resident_memory_bytes{{{SERVICE}}}", "{{service}}")],
              x=0, y=44, w=8, unit="bytes", description="Flat over days when nothing leaks"),
        panel(16, "Open files", [(f"process_open_fds{{{SERVICE}}}", "{{service}}")], x=8, y=44, w=8),
        panel(17, "CPU", [(f"rate(process_cpu_seconds_total{{{SERVICE}}}[$__rate_interval])", "{{service}}")],
              x=16, y=44, w=8, unit="percentunit"),
    ]
    return {
        "uid": "trainmon-pipeline",
        "title": "trainmon / Pipeline",
        "description": "trainmon itself: each service's lag, rates, dead letters, latencies and restarts, "
                       "from their Prometheus metrics (docs/metrics.md).",
        "tags": ["trainmon", "trainmon-pipeline"],
        "editable": False, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {}, "timezone": "browser", "links": [],
        "annotations": {"list": []},
        "templating": {"list": [{
            "name": "service", "label": "Service", "type": "query", "datasource": SOURCE,
            "query": {"query": "label_values(up{job=\"trainmon\"}, service)", "refId": "service"},
            "definition": "label_values(up{job=\"trainmon\"}, service)",
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}]},
        "panels": panels,
    }


def rendered_text() -> str:
    return json.dumps(render(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(rendered_text())
    print(f"wrote {OUT}")
