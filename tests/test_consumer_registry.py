"""One list of consumers (trainmon/consumers/registry.py) feeds the command line, `trainmon
up`, docker-compose.yml and the docs: a consumer added there and missing anywhere else
fails here, saying where. No broker needed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trainmon import cli, stack
from trainmon.consumers import registry

REPO = Path(__file__).resolve().parents[1]
COMPOSE_SERVICES = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
NAMES = [c.name for c in registry.CONSUMERS]


def entry_point(consumer: registry.Consumer):
    module, function = consumer.main.split(":")
    return getattr(importlib.import_module(module), function)


def test_trainmon_consume_runs_and_lists_every_registered_consumer(capsys):
    assert list(cli.CONSUMERS) == NAMES
    assert cli.main(["consume", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == NAMES
    for consumer, line in zip(registry.CONSUMERS, listed):
        assert consumer.summary in line and consumer.group in line
    assert cli.main(["consume", "no-such-consumer"]) == 2
    assert "clickhouse" in capsys.readouterr().err


@pytest.mark.parametrize("consumer", registry.CONSUMERS, ids=NAMES)
def test_every_consumer_takes_the_one_idle_exit_option(consumer, capsys):
    with pytest.raises(SystemExit) as done:
        entry_point(consumer)(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert f"trainmon consume {consumer.name}" in shown
    assert "--exit-when-idle SECONDS" in shown


def test_trainmon_up_runs_the_registered_consumers(tmp_path):
    assert set(stack.ALWAYS) | set(stack.ON_REQUEST) == set(NAMES)
    services = {s.name: s for s in stack.services(tmp_path, list(stack.ON_REQUEST), None)}
    assert list(services) == [*stack.ALWAYS, *stack.ON_REQUEST]
    for consumer in registry.CONSUMERS:
        service = services[consumer.name]
        assert service.command[:5] == [sys.executable, "-m", "trainmon", "consume", consumer.name]
        assert service.group == consumer.group  # the lag `trainmon status` shows is its group's
        for path in [*service.command[5:], *service.env.values()]:
            assert not path.startswith("/") or path.startswith(str(tmp_path)), \
                f"{consumer.name} writes outside the stack directory: {path}"


def test_every_consumer_has_a_compose_service():
    compose_consumers = {name for name, s in COMPOSE_SERVICES.items() if s.get("command", [None])[0] == "consume"}
    assert compose_consumers == {c.compose_service for c in registry.CONSUMERS}
    for consumer in registry.CONSUMERS:
        service = COMPOSE_SERVICES[consumer.compose_service]
        assert service["command"] == ["consume", consumer.name]
        assert service["environment"]["TRAINMON_KAFKA_GROUP_INSTANCE_ID"] == consumer.compose_service
        # The core stack is what `trainmon up` always runs; the others are a profile away.
        assert ("profiles" in service) != consumer.always_up, consumer.name
        if not consumer.always_up:
            assert service["profiles"] == [consumer.name]


def test_the_docs_name_every_consumer():
    table = (REPO / "docs" / "consumers.md").read_text()
    assert registry.markdown_table() in table, "regenerate it: python -m trainmon.consumers.registry"
    deploy = (REPO / "docs" / "deploy.md").read_text()
    readme = (REPO / "README.md").read_text()
    for consumer in registry.CONSUMERS:
        assert f"trainmon consume {consumer.name}" in (REPO / consumer.doc).read_text(), consumer.doc
        assert f"| `{consumer.compose_service}` |" in deploy, f"docs/deploy.md: {consumer.compose_service}"
        assert f"trainmon consume {consumer.name}" in readme


def declared_groups(tmp_path) -> dict:
    """Each consumer's default group as its sink declares it."""
    from trainmon.consumers.alerts.config import load_config
    from trainmon.consumers.alerts.service import AlertService
    from trainmon.consumers.clickhouse.loader import ClickHouseSink
    from trainmon.consumers.forwarding import ForwardingSink, ProgressStore

    def forwarding(name):
        return ForwardingSink(SimpleNamespace(name=name), ProgressStore(tmp_path)).group

    from trainmon.consumers.notify.config import load_config as notify_config
    from trainmon.consumers.notify.sink import NotifySink

    return {"clickhouse": ClickHouseSink.group, "alerts": AlertService(load_config(env={})).group,
            **{name: forwarding(name) for name in ("tensorboard", "aim", "wandb")},
            "notify": NotifySink(notify_config(env={})).group}


def test_each_sink_declares_the_group_the_registry_names(tmp_path):
    declared = declared_groups(tmp_path)
    assert set(declared) == set(NAMES), "a new consumer: say here how its sink declares its group"
    for consumer in registry.CONSUMERS:
        assert declared[consumer.name] == consumer.group
