"""Hosts for multi-host tests: Linux network namespaces joined by veth pairs to one bridge.

Each host is a namespace with its loopback and one interface, eth0, at 192.0.2.<n>/24 (TEST-NET-1:
documentation addresses no real network uses); eth0's peer is a port of a bridge in a namespace of
its own, the switch. Nothing is routed anywhere else (no default route, and the switch has no link
to this machine's own namespace), so whatever runs on these hosts can reach only these hosts.
`drop` makes one host's link lose every packet both ways (its switch port disabled, as a cut cable:
no refusal, no reset, no ICMP; tc's netem and nftables need kernel modules a container may lack).
Needs root and iproute2 (`ip`, `bridge`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBNET = "192.0.2"


def run(*argv: str, netns: str | None = None) -> None:
    """`argv` (an `ip` or `tc` command) here, or in `netns`; raises saying what failed."""
    command = list(argv) if netns is None else ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def ip(*arguments: str, netns: str | None = None) -> None:
    run("ip", *arguments, netns=netns)


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    switch_port: str  # eth0's peer on the switch

    def command(self, *argv: str) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """The hosts of one test, made on enter and removed on exit, with every process still in them."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.switch = f"{prefix}-switch"
        self.hosts: dict[str, Host] = {}

    def __enter__(self) -> Network:
        if os.geteuid() != 0:
            raise RuntimeError("network namespaces need root")
        self.remove()  # what an interrupted run left
        ip("netns", "add", self.switch)
        ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        ip("link", "set", "br0", "up", netns=self.switch)
        return self

    def add(self, name: str, number: int) -> Host:
        host = Host(name, f"{self.prefix}-{name}", f"{SUBNET}.{number}", f"p{number}")
        ip("netns", "add", host.netns)
        ip("link", "set", "lo", "up", netns=host.netns)
        # Made in the host's namespace, the peer then moved onto the switch.
        ip("link", "add", "eth0", "type", "veth", "peer", "name", host.switch_port, netns=host.netns)
        ip("link", "set", host.switch_port, "netns", self.switch, netns=host.netns)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        ip("link", "set", "eth0", "up", netns=host.netns)
        ip("link", "set", host.switch_port, "master", "br0", netns=self.switch)
        ip("link", "set", host.switch_port, "up", netns=self.switch)
        self.hosts[name] = host
        return host

    def drop(self, name: str) -> None:
        """Every packet to or from the host is lost from now on: its switch port forwards nothing
        (bridge port state 0, disabled)."""
        run("bridge", "link", "set", "dev", self.hosts[name].switch_port, "state", "0", netns=self.switch)

    def restore(self, name: str) -> None:
        """The host's switch port forwards again (state 3)."""
        run("bridge", "link", "set", "dev", self.hosts[name].switch_port, "state", "3", netns=self.switch)

    def describe(self, path: Path) -> None:
        """Written for a process in another namespace (the test's client) to find the hosts."""
        path.write_text(
            json.dumps(
                {
                    "prefix": self.prefix,
                    "switch": self.switch,
                    "hosts": {h.name: [h.netns, h.address, h.switch_port] for h in self.hosts.values()},
                }
            )
        )

    @classmethod
    def described(cls, path: Path) -> Network:
        data = json.loads(path.read_text())
        network = cls(data["prefix"])
        network.hosts = {name: Host(name, *values) for name, values in data["hosts"].items()}
        return network

    def remove(self) -> None:
        """Kill every process left in this test's namespaces, then delete them (veths go with them)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for netns in [name for name in names if name.startswith(f"{self.prefix}-")]:
            pids = subprocess.run(
                ["ip", "netns", "pids", netns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True)

    def __exit__(self, *exc_info: object) -> None:
        self.remove()
