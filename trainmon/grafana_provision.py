"""``trainmon grafana provision --out DIR``: Grafana provisioning for the running stack.

Writes, for the service that holds the embedded chDB directory (``trainmon up``'s, or any
``trainmon consume clickhouse``), what a locally installed Grafana needs to show the
trainmon dashboards and evaluate the alert rule against it:

* ``DIR/provisioning/datasources/trainmon.yaml``: the official ClickHouse data source
  (grafana-clickhouse-datasource, protocol http, uid ``trainmon-clickhouse`` as the
  dashboards expect) pointing at the service's SQL endpoint -- ClickHouse's HTTP
  interface on chDB -- as the read-only ``viewer`` (mode 0600: it holds the password;
  with TLS, the endpoint's certificate as the CA);
* ``DIR/provisioning/dashboards/trainmon.yaml`` and ``DIR/dashboards/*.json``: the
  dashboards of ``trainmon/grafana/dashboards`` (shipped in the package);
* ``DIR/provisioning/alerting/trainmon.yaml``: the alert rule of ``trainmon/grafana``;
* ``DIR/grafana.sh``: the one command that starts a locally installed Grafana (12.x,
  ``grafana`` on PATH) with all of it, its data and plugins kept under ``DIR``.

The endpoint's port is chosen at each start unless the service was given one
(``--listen 127.0.0.1:PORT``): provision again after a restart, or give it a port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import urllib.parse
from pathlib import Path

PLUGIN = "grafana-clickhouse-datasource"
PLUGIN_VERSION = "4.15.0"  # as docker-compose.yml's Grafana
DATASOURCE_UID = "trainmon-clickhouse"
GRAFANA_DIR = Path(__file__).resolve().parent / "grafana"


def _q(value) -> str:
    """A YAML scalar: JSON's quoting is YAML's."""
    return json.dumps(value)


def datasource_yaml(info: dict) -> str:
    url = urllib.parse.urlsplit(info["url"])
    secure = url.scheme == "https"
    lines = [
        "# Written by `trainmon grafana provision`: the trainmon stack's embedded ClickHouse",
        "# (chDB behind ClickHouse's HTTP interface), as its read-only viewer.",
        "apiVersion: 1",
        "",
        "datasources:",
        "  - name: ClickHouse (trainmon)",
        f"    uid: {DATASOURCE_UID}",
        f"    type: {PLUGIN}",
        "    access: proxy",
        "    isDefault: true",
        "    editable: false",
        "    jsonData:",
        f"      host: {_q(url.hostname)}",
        f"      port: {url.port}",
        "      protocol: http",
        f"      secure: {'true' if secure else 'false'}",
        f"      username: {_q(info['viewer'])}",
        f"      defaultDatabase: {_q(info.get('database') or 'trainmon')}",
    ]
    secrets = [f"      password: {_q(info['viewer_password'])}"]
    if secure and info.get("tls_cert"):
        lines.append("      tlsAuthWithCACert: true")
        # Its certificates only: the file may be the broker's PEM, its private key first.
        certificates = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----",
                                  Path(info["tls_cert"]).read_text(), re.S)
        secrets.append(f"      tlsCACert: {_q(''.join(c + chr(10) for c in certificates))}")
    return "\n".join(lines + ["    secureJsonData:"] + secrets) + "\n"


def dashboards_yaml(dashboards: Path) -> str:
    return "\n".join([
        "# Written by `trainmon grafana provision`: the trainmon dashboards, in folder trainmon.",
        "apiVersion: 1",
        "",
        "providers:",
        "  - name: trainmon",
        "    folder: trainmon",
        "    type: file",
        "    disableDeletion: true",
        "    allowUiUpdates: false",
        "    updateIntervalSeconds: 30",
        "    options:",
        f"      path: {_q(str(dashboards))}",
    ]) + "\n"


def grafana_command(out: Path) -> str:
    env = {
        "GF_PATHS_PROVISIONING": out / "provisioning",
        "GF_PATHS_DATA": out / "data",
        "GF_PATHS_PLUGINS": out / "plugins",
        "GF_PATHS_LOGS": out / "logs",
        "GF_PLUGINS_PREINSTALL_SYNC": f"{PLUGIN}@{PLUGIN_VERSION}",
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": out / "dashboards" / "run-overview.json",
    }
    assignments = " ".join(f"{name}={shlex.quote(str(value))}" for name, value in env.items())
    return f'{assignments} grafana server --homepath "${{GRAFANA_HOME:-/usr/share/grafana}}"'


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def provision(info: dict, out: Path, grafana_dir: Path = GRAFANA_DIR) -> list[Path]:
    """Write the provisioning for the endpoint ``info`` under ``out``; the files written."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)  # a password is inside
    written = []
    source = out / "provisioning" / "datasources" / "trainmon.yaml"
    _write(source, datasource_yaml(info), 0o600)
    written.append(source)
    dashboards = out / "dashboards"
    dashboards.mkdir(parents=True, exist_ok=True)
    for old in dashboards.glob("*.json"):
        old.unlink()
    for path in sorted((grafana_dir / "dashboards").glob("*.json")):
        shutil.copyfile(path, dashboards / path.name)
        written.append(dashboards / path.name)
    provider = out / "provisioning" / "dashboards" / "trainmon.yaml"
    _write(provider, dashboards_yaml(dashboards))
    written.append(provider)
    for path in sorted((grafana_dir / "provisioning" / "alerting").glob("*.yaml")):
        target = out / "provisioning" / "alerting" / path.name
        _write(target, path.read_text())
        written.append(target)
    script = out / "grafana.sh"
    _write(script, "#!/bin/sh\n# Starts a locally installed Grafana (12.x) with the trainmon provisioning "
                   "of this folder.\n# GRAFANA_HOME: where Grafana is installed (default "
                   "/usr/share/grafana, as the .deb / .rpm put it).\nexec env "
           + grafana_command(out) + "\n", 0o755)
    written.append(script)
    return written


