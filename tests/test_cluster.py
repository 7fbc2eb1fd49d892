"""Cluster tests: four real nodes and a compute-only client, each in its own network namespace.

One cluster serves the whole module (NetLab: n1..n4 run `dlfs node`, c1 is a machine outside the
node list). Tests run in file order and leave the cluster healthy for the next one (killed nodes
are restarted, cut links restored, damage repaired); the one that removes a node for good runs last.
The failover timings of the first two tests are printed (-s) and written to <tmp>/failover.json. Every CLI
command runs inside a host's network namespace with `nsenter --net`, so FUSE mounts made there are
visible to this process, which reads them and compares every byte with the source.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import DLFS, HAVE_FUSE, REPO, dlfs_env, force_unmount, mount_pids, pid_alive
from etcdlab import EtcdCluster, Member, etcd_available
from netlab import Host, NetLab, netns_available

from dlfs.config import DATA_PORT, META_PORT
from dlfs.format.chunk import HEADER, RECORD
from dlfs.mount.records import mount_log

NODES = ["n1", "n2", "n3", "n4"]
CLIENT = "c1"  # a compute-only client: in no cluster file
ETCD = ["e1", "e2", "e3"]  # the control plane: a 3-member etcd, one member per host of its own
LEASE_TTL = 4
CLI_TIMEOUT = 60.0
UP_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
CATCH_UP_TIMEOUT = 30.0
CHUNK_SIZE = "256K"
UNDER_REPLICATED = re.compile(r"chunks with fewer than \S+ healthy replicas: (\d+)")


# --- the cluster ---------------------------------------------------------------------------------
@dataclass
class ClusterNode:
    name: str
    host: Host
    home: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def chunk_ids(self) -> set[str]:
        """Hex ids of the chunk files in this node's store (data/chunks/<2 hex>/<hex>)."""
        return {p.name for p in chunk_files(self.home)}


def chunk_files(home: Path) -> list[Path]:
    root = home / "data" / "chunks"
    found: list[Path] = []
    try:
        subdirs = list(root.iterdir())
    except FileNotFoundError:
        return found
    for d in subdirs:
        try:
            found.extend(p for p in d.iterdir() if len(p.name) == 32)
        except (FileNotFoundError, NotADirectoryError):
            pass
    return found


