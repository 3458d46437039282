"""docker-compose.yml without a Docker engine: it validates against the Compose
Specification schema, and its settings agree with the code, the Grafana provisioning
and docs/deploy.md: three replicated KRaft nodes, SASL_SSL with ACLs from outside. The
Slurm recipe of docs/cluster.md sets only variables the code reads, in valid bash."""

from __future__ import annotations

import json
import re
import subprocess
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


# -- Kafka: three nodes, replicated, SASL_SSL from outside with ACLs ------------------------

KAFKA_NODES = ["kafka", "kafka-2", "kafka-3"]
REQUIRED = re.compile(r"\$\{(\w+):\?[^}]*\}")  # ${VAR:?message}: compose refuses to run without VAR
KAFKA_COMPOSE_DIR = REPO / "infra" / "kafka-compose"


def listener_map(value: str) -> dict[str, str]:
    return dict(item.split("://", 1) if "://" in item else item.split(":", 1) for item in value.split(","))


def required_value(service: str, key: str) -> str:
    """The variable a ${VAR:?...} setting requires (the value itself is the operator's)."""
    match = REQUIRED.fullmatch(str(SERVICES[service]["environment"][key]))
    assert match, f"{service}: {key} must be a required ${{VAR:?...}} with no default"
    return match.group(1)


def test_kafka_is_three_kraft_nodes_each_a_controller_voter():
    envs = {name: environment(name) for name in KAFKA_NODES}
    assert {name for name, s in SERVICES.items() if s.get("image", "").startswith("apache/kafka")
            and "entrypoint" not in s} == set(KAFKA_NODES)
    assert sorted(int(env["KAFKA_NODE_ID"]) for env in envs.values()) == [1, 2, 3]
    assert len({env["CLUSTER_ID"] for env in envs.values()}) == 1
    for name, env in envs.items():
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
        voters = dict(v.split("@") for v in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))
        # Every node is a voter, at its own host name and controller listener.
        assert {voters[env["KAFKA_NODE_ID"]]} == {f"{SERVICES[name]['hostname']}:"
                                                   f"{listener_map(env['KAFKA_LISTENERS'])['CONTROLLER'][1:]}"}
        assert sorted(voters.values()) == sorted(f"{n}:9093" for n in KAFKA_NODES)
        advertised = listener_map(env["KAFKA_ADVERTISED_LISTENERS"])
        assert advertised["INTERNAL"] == f"{SERVICES[name]['hostname']}:19092"
        assert "CONTROLLER" not in advertised
        data = [v for v in SERVICES[name]["volumes"] if v.endswith(":" + env["KAFKA_LOG_DIRS"])]
        assert len(data) == 1
    # Each node has a data volume of its own.
    assert len({v for name in KAFKA_NODES for v in SERVICES[name]["volumes"]
                if v.endswith(":/var/lib/kafka/data")}) == 3


def test_kafka_replicates_every_topic_and_never_elects_an_unclean_leader():
    for name in KAFKA_NODES:
        env = environment(name)
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"  # topics made on first use, by the consumers
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert env["KAFKA_UNCLEAN_LEADER_ELECTION_ENABLE"] == "false"
        for internal in ("OFFSETS_TOPIC", "TRANSACTION_STATE_LOG", "SHARE_COORDINATOR_STATE_TOPIC"):
            assert env[f"KAFKA_{internal}_REPLICATION_FACTOR"] == "3", internal
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert env["KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR"] == "2"
    # The topics are created with the broker's defaults, not a replication factor of their own.
    admin = (REPO / "trainmon" / "kafka_client" / "admin.py").read_text()
    assert "replication_factor=-1" in admin