def _stack_clickhouse_dir() -> Path | None:
    """``trainmon up``'s chDB directory (its --dir default), when no path is given."""
    try:
        from .stack import default_dir
    except Exception:  # noqa: BLE001 - the stack's module unavailable: no fallback
        return None
    return default_dir() / "clickhouse"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainmon grafana",
        description="Grafana for the trainmon stack: 'provision --out DIR' writes data source "
                    "(the embedded ClickHouse endpoint, read-only viewer), dashboards and alert "
                    "rule for the running service, and DIR/grafana.sh to start a local Grafana.")
    parser.add_argument("action", choices=["provision"])
    parser.add_argument("--out", required=True, type=Path, help="folder to write (created, mode 0700)")
    parser.add_argument("--path", help="the service's chDB data directory (default: "
                                       "$TRAINMON_CLICKHOUSE_PATH, else ./trainmon-data/chdb or "
                                       "trainmon up's, whichever a service holds)")
    args = parser.parse_args(argv)
    from .consumers.clickhouse.client import DEFAULT_PATH
    from .consumers.clickhouse.sql_endpoint import find_endpoint

    given = args.path or os.environ.get("TRAINMON_CLICKHOUSE_PATH")
    candidates = [Path(given)] if given else [DEFAULT_PATH, _stack_clickhouse_dir()]
    path = candidates[0]
    info = None
    for candidate in filter(None, candidates):
        info = find_endpoint(candidate)
        if info is not None:
            path = candidate
            break
    if info is None or "viewer_password" not in info:
        print(f"trainmon grafana: no running service answers SQL for {path} (start `trainmon up`, "
              "or `trainmon consume clickhouse --path ...`, or give its --path)", file=sys.stderr)
        return 1
    if not (GRAFANA_DIR / "dashboards").is_dir():
        print(f"trainmon grafana: the dashboards are not here ({GRAFANA_DIR / 'dashboards'}): run "
              "from a trainmon checkout", file=sys.stderr)
        return 1
    provision(info, args.out)
    out = args.out.resolve()
    print(f"Grafana provisioning for {info['url']} (user {info['viewer']}) written to {out}.\n"
          f"Start a locally installed Grafana with it:\n  sh {shlex.quote(str(out / 'grafana.sh'))}\n"
          "then open http://localhost:3000 (admin / admin at first).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
