"""docker-compose.yml without a Docker engine: it validates against the Compose
Specification schema, and its settings agree with the code, the Grafana provisioning
and docs/deploy.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from trainmon.cli import CONSUMERS

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DEPLOY_DOC = (REPO / "docs" / "deploy.md").read_text()
CODE = "\n".join(p.read_text() for p in (REPO / "trainmon").rglob("*.py"))
TRAINMON_VAR = re.compile(r"\bTRAINMON_[A-Z0-9_]+\b")
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def schema_validator() -> jsonschema.Draft201909Validator:
    schema = json.loads((REPO / "infra" / "compose-spec" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def interpolate(value, env: dict | None = None):
    """Compose's ${VAR:-default} substitution, with the defaults when env is empty."""
    env = env or {}
    if not isinstance(value, str):
        return value
    return INTERPOLATION.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(interpolate(value)) for key, value in env.items()}


def consumer_services() -> list[str]:
    return [name for name, s in SERVICES.items() if s.get("command", [None])[0] == "consume"]


def test_compose_file_validates_against_the_compose_spec():
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in schema_validator().iter_errors(COMPOSE)]
    assert errors == []


def test_the_schema_rejects_a_misspelled_key():
    broken = json.loads(json.dumps(COMPOSE))
    broken["services"]["kafka"]["helthcheck"] = broken["services"]["kafka"].pop("healthcheck")
    assert not schema_validator().is_valid(broken)


def test_every_trainmon_variable_in_compose_is_read_by_the_code_and_documented():
    used = {key for name in SERVICES for key in environment(name) if key.startswith("TRAINMON_")}
    assert used, "the consumers get their settings from TRAINMON_* variables"
    for var in sorted(used):
        assert f'"{var}"' in CODE, f"{var} is set in docker-compose.yml but no code reads it"
        assert f"`{var}`" in DEPLOY_DOC, f"{var} is set in docker-compose.yml but not in docs/deploy.md"


def test_every_documented_trainmon_variable_is_read_by_the_code():
    for var in sorted(set(TRAINMON_VAR.findall(DEPLOY_DOC))):
        assert f'"{var}"' in CODE, f"docs/deploy.md lists {var} but no code reads it"


def test_every_compose_interpolation_variable_is_documented():
    text = (REPO / "docker-compose.yml").read_text()
    for var in sorted({m.group(1) for m in INTERPOLATION.finditer(text)}):
        assert f"`{var}`" in DEPLOY_DOC, f"${{{var}}} is not explained in docs/deploy.md"


def test_kafka_runs_kraft_with_every_setting_given():
    env = environment("kafka")
    # Any KAFKA_* variable replaces the image's default server.properties.
    required = ["KAFKA_NODE_ID", "KAFKA_PROCESS_ROLES", "KAFKA_LISTENERS",
                "KAFKA_ADVERTISED_LISTENERS", "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
                "KAFKA_CONTROLLER_LISTENER_NAMES", "KAFKA_CONTROLLER_QUORUM_VOTERS",
                "KAFKA_INTER_BROKER_LISTENER_NAME", "KAFKA_LOG_DIRS",
                "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
                "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
                "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR"]
    assert [key for key in required if key not in env] == []
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    listeners = dict(item.split("://") for item in env["KAFKA_LISTENERS"].split(","))
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) == set(protocols)
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    voter_port = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].rsplit(":", 1)[1]
    assert listeners[env["KAFKA_CONTROLLER_LISTENER_NAMES"]] == f":{voter_port}"
    # The consumers use the internal listener; training jobs the published external one.
    for name in consumer_services():
        assert environment(name)["TRAINMON_KAFKA_BOOTSTRAP"] == advertised["INTERNAL"]
    external_port = advertised["EXTERNAL"].rsplit(":", 1)[1]
    assert f"{external_port}:{external_port}" in SERVICES["kafka"]["ports"]
    assert any(v.endswith(":" + env["KAFKA_LOG_DIRS"]) for v in SERVICES["kafka"]["volumes"])


def test_clickhouse_credentials_agree_everywhere():
    server = environment("clickhouse")
    assert {"CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD", "CLICKHOUSE_DB"} <= set(server)
    for name in consumer_services():
        env = environment(name)
        assert env["TRAINMON_CLICKHOUSE_URL"] == "http://clickhouse:8123"
        assert env["TRAINMON_CLICKHOUSE_USER"] == server["CLICKHOUSE_USER"]
        assert env["TRAINMON_CLICKHOUSE_PASSWORD"] == server["CLICKHOUSE_PASSWORD"]
        assert env["TRAINMON_CLICKHOUSE_DATABASE"] == server["CLICKHOUSE_DB"]


def test_grafana_provisions_the_clickhouse_plugin_with_the_server_credentials():
    env = environment("grafana")
    plugin, version = env["GF_PLUGINS_PREINSTALL_SYNC"].split("@")
    assert plugin == "grafana-clickhouse-datasource" and re.fullmatch(r"\d+\.\d+\.\d+", version)
    mounts = {v.split(":")[1]: REPO / v.split(":")[0] for v in SERVICES["grafana"]["volumes"]
              if v.startswith("./")}
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "clickhouse.yaml").read_text())["datasources"]
    assert source["type"] == plugin
    # Grafana expands $VAR / ${VAR} in provisioning files from its own environment.
    expand = lambda text: re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], str(text))
    server = environment("clickhouse")
    data = source["jsonData"]
    assert data["host"] == "clickhouse" and f"{data['port']}:{data['port']}" in SERVICES["clickhouse"]["ports"]
    assert data["protocol"] in {"http", "native"}
    assert expand(data["username"]) == server["CLICKHOUSE_USER"]
    assert expand(data["defaultDatabase"]) == server["CLICKHOUSE_DB"]
    assert expand(source["secureJsonData"]["password"]) == server["CLICKHOUSE_PASSWORD"]
    # The dashboards provider reads the directory the dashboards are mounted on.
    for provider_file in (provisioning / "dashboards").glob("*.yaml"):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            assert mounts[provider["options"]["path"]].is_dir()
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    directory, _, file = home.rpartition("/")
    assert (mounts[directory] / file).is_file(), f"home dashboard {home} is not in the repository"


def test_consumers_are_built_from_the_repository():
    assert {"trainmon-clickhouse", "trainmon-alerts"} <= set(consumer_services())
    for name in consumer_services():
        service = SERVICES[name]
        assert service["command"][1] in CONSUMERS, f"{name} runs an unknown consumer"
        dockerfile = REPO / service["build"]["context"] / service["build"]["dockerfile"]
        assert dockerfile.is_file()
    dockerfile = dockerfile.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert "pip install '.[consumers]'" in dockerfile
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"^consumers = ", pyproject, re.M)


@pytest.mark.parametrize("name", list(SERVICES))
def test_healthy_dependencies_have_healthchecks(name):
    for dependency, condition in (SERVICES[name].get("depends_on") or {}).items():
        assert dependency in SERVICES
        if condition["condition"] == "service_healthy":
            assert "healthcheck" in SERVICES[dependency], f"{name} waits on {dependency}'s health"
