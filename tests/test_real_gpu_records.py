"""Records a real GPU produced: tests/data/gpu/h200-gpu-check.jsonl is every record that
scripts/gpu_check.py sent from an NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130,
2026-11-27) while a 12-layer language model trained on it for 30 s: NVML's gpu records
every 0.25 s and gpu_health every 2 s, torch.cuda's allocator records every 10 steps, the
gpu_model record, steps and the run's start and end. CI has no GPU; these are what the
rules and the dashboards meet on one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.alerts_support import engine_with, firing, run_engine
from tests.run_dashboard_sql import records_of
from trainmon.grafana_sql import ALL, TimeRange, dashboard_queries, expand, load_dashboards

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "data" / "gpu" / "h200-gpu-check.jsonl"
RECORDS = sorted(records_of(str(CAPTURE)), key=lambda r: r.time)
RUN_ID = RECORDS[0].run_id
GPUS = [r for r in RECORDS if r.kind == "gpu"]
ALLOCATORS = [r for r in RECORDS if r.kind == "allocator"]


def test_the_capture_is_a_busy_power_capped_gpu():
    """What the tests below rely on: the GPU ran at its power cap for most of the run."""
    assert {r.kind for r in RECORDS} >= {"run", "step", "gpu", "gpu_health", "allocator", "gpu_model"}
    capped = [g for g in GPUS if g.throttle == "sw_power_cap"]
    assert len(capped) > len(GPUS) / 2
    assert max(g.gpu_util for g in GPUS) >= 95 and max(g.power for g in GPUS) > 500_000  # mW


def test_no_rule_fires_on_a_healthy_gpu_run():
    assert [(a.rule, a.message) for a in firing(run_engine(engine_with(), RECORDS))] == []


def test_the_power_cap_fires_when_a_site_chooses_it():
    """The records do carry the power cap: a configuration that no longer ignores it is
    told, naming the GPU (the rule is not silent because it cannot see)."""
    alerts = firing(run_engine(engine_with(gpu_throttle_ignore="app_clocks"), RECORDS))
    assert [a.rule for a in alerts] == ["gpu_throttle"]
    assert "sw_power_cap" in alerts[0].message and "GPU 0 of rank 0" in alerts[0].message


# The tables NVML's and torch.cuda's records fill (not checkpoints, log warnings, alerts).
GPU_TABLES = re.compile(r"\bFROM (gpu|gpu_health|allocator|gpu_model)\b")


@pytest.fixture(scope="module")
def panels(tmp_path_factory) -> dict[str, dict]:
    """Every dashboard query reading the GPU tables, over the capture in chDB."""
    time = TimeRange(RECORDS[0].time - timedelta(seconds=5), RECORDS[-1].time + timedelta(seconds=5),
                     interval_s=1)
    queries = {}
    for dashboard in load_dashboards(REPO / "trainmon" / "grafana" / "dashboards"):
        for q in dashboard_queries(dashboard):
            if GPU_TABLES.search(q.sql):
                queries[f"{q.dashboard} / {q.panel} / {q.ref_id}"] = \
                    expand(q.sql, time, {"run_id": RUN_ID, "rank": ALL})
    assert len(queries) > 40
    proc = subprocess.run([sys.executable, "-m", "tests.run_dashboard_sql",
                           str(tmp_path_factory.mktemp("chdb") / "data"), "--records", str(CAPTURE)],
                          input=json.dumps(queries), capture_output=True, text=True, cwd=REPO,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def column(panels: dict, name: str, index: int = -1) -> list[float]:
    (found,) = [r for key, r in panels.items() if key.endswith(name)]
    return [float(eval(row[index])) for row in found["rows"]]  # rows hold repr()s of numbers


def test_every_panel_on_the_gpu_tables_answers(panels):
    """Each panel draws something (one rank: its own line; the distribution and the
    standouts' queries are for runs of many ranks)."""
    assert {name: r["error"] for name, r in panels.items() if "error" in r} == {}
    answered: dict[str, bool] = {}
    for name, r in panels.items():
        panel = name.rsplit(" / ", 1)[0]
        answered[panel] = answered.get(panel, False) or bool(r["rows"])
    silent = [panel for panel, drawn in answered.items() if not drawn]
    assert silent == ["trainmon / GPU / Throttle events"]  # the power cap is not one


def test_panels_show_nvml_values_in_their_units(panels):
    watts = column(panels, "/ GPU / Power / A")
    assert max(watts) == pytest.approx(max(g.power for g in GPUS) / 1000, rel=0.2)  # (1 s buckets)
    assert 300 < max(watts) < 700
    assert max(column(panels, "/ GPU / Temperature / A")) == max(g.temperature for g in GPUS)
    assert max(column(panels, "/ GPU / SM clock / A")) <= GPUS[0].max_clock
    assert column(panels, "/ GPU / Throttled samples / A") == [0.0] * len(panels[next(
        k for k in panels if k.endswith("/ GPU / Throttled samples / A"))]["rows"])
    assert panels[next(k for k in panels if k.endswith("Throttle events / A"))]["rows"] == []
    assert max(column(panels, "/ Memory / Allocated / A")) == max(a.allocated for a in ALLOCATORS)
    assert max(column(panels, "/ Memory / Reserved / A")) == max(a.reserved for a in ALLOCATORS)
    (model,) = panels[next(k for k in panels if k.endswith("/ GPU models / A"))]["rows"]
    assert "'NVIDIA H200'" in model and str(150109880320) in " ".join(model)
