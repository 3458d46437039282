"""Every consumer trainmon runs, listed once.

``trainmon consume NAME`` finds its entry point here, ``trainmon up`` its arguments under
the stack directory, docker-compose.yml has a service ``trainmon-NAME`` for each, and the
table in docs/consumers.md is generated from this list (``python -m
trainmon.consumers.registry``); tests/test_consumer_registry.py holds them all to it.

An entry is data only (module paths as strings), so the command line reads it without
importing a consumer's libraries (chDB, wandb, aim ...). The consumer itself is a
:class:`.runtime.Sink` that declares what it reads, run by :func:`.serving.serve` from its
module's ``main(argv)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def _no_arguments(stack: Path) -> list[str]:
    return []


def _no_env(stack: Path) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Consumer:
    name: str  # trainmon consume NAME; consumer group trainmon-NAME; compose service trainmon-NAME
    main: str  # "module:function", called with the rest of the command line
    extra: str  # pip install 'trainmon[EXTRA]' brings what it imports
    summary: str  # one line: what it does
    doc: str  # the page that describes it
    always_up: bool  # run by every `trainmon up`, else on request (--with NAME)
    # Under `trainmon up`: its arguments and environment, given the stack directory.
    stack_arguments: Callable[[Path], list[str]] = field(default=_no_arguments, compare=False)
    stack_env: Callable[[Path], dict[str, str]] = field(default=_no_env, compare=False)

    @property
    def group(self) -> str:
        """Its consumer group unless told another (each consumer's --group or config)."""
        return f"trainmon-{self.name}"

    @property
    def compose_service(self) -> str:
        return f"trainmon-{self.name}"


CONSUMERS: tuple[Consumer, ...] = (
    Consumer("clickhouse", "trainmon.consumers.clickhouse.service:main", "clickhouse",
             "every record topic into typed ClickHouse tables (chDB by default), exactly once",
             "docs/clickhouse.md", always_up=True,
             stack_arguments=lambda stack: ["--path", str(stack / "clickhouse")]),
    Consumer("alerts", "trainmon.consumers.alerts.service:main", "alerts",
             "anomaly rules over the record topics: alerts to the alert topic and Grafana annotations",
             "docs/alerts.md", always_up=True,
             stack_env=lambda stack: {"TRAINMON_ALERT_STATE_DIR": str(stack / "alerts")}),
    Consumer("tensorboard", "trainmon.consumers.tensorboard_sink:main", "tensorboard",
             "mirrors the runs into TensorBoard event files", "docs/forwarders.md", always_up=False,
             stack_arguments=lambda stack: ["--logdir", str(stack / "tensorboard")]),
    Consumer("aim", "trainmon.consumers.aim_sink:main", "aim",
             "mirrors the runs into an Aim repository", "docs/forwarders.md", always_up=False,
             stack_arguments=lambda stack: ["--repo", str(stack / "aim")]),
    Consumer("wandb", "trainmon.consumers.wandb_sink:main", "wandb",
             "mirrors the runs into Weights & Biases (offline mode works)", "docs/forwarders.md",
             always_up=False,
             # Offline unless the environment says otherwise: `trainmon up` needs no W&B login.
             stack_env=lambda stack: {"WANDB_DIR": str(stack / "wandb"),
                                      "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}),
    Consumer("notify", "trainmon.consumers.notify.sink:main", "alerts",
             "delivers the alert topic's incidents to Alertmanager, apprise URLs (Slack, e-mail, "
             "webhooks ...) and actions, each once", "docs/notify.md", always_up=False,
             # Where to deliver comes from the environment (TRAINMON_ALERTMANAGER_URL,
             # TRAINMON_NOTIFY, TRAINMON_NOTIFY_ACTIONS), passed through as it is.
             stack_env=lambda stack: {"TRAINMON_NOTIFY_STATE_DIR": str(stack / "notify")}),
)
BY_NAME = {consumer.name: consumer for consumer in CONSUMERS}


def listing() -> str:
    """One line per consumer, for ``trainmon consume --list``."""
    width = max(len(c.name) for c in CONSUMERS)
    return "\n".join(f"{c.name:<{width}}  {c.summary} (group {c.group}; "
                     f"pip install 'trainmon[{c.extra}]')" for c in CONSUMERS)


def markdown_table() -> str:
    """The table of docs/consumers.md."""
    rows = ["| consumer | what | consumer group | extra | `trainmon up` | compose service | docs |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in CONSUMERS:
        up = "always" if c.always_up else f"`--with {c.name}`"
        rows.append(f"| `trainmon consume {c.name}` | {c.summary} | `{c.group}` | `{c.extra}` | {up} "
                    f"| `{c.compose_service}` | [{c.doc.removeprefix('docs/')}]({c.doc.removeprefix('docs/')}) |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
