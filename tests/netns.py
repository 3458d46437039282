"""Hosts on one machine, for real: Linux network namespaces joined by a private link.

Each host is a network namespace with its own loopback and one interface, ``eth0``,
joined to the others through a bridge in a namespace of its own (a switch), on a
private subnet used only inside these namespaces. Processes run in a host with
``ip netns exec``: they share the file system (a "copy to the node" is a copy to
another directory) but not the network. Everything is removed at the end, processes
first. Needs root and iproute2; :func:`unavailable` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"tmprobe{uuid.uuid4().hex[:6]}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode:
        return f"ip netns add failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """``Hosts(["stack", "node0"])``: host i gets address 10.<subnet>.0.<i + 1>."""

    def __init__(self, names: list[str], subnet: int = 231):
        tag = uuid.uuid4().hex[:6]
        self.names = list(names)
        self.namespace = {name: f"tm{tag}-{name}"[:15] for name in names}
        self.address = {name: f"10.{subnet}.0.{i + 1}" for i, name in enumerate(names)}
        self._switch = f"tm{tag}-sw"
        self._made: list[str] = []

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _make(self) -> None:
        for ns in [self._switch, *self.namespace.values()]:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.namespace.items()):
            port = f"p{i}"
            _ip("-n", self._switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self._switch, "link", "set", port, "master", "br0")
            _ip("-n", self._switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return ["ip", "netns", "exec", self.namespace[host], *argv]

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def remove(self) -> None:
        """Every process still in a namespace killed, then the namespaces deleted."""
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
