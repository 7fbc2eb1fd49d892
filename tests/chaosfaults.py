"""The chaos scenarios: a three-node cluster (replicas = 2, one etcd member) and the faults done to it
while readers (tests/chaoslab.py) read a mount of it and check every byte. scripts/chaos.py runs them
all and prints a table; tests/test_chaos.py runs the newer ones on a small dataset.

Each fault is a function of the cluster and the readers (to pace its steps by reads) that returns an
Outcome: what was done, what the commands it ran said, and the expectations that did not hold.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from chaoslab import Readers, ReadLog, make_files
from conftest import DLFS, REPO, dlfs_env, force_unmount, start_node_process, wait_for_node
from etcdlab import EtcdCluster, Member, free_ports
from netlab import NetLab

from dlfs.format.chunk import iter_records
from dlfs.mount.records import mount_log

NODES = ["n1", "n2", "n3"]
CHUNK_SIZE = "256K"
STOP_TIMEOUT = 15.0
CLI_TIMEOUT = 120.0
TIGHT_NODE = "n3"  # the node whose chunk store is a small file system of its own (the disk-full scenario)
SPILL_CHUNK = "64K"  # the disk-full scenario's ingest: many small chunks, so many meet the full node


@dataclass
class ClusterNode:
    name: str
    home: Path
    wrap: list[str]  # how to run a command on its host ([] on this machine's network)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def chunks(self) -> Path:
        return self.home / "data" / "chunks"

    def chunk_ids(self) -> set[str]:
        return {p.name for p in self.chunks.glob("*/*") if len(p.name) == 32} if self.chunks.is_dir() else set()

    def chunk_file(self, cid: str) -> Path:
        return self.chunks / cid[:2] / cid


class Cluster:
    """Three `dlfs node`s from one cluster file, on this machine's network or each in a network
    namespace of its own (with a compute-only client host c1 and the etcd member on e1). With
    `tight_store` (bytes), TIGHT_NODE's chunk store is a tmpfs of that size (None if it cannot be
    mounted: `tight_why` says why). Mounts go under base/mnt, with `mount_args` (say a --cache-size
    smaller than the dataset: then the serving threads fetch each record from the daemons themselves);
    `close()` ends all of it."""

    def __init__(self, base: Path, lab: NetLab | None, tight_store: int | None = None,
                 mount_args: Sequence[str] = ()) -> None:
        self.base, self.lab = base, lab
        self.mount_args = list(mount_args)
        self.file = base / "cluster.toml"
        self.tight: Path | None = None
        self.tight_why = "no small chunk store asked for"
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
        try:
            if tight_store is not None:
                self._tight_store(tight_store)
            self.etcd.start()
        except BaseException:
            self.close()  # the small store unmounted, the etcd member stopped
            raise

    def _tight_store(self, size: int) -> None:
        fs = self.base / f"store-{TIGHT_NODE}"
        fs.mkdir(mode=0o700)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(fs)],
                           capture_output=True, text=True, timeout=30, check=False)
        if r.returncode:
            self.tight_why = f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}"
            return
        home = self.nodes[TIGHT_NODE].home
        home.mkdir(mode=0o700)
        (home / "data").symlink_to(fs)  # the node's data directory lives on the small file system
        self.tight, self.tight_why = fs, ""

    def run(self, *args: str | os.PathLike[str], node: str | None = None,
            timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """The CLI with this cluster file, from `node`'s host and home (default: the mount's)."""
        wrap, home = (self.client_wrap, self.client_home) if node is None else \
            (self.nodes[node].wrap, self.nodes[node].home)
        argv = [*wrap, *DLFS, "--cluster", str(self.file), *map(str, args)]
        try:
            return subprocess.run(argv, env=dlfs_env(home), capture_output=True, text=True, timeout=timeout,
                                  cwd=REPO)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"did not end within {timeout:g} s")

    def cli(self, *args: str | os.PathLike[str], node: str | None = None, timeout: float = CLI_TIMEOUT) -> str:
        """The CLI's stdout; RuntimeError if it fails."""
        proc = self.run(*args, node=node, timeout=timeout)
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
            while self.run("status", node=name, timeout=30).returncode:
                if node.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up:\n{node.log.read_text()[-2000:]}")
                time.sleep(0.1)
        else:
            wait_for_node(node.home, node.proc, node.log, self.file, timeout=30)

    def start_all(self) -> None:
        for name in NODES:
            self.start(name)
        for name in NODES:
            self.wait(name)

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

    def down(self) -> list[str]:
        """The nodes whose process has exited."""
        return [n for n, node in self.nodes.items() if node.proc is None or node.proc.poll() is not None]

    def chunk_ids(self) -> set[str]:
        """Every chunk stored on any node."""
        return set().union(*(node.chunk_ids() for node in self.nodes.values()))

    def mount_log(self, mnt: Path, dataset: str = "chaos") -> str:
        """What the mount of `dataset` at `mnt` has logged so far."""
        path = mount_log(self.client_home, dataset, mnt)
        return path.read_text(errors="replace") if path.exists() else ""

    @contextmanager
    def mounted(self, dataset: str, mnt: Path, short_circuit: bool = False) -> Iterator[Path]:
        """A mount of `dataset` at `mnt` (under base/mnt), through the data daemons unless `short_circuit`
        (then, on this machine's network, it reads n1's chunk files itself)."""
        mnt.mkdir(parents=True, exist_ok=True)
        extra = ["--no-short-circuit"] if self.lab is None and not short_circuit else []
        self.cli("mount", dataset, mnt, *extra, *self.mount_args)
        try:
            yield mnt
        finally:
            if self.run("umount", mnt, timeout=60).returncode:
                force_unmount(mnt)

    def close(self) -> None:
        force_unmount(self.base / "mnt")  # only the mounts made here (the small store is unmounted below)
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)  # a frozen node would wait out its stop timeout
        self.stop(list(self.nodes))
        self.etcd.stop()
        if self.tight is not None:
            if subprocess.run(["umount", str(self.tight)], capture_output=True, timeout=30).returncode:
                subprocess.run(["umount", "-l", str(self.tight)], capture_output=True, timeout=30)
            self.tight = None


