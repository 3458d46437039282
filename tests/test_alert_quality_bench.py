"""The alert-quality benchmark's scoring (benchmarks/alert_quality.py) on a hand-made case:
pure, in memory, no engine and no broker."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "alert_quality.py"


def _load():
    spec = importlib.util.spec_from_file_location("alert_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


aq = _load()
LOGGED = {0: [0, 5, 10, 11, 12, 13, 20, 30, 31, 40]}  # rank 0 logged these steps


def test_one_caught_one_missed_one_false_alert():
    incidents = [aq.Incident("nan", 10, 12), aq.Incident("grad_norm_spike", 30, 30)]
    alerts = [
        aq.Alert("non_finite", "critical", 11),  # inside the NaN's window: caught, 1 record late
        aq.Alert("loss_spike", "warning", 20),  # outside every window: a false alert
        aq.Alert("iteration_time_spike", "info", 25),  # outside too, but info: not counted
        aq.Alert("loss_scale_collapse", "critical", 31),  # in the spike's window, wrong rule
    ]
    score = aq.score_log("hand-made", incidents, alerts, LOGGED)

    nan, spike = score.catches
    assert nan.alert == alerts[0] and nan.delay == 1
    assert spike.alert is None and spike.delay is None
    assert score.outside == [alerts[1], alerts[2]]
    assert score.false_alerts == [alerts[1]]
    assert score.inside_other == [alerts[3]]

    totals = aq.summarize([score], [])
    assert (totals.caught, totals.incidents) == (1, 2)
    assert totals.by_kind == {"nan": [1, 1], "grad_norm_spike": [0, 1]}
    assert (totals.false_healthy, totals.false_elsewhere, totals.info) == (0, 1, 1)
    assert totals.median_delay == 1
    met = {what: ok for what, ok, _ in aq.targets(totals)}
    assert list(met.values()) == [False, True, True, True]  # recall 50 %: missed


def test_window_allows_one_logged_record_after_the_last_step():
    nan = [aq.Incident("nan", 10, 12)]
    # 13 is the next record rank 0 logged after step 12: still counts, 3 records late.
    (late,) = aq.score_log("x", nan, [aq.Alert("non_finite", "critical", 13)], LOGGED).catches
    assert late.alert is not None and late.delay == 3
    # 20 is two records after: missed, and a false alert.
    score = aq.score_log("x", nan, [aq.Alert("non_finite", "critical", 20)], LOGGED)
    assert score.catches[0].alert is None and len(score.false_alerts) == 1


def test_an_incident_without_steps_spans_the_log_and_healthy_logs_count_apart():
    whole = aq.score_log("x", [aq.Incident("nan")], [aq.Alert("non_finite", "critical", 30)], LOGGED)
    assert whole.catches[0].delay == 7  # records 0..20 came before the alert at step 30
    healthy = aq.score_log("h", [], [aq.Alert("grad_spike", "warning", 5)], LOGGED, healthy=True)
    synthetic = aq.score_log("s", [], [aq.Alert("straggler", "warning", 5, rank=3)], LOGGED,
                             healthy=True)
    totals = aq.summarize([whole, healthy], [synthetic])
    assert (totals.false_healthy, totals.false_elsewhere, totals.false_synthetic) == (1, 0, 1)
    assert math.isnan(aq.summarize([], []).median_delay)  # none caught: no median
