"""Hosts on one machine, for real: the stack on one network namespace with `trainmon up
--listen`, a 2-node x 2-rank torchrun job (gloo, CPU) on two others, configured only by
the env lines `up` printed and its CA file (one node's ranks through the node's relay);
then clients the stack must refuse."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import netns
from .clickhouse_service import REPO

NOT_HERE = netns.unavailable()
pytestmark = [pytest.mark.kafka, pytest.mark.slow,
              pytest.mark.skipif(NOT_HERE is not None, reason=NOT_HERE or "")]

STEPS = 25
RANKS = 4
REFUSED = ["no-credentials", "wrong-password", "plaintext", "no-ca", "unknown-principal",
           "writer-consumes"]


def printed_env(output: str) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines `trainmon up` printed."""
    env = {}
    for line in output.splitlines():
        if line.startswith("export "):
            for assignment in line.removeprefix("export ").split():
                name, _, value = assignment.partition("=")
                env[name] = value
    return env


def on_node(job_env: dict[str, str], node_dir: Path) -> dict[str, str]:
    """A node's environment: its own, the printed lines, the CA where it copied it."""
    node_dir.mkdir(parents=True, exist_ok=True)
    ca = node_dir / "ca.pem"
    shutil.copy(job_env["TRAINMON_KAFKA_SSL_CAFILE"], ca)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMON_")}
    return {**base, **job_env, "TRAINMON_KAFKA_SSL_CAFILE": str(ca),
            "TRAINMON_SPILL_DIR": str(node_dir / "spill"), "PYTHONPATH": str(REPO),
            # gloo picks its address from the host name, which every namespace shares
            "GLOO_SOCKET_IFNAME": "eth0"}


def sql(hosts, stack_dir: Path, query: str) -> list[dict]:
    done = hosts.run("stack", [sys.executable, "-m", "trainmon", "sql", "--path", str(stack_dir / "clickhouse"),
                               "-f", "jsonl", query], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wait_for_rows(hosts, stack_dir: Path, query: str, expected, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (rows := sql(hosts, stack_dir, query)) != expected:
        assert time.monotonic() < deadline, f"{query} gave {rows}, expected {expected}"
        time.sleep(0.5)
    return rows


def topic_ends(hosts, stack_dir: Path) -> dict:
    """Every topic's end offsets, asked as the stack's admin on the stack's host."""
    done = hosts.run("stack", [sys.executable, "-m", "tests.cluster_probe", "topic-ends", str(stack_dir)],
                     capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_two_node_job_logs_through_a_secured_stack_and_strangers_are_refused(tmp_path):
    stack_dir = tmp_path / "stack"
    with netns.Hosts(["stack", "node0", "node1"]) as hosts:
        address = hosts.address["stack"]
        up = hosts.run("stack", [sys.executable, "-m", "trainmon", "up", "--dir", str(stack_dir),
                                 "--listen", address], capture_output=True, text=True, timeout=300, cwd=REPO)
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            job_env = printed_env(up.stdout)
            assert job_env["TRAINMON_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
            assert job_env["TRAINMON_KAFKA_SASL_USERNAME"] == "writer"
            assert job_env["TRAINMON_KAFKA_BOOTSTRAP"].startswith(address)

            # node1's ranks send through the node's relay (trainmon relay), node0's each
            # with its own Kafka client: both reach the secured stack the same.
            relay_env = on_node(job_env, tmp_path / "node1")
            relay_socket = str(tmp_path / "node1" / "relay.sock")
            relay = hosts.popen("node1", [sys.executable, "-m", "trainmon", "relay", "--socket", relay_socket],
                                env=relay_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            nodes = []
            for rank, node in enumerate(["node0", "node1"]):
                env = {**on_node(job_env, tmp_path / node), "TRAINMON_RUN_ID": "two-nodes",
                       "JOB_STEPS": str(STEPS)}
                if node == "node1":
                    env["TRAINMON_RELAY"] = relay_socket
                nodes.append(hosts.popen(node, [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--node-rank", str(rank), "--master-addr", hosts.address["node0"],
                    "--master-port", "29512", "tests/cluster_job.py"],
                    env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outputs = [node.communicate(timeout=300)[0] for node in nodes]
            for node, output in zip(nodes, outputs):
                assert node.returncode == 0, output[-3000:]
            assert sum(output.count("delivered=True") for output in outputs) == RANKS, outputs
            relay.terminate()
            relay_log = relay.communicate(timeout=60)[0]
            assert relay.returncode == 0 and "connections=2" in relay_log, relay_log[-3000:]

            expected = [{"rank": rank, "steps": STEPS, "rows": STEPS} for rank in range(RANKS)]
            wait_for_rows(hosts, stack_dir,
                          "SELECT rank, uniqExact(step) AS steps, count() AS rows FROM trainmon.step FINAL "
                          "WHERE run_id = 'two-nodes' GROUP BY rank ORDER BY rank", expected)
            # Exactly once, FINAL or not: no copy of any record.
            assert sql(hosts, stack_dir, "SELECT count() AS n FROM trainmon.step WHERE run_id = 'two-nodes'") \
                == [{"n": RANKS * STEPS}]

            # The SQL endpoint (ClickHouse's HTTP interface) listens on the stack's address
            # too, over HTTPS with the stack's certificate: a node reaches it with the CA.
            endpoint = json.loads((stack_dir / "clickhouse" / "sql-endpoint.json").read_text())
            assert endpoint["url"].startswith(f"https://{address}:"), endpoint["url"]
            ping = ("import ssl, sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/ping', "
                    "context=ssl.create_default_context(cafile=sys.argv[2]), timeout=10).read().decode())")
            pinged = hosts.run("node0", [sys.executable, "-c", ping, endpoint["url"], job_env["TRAINMON_KAFKA_SSL_CAFILE"]],
                               capture_output=True, text=True, timeout=60)
            assert pinged.stdout.strip() == "Ok.", pinged.stderr

            # Clients the stack must refuse, each from a compute node, each told why.
            before = topic_ends(hosts, stack_dir)
            # Each a process of its own (a producer says a cause once per process), all at once.
            probes = [hosts.popen("node0", [sys.executable, "-m", "tests.cluster_probe", mode,
                                            str(tmp_path / f"probe-{mode}" / "spill")],
                                  env=on_node(job_env, tmp_path / f"probe-{mode}"), cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for mode in REFUSED]
            for mode, probe in zip(REFUSED, probes):
                out, err = probe.communicate(timeout=120)
                assert probe.returncode == 0, err[-2000:]
                said = json.loads(out.strip().splitlines()[-1])
                assert said["error"] and said["after_s"] <= 10, (mode, said)
                cause = {"no-credentials": "wants a login", "wrong-password": "refused the login",
                         "plaintext": "wants TLS", "no-ca": "not trusted",
                         "unknown-principal": "refused the login",
                         "writer-consumes": "may not do it"}[mode]
                assert cause in said["error"], (mode, said["error"])
                if mode != "writer-consumes":
                    assert not said["delivered"] and said["kept"] == 5, (mode, said)  # kept, as in an outage
                else:
                    assert said["read"] == 0
            assert topic_ends(hosts, stack_dir) == before, "a refused client's records reached a topic"
        finally:
            down = hosts.run("stack", [sys.executable, "-m", "trainmon", "down", "--dir", str(stack_dir)],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
            assert down.returncode == 0, down.stderr