def test_kafka_external_listener_is_sasl_ssl_scram_with_acls_and_nothing_is_plaintext():
    ports = set()
    for name in KAFKA_NODES:
        env = environment(name)
        protocols = listener_map(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"])
        assert protocols == {"INTERNAL": "SASL_PLAINTEXT", "EXTERNAL": "SASL_SSL", "CONTROLLER": "SASL_PLAINTEXT"}
        assert env["KAFKA_LISTENER_NAME_EXTERNAL_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
        assert "ScramLoginModule" in env["KAFKA_LISTENER_NAME_EXTERNAL_SCRAM___SHA___512_SASL_JAAS_CONFIG"]
        assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
        assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
        assert env["KAFKA_SUPER_USERS"] == "User:admin"
        # Only the EXTERNAL listener is published, on a port of its own per node.
        external = listener_map(env["KAFKA_LISTENERS"])["EXTERNAL"]
        port = external.rsplit(":", 1)[1]
        assert SERVICES[name]["ports"] == [f"{port}:{port}"]
        assert listener_map(env["KAFKA_ADVERTISED_LISTENERS"])["EXTERNAL"] == f"localhost:{port}"
        ports.add(port)
        # The brokers' own logins: PLAIN as admin with the one required admin password.
        for listener in ("INTERNAL", "CONTROLLER"):
            assert env[f"KAFKA_LISTENER_NAME_{listener}_SASL_ENABLED_MECHANISMS"] == "PLAIN"
            jaas = SERVICES[name]["environment"][f"KAFKA_LISTENER_NAME_{listener}_PLAIN_SASL_JAAS_CONFIG"]
            assert 'username="admin"' in jaas and set(REQUIRED.findall(jaas)) == {"KAFKA_ADMIN_PASSWORD"}
        assert env["KAFKA_SASL_MECHANISM_INTER_BROKER_PROTOCOL"] == "PLAIN"
        assert env["KAFKA_SASL_MECHANISM_CONTROLLER_PROTOCOL"] == "PLAIN"
        # TLS: the keystore kafka-tls makes, in the volume both mount, made before a node starts.
        assert env["KAFKA_SSL_KEYSTORE_TYPE"] == "PKCS12"
        keystore_dir, _, keystore = env["KAFKA_SSL_KEYSTORE_LOCATION"].rpartition("/")
        assert f"kafka-tls:{keystore_dir}:ro" in SERVICES[name]["volumes"]
        assert f"kafka-tls:{keystore_dir}" in SERVICES["kafka-tls"]["volumes"]
        assert SERVICES[name]["depends_on"]["kafka-tls"] == {"condition": "service_completed_successfully"}
        assert f"{keystore}" in (KAFKA_COMPOSE_DIR / "tls.sh").read_text()
        for key in ("KAFKA_SSL_KEYSTORE_PASSWORD", "KAFKA_SSL_KEY_PASSWORD"):
            assert required_value(name, key) == "KAFKA_TLS_PASSWORD"
    assert len(ports) == 3


def test_kafka_setup_grants_what_the_embedded_stack_grants():
    """kafka-setup's users and ACLs are those of `trainmon up --listen`
    (trainmon/kafka_client/acls.py), for the prefix the consumers use."""
    setup = SERVICES["kafka-setup"]
    assert setup["entrypoint"] == ["/bin/sh", "/trainmon/setup.sh"]
    for node in KAFKA_NODES:
        assert setup["depends_on"][node] == {"condition": "service_healthy"}
    script = (KAFKA_COMPOSE_DIR / "setup.sh").read_text()
    assert {required_value("kafka-setup", f"{u}_PASSWORD") for u in ("ADMIN", "WRITER", "READER")} == \
        {"KAFKA_ADMIN_PASSWORD", "KAFKA_WRITER_PASSWORD", "KAFKA_READER_PASSWORD"}
    assert environment("kafka-setup")["TOPIC_PREFIX"] == environment("trainmon-clickhouse")["TRAINMON_TOPIC_PREFIX"]
    assert "SCRAM-SHA-512=[iterations=8192,password=$password]" in script
    grants = re.findall(r"--add --allow-principal User:(\w+) (.*)", script)
    acl_of = {(user, " ".join(sorted(re.findall(r"--operation (\w+)", rest))),
               "cluster" if "--cluster" in rest else "group *" if "--group '*'" in rest
               else "dead letters" if "deadletter" in rest else "topics")
              for user, rest in grants}
    assert acl_of == {("writer", "Describe Write", "topics"), ("writer", "IdempotentWrite", "cluster"),
                      ("reader", "Describe Read", "topics"), ("reader", "Describe Read", "group *"),
                      ("reader", "Write", "dead letters")}
    assert "--resource-pattern-type prefixed" in script
    acls = (REPO / "trainmon" / "kafka_client" / "acls.py").read_text()
    for user, operations, resource in [("writer", "WRITE, AclOperation.DESCRIBE", "topics"),
                                       ("writer", "IDEMPOTENT_WRITE", "ResourceType.BROKER"),
                                       ("reader", "READ, AclOperation.DESCRIBE", "topics"),
                                       ("reader", "READ, AclOperation.DESCRIBE", "ResourceType.GROUP"),
                                       ("reader", "WRITE", "topics, f\"{topic_prefix}{DEADLETTER}\"")]:
        assert re.search(rf'allow\("{user}", {resource}.*AclOperation\.{operations}\)', acls), (user, resource)


def test_consumers_use_the_internal_listener_as_admin():
    for name in consumer_services():
        env = environment(name)
        assert env["TRAINMON_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
        assert env["TRAINMON_KAFKA_SASL_MECHANISM"] == "PLAIN"
        assert env["TRAINMON_KAFKA_SASL_USERNAME"] == "admin"
        assert required_value(name, "TRAINMON_KAFKA_SASL_PASSWORD") == "KAFKA_ADMIN_PASSWORD"
        # The whole quorum first: replication-factor-3 topics need three brokers.
        for node in KAFKA_NODES:
            assert SERVICES[name]["depends_on"][node] == {"condition": "service_healthy"}


def test_kafka_helper_scripts_are_mounted_and_passwords_have_no_defaults():
    text = (REPO / "docker-compose.yml").read_text()
    for name, service in SERVICES.items():
        used = re.findall(r"/trainmon/([\w.-]+\.sh)", json.dumps(service))
        if used:
            assert "./infra/kafka-compose:/trainmon:ro" in service["volumes"], name
        for script in used:
            assert (KAFKA_COMPOSE_DIR / script).is_file(), script
    assert (KAFKA_COMPOSE_DIR / "admin-client.sh").is_file()
    for var in {m.group(1) for m in INTERPOLATION.finditer(text)}:
        assert "PASSWORD" not in var or var in ("CLICKHOUSE_PASSWORD", "GRAFANA_ADMIN_PASSWORD"), \
            f"{var} has a default in docker-compose.yml"
    example = (KAFKA_COMPOSE_DIR / "example.env").read_text()
    for var in sorted(set(REQUIRED.findall(text))):
        assert f"`{var}`" in DEPLOY_DOC, f"${{{var}:?}} is not explained in docs/deploy.md"
        assert re.search(rf"^{var}=", example, re.M), f"{var} is missing from example.env"


def test_compose_file_says_it_was_not_started_here():
    header = (REPO / "docker-compose.yml").read_text().split("\nx-", 1)[0]
    assert "NOT STARTED HERE" in header and "without a container engine" in header.replace("\n# ", " ")


def test_cluster_doc_names_only_settings_the_code_reads_and_its_scripts_parse():
    """docs/cluster.md (the Slurm recipe): every TRAINMON_* variable it sets is one the code
    reads, and every bash block is valid bash."""
    doc = (REPO / "docs" / "cluster.md").read_text()
    for var in sorted(set(TRAINMON_VAR.findall(doc))):
        assert f'"{var}"' in CODE, f"docs/cluster.md sets {var} but no code reads it"
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.S)
    assert len(blocks) >= 3
    for block in blocks:
        checked = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert checked.returncode == 0, (checked.stderr, block)
