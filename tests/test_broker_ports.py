"""A port taken between being picked and being bound: a broker's ports are picked free
(free_ports binds port 0 and lets go) and its JVM binds them seconds later, so another
process may take one first. CI saw it once: a node of a 3-broker cluster exited with
"Address already in use" and the cluster's start waited 180 s for it. Now a start on
ports it picked itself picks new ones; a port given by the caller fails at once, named.

Each test holds the port with a listening socket of its own before the start, so the
race is certain, not waited for. Real brokers (JVMs), about 10-40 s each.
"""

from __future__ import annotations

import socket
import time

import pytest

from trainmon.broker import Broker, Cluster, PortTaken
from trainmon.kafka_client import list_topics


def _listening_on(port: int) -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    return held


def test_a_broker_whose_picked_port_is_taken_before_it_starts_listens_on_new_ones(tmp_path):
    broker = Broker(tmp_path / "kafka", heap="256m", throwaway=True)
    taken = broker.port
    with _listening_on(taken):
        broker.start(timeout=90)
        try:
            assert broker.port != taken
            assert (tmp_path / "kafka" / "broker.log").read_text().count("Address already in use") >= 1
            list_topics(bootstrap=broker.bootstrap, timeout_s=10)  # (raises if it does not answer)
        finally:
            broker.stop()


def test_a_port_given_by_the_caller_that_is_in_use_fails_the_start_at_once_naming_it(tmp_path):
    with _listening_on(0) as held:
        port = held.getsockname()[1]
        broker = Broker(tmp_path / "kafka", heap="256m", throwaway=True)
        broker.port = port  # (as `trainmon up` gives its brokers their client ports)
        began = time.monotonic()
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}.*in use"):
            broker.start(timeout=300)
        # The JVM's exit is the answer, not the timeout.
        assert time.monotonic() - began < 120
        assert broker.port == port


def test_a_cluster_whose_nodes_controller_port_is_taken_starts_every_node_on_new_ports(tmp_path):
    cluster = Cluster(tmp_path / "kafka", nodes=3, heap="256m", throwaway=True)
    second = cluster.brokers[1]
    taken = second.controller_port
    with _listening_on(taken):
        cluster.start(timeout=120)
        try:
            assert second.controller_port != taken
            # Every node's voter list names the node's new controller port.
            for broker in cluster.brokers:
                voters = (broker.data_dir / "server.properties").read_text()
                assert f"2@127.0.0.1:{second.controller_port}" in voters
            assert cluster.running() == [True, True, True]
            list_topics(bootstrap=cluster.bootstrap, timeout_s=10)
        finally:
            cluster.stop()
