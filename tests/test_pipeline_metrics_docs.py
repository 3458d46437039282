"""What operators are given for trainmon itself holds together, with no service running:
every metric the Pipeline dashboard and the Prometheus rules ask for is one docs/metrics.md
lists, and every one it lists is exported (the runtime's and the supervisor's by their
registries, a sink's by its module); the dashboard is what its build script writes and
reads the provisioned Prometheus source; the rules are well formed."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml

from trainmon import stack
from trainmon.consumers.metrics import ServiceMetrics

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "trainmon" / "grafana" / "pipeline"
RULES = yaml.safe_load((REPO / "infra" / "prometheus" / "trainmon-rules.yaml").read_text())
DOC = (REPO / "docs" / "metrics.md").read_text()
# A sink's own metrics, by the module that defines them.
SINK_MODULES = {"clickhouse": "trainmon/consumers/clickhouse/loader.py",
                "alerts": "trainmon/consumers/alerts/service.py",
                "notify": "trainmon/consumers/notify/sink.py",
                "relay": "trainmon/relay/server.py"}
METRIC = re.compile(r"\b((?:trainmon|process)_[a-z0-9_]+)")


def base(name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", name)


def documented() -> dict[str, str]:
    """metric (base name) -> the 'from' column of its row in docs/metrics.md."""
    rows = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`trainmon_"):
            rows[base(cells[0].strip("`"))] = cells[3]
    return rows


def exported_by_registry(registry) -> set[str]:
    return {base(family.name) for family in registry.collect()}


def asked_for() -> set[str]:
    dashboard = json.loads((PIPELINE / "trainmon-pipeline.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [rule["expr"] for group in RULES["groups"] for rule in group["rules"]]
    return {base(m) for expr in exprs for m in METRIC.findall(expr)}


def test_every_metric_asked_for_is_documented_and_every_documented_one_exported():
    docs = documented()
    runtime = exported_by_registry(ServiceMetrics("s").registry)
    supervisor = exported_by_registry(stack.supervisor_registry(SimpleNamespace(children=[
        stack.Child(stack.Service("clickhouse", [], "trainmon-clickhouse"))])))
    assert len(docs) >= 20
    for name, where in docs.items():
        if where == "every consumer":
            assert name in runtime, name
        elif where == "supervisor":
            assert name in supervisor, name
        else:
            source = (REPO / SINK_MODULES[where]).read_text()
            assert f'"{name}"' in source, f"{name}: not defined in {SINK_MODULES[where]}"
    trainmon_runtime = {n for n in runtime if n.startswith("trainmon_")}
    assert trainmon_runtime <= set(docs), trainmon_runtime - set(docs)
    asked = asked_for()
    process = {n for n in asked if n.startswith("process_")}
    assert process and process <= runtime & supervisor
    assert asked - process <= set(docs), asked - process - set(docs)
    assert {"trainmon_consumer_lag", "trainmon_records_dead_lettered", "trainmon_service_restarts"} <= asked


def test_the_dashboard_is_what_its_build_script_writes_and_reads_the_provisioned_source():
    spec = importlib.util.spec_from_file_location("build_pipeline", REPO / "infra" / "grafana" / "build_pipeline.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert (PIPELINE / "trainmon-pipeline.json").read_text() == build.rendered_text(), \
        "run: python infra/grafana/build_pipeline.py"
    [source] = yaml.safe_load((PIPELINE / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    [provider] = yaml.safe_load((PIPELINE / "provisioning" / "dashboards" / "trainmon-pipeline.yaml").read_text())["providers"]
    assert provider["options"]["path"] in DOC  # the mount the docs give
    dashboard = build.render()
    wanted = {"type": source["type"], "uid": source["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == wanted and all(t["datasource"] == wanted for t in panel["targets"])
        assert all("$service" in t["expr"] for t in panel["targets"]), panel["title"]


def test_the_rules_are_well_formed():
    rules = [rule for group in RULES["groups"] for rule in group["rules"]]
    assert {r["alert"] for r in rules} >= {"TrainmonConsumerLagGrowing", "TrainmonDeadLetters",
                                          "TrainmonServiceRestarting"}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        assert f"`{rule['alert']}`" in DOC
