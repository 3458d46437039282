"""A real Alertmanager for the tests: built from its Go module once (``go install
github.com/prometheus/alertmanager/cmd/alertmanager@v0.28.1``, about 45 s) into a cache
outside the repository, then started per test on a free port with a webhook receiver.
Without Go, or when the build fails (no network to fetch the module), the tests skip,
saying why. Newer module versions lack the web UI's built assets and do not build this way.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from .waiting import wait_until

VERSION = "v0.28.1"
CACHE = Path(os.environ.get("TRAINMON_TEST_CACHE", Path.home() / ".cache" / "trainmon-tests"))


def alertmanager_binary() -> Path:
    binary = CACHE / f"alertmanager-{VERSION}" / "alertmanager"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: cannot build Alertmanager from its module")
    binary.parent.mkdir(parents=True, exist_ok=True)
    try:
        built = subprocess.run([go, "install", f"github.com/prometheus/alertmanager/cmd/alertmanager@{VERSION}"],
                               env={**os.environ, "GOBIN": str(binary.parent)}, capture_output=True, text=True,
                               timeout=600, cwd=binary.parent)
    except subprocess.TimeoutExpired:
        pytest.skip(f"building Alertmanager {VERSION} took over 600 s")
    if built.returncode != 0 or not binary.exists():
        pytest.skip(f"could not build Alertmanager {VERSION}: {built.stderr.strip()[-500:]}")
    return binary


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


CONFIG = """\
route:
  receiver: hook
  group_by: [alertname, run_id]
  group_wait: 200ms
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {webhook}
        send_resolved: true
"""


class Alertmanager:
    def __init__(self, directory: Path, webhook: str):
        self.binary = alertmanager_binary()
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (directory / "alertmanager.yml").write_text(CONFIG.format(webhook=webhook))
        self.log = directory / "alertmanager.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Alertmanager":
        self.process = subprocess.Popen(
            [str(self.binary), f"--config.file={self.directory / 'alertmanager.yml'}",
             f"--storage.path={self.directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address="],  # one instance: no gossip port
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        wait_until(self.ready, 30, "Alertmanager ready", pause=0.1, details=lambda: self.log.read_text()[-2000:])
        return self

    def ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/api/v2/{path}", data=data, method="POST" if data else "GET",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read() or b"null")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(10)
