"""`trainmon up --notify URL`: a NaN at 3 a.m. reaches a person, not only a table. The stack
(Kafka, ClickHouse, alerts, and the notify sink the flag adds) pages a local webhook when
a rank's loss goes NaN; `trainmon status` counts the messages. And the stack's store is
read as any ClickHouse server is: clickhouse-connect over HTTP, as the read-only viewer a
dashboard uses, gets the job's rows and may not write."""

from __future__ import annotations

import subprocess
import sys

import clickhouse_connect

import pytest

from trainmon.broker import free_port
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint

from .notify_support import WebhookServer
from .test_stack import REPO, job_env, trainmon
from .waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

JOB = """
import math, sys
import trainmon.producer as tm
for step in range(60):
    tm.log_step(step, loss=math.nan if step == 40 else 2.0 - step / 100, step_tokens=1024, duration_ms=10.0)
assert tm.flush(30)
"""


def test_up_with_notify_pages_a_webhook_on_a_nan(tmp_path):
    stack_dir = tmp_path / "stack"
    with WebhookServer() as hook:
        up = trainmon("up", "--dir", str(stack_dir), "--port", str(free_port()), "--notify", hook.json_url())
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            assert "notify" in up.stdout  # the flag added the sink
            line = next(l for l in up.stdout.splitlines() if l.startswith("export "))
            env = job_env(line, tmp_path, TRAINMON_RUN_ID="paged-run")
            done = subprocess.run([sys.executable, "-c", JOB], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            messages = wait_until(lambda: [r for r in hook.received.requests
                                           if "nan" in str(r["body"]).lower()], 90, "the NaN's notification")
            text = str(messages[0]["body"])
            assert "paged-run" in text and "40" in text  # names the run and the step
            shown = trainmon("status", "--dir", str(stack_dir)).stdout
            assert "notify" in shown and "failed sends" in shown, shown

            endpoint = find_endpoint(stack_dir / "clickhouse")
            viewer = clickhouse_connect.get_client(
                host="127.0.0.1", port=endpoint["port"], interface="http", username=endpoint["viewer"],
                password=endpoint["viewer_password"], database="trainmon")
            # The page can come before the loader's last batch (two consumers, no order between them).
            wait_until(lambda: viewer.query("SELECT count() FROM step FINAL WHERE run_id = 'paged-run'")
                       .result_rows == [(60,)], 60, "the job's 60 step rows in ClickHouse", pause=0.5)
            with pytest.raises(Exception, match="readonly|READONLY"):
                viewer.command("DROP TABLE step")
        finally:
            trainmon("down", "--dir", str(stack_dir))
