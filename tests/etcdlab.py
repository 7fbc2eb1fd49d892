"""Real etcd members for the tests: one on localhost, or several (one per network namespace host).

Each member runs the `etcd` of Debian's etcd-server (make install puts it there) with its data in the
test's directory; `stop()` SIGKILLs it as a crash would, `start()` brings it back on the same data.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT = 20.0


def etcd_available() -> str | None:
    return None if shutil.which("etcd") else "etcd is not installed (make install installs etcd-server)"


_handed: deque[int] = deque(maxlen=1024)  # ports this process handed out lately: picked, maybe not bound yet


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now, for servers the tests start. Picked below the kernel's range of
    ephemeral ports (ip_local_port_range), not by binding port 0: a port from that range can be given to
    any outgoing connection on the machine between the pick and the server's bind. Each pytest-xdist
    worker picks from its own share of that span, and not a port it handed out lately: two tests at
    once could otherwise pick one port before either bound it (a node then failed to start, "Address
    already in use", about one CI run in ten)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    lo, hi = max(1024, low - 16384), low
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker[2:].isdigit() and count > 1:
        share = (hi - lo) // count
        lo += int(worker[2:]) % count * share
        hi = lo + share
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(lo, hi)
        if port in ports or port in _handed:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use now
        ports.append(port)
    _handed.extend(ports)
    return ports


@dataclass
class Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data: Path
    wrap: list[str] = field(default_factory=list)  # e.g. nsenter into a host's network namespace
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        self.data.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = [*self.wrap, "etcd", "--name", self.name, "--data-dir", str(self.data / "etcd"),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", initial_cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", f"dlfs-test-{os.getpid()}",
                "--heartbeat-interval", "100", "--election-timeout", "1000"]
        log = open(self.data / "etcd.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def answers(self) -> bool:
        """Whether this member serves a linearizable read (it is up and its cluster has a leader)."""
        if not self.wrap:
            try:
                r = httpx.post(f"{self.client_url}/v3/kv/range", json={"key": "eA=="}, timeout=2)
                return r.status_code == 200 and "header" in r.json()
            except (httpx.HTTPError, ValueError):
                return False
        argv = [*self.wrap, "etcdctl", "--endpoints", self.client_url, "--command-timeout=2s", "get", "x"]
        return subprocess.run(argv, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"}).returncode == 0

    def is_leader(self) -> bool:
        """Whether this member leads its cluster now (etcdctl endpoint status)."""
        argv = [*self.wrap, "etcdctl", "--endpoints", self.client_url, "--command-timeout=2s", "endpoint", "status",
                "-w", "json"]
        out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
        if out.returncode:
            return False
        status = json.loads(out.stdout)[0]["Status"]
        return bool(status["header"]["member_id"] == status["leader"])

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None


@dataclass
class EtcdCluster:
    members: list[Member]

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    @property
    def initial(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def start(self) -> EtcdCluster:
        for m in self.members:
            m.start(self.initial)
        self.wait_healthy()
        return self

    def wait_healthy(self, members: list[Member] | None = None, timeout: float = START_TIMEOUT) -> None:
        """Until each member (all, or those given) answers a linearizable read (it has a leader)."""
        deadline = time.monotonic() + timeout
        for m in members or self.members:
            while True:
                if m.answers():
                    break
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited: {(m.data / 'etcd.log').read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} did not answer in {timeout:.0f} s")
                time.sleep(0.1)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def leader(self) -> Member:
        for m in self.members:
            if m.proc is not None and m.is_leader():
                return m
        raise RuntimeError("no etcd member leads")

    def toml(self, lease_ttl: int = 4) -> str:
        urls = ", ".join(f'"{e}"' for e in self.endpoints)
        return f"[etcd]\nendpoints = [{urls}]\nlease_ttl = {lease_ttl}\n"


def local_etcd(base: Path) -> EtcdCluster:
    """One member on localhost, started."""
    client, peer = free_ports(2)
    return EtcdCluster([Member("e1", "127.0.0.1", client, peer, base / "etcd-e1")]).start()