@dataclass
class Outcome:
    """What a fault did (`fault`), what the commands it ran said (`outcome`, short; `details`, their
    lines), and what it expected that did not hold (`problems`)."""

    fault: str
    outcome: str = "-"
    problems: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # what a user would want to see beside the table


@dataclass
class Scenario:
    name: str
    fault: Callable[[Cluster, Readers], Outcome]
    short_circuit: tuple[bool, ...] = (False,)  # one mount per entry, the readers shared among them
    needs: str = ""  # "netns": a cluster in network namespaces; "tight": TIGHT_NODE's small store


@dataclass
class Row:
    scenario: str
    log: ReadLog | None
    outcome: Outcome


def run_scenario(cluster: Cluster, sc: Scenario, files: dict[str, bytes], readers: int) -> Row:
    """Fresh mounts, readers on them; the fault once they have read the dataset twice; two more passes."""
    with ExitStack() as stack:
        mnts = [stack.enter_context(cluster.mounted("chaos", cluster.base / "mnt" / f"{sc.name}-{i}", short))
                for i, short in enumerate(sc.short_circuit)]
        r = stack.enter_context(Readers(mnts, files, threads=readers, seed=len(sc.name)))
        r.wait_reads(2 * len(files))
        try:
            outcome = sc.fault(cluster, r)
        except Exception as exc:  # a fault that could not be done is a finding too: the table still comes
            outcome = Outcome("fault did not complete", problems=[f"{type(exc).__name__}: {exc}"])
        if cluster.down():  # a fault leaves every node running: the next scenario starts clean
            outcome.problems.append(f"nodes not running after the fault: {', '.join(cluster.down())}")
            for name in cluster.down():
                cluster.start(name)
                cluster.wait(name)
        r.wait_reads(2 * len(files), timeout=120)
        return Row(sc.name, r.stop(), outcome)


