"""Alert settings: defaults, YAML file, env overrides, errors that name the setting, and
the docs' rules table checked against the defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainmon.consumers.alerts import AlertEngine, ConfigError, load_config
from trainmon.consumers.alerts.config import RULE_NAMES, env_var
from trainmon.consumers.alerts.engine import RULE_CLASSES


def test_defaults_follow_the_healthy_ranges():
    rules = load_config(env={}).rules
    # Judged against the run's own values, from the first records on.
    assert (rules.grad_spike.factor, rules.grad_spike.jump, rules.grad_spike.min_samples) == (3, 10, 3)
    assert (rules.exploding_grad.factor, rules.exploding_grad.fire_after) == (10, 3)
    assert (rules.loss_spike.rise, rules.loss_spike.jump, rules.loss_spike.min_samples) == (0.2, 1.0, 3)
    assert rules.throughput_drop.drop == 0.25 and rules.throughput_drop.min_samples == 3
    assert rules.moe_aux_loss.rise == 0.5 and rules.moe_z_loss.rise == 1.0
    # fp16: the calibration at the start of a run is info, a collapse after it critical.
    assert rules.loss_scale_collapse.warmup_steps == rules.skipped_iterations.warmup_steps == 100
    assert rules.num_zeros.max_fraction == 0.5 and rules.gpu_underutilized.min_util == 50
    assert (rules.moe_expert_utilization.threshold, rules.moe_load_imbalance.threshold) == (0.5, 3.0)
    assert all(getattr(rules, name).enabled for name in RULE_NAMES)
    assert set(RULE_NAMES) == set(RULE_CLASSES)


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
