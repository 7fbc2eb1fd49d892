#!/usr/bin/env python3
"""Faults against a real cluster while readers check every byte: a table of what readers saw.

A three-node cluster (replicas = 2, one etcd member) on this machine serves a generated dataset
(--files files of 20-120 KB in 256 KiB chunks). For each scenario a fresh mount is made and
--readers threads read its files round and round with `open(p, "rb").read()`, comparing every byte
with the source and timing every read (tests/chaoslab.py; each file's pages are dropped after its
read, so reads keep reaching the mount). Once the readers have read the dataset twice, the fault
happens; once it is over they read it twice more, then stop.

  sigstop      the mount's first replica (n1) frozen (SIGSTOP) for --hold seconds, then SIGCONT
  partition    n1's link cut for --hold seconds, then restored (network namespaces: root, ip, nsenter)
  kill         n2 SIGKILLed, then started again
  rolling      each node in turn stopped (SIGTERM) and started again
  restart-all  every node stopped (SIGTERM) at once, then all started again (the downtime is printed)

The mount reads through the data daemons (--no-short-circuit; on the namespaced cluster it runs on a
machine outside the cluster, c1), with the default --retry-timeout (60 s).

    sudo .venv/bin/python scripts/chaos.py [--files 300] [--readers 4] [--hold 5] [--only sigstop,restart-all]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from chaoslab import Readers, ReadLog, make_files  # noqa: E402
from conftest import (  # noqa: E402
    DLFS,
    dlfs_env,
    force_unmount,
    start_node_process,
    wait_for_node,
)
from etcdlab import EtcdCluster, Member, etcd_available, free_ports  # noqa: E402
from netlab import NetLab, netns_available  # noqa: E402

SCENARIOS = ["sigstop", "partition", "kill", "rolling", "restart-all"]
NODES = ["n1", "n2", "n3"]
CHUNK_SIZE = "256K"
STOP_TIMEOUT = 15.0


@dataclass
class ClusterNode:
    name: str
    home: Path
    wrap: list[str]  # how to run a command on its host ([] on this machine's network)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


class Cluster:
    """Three `dlfs node`s from one cluster file, on this machine's network or each in a network
    namespace of its own (with a compute-only client host c1 and the etcd member on e1)."""

    def __init__(self, base: Path, lab: NetLab | None) -> None:
        self.base, self.lab = base, lab
        self.file = base / "cluster.toml"
        subprocess.run([*DLFS, "keygen", str(base / "cluster.key")], env=dlfs_env(base), check=True,
                       capture_output=True, timeout=60)
        lines = ["replicas = 2", 'key_file = "cluster.key"']
        if lab is None:
            ports = free_ports(2 * len(NODES))
            client, peer = free_ports(2)
            self.etcd = EtcdCluster([Member("e1", "127.0.0.1", client, peer, base / "etcd-e1")])
            for i, name in enumerate(NODES):
                lines += ["[[node]]", f'name = "{name}"', 'address = "127.0.0.1"',
                          f"meta_port = {ports[2 * i]}", f"data_port = {ports[2 * i + 1]}"]
            self.nodes = {n: ClusterNode(n, base / f"home-{n}", []) for n in NODES}
            self.client_wrap: list[str] = []
            self.client_home = self.nodes["n1"].home  # the mount runs beside n1
        else:
            e1 = lab.hosts["e1"]
            self.etcd = EtcdCluster([Member("e1", e1.address, 2379, 2380, base / "etcd-e1", e1.cmd())])
            for name in NODES:
                lines += ["[[node]]", f'name = "{name}"', f'address = "{lab.hosts[name].address}"']
            self.nodes = {n: ClusterNode(n, base / f"home-{n}", lab.hosts[n].cmd()) for n in NODES}
            self.client_wrap = lab.hosts["c1"].cmd()
            self.client_home = base / "home-c1"
        self.file.write_text("\n".join(lines) + "\n" + self.etcd.toml())
        self.etcd.start()

    def cli(self, *args: str | os.PathLike[str], home: Path | None = None, wrap: list[str] | None = None,
            timeout: float = 120) -> str:
        argv = [*(self.client_wrap if wrap is None else wrap), *DLFS, "--cluster", str(self.file), *map(str, args)]
        proc = subprocess.run(argv, env=dlfs_env(home or self.client_home), capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"dlfs {' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def start(self, name: str) -> None:
        node = self.nodes[name]
        if node.wrap:
            node.home.mkdir(parents=True, exist_ok=True, mode=0o700)
            node.log = self.base / f"{name}-node.log"
            with open(node.log, "ab") as logf:
                node.proc = subprocess.Popen([*node.wrap, *DLFS, "--cluster", str(self.file), "node", "--name", name],
                                             env=dlfs_env(node.home), stdout=logf, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=REPO)
        else:
            node.proc, node.log = start_node_process(node.home, "--cluster", str(self.file), "--name", name)

    def wait(self, name: str) -> None:
        node = self.nodes[name]
        assert node.proc is not None and node.log is not None
        if node.wrap:  # `dlfs status` from the node's own host
            deadline = time.monotonic() + 30
            while subprocess.run([*node.wrap, *DLFS, "--cluster", str(self.file), "status"], env=dlfs_env(node.home),
                                 capture_output=True, timeout=30, cwd=REPO).returncode:
                if node.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up:\n{node.log.read_text()[-2000:]}")
                time.sleep(0.1)
        else:
            wait_for_node(node.home, node.proc, node.log, self.file, timeout=30)

    def stop(self, names: list[str], sig: int = signal.SIGTERM) -> None:
        """Signal the nodes at once, then wait for each (SIGKILL after STOP_TIMEOUT)."""
        procs = [self.nodes[n].proc for n in names]
        for p in procs:
            if p is not None and p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            if p is None:
                continue
            try:
                p.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def signal(self, name: str, sig: int) -> None:
        proc = self.nodes[name].proc
        assert proc is not None
        proc.send_signal(sig)

    @contextmanager
    def mounted(self, dataset: str, mnt: Path) -> Iterator[Path]:
        mnt.mkdir(parents=True, exist_ok=True)
        extra = ["--no-short-circuit"] if self.lab is None else []
        self.cli("mount", dataset, mnt, *extra)
        try:
            yield mnt
        finally:
            try:
                self.cli("umount", mnt, timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired):
                force_unmount(mnt)

    def close(self) -> None:
        force_unmount(self.base)
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
        self.stop(list(self.nodes))
        self.etcd.stop()


@dataclass
class Row:
    scenario: str
    log: ReadLog | None
    note: str = ""


def run_scenario(cluster: Cluster, name: str, files: dict[str, bytes], readers: int, fault: Callable[[], str],
                 mnt: Path) -> Row:
    """A fresh mount, readers on it; the fault once they have read the dataset twice; two more passes."""
    with cluster.mounted("chaos", mnt), Readers(mnt, files, threads=readers, seed=len(name)) as r:
        r.wait_reads(2 * len(files))
        note = fault()
        r.wait_reads(2 * len(files), timeout=120)
        return Row(name, r.stop(), note)


def faults(cluster: Cluster, hold: float) -> dict[str, Callable[[], str]]:
    def sigstop() -> str:
        cluster.signal("n1", signal.SIGSTOP)
        time.sleep(hold)
        cluster.signal("n1", signal.SIGCONT)
        return f"n1 frozen {hold:g} s"

    def partition() -> str:
        assert cluster.lab is not None
        cluster.lab.cut("n1")
        time.sleep(hold)
        cluster.lab.restore("n1")
        return f"n1 cut off {hold:g} s"

    def kill() -> str:
        t0 = time.monotonic()
        cluster.stop(["n2"], signal.SIGKILL)
        cluster.start("n2")
        cluster.wait("n2")
        return f"n2 down {time.monotonic() - t0:.1f} s"

    def rolling() -> str:
        for name in NODES:
            cluster.stop([name])
            cluster.start(name)
            cluster.wait(name)
        return "each node stopped and started in turn"

    def restart_all() -> str:
        t0 = time.monotonic()
        cluster.stop(NODES)
        for name in NODES:
            cluster.start(name)
        for name in NODES:
            cluster.wait(name)
        return f"all down, all up in {time.monotonic() - t0:.1f} s"

    return {"sigstop": sigstop, "partition": partition, "kill": kill, "rolling": rolling, "restart-all": restart_all}


def table(rows: list[Row]) -> str:
    head = ["scenario", "reads", "errors", "wrong bytes", "longest read", "p99 read", "reads > 1 s", "fault"]
    body = []
    for r in rows:
        if r.log is None:
            body.append([r.scenario, "-", "-", "-", "-", "-", "-", r.note])
            continue
        body.append([r.scenario, str(r.log.reads), str(len(r.log.errors)), str(len(r.log.wrong)),
                     f"{r.log.longest:.3f} s", f"{r.log.percentile(0.99) * 1e3:.0f} ms", str(r.log.slow), r.note])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in [head, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def run_on(base: Path, lab: NetLab | None, names: list[str], files: dict[str, bytes], src: Path,
           args: argparse.Namespace) -> list[Row]:
    cluster = Cluster(base, lab)
    try:
        for name in NODES:
            cluster.start(name)
        for name in NODES:
            cluster.wait(name)
        cluster.cli("ingest", src, "--name", "chaos", "--chunk-size", CHUNK_SIZE, home=cluster.nodes["n1"].home,
                    wrap=cluster.nodes["n1"].wrap, timeout=300)
        todo = faults(cluster, args.hold)
        rows = []
        for name in names:
            row = run_scenario(cluster, name, files, args.readers, todo[name], base / f"mnt-{name}")
            print(f"{name}: {row.log.reads if row.log else 0} reads, {row.note}", file=sys.stderr, flush=True)
            rows.append(row)
        return rows
    finally:
        cluster.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=300, help="files in the dataset (default 300)")
    ap.add_argument("--readers", type=int, default=4, help="reader threads (default 4)")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds a node stays frozen or cut off (default 5)")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"scenarios, comma-separated (default all: {','.join(SCENARIOS)})")
    ap.add_argument("--dir", help="work here (default: a temporary directory, removed after)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if etcd_available():
        ap.error(etcd_available())
    with tempfile.TemporaryDirectory(prefix="dlfs-chaos-", dir=args.dir) as tmp:
        base = Path(tmp)
        os.chmod(base, 0o700)
        src = base / "src"
        files = make_files(src, args.files, seed=7)
        rows: list[Row] = []
        local = [n for n in names if n != "partition"]
        if local:
            (base / "local").mkdir()
            rows += run_on(base / "local", None, local, files, src, args)
        if "partition" in names:
            why = netns_available()
            if why:
                rows.append(Row("partition", None, f"skipped: {why}"))
            else:
                (base / "netns").mkdir()
                with NetLab([*NODES, "c1", "e1"]) as lab:
                    rows += run_on(base / "netns", lab, ["partition"], files, src, args)
        rows.sort(key=lambda r: names.index(r.scenario))
    print(table(rows))
    bad = sum(len(r.log.errors) + len(r.log.wrong) for r in rows if r.log)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