# --- the faults ---------------------------------------------------------------------------------------
def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The last line a command wrote to stderr."""
    return last_line(proc.stderr)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def flip_records(path: Path) -> int:
    """Spoil one byte in the middle of every record's stored bytes of a chunk file, in place; returns
    how many records."""
    data = path.read_bytes()
    spots = [rec.offset + rec.stored_len // 2 for rec in iter_records(data, path.name) if rec.stored_len]
    with open(path, "r+b") as f:
        for pos in spots:
            f.seek(pos)
            f.write(bytes([data[pos] ^ 0xFF]))
    return len(spots)


def fill(fs: Path, leave: int) -> Path:
    """Take the room of `fs` until about `leave` bytes are free; returns the file that does."""
    st = os.statvfs(fs)
    filler = fs / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, st.f_bavail * st.f_frsize - leave))
    return filler


def scenarios(hold: float, files: dict[str, bytes]) -> dict[str, Scenario]:
    """Every scenario, by name, in the order the table lists them."""
    npass = len(files)

    def sigstop(cluster: Cluster, r: Readers) -> Outcome:
        cluster.signal("n1", signal.SIGSTOP)
        time.sleep(hold)
        cluster.signal("n1", signal.SIGCONT)
        return Outcome(f"n1 frozen {hold:g} s")

    def partition(cluster: Cluster, r: Readers) -> Outcome:
        assert cluster.lab is not None
        cluster.lab.cut("n1")
        time.sleep(hold)
        cluster.lab.restore("n1")
        return Outcome(f"n1 cut off {hold:g} s")

    def kill(cluster: Cluster, r: Readers) -> Outcome:
        t0 = time.monotonic()
        cluster.stop(["n2"], signal.SIGKILL)
        cluster.start("n2")
        cluster.wait("n2")
        return Outcome(f"n2 down {time.monotonic() - t0:.1f} s")

    def rolling(cluster: Cluster, r: Readers) -> Outcome:
        for name in NODES:
            cluster.stop([name])
            cluster.start(name)
            cluster.wait(name)
        return Outcome("each node stopped and started in turn")

    def restart_all(cluster: Cluster, r: Readers) -> Outcome:
        t0 = time.monotonic()
        cluster.stop(NODES)
        cluster.start_all()
        return Outcome(f"all down, all up in {time.monotonic() - t0:.1f} s")

    return {sc.name: sc for sc in [
        Scenario("sigstop", sigstop), Scenario("partition", partition, needs="netns"), Scenario("kill", kill),
        Scenario("rolling", rolling), Scenario("restart-all", restart_all),
        Scenario("etcd-kill", lambda c, r: etcd_kill(c, r, hold, npass)),
        Scenario("disk-full", lambda c, r: disk_full(c, r, npass), needs="tight"),
        Scenario("corrupt-repair", lambda c, r: corrupt_repair(c, r, npass), short_circuit=(False, True)),
    ]}


def etcd_kill(cluster: Cluster, r: Readers, hold: float, npass: int) -> Outcome:
    """etcd's one member SIGKILLed mid-epoch, then started again on its data. While it is down the
    readers must read a whole pass, and an ingest and a gc must each fail with one line naming etcd;
    once it is back both must work, and the failed ingest must leave no chunk behind."""
    problems: list[str] = []
    down_src, back_src = cluster.base / "src-etcd-down", cluster.base / "src-etcd-back"
    make_files(down_src, 6, seed=31)
    make_files(back_src, 6, seed=32)
    before = cluster.chunk_ids()
    member = cluster.etcd.members[0]
    t0 = time.monotonic()
    member.stop()  # SIGKILL
    try:
        start = r.log.reads
        ingest = cluster.run("ingest", down_src, "--name", "etcd-down", node="n1")
        ingest_s = time.monotonic() - t0
        gc = cluster.run("gc", node="n2")
        gc_s = time.monotonic() - t0 - ingest_s
        r.wait_reads(npass, timeout=max(0.0, 60 - (time.monotonic() - t0)))
        time.sleep(max(0.0, hold - (time.monotonic() - t0)))
        during = r.log.reads - start
    finally:
        member.start(cluster.etcd.initial)
        cluster.etcd.wait_healthy()
    down = time.monotonic() - t0
    if during < npass:
        problems.append(f"only {during} reads in the {down:.1f} s etcd was down (a pass is {npass})")
    for what, proc in (("ingest", ingest), ("gc", gc)):
        lines = proc.stderr.strip().splitlines()
        if proc.returncode == 0:
            problems.append(f"{what} with etcd down exited 0")
        elif proc.returncode == 124:
            problems.append(f"{what} with etcd down {proc.stderr}")
        elif len(lines) != 1 or "etcd" not in lines[0]:
            problems.append(f"{what} with etcd down did not fail in one line naming etcd: {proc.stderr.strip()!r}")
    codes = f"ingest exit {ingest.returncode} in {ingest_s:.1f} s, gc exit {gc.returncode} in {gc_s:.1f} s"
    details = [f"ingest with etcd down: {one_line(ingest)}", f"gc with etcd down: {one_line(gc)}"]
    after = [cluster.run("ingest", back_src, "--name", "etcd-back", node="n1"), cluster.run("gc", node="n2")]
    for what, proc in zip(("ingest", "gc"), after):
        if proc.returncode:
            problems.append(f"{what} after etcd came back exited {proc.returncode}: {one_line(proc)}")
    # Clean up, and see that the failed ingest freed what it stored (or gc did).
    cluster.run("rm", "etcd-down", node="n1")  # NotFound, unless the ingest went through with etcd down
    if not after[0].returncode:
        rm = cluster.run("rm", "etcd-back", node="n1")
        if rm.returncode:
            problems.append(f"rm etcd-back exited {rm.returncode}: {one_line(rm)}")
    gc_end = cluster.run("gc", node="n1")
    if gc_end.returncode:
        problems.append(f"the last gc exited {gc_end.returncode}: {one_line(gc_end)}")
    left = cluster.chunk_ids() - before
    if left:
        problems.append(f"{len(left)} chunks left behind by the ingests once removed and collected")
    back = "ingest, gc ok after" if not any(p.returncode for p in after) else "FAILED after"
    return Outcome(f"etcd down {down:.1f} s", f"{codes} while down; {back}", problems, details)


def disk_full(cluster: Cluster, r: Readers, npass: int) -> Outcome:
    """TIGHT_NODE's chunk store filled to less than a chunk's room, then a replicas=2 ingest of a new
    dataset in small chunks from n1 while the readers read: the ingest completes on the other nodes
    (every chunk on 2 good replicas, `dlfs verify`) and says the full node is full."""
    assert cluster.tight is not None
    problems: list[str] = []
    src = cluster.base / "src-spill"
    make_files(src, 30, seed=41, sizes=(80_000, 120_000))
    tight = cluster.nodes[TIGHT_NODE]
    before = tight.chunk_ids()
    filler = fill(cluster.tight, 16 << 10)
    try:
        start, t0 = r.log.reads, time.monotonic()
        ingest = cluster.run("ingest", src, "--name", "spill", "--chunk-size", SPILL_CHUNK, node="n1")
        took, during = time.monotonic() - t0, r.log.reads - start
        if ingest.returncode:
            problems.append(f"ingest exited {ingest.returncode}: {one_line(ingest)}")
        elif f"data node {TIGHT_NODE} is full" not in ingest.stderr:
            problems.append(f"the ingest did not say that {TIGHT_NODE} is full: {ingest.stderr.strip()!r}")
        verify = cluster.run("verify", "spill", node="n1")
        if not ingest.returncode and (verify.returncode or "every chunk has 2 good replicas" not in verify.stdout):
            problems.append(f"verify spill exited {verify.returncode}: {last_line(verify.stdout)}")
        m = re.search(r"verified (\d+) chunks", verify.stdout)
        spilled = int(m.group(1)) if m else 0
        on_tight = len(tight.chunk_ids() - before)
        if during == 0:
            problems.append(f"no read ended during the {took:.1f} s ingest")
    finally:
        filler.unlink()
        cluster.run("rm", "spill", node="n1")
        cluster.run("gc", node="n1")
    result = f"ingest exit {ingest.returncode} in {took:.1f} s, {spilled} chunks on 2 replicas ({on_tight} on {TIGHT_NODE})"
    said = [line for line in ingest.stderr.splitlines() if "full" in line][:1]
    return Outcome(f"{TIGHT_NODE}'s store full", result, problems, [f"ingest: {line}" for line in said])


def corrupt_repair(cluster: Cluster, r: Readers, npass: int) -> Outcome:
    """Every chunk n1 and n2 both hold is spoiled on n1 (a byte of each record), then deleted there;
    `dlfs repair` copies them back from n2; then n2 is stopped, so n1's new files are their only copies
    (the readers read a pass between steps); n2 is started again at the end."""
    problems: list[str] = []
    n1, n2 = cluster.nodes["n1"], cluster.nodes["n2"]
    both = sorted(n1.chunk_ids() & n2.chunk_ids())
    if not both:
        return Outcome("no chunk on both n1 and n2", problems=["nothing to spoil"])
    logged = [len(cluster.mount_log(m)) for m in r.mnts]
    records = sum(flip_records(n1.chunk_file(cid)) for cid in both)
    # The readers meet the spoiled copies: a pass may find what a mount's read-ahead took in before the
    # spoiling still in its cache (faster on huge pages), so up to four passes until each mount has.
    for _ in range(4):
        r.wait_reads(npass)
        met = [sum(cid in line for cid in both for line in cluster.mount_log(m)[at:].splitlines())
               for m, at in zip(r.mnts, logged)]
        if all(met):
            break
    if not all(met):
        problems.append(f"a mount never logged meeting a spoiled copy (lines naming one: {met})")
    for cid in both:
        n1.chunk_file(cid).unlink()
    r.wait_reads(npass)
    repair = cluster.run("repair", node="n1")
    copied = set(re.findall(r"^copied chunk ([0-9a-f]{32}) from n2 to n1$", repair.stdout, re.M))
    if repair.returncode or copied != set(both):
        problems.append(f"repair exited {repair.returncode} and copied {len(copied)} of {len(both)} chunks to n1: "
                        f"{one_line(repair)}")
    verify = cluster.run("verify", "chaos", node="n1")
    if verify.returncode:
        problems.append(f"verify after repair exited {verify.returncode}: {last_line(verify.stdout)}")
    r.wait_reads(npass)
    cluster.stop(["n2"])
    start = r.log.reads
    r.wait_reads(npass)
    alone = r.log.reads - start
    cluster.start("n2")
    cluster.wait("n2")
    if alone < npass:
        problems.append(f"only {alone} reads with n2 stopped (a pass is {npass})")
    return Outcome(f"{len(both)} chunks ({records} records) spoiled, deleted on n1; repair; n2 stopped",
                   f"mounts logged {'+'.join(map(str, met))} bad copies; repair copied {len(copied)}/{len(both)}, "
                   f"verify exit {verify.returncode}",
                   problems)
