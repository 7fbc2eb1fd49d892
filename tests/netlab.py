"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge.

The bridge lives in a namespace of its own, so the machine's own network is never touched. Every
address is one this module assigns (10.251.<lab>.0/24). Processes run in a host's network namespace
through `nsenter --net` alone, so FUSE mounts they make stay visible to the test process.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("nsenter"):
        return "ip (iproute2) and nsenter (util-linux) are needed"
    name = f"dlfs-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace: {exc.stderr.strip()}"
    _ip("netns", "del", name)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str

    def cmd(self, *argv: str) -> list[str]:
        """argv run inside this host's network namespace (mount namespace shared)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]


@dataclass
class NetLab:
    """`hosts` hosts on one bridge; use as a context manager, it always tears down."""

    names: list[str]
    lab: int = field(default_factory=lambda: random.randint(1, 250))
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tag = f"{os.getpid() % 10000}{self.lab}"
        self.switch = f"dlfs-sw-{self.tag}"

    def __enter__(self) -> NetLab:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self.add_host(name, i)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def add_host(self, name: str, i: int) -> Host:
        ns = f"dlfs-{self.tag}-{i}"
        _ip("netns", "add", ns)
        host = Host(name, ns, f"10.251.{self.lab}.{10 + i}")
        self.hosts[name] = host
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
        _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")
        return host

    def cut(self, name: str) -> None:
        """Take a host off the network (its link goes down), as a pulled cable would."""
        i = self.names.index(name)
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def restore(self, name: str) -> None:
        """Put a host that was cut back on the network."""
        i = self.names.index(name)
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