class NetCluster:
    """The running cluster: its lab, cluster file, node processes, and the CLI in any host."""

    def __init__(self, lab: NetLab, base: Path) -> None:
        self.lab = lab
        self.base = base
        self.cluster_file = base / "cluster.toml"
        self.nodes = {name: ClusterNode(name, lab.hosts[name], base / f"home-{name}", base / f"{name}-node.log")
                      for name in NODES}
        self.homes = {name: base / f"home-{name}" for name in [*NODES, CLIENT]}
        self.extra_procs: list[subprocess.Popen[bytes]] = []
        self.etcd = EtcdCluster([Member(e, lab.hosts[e].address, 2379, 2380, base / f"etcd-{e}", lab.hosts[e].cmd())
                                 for e in ETCD])

    def write_cluster_file(self, path: Path, names: list[str], key_file: str = "cluster.key",
                           replicas: int | None = 2) -> Path:
        lines = [] if replicas is None else [f"replicas = {replicas}"]
        lines.append(f'key_file = "{key_file}"')
        for name in names:
            lines += ["[[node]]", f'name = "{name}"', f'address = "{self.lab.hosts[name].address}"']
        path.write_text("\n".join(lines) + "\n" + (self.etcd.toml(LEASE_TTL) if len(names) > 1 else ""))
        return path

    def argv(self, host: str, *args: str | os.PathLike[str], cluster: Path | None = None) -> list[str]:
        return self.lab.hosts[host].cmd(*DLFS, "--cluster", str(cluster or self.cluster_file), *map(str, args))

    def cli(self, host: str, *args: str | os.PathLike[str], cluster: Path | None = None, check: bool = True,
            timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """`dlfs --cluster FILE ARGS` in `host`'s network namespace, with that host's DLFS_HOME."""
        proc = subprocess.run(self.argv(host, *args, cluster=cluster), env=dlfs_env(self.homes[host]),
                              capture_output=True, text=True, errors="replace", timeout=timeout, cwd=REPO)
        if check and proc.returncode != 0:
            raise AssertionError(f"on {host}: dlfs {' '.join(map(str, args))} exited {proc.returncode}\n"
                                 f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    def popen(self, host: str, *args: str | os.PathLike[str]) -> subprocess.Popen[bytes]:
        """A CLI command left running (stopped at teardown if the test does not)."""
        proc = subprocess.Popen(self.argv(host, *args), env=dlfs_env(self.homes[host]), cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.extra_procs.append(proc)
        return proc

    # nodes
    def start(self, name: str) -> None:
        node = self.nodes[name]
        assert not node.running, f"{name} is already running"
        node.home.mkdir(parents=True, exist_ok=True)
        with open(node.log, "ab") as logf:
            node.proc = subprocess.Popen(
                node.host.cmd(*DLFS, "--cluster", str(self.cluster_file), "node", "--name", name),
                env=dlfs_env(node.home), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int:
        """Signal a node and wait for it (SIGKILL if it lingers); returns its exit status."""
        node = self.nodes[name]
        proc = node.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
                raise AssertionError(f"{name} did not stop within {STOP_TIMEOUT} s of "
                                     f"{signal.Signals(sig).name}:\n{node.log_text()[-3000:]}") from None
        return proc.returncode

    def restart(self, name: str) -> None:
        self.start(name)
        self.wait_up()

    def wait_up(self, timeout: float = UP_TIMEOUT) -> None:
        """Until `dlfs status` run in n1's namespace exits 0 (every node up), bounded."""
        deadline = time.monotonic() + timeout
        last: subprocess.CompletedProcess[str] | None = None
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                if node.proc is not None and node.proc.poll() is not None:
                    raise AssertionError(f"{node.name} exited {node.proc.returncode} while the cluster came up:\n"
                                         f"{node.log_text()[-3000:]}")
            last = self.cli("n1", "status", check=False, timeout=20)
            if last.returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"cluster not up within {timeout} s; last status:\n"
                             f"{last.stdout if last else ''}{last.stderr if last else ''}")

    # mounts
    @contextmanager
    def mounted(self, host: str, dataset: str, mountpoint: Path, cluster: Path | None = None) -> Iterator[Path]:
        """`dlfs mount DATASET MOUNTPOINT` in `host`'s namespace; unmounted on leaving, always."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        try:
            self.cli(host, "mount", dataset, mountpoint, cluster=cluster)
            assert os.path.ismount(mountpoint), f"{mountpoint} is not a mount point after dlfs mount"
            yield mountpoint
        finally:
            if os.path.ismount(mountpoint) and self.cli(host, "umount", mountpoint, check=False,
                                                        timeout=30).returncode != 0:
                force_unmount(mountpoint)

    def mount_log(self, host: str, dataset: str, mountpoint: Path) -> Path:
        return mount_log(self.homes[host], dataset, mountpoint)

    def close(self) -> None:
        """Unmount everything under base, stop every process this cluster started."""
        force_unmount(self.base)
        for proc in self.extra_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        for name in self.nodes:
            try:
                self.stop(name)
            except AssertionError:
                pass  # stop() already killed it
        for home in self.homes.values():
            for pid in mount_pids(home):
                if pid_alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        force_unmount(self.base)
        self.etcd.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    if not HAVE_FUSE:
        pytest.skip("needs /dev/fuse and fusermount3")
    if etcd_available():
        pytest.fail(etcd_available())  # make install provides it: its absence is a broken set-up, not a skip
    base = tmp_path_factory.mktemp("cluster")
    with NetLab([*NODES, CLIENT, *ETCD]) as lab:
        c = NetCluster(lab, base)
        try:
            c.etcd.start()
            subprocess.run([*DLFS, "keygen", str(base / "cluster.key")], env=dlfs_env(base), check=True,
                           capture_output=True, timeout=CLI_TIMEOUT)
            c.write_cluster_file(c.cluster_file, NODES)
            for name in NODES:
                c.start(name)
            c.wait_up()
            yield c
        finally:
            c.close()


# --- datasets and reading ------------------------------------------------------------------------
def make_tree(root: Path, n_files: int, seed: int, dirs: int = 5,
              sizes: tuple[int, int] = (20_000, 200_000)) -> dict[str, bytes]:
    """Random files in `dirs` class folders; returns relative path -> bytes."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n_files):
        rel = f"class{i % dirs:02d}/img{i:05d}.bin"
        data = rng.randbytes(rng.randint(*sizes))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[rel] = data
    return files


@dataclass
class Dataset:
    name: str
    src: Path
    files: dict[str, bytes]
    chunks: dict[str, set[str]] = field(default_factory=dict)  # node -> chunk ids right after ingest


@pytest.fixture(scope="module")
def dataset(cluster: NetCluster) -> Dataset:
    """About 400 files of 20-200 KB ingested on n1 in 256 KiB chunks (spread over every node)."""
    src = cluster.base / "src"
    ds = Dataset("imagenet-like", src, make_tree(src, 400, seed=3))
    cluster.cli("n1", "ingest", src, "--name", ds.name, "--chunk-size", CHUNK_SIZE, timeout=120)
    ds.chunks = {name: node.chunk_ids() for name, node in cluster.nodes.items()}
    return ds


@dataclass
class Epoch:
    seconds: float
    problems: list[str]  # reads that raised, bytes that differ, readers that hung
    slowest_read_s: float  # the longest open+read of one file
    slow_reads: int  # reads that took longer than slow_s


def read_all(mnt: Path, files: dict[str, bytes], seed: int, workers: int = 2,
             on_progress: Callable[[int], None] | None = None, timeout: float = 60.0, slow_s: float = 1.0) -> Epoch:
    """Read every file under `mnt` once, in a random order, from `workers` threads, checking every
    byte against the source. `on_progress(done)` is called after each file."""
    order = list(files)
    random.Random(seed).shuffle(order)
    lock = threading.Lock()
    todo = iter(order)
    done = slow = 0
    slowest = 0.0
    problems: list[str] = []

    def reader() -> None:
        nonlocal done, slow, slowest
        while True:
            with lock:
                rel = next(todo, None)
            if rel is None:
                return
            t = time.perf_counter()
            try:
                with open(mnt / rel, "rb") as f:
                    data = f.read()
                if data != files[rel]:
                    problems.append(f"{rel}: {len(data)} bytes differ from the source's {len(files[rel])}")
            except OSError as exc:
                problems.append(f"{rel}: {exc!r}")
            t = time.perf_counter() - t
            with lock:
                done += 1
                n = done
                slowest = max(slowest, t)
                slow += t > slow_s
            if on_progress is not None:
                on_progress(n)

    threads = [threading.Thread(target=reader, name=f"reader-{i}", daemon=True) for i in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + timeout - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        problems.append(f"readers still blocked after {timeout} s ({done} of {len(order)} files read)")
    return Epoch(elapsed, problems, slowest, slow)


def read_problems(mnt: Path, files: dict[str, bytes], seed: int) -> str:
    """'' if every file reads back exactly, else the first problems, one a line."""
    return "\n".join(read_all(mnt, files, seed).problems[:20])


def ingest_counts(out: str) -> tuple[int, int]:
    """(sent, already stored) from ingest's summary line."""
    m = re.search(r"\((\d+) sent, (\d+) already stored\)", out)
    assert m, f"no chunk counts in the ingest output:\n{out}"
    return int(m.group(1)), int(m.group(2))


def under_replicated(out: str) -> int:
    m = UNDER_REPLICATED.search(out)
    assert m, f"status shows no 'chunks with fewer than R healthy replicas: N' line:\n{out}"
    return int(m.group(1))


def dataset_names(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:] if line.strip()]


# --- the cases, in the order they run ----------------------------------------------------------
@pytest.mark.timeout(150)
def test_reads_survive_a_data_node_killed_mid_epoch(cluster: NetCluster, dataset: Dataset) -> None:
    """Ingest on n1, mount on n3, read everything at random while n2 is SIGKILLed: every byte right."""
    for name, ids in dataset.chunks.items():
        assert ids, f"{name} holds no chunk of {dataset.name}: chunks do not spread over the nodes"
    total = len(dataset.files)
    nbytes = sum(map(len, dataset.files.values()))

    # The same epoch (same random order, 2 readers) on fresh, cold mounts on n3: undisturbed, with
    # n2 SIGKILLed after a third of the files, and undisturbed again once n2 is back (to show drift).
    with cluster.mounted("n3", dataset.name, cluster.base / "mnt-epoch-before") as mnt:
        before = read_all(mnt, dataset.files, seed=1)
    assert not before.problems, "\n".join(before.problems[:20])

    killed_at: list[int] = []
    n2 = cluster.nodes["n2"]

    def kill_n2(done: int) -> None:
        if done >= total // 3 and not killed_at:
            killed_at.append(done)
            assert n2.proc is not None
            n2.proc.send_signal(signal.SIGKILL)

    log = cluster.mount_log("n3", dataset.name, cluster.base / "mnt-epoch-kill")
    try:
        with cluster.mounted("n3", dataset.name, cluster.base / "mnt-epoch-kill") as mnt:
            seen = log.stat().st_size
            kill = read_all(mnt, dataset.files, seed=1, on_progress=kill_n2)
        with open(log, errors="replace") as f:
            f.seek(seen)
            mount_log = f.read()
        assert killed_at, "n2 was never killed"
        assert n2.proc is not None and n2.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if not n2.running:
            cluster.restart("n2")
    assert not kill.problems, f"{len(kill.problems)} bad reads with n2 killed:\n" + \
        "\n".join(kill.problems[:20]) + f"\nmount log:\n{mount_log[-3000:]}"
    # Proof that the epoch did fail over, rather than finish from chunks fetched before the kill.
    assert "n2" in mount_log, f"the mount's log never mentions n2 after it was killed:\n{mount_log[-3000:]}"

    with cluster.mounted("n3", dataset.name, cluster.base / "mnt-epoch-after") as mnt:
        after = read_all(mnt, dataset.files, seed=1)
    assert not after.problems, "\n".join(after.problems[:20])

    result = {
        "files": total, "bytes": nbytes, "readers": 2, "chunk_size": CHUNK_SIZE,
        "killed": "n2 (SIGKILL)", "killed_after_files": killed_at[0],
        "epoch_s": {"no_kill_before": round(before.seconds, 3), "with_kill": round(kill.seconds, 3),
                    "no_kill_after_restart": round(after.seconds, 3)},
        "slowest_read_s": {"no_kill_before": round(before.slowest_read_s, 4),
                           "with_kill": round(kill.slowest_read_s, 4),
                           "no_kill_after_restart": round(after.slowest_read_s, 4)},
        "note": "each pass on a fresh mount (cold chunk cache) in n3's namespace, same random order, "
                "same run; chunk files are in the data nodes' page cache for all three",
    }
    (cluster.base / "failover.json").write_text(json.dumps(result, indent=2))
    print(f"\nfailover cost ({total} files, {nbytes / 1e6:.1f} MB, 2 readers, fresh mounts on n3): epoch "
          f"{before.seconds:.2f} s without a kill, {kill.seconds:.2f} s with n2 SIGKILLed after {killed_at[0]} "
          f"files, {after.seconds:.2f} s again without; slowest read {before.slowest_read_s * 1e3:.0f} / "
          f"{kill.slowest_read_s * 1e3:.0f} / {after.slowest_read_s * 1e3:.0f} ms -> {cluster.base / 'failover.json'}")


@pytest.mark.timeout(90)
def test_scan_mode_fetches_by_the_serving_threads_survive_a_data_node_killed_mid_epoch(
        cluster: NetCluster, dataset: Dataset) -> None:
    """A mount on n3 whose cache is far smaller than the dataset (scan mode: the serving threads fetch
    other nodes' records themselves, on range lanes), read at random while n2 is SIGKILLed: every byte
    right, the threads' fetches from n2 fail over through Python, and they go on fetching from the rest."""
    n2 = cluster.nodes["n2"]
    mnt = cluster.base / "mnt-scan-kill"
    mnt.mkdir(parents=True, exist_ok=True)
    killed_at: list[int] = []

    def stats() -> dict:
        return json.loads(cluster.cli("n3", "stats", mnt, "--json").stdout)

    try:
        cluster.cli("n3", "mount", dataset.name, mnt, "--cache-size", "1M", "--readahead", "64K")
        try:
            first = read_all(mnt, dataset.files, seed=5)  # the threads' lanes open as they ask
            assert not first.problems, "\n".join(first.problems[:20])
            for rel in dataset.files:  # the kernel's copy dropped: the next epoch reaches the mount again
                fd = os.open(mnt / rel, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            before = stats()
            assert before["engine"]["scan"] and before["engine"]["remote_reads"] > 0, before["engine"]  # the threads'
            assert {"n1", "n2"} <= set(before["thread_connections"]), before["thread_connections"]

            def kill_n2(done: int) -> None:
                if done >= len(dataset.files) // 3 and not killed_at:
                    killed_at.append(done)
                    assert n2.proc is not None
                    n2.proc.send_signal(signal.SIGKILL)

            kill = read_all(mnt, dataset.files, seed=6, on_progress=kill_n2)
            after = stats()
        finally:
            cluster.cli("n3", "umount", mnt, check=False, timeout=30)
        assert killed_at and n2.proc is not None and n2.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if not n2.running:
            cluster.restart("n2")
    assert not kill.problems, f"{len(kill.problems)} bad reads with n2 killed:\n" + "\n".join(kill.problems[:20])
    eng, was = after["engine"], before["engine"]
    # The threads fetched through the kill: most of the epoch's files were theirs, n2's failed over.
    assert eng["remote_reads"] - was["remote_reads"] >= len(dataset.files) // 3, (eng, was)
    assert eng["remote_failures"] > was["remote_failures"], (eng, was)  # a lane to n2 broke under a fetch
    assert "n2" in after["failing_nodes"] or after["total"]["failovers"] > before["total"]["failovers"], after


def test_reads_survive_a_cut_link_without_stalling_on_every_read(cluster: NetCluster, dataset: Dataset) -> None:
    """n2's cable is pulled a third of the way into an epoch on n3 (no RST: requests time out): every
    byte is still right, the epoch ends, and n2 is retried with backoff, not on every read."""
    total = len(dataset.files)
    stalled_s = 1.0  # a read this slow waited on n2
    cut_at: list[int] = []

    def cut_n2(done: int) -> None:
        if done >= total // 3 and not cut_at:
            cut_at.append(done)
            cluster.lab.cut("n2")

    try:
        with cluster.mounted("n3", dataset.name, cluster.base / "mnt-epoch-cut") as mnt:
            epoch = read_all(mnt, dataset.files, seed=1, on_progress=cut_n2, timeout=75, slow_s=stalled_s)
    finally:
        cluster.lab.restore("n2")
    assert cut_at, "n2 was never cut"
    assert not epoch.problems, f"{len(epoch.problems)} bad reads with n2 cut off:\n" + "\n".join(epoch.problems[:20])
    # Each stall is one request timing out; with backoff there are a few per epoch, not one per read.
    assert epoch.slow_reads <= 10, f"{epoch.slow_reads} reads took over {stalled_s} s: n2 is retried too often"

    path = cluster.base / "failover.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result["link_cut"] = {"cut_after_files": cut_at[0], "epoch_s": round(epoch.seconds, 3),
                          "slowest_read_s": round(epoch.slowest_read_s, 3),
                          f"reads_over_{stalled_s:g}_s": epoch.slow_reads}
    path.write_text(json.dumps(result, indent=2))
    print(f"\nlink cut: epoch {epoch.seconds:.2f} s with n2's link down after {cut_at[0]} files; slowest read "
          f"{epoch.slowest_read_s:.2f} s, {epoch.slow_reads} reads over {stalled_s:g} s")
    cluster.wait_up()


@pytest.mark.timeout(90)
def test_corrupt_replica_is_skipped_reported_and_repaired(cluster: NetCluster, dataset: Dataset) -> None:
    """Flip a byte in n3's copy of a chunk: a mount on n3 (local replica first) still reads right,
    `dlfs verify` names the chunk, `dlfs repair` heals it, and verify is clean again."""
    cid = sorted(dataset.chunks["n3"])[0]
    path = cluster.nodes["n3"].home / "data" / "chunks" / cid[:2] / cid
    with open(path, "r+b") as f:  # in place: the daemon may hold the file open
        head = f.read(HEADER.size + RECORD.size)
        stored_len = RECORD.unpack_from(head, HEADER.size)[2]
        pos = HEADER.size + RECORD.size + stored_len // 2  # inside the first record's bytes
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))

    log = cluster.mount_log("n3", dataset.name, cluster.base / "mnt-corrupt")
    seen = log.stat().st_size if log.exists() else 0
    with cluster.mounted("n3", dataset.name, cluster.base / "mnt-corrupt") as mnt:
        problems = read_problems(mnt, dataset.files, seed=2)
    assert not problems, problems
    with open(log, errors="replace") as f:
        f.seek(seen)
        assert cid in f.read(), f"the mount on n3 did not log the corrupt replica of chunk {cid}"

    verify = cluster.cli("n1", "verify", dataset.name, check=False, timeout=120)
    report = verify.stdout + verify.stderr
    assert verify.returncode == 5, f"verify exited {verify.returncode}, not 5:\n{report}"
    bad = [line for line in report.splitlines() if cid in line]
    assert bad and any("n3" in line for line in bad), f"verify does not name chunk {cid} on n3:\n{report}"

    repair = cluster.cli("n1", "repair", timeout=120)
    assert cid in repair.stdout, f"repair does not say it copied chunk {cid}:\n{repair.stdout}"

    verify = cluster.cli("n1", "verify", dataset.name, check=False, timeout=120)
    assert verify.returncode == 0, f"verify after repair exited {verify.returncode}:\n{verify.stdout}{verify.stderr}"


@pytest.mark.timeout(60)
def test_wrong_key_is_refused_and_daemons_keep_serving(cluster: NetCluster, dataset: Dataset) -> None:
    """A client with another key is refused (one line about the key; a log line on the node); junk
    on the ports closes only that connection; correct clients are served throughout."""
    subprocess.run([*DLFS, "keygen", str(cluster.base / "wrong.key")], env=dlfs_env(cluster.base), check=True,
                   capture_output=True, timeout=CLI_TIMEOUT)
    wrong = cluster.write_cluster_file(cluster.base / "cluster-wrong-key.toml", NODES, key_file="wrong.key")
    n1 = cluster.nodes["n1"]
    log_seen = len(n1.log_text())

    for cmd in ("datasets", "status"):
        proc = cluster.cli(CLIENT, cmd, cluster=wrong, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode in (3, 9), f"dlfs {cmd} with the wrong key exited {proc.returncode}:\n{out}"
        assert "key" in out.lower(), f"dlfs {cmd} with the wrong key does not say so:\n{out}"
        assert "Traceback" not in out, out
    datasets = cluster.cli(CLIENT, "datasets", cluster=wrong, check=False)
    assert len(datasets.stderr.strip().splitlines()) == 1, f"not a one-line error:\n{datasets.stderr}"

    deadline = time.monotonic() + 5
    while "wrong cluster key" not in n1.log_text()[log_seen:] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "wrong cluster key" in n1.log_text()[log_seen:], f"n1 logged no refusal:\n{n1.log_text()[log_seen:]}"

    # Junk instead of a handshake, on both of n1's ports, from c1.
    junk = (
        "import socket, sys\n"
        f"for port in ({META_PORT}, {DATA_PORT}):\n"
        "    s = socket.create_connection((sys.argv[1], port), timeout=5)\n"
        "    s.sendall(b'\\xff' * 4096 + b'GET / HTTP/1.0\\r\\n\\r\\n')\n"
        "    try:\n"
        "        while s.recv(65536): pass\n"
        "    except OSError: pass\n"
        "    s.close()\n"
    )
    subprocess.run(cluster.lab.hosts[CLIENT].cmd(DLFS[0], "-c", junk, n1.host.address), check=True,
                   capture_output=True, timeout=30)

    assert n1.running, f"n1 died:\n{n1.log_text()[-3000:]}"
    status = cluster.cli(CLIENT, "status", check=False)
    assert status.returncode == 0, f"status with the right key exited {status.returncode}:\n{status.stdout}{status.stderr}"
    assert dataset.name in dataset_names(cluster.cli(CLIENT, "datasets").stdout)


@pytest.mark.timeout(60)
def test_compute_only_client_mounts_with_cluster_file_and_key(cluster: NetCluster, dataset: Dataset) -> None:
    """c1 is in no node list; with a copy of the cluster file and the key and an empty home, it mounts
    and reads every file correctly."""
    conf = cluster.base / "c1-conf"
    conf.mkdir(exist_ok=True)
    shutil.copy2(cluster.cluster_file, conf / "cluster.toml")
    shutil.copy2(cluster.base / "cluster.key", conf / "cluster.key")

    assert dataset.name in dataset_names(cluster.cli(CLIENT, "datasets", cluster=conf / "cluster.toml").stdout)
    with cluster.mounted(CLIENT, dataset.name, cluster.base / "mnt-c1", cluster=conf / "cluster.toml") as mnt:
        problems = read_problems(mnt, dataset.files, seed=7)
    assert not problems, problems


@pytest.mark.timeout(120)
def test_killed_ingest_is_invisible_and_a_rerun_completes(cluster: NetCluster) -> None:
    """SIGKILL an ingest once its first chunks are stored: no dataset appears; running it again
    completes, reuses what was stored, and the result reads back exactly."""
    src = cluster.base / "src-resumed"
    files = make_tree(src, 600, seed=6)
    name = "resumed"
    listed_before = dataset_names(cluster.cli("n1", "datasets").stdout)
    before = {n: node.chunk_ids() for n, node in cluster.nodes.items()}

    proc = cluster.popen("n2", "ingest", src, "--name", name, "--chunk-size", CHUNK_SIZE)
    deadline = time.monotonic() + 60
    new: dict[str, set[str]] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        new = {n: node.chunk_ids() - before[n] for n, node in cluster.nodes.items()}
        if any(new.values()):
            break
        time.sleep(0.005)
    still_running = proc.poll() is None
    proc.kill()
    out = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert any(new.values()), f"no chunk was stored within 60 s of starting the ingest:\n{out}"
    assert still_running, f"the ingest finished before it could be killed (too small a source?):\n{out}"

    for host in NODES:  # on every metadata daemon
        listed = cluster.cli(host, "datasets").stdout
        assert dataset_names(listed) == listed_before, f"a killed ingest is visible from {host}:\n{listed}"

    rerun = cluster.cli("n2", "ingest", src, "--name", name, "--chunk-size", CHUNK_SIZE, timeout=120)
    _, present = ingest_counts(rerun.stdout)
    assert present > 0, f"the re-run stored everything again instead of reusing what was there:\n{rerun.stdout}"
    assert name in dataset_names(cluster.cli("n1", "datasets").stdout)

    with cluster.mounted("n1", name, cluster.base / "mnt-resumed") as mnt:
        problems = read_problems(mnt, files, seed=6)
    assert not problems, problems


@pytest.mark.timeout(120)
def test_metadata_daemon_down_then_catch_up(cluster: NetCluster, dataset: Dataset) -> None:
    """With n1 (which ran the first ingest) stopped, a mount made before reads on and n3 mounts and
    reads; a dataset ingested via n2 meanwhile reaches n1 within 30 s of n1 coming back."""
    try:
        with cluster.mounted(CLIENT, dataset.name, cluster.base / "mnt-before-meta-down") as early:
            assert cluster.stop("n1") == 0, f"n1 did not stop cleanly:\n{cluster.nodes['n1'].log_text()[-3000:]}"
            problems = read_problems(early, dataset.files, seed=8)
        assert not problems, f"a mount made before n1 stopped: {problems}"

        with cluster.mounted("n3", dataset.name, cluster.base / "mnt-meta-down") as mnt:
            problems = read_problems(mnt, dataset.files, seed=5)
        assert not problems, problems

        src = cluster.base / "src-late"
        files = make_tree(src, 60, seed=5, dirs=2)
        cluster.cli("n2", "ingest", src, "--name", "late", "--chunk-size", CHUNK_SIZE, timeout=120)
        only_n3 = cluster.write_cluster_file(cluster.base / "cluster-n3-only.toml", ["n3"], replicas=None)
        on_n3 = cluster.cli("n3", "datasets", cluster=only_n3).stdout
        assert "late" in dataset_names(on_n3), f"the commit via n2 did not reach n3's metadata daemon:\n{on_n3}"
    finally:
        if not cluster.nodes["n1"].running:
            cluster.restart("n1")

    only_n1 = cluster.write_cluster_file(cluster.base / "cluster-n1-only.toml", ["n1"], replicas=None)
    deadline = time.monotonic() + CATCH_UP_TIMEOUT
    listed = ""
    while time.monotonic() < deadline:
        listed = cluster.cli("n1", "datasets", cluster=only_n1).stdout
        if "late" in dataset_names(listed):
            break
        time.sleep(0.5)
    assert "late" in dataset_names(listed), f"n1 did not catch up within {CATCH_UP_TIMEOUT} s:\n{listed}"

    with cluster.mounted("n1", "late", cluster.base / "mnt-late") as mnt:
        problems = read_problems(mnt, files, seed=5)
    assert not problems, problems


# --- the control plane (etcd) --------------------------------------------------------------------
def all_chunks(cluster: NetCluster) -> set[str]:
    return {c for node in cluster.nodes.values() if node.running for c in node.chunk_ids()}


def wait_until(what: str, done: Callable[[], bool], timeout: float) -> float:
    """Seconds until `done()`, polled; fails the test after `timeout`."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def ingested_version(out: str, name: str) -> int:
    m = re.search(rf"ingested {re.escape(name)} version (\d+)", out)
    assert m, f"no 'ingested {name} version N' in:\n{out}"
    return int(m.group(1))


@pytest.mark.timeout(180)
def test_two_ingests_of_one_name_at_once_get_two_versions(cluster: NetCluster) -> None:
    """Two ingests of one name from n1 and n2 at once: two distinct versions, each with its own bytes,
    and `dlfs datasets` the same on every node at once."""
    trees = {host: make_tree(cluster.base / f"race-{host}", 40, seed=30 + i, dirs=2) for i, host in enumerate(["n1", "n2"])}
    procs = {host: cluster.popen(host, "ingest", cluster.base / f"race-{host}", "--name", "race", "--chunk-size",
                                 CHUNK_SIZE) for host in trees}
    outs = {host: p.communicate(timeout=120)[0].decode(errors="replace") for host, p in procs.items()}
    for host, p in procs.items():
        assert p.returncode == 0, f"ingest on {host} exited {p.returncode}:\n{outs[host]}"
    versions = {host: ingested_version(outs[host], "race") for host in outs}
    assert sorted(versions.values()) == [1, 2], versions

    listings = {host: cluster.cli(host, "datasets").stdout for host in NODES}
    assert len(set(listings.values())) == 1, listings
    assert dataset_names(listings["n1"]).count("race") == 2, listings["n1"]
    for host, version in versions.items():
        with cluster.mounted("n4", f"race@{version}", cluster.base / f"mnt-race-{version}") as mnt:
            problems = read_problems(mnt, trees[host], seed=version)
        assert not problems, f"race@{version} (ingested on {host}): {problems}"
    for version in versions.values():
        cluster.cli("n1", "rm", f"race@{version}")


@pytest.mark.timeout(180)
def test_rm_of_a_version_mounted_elsewhere_waits_for_the_mount(cluster: NetCluster) -> None:
    """`dlfs rm` on n1 of a version mounted on n3: n3 reads it byte-exact afterwards, gc leaves its
    chunks, a new mount is refused; the chunks go once n3 unmounts, and, for a mount SIGKILLed, once
    its lease expires."""
    src = cluster.base / "src-held"
    files = make_tree(src, 60, seed=21, dirs=2)
    before = all_chunks(cluster)
    cluster.cli("n1", "ingest", src, "--name", "held", "--chunk-size", CHUNK_SIZE, timeout=120)
    mine = all_chunks(cluster) - before
    assert mine
    with cluster.mounted("n3", "held", cluster.base / "mnt-held") as mnt:
        out = cluster.cli("n1", "rm", "held").stdout
        assert "chunks are freed when the 1 mount on n3 end" in out, out
        assert "held" not in dataset_names(cluster.cli("n2", "datasets").stdout)
        cluster.cli("n4", "gc")
        assert mine <= all_chunks(cluster), "gc freed chunks of a removed version still mounted"
        status = cluster.cli("n2", "status", check=False).stdout
        assert re.search(r"held@1 on n3 at \S*mnt-held", status), status
        problems = read_problems(mnt, files, seed=2)
        assert not problems, f"reads after the removal: {problems}"
        (cluster.base / "mnt-held-again").mkdir()
        again = cluster.cli("n2", "mount", "held@1", cluster.base / "mnt-held-again", check=False)
        assert again.returncode == 4 and "held@1 was removed" in again.stderr, again.stderr
    freed_after = wait_until("chunks freed after the unmount", lambda: not (mine & all_chunks(cluster)), 30)

    # The mount's machine dies: its lease expires, then the chunks go.
    src2 = cluster.base / "src-held2"
    files2 = make_tree(src2, 30, seed=22, dirs=2)
    before = all_chunks(cluster)
    cluster.cli("n1", "ingest", src2, "--name", "held2", "--chunk-size", CHUNK_SIZE, timeout=120)
    mine = all_chunks(cluster) - before
    mnt2 = cluster.base / "mnt-held2"
    mnt2.mkdir()
    cluster.cli("n3", "mount", "held2", mnt2)
    try:
        assert not read_problems(mnt2, files2, seed=3)
        for pid in mount_pids(cluster.homes["n3"]):
            os.kill(pid, signal.SIGKILL)
        out = cluster.cli("n1", "rm", "held2").stdout
        assert "chunks are freed when the 1 mount on n3 end" in out, out
        expiry = wait_until("chunks freed after the dead mount's lease expired",
                            lambda: not (mine & all_chunks(cluster)), LEASE_TTL + 30)
    finally:
        force_unmount(mnt2)
    print(f"\nfreed after unmount: {freed_after:.1f} s; after a SIGKILLed mount: {expiry:.1f} s "
          f"(lease_ttl {LEASE_TTL} s)")
    assert expiry >= LEASE_TTL - 2, f"chunks freed {expiry:.1f} s after the kill, before the lease could expire"


@pytest.mark.timeout(240)
def test_etcd_member_lost_then_quorum_lost_then_back(cluster: NetCluster, dataset: Dataset) -> None:
    """One of three etcd members SIGKILLed (a follower, then the leader): ingest, mount and rm still
    work. Two: mounted data reads byte-exact, ingest fails with one line naming etcd. Members back:
    ingest works again."""
    src = cluster.base / "src-etcd"
    files = make_tree(src, 20, seed=41, dirs=1)
    with cluster.mounted("n3", dataset.name, cluster.base / "mnt-etcd") as mnt:
        try:
            # A follower lost, then (the follower back) the leader: that one costs an election.
            leader = cluster.etcd.leader()
            follower = next(m for m in cluster.etcd.members if m is not leader)
            follower.stop()
            t0 = time.monotonic()
            cluster.cli("n2", "ingest", src, "--name", "follower-down", "--chunk-size", CHUNK_SIZE, timeout=120)
            follower_down_s = time.monotonic() - t0
            cluster.cli("n1", "rm", "follower-down")
            follower.start(cluster.etcd.initial)
            cluster.etcd.wait_healthy()
            leader = cluster.etcd.leader()
            leader.stop()
            t0 = time.monotonic()
            cluster.cli("n2", "ingest", src, "--name", "one-down", "--chunk-size", CHUNK_SIZE, timeout=120)
            one_down_s = time.monotonic() - t0
            with cluster.mounted("n4", "one-down", cluster.base / "mnt-one-down") as m2:
                assert not read_problems(m2, files, seed=1)
            cluster.cli("n1", "rm", "one-down")

            second, last = [m for m in cluster.etcd.members if m.proc is not None]
            second.stop()  # no quorum
            problems = read_problems(mnt, dataset.files, seed=9)
            assert not problems, f"a mounted dataset with etcd's quorum lost: {problems}"
            t0 = time.monotonic()
            failed = cluster.cli("n1", "ingest", src, "--name", "no-quorum", check=False, timeout=120)
            fail_s = time.monotonic() - t0
            assert failed.returncode == 3, f"{failed.returncode}: {failed.stdout}{failed.stderr}"
            lines = failed.stderr.strip().splitlines()
            assert len(lines) == 1 and "etcd" in lines[0] and last.client_url in lines[0], failed.stderr
        finally:
            for m in cluster.etcd.members:
                if m.proc is None:
                    m.start(cluster.etcd.initial)
            cluster.etcd.wait_healthy()
        t0 = time.monotonic()
        cluster.cli("n1", "ingest", src, "--name", "quorum-back", "--chunk-size", CHUNK_SIZE, timeout=120)
        back_s = time.monotonic() - t0
        assert "quorum-back" in dataset_names(cluster.cli("n4", "datasets").stdout)
        problems = read_problems(mnt, dataset.files, seed=10)
        assert not problems, problems
    cluster.cli("n1", "rm", "quorum-back")
    print(f"\ningest of 20 files: {follower_down_s:.1f} s with a follower etcd member down, {one_down_s:.1f} s just "
          f"after the leader was killed, {back_s:.1f} s with all three; failed in {fail_s:.1f} s without quorum")


@pytest.mark.timeout(120)
def test_node_removed_then_repair_restores_replicas(cluster: NetCluster, dataset: Dataset) -> None:
    """Destructive, so last: n4 stops for good. Status reports it and the under-replicated chunks;
    repair restores R copies on the remaining nodes; verify is clean and a fresh mount reads right."""
    assert cluster.stop("n4") == 0, f"n4 did not stop cleanly:\n{cluster.nodes['n4'].log_text()[-3000:]}"

    status = cluster.cli("n1", "status", check=False)
    out = status.stdout + status.stderr
    assert status.returncode == 3, f"status exits {status.returncode} with n4 down (3: a node is down):\n{out}"
    assert "node n4: DOWN" in out, out
    assert under_replicated(out) > 0, f"no chunk is reported under-replicated with n4 down:\n{out}"

    repair = cluster.cli("n1", "repair", timeout=120)
    assert "copied chunk" in repair.stdout, f"repair copied nothing:\n{repair.stdout}"

    status = cluster.cli("n1", "status", check=False)
    out = status.stdout + status.stderr
    assert status.returncode == 3, f"status exits {status.returncode} with n4 still down:\n{out}"
    assert "node n4: DOWN" in out, out
    assert under_replicated(out) == 0, f"chunks still under-replicated after repair:\n{out}"

    verify = cluster.cli("n1", "verify", dataset.name, check=False, timeout=120)
    assert verify.returncode == 0, f"verify with n4 gone, after repair, exited {verify.returncode}:\n" \
                                   f"{verify.stdout}{verify.stderr}"

    with cluster.mounted(CLIENT, dataset.name, cluster.base / "mnt-after-repair") as mnt:
        problems = read_problems(mnt, dataset.files, seed=4)
    assert not problems, problems
