"""Alert settings: defaults, YAML file, env overrides, errors that name the setting, and
the docs' rules table checked against the defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainmon.consumers.alerts import AlertEngine, ConfigError, load_config
from trainmon.consumers.alerts.config import RULE_NAMES, env_var


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
