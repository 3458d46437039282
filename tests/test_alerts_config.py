"""Alert settings (defaults, YAML file, env overrides, clear errors) and the incident
lifecycle of the pure engine (debounce, cooldown, rate limit, deterministic ids)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainmon.consumers.alerts import AlertEngine, ConfigError, load_config
from trainmon.consumers.alerts.config import RULE_NAMES, env_var
from trainmon.consumers.alerts.incidents import event_id

from .alerts_support import synthetic_run


def test_defaults_follow_the_healthy_ranges():
    rules = load_config(env={}).rules
    assert rules.grad_spike.factor == 5 and rules.exploding_grad.threshold == 100
    assert rules.loss_spike.rise == 0.2
    assert rules.num_zeros.max_fraction == 0.5 and rules.gpu_underutilized.min_util == 50
    assert (rules.moe_aux_loss.threshold, rules.moe_z_loss.threshold,
            rules.moe_expert_utilization.threshold, rules.moe_load_imbalance.threshold) == (1.0, 0.1, 0.5, 3.0)
    assert all(getattr(rules, name).enabled for name in RULE_NAMES)


def test_yaml_file_then_env_override(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("rate_limit_per_minute: 5\nrules:\n  grad_spike: {factor: 8, severity: critical}\n"
                    "  gpu_throttle: {ignore: [sw_power_cap]}\n")
    cfg = load_config(path, env={"TRAINMON_ALERT_GRAD_SPIKE_FACTOR": "6",
                                 "TRAINMON_ALERT_RANK_MISMATCH_GRACE_S": "30",
                                 "TRAINMON_ALERT_NON_FINITE_ENABLED": "false",
                                 "TRAINMON_ALERT_GPU_THROTTLE_IGNORE": "app_clocks, sw_thermal"})
    assert cfg.rate_limit_per_minute == 5
    assert cfg.rules.grad_spike.factor == 6 and cfg.rules.grad_spike.severity == "critical"
    assert cfg.rules.rank_mismatch.grace_s == 30
    assert cfg.rules.non_finite.enabled is False
    assert cfg.rules.gpu_throttle.ignore == ["app_clocks", "sw_thermal"]
    assert "non_finite" not in AlertEngine(cfg).rules
    assert env_var("grad_spike", "factor") == "TRAINMON_ALERT_GRAD_SPIKE_FACTOR"


@pytest.mark.parametrize("env, says", [
    ({"TRAINMON_ALERT_GRAD_SPIKE_FACTR": "3"}, "rule 'grad_spike' has no setting 'factr'"),
    ({"TRAINMON_ALERT_NO_SUCH_RULE_X": "1"}, "TRAINMON_ALERT_NO_SUCH_RULE_X: not a setting"),
    ({"TRAINMON_ALERT_GRAD_SPIKE_FACTOR": "abc"}, "TRAINMON_ALERT_GRAD_SPIKE_FACTOR: Input should be a valid number"),
    ({"TRAINMON_ALERT_LOSS_SPIKE_SEVERITY": "loud"}, "TRAINMON_ALERT_LOSS_SPIKE_SEVERITY"),
    ({"TRAINMON_ALERT_GRAD_SPIKE_FACTOR": "0.5"}, "greater than 1"),
])
def test_bad_settings_are_named(env, says):
    with pytest.raises(ConfigError, match=None) as exc:
        load_config(env=env)
    assert says in str(exc.value)


def test_bad_yaml_key_names_the_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  grad_spike:\n    factr: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert str(path) in str(exc.value) and "rules.grad_spike.factr" in str(exc.value)


def test_cli_prints_effective_config_and_rejects_bad_env():
    env = {"TRAINMON_ALERT_STRAGGLER_FACTOR": "1.7", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "trainmon", "consume", "alerts", "--print-config"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "factor: 1.7" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "trainmon", "consume", "alerts", "--print-config"],
                         env={**env, "TRAINMON_ALERT_STRAGGLER_FACTOR": "fast"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "TRAINMON_ALERT_STRAGGLER_FACTOR" in bad.stderr


def nan_steps(*steps):
    def mutate(s, r, step, gpu, moe):
        if s in steps:
            step["loss"] = float("nan")
    return mutate


def run_engine(engine, records):
    out = []
    for record in records:
        out.extend(engine.process(record))
    return out


def test_cooldown_holds_back_a_second_incident_of_the_same_kind():
    t0 = time.time() - 900
    records = synthetic_run("c", t0=t0, steps=40, mutate=nan_steps(10, 20, 35), end=False)
    cooled = run_engine(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "20"})), records)
    # One step per second. NaN at 10 fires and resolves at 11; the NaN at 20 comes 9 s
    # later, within the 20 s cooldown; the one at 35 comes 24 s later and fires again.
    assert [(a.state, a.step) for a in cooled] == [("firing", 10), ("resolved", 11),
                                                  ("firing", 35), ("resolved", 36)]
    assert [a.incident_id for a in cooled] == ["c/non_finite/run#1"] * 2 + ["c/non_finite/run#2"] * 2
    no_cooldown = run_engine(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0"})), records)
    assert [a.step for a in no_cooldown if a.state == "firing"] == [10, 20, 35]


def test_rate_limit_caps_new_incidents_per_run():
    env = {"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0", "TRAINMON_ALERT_RATE_LIMIT_PER_MINUTE": "2"}
    engine = AlertEngine(load_config(env=env))
    records = synthetic_run("rl", t0=time.time() - 900, steps=40, mutate=nan_steps(*range(0, 40, 2)), end=False)
    firing = [a for a in run_engine(engine, records) if a.state == "firing"]
    # 40 s of record time: two per rolling minute.
    assert len(firing) == 2
    assert engine.book.suppressed > 0


def test_ids_are_deterministic_and_event_ids_fit_the_schema():
    records = synthetic_run("a-very-long-run-id-" * 12, t0=1.7e9, steps=20, mutate=nan_steps(5), end=False)
    first = run_engine(AlertEngine(load_config(env={})), records)
    again = run_engine(AlertEngine(load_config(env={})), records)
    assert [a.event_id for a in first] == [a.event_id for a in again]
    assert first[0].event_id == event_id(first[0].incident_id, "firing")
    assert all(len(a.event_id) <= 128 for a in first)


def test_engine_never_fails_on_odd_but_valid_records():
    def odd(s, r, step, gpu, moe):
        step.update(loss=float("inf"), norm=float("-inf"), duration_ms=0.0, lr=-1.0, num_params=0,
                    loss_scale=0.0, total_steps=0)
        gpu.update(temp_slowdown=0, temperature=-40, throttle=",,,")
        moe.update(aux_loss=float("nan"), load_imbalance=1.0)
    engine = AlertEngine(load_config(env={}))
    run_engine(engine, synthetic_run("odd", t0=1.7e9, ranks=3, steps=30, mutate=odd))
    engine.tick(time.time())
    assert engine.runs == {}  # the run ended and was forgotten


def test_docs_table_lists_every_rule_with_its_parameters_and_debounce():
    from pathlib import Path

    from trainmon.consumers.alerts.config import RuleConfig, Rules

    doc = (Path(__file__).resolve().parents[1] / "docs" / "alerts.md").read_text()
    rows = {line.split("`")[1]: line for line in doc.splitlines() if line.startswith("| `")}
    for name in RULE_NAMES:
        cfg = getattr(Rules(), name)
        row = rows[name]
        assert f"| {cfg.severity} |" in row, name
        assert f"| {cfg.fire_after} / {cfg.clear_after} / {cfg.cooldown_s:g} s |" in row, name
        for param in set(type(cfg).model_fields) - set(RuleConfig.model_fields):
            assert f"`{param}`" in row, (name, param)
