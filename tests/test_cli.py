"""The command line as a user meets it: --help lists every command with a line saying what
it does; a broker started on a data directory is found again by that directory alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon.broker import free_port
from trainmon.cli import DELEGATED, STACK_ACTIONS

REPO = Path(__file__).resolve().parents[1]


def trainmon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_help_lists_every_command_with_what_it_does():
    shown = trainmon("--help")
    assert shown.returncode == 0
    text = shown.stdout
    assert "``" not in text and "see 'trainmon" not in text  # no reStructuredText, no placeholders
    for command in ["schema", "broker", "consume", *STACK_ACTIONS, *DELEGATED]:
        line = re.search(rf"^    {command}\s*\n?\s+(\S.*)$", text, re.M)
        assert line and len(line.group(1).split()) >= 3, (command, text)


@pytest.mark.kafka
@pytest.mark.slow
def test_broker_status_finds_a_broker_by_its_data_directory(tmp_path):
    data = tmp_path / "broker"
    port = free_port()
    started = trainmon("broker", "start", "--data-dir", str(data), "--port", str(port))
    try:
        assert started.returncode == 0, started.stderr
        assert f"export TRAINMON_KAFKA_BOOTSTRAP=127.0.0.1:{port}" in started.stdout
        status = trainmon("broker", "status", "--data-dir", str(data))  # no --port
        assert status.returncode == 0 and f"running on 127.0.0.1:{port}" in status.stdout, status.stdout
    finally:
        stopped = trainmon("broker", "stop", "--data-dir", str(data))
    assert stopped.returncode == 0
    after = trainmon("broker", "status", "--data-dir", str(data))
    assert after.returncode == 1 and "not running" in after.stdout
