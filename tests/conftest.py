"""Fixtures for the integration tests: a real `dlfs node`, the real CLI, real FUSE mounts.

Every node runs under its own DLFS_HOME in a temporary directory; teardown unmounts whatever is
still mounted under the test's directories, stops the node with SIGTERM and checks it exited 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from etcdlab import free_ports as _free_ports  # one definition, for the tests that import it from here
from etcdlab import local_etcd

from dlfs.procmounts import mounts_under as table_mounts_under

REPO = Path(__file__).resolve().parent.parent
DLFS = [sys.executable, "-m", "dlfs"]
START_TIMEOUT = 15.0
STOP_TIMEOUT = 15.0
CLI_TIMEOUT = 120.0

HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
needs_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse and fusermount3")

# `make test` runs the suite on several pytest-xdist workers; a test marked `serial` changes or measures
# what the whole machine shares (a kernel parameter, timing that other tests' load would change), so it
# runs alone. A test that drops the page cache is marked `drops_caches` instead: it runs beside any other
# test except another such one and those marked `page_cache`, whose assertions need what the kernel
# cached in one step to be there in the next (found by reading every test for it).
SERIAL = "serial: runs with no other test in progress (it sets a kernel parameter, or measures timing or "\
         "counts that other tests' load would change; it may drop the page cache)"
DROPS_CACHES = "drops_caches: drops the page cache; runs with no other drops_caches or page_cache test in progress"
PAGE_CACHE = "page_cache: needs what the kernel caches in one step to be there in the next (no drop_caches meanwhile)"


def pytest_configure(config: pytest.Config) -> None:
    for line in (SERIAL, DROPS_CACHES, PAGE_CACHE):
        config.addinivalue_line("markers", line)


class _Locks:
    """This worker's lock files of the run (opened once), and whether it holds `all` exclusively."""

    def __init__(self, run_dir: Path) -> None:
        self.gate, self.every, self.caches = (open(run_dir / f"dlfs-{name}.lock", "a")
                                              for name in ("gate", "all", "caches"))
        self.alone = False


_locks: dict[Path, _Locks] = {}


def _serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@contextmanager
def _alone_if_serial(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Across the workers of one run: a `serial` test holds `all` exclusively, every other test holds it
    shared. `gate` gives the serial one priority: while it waits for `all`, no new test starts. A run of
    serial tests on one worker keeps both from the first to the last, rather than letting the other
    workers start a test between two of them that the next would then wait for. Besides, a `drops_caches`
    test holds `caches` exclusively and a `page_cache` one holds it shared (taken after `gate` is let go:
    a long drops_caches test holds up only those two kinds)."""
    basetemp = item.config.option.basetemp
    if not os.environ.get("PYTEST_XDIST_WORKER") or not basetemp:
        yield
        return
    run_dir = Path(basetemp).parent  # pytest-N/, the parent of every worker's popen-gwK/
    locks = _locks.get(run_dir) or _locks.setdefault(run_dir, _Locks(run_dir))
    if _serial(item):
        if not locks.alone:
            fcntl.flock(locks.gate, fcntl.LOCK_EX)
            fcntl.flock(locks.every, fcntl.LOCK_EX)
            locks.alone = True
        try:
            yield
        finally:
            if not _serial(nextitem):
                fcntl.flock(locks.every, fcntl.LOCK_UN)
                fcntl.flock(locks.gate, fcntl.LOCK_UN)
                locks.alone = False
        return
    fcntl.flock(locks.gate, fcntl.LOCK_EX)
    fcntl.flock(locks.every, fcntl.LOCK_SH)
    fcntl.flock(locks.gate, fcntl.LOCK_UN)
    caches = (fcntl.LOCK_EX if item.get_closest_marker("drops_caches") else
              fcntl.LOCK_SH if item.get_closest_marker("page_cache") else None)
    try:
        if caches is not None:
            fcntl.flock(locks.caches, caches)
        yield
    finally:
        if caches is not None:
            fcntl.flock(locks.caches, fcntl.LOCK_UN)
        fcntl.flock(locks.every, fcntl.LOCK_UN)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A file's serial tests run one after another at its end: the other workers wait for a run of them
    # once (_alone_if_serial), not once for each.
    first: dict[Path, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (first[item.path], _serial(item)))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Outside pytest-timeout's own hook: the wait for the lock is not part of a test's time limit.
    with _alone_if_serial(item, nextitem):
        yield


def dlfs_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["DLFS_HOME"] = str(home)
    env.pop("DLFS_CLUSTER", None)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Tests read stderr whole: no plain progress lines in it however slow the machine (a test of them sets this).
    env.setdefault("DLFS_PROGRESS_EVERY", "86400")
    return env


def run_dlfs(home: Path, *args: str | os.PathLike[str], check: bool = True,
             timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the dlfs CLI with DLFS_HOME=home; text output captured."""
    proc = subprocess.run([*DLFS, *map(str, args)], env=dlfs_env(home), capture_output=True, text=True,
                          errors="surrogateescape", timeout=timeout, cwd=REPO, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"dlfs {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def mounts_under(base: Path) -> list[str]:
    """Mount points at or below `base`, deepest first (dlfs's parser of /proc/self/mounts)."""
    return [str(p) for p in table_mounts_under(base)]


def force_unmount(base: Path) -> list[str]:
    """Unmount everything under `base` (fusermount3 -u, then umount -l); returns what was mounted."""
    left = mounts_under(base)
    for mnt in left:
        if subprocess.run(["fusermount3", "-u", mnt], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    return left


@dataclass
class Node:
    """A running `dlfs node` and the CLI pointed at it."""

    home: Path
    proc: subprocess.Popen[bytes]
    log: Path
    mounts: list[Path] = field(default_factory=list)
    cluster: Path | None = None  # the cluster file, for a node of a cluster (not the embedded one)
    name: str | None = None
    last_mount: dict[str, Path] = field(default_factory=dict)  # dataset as mounted -> its latest mountpoint

    @property
    def env(self) -> dict[str, str]:
        return dlfs_env(self.home)

    def run(self, *args: str | os.PathLike[str], check: bool = True,
            timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        if self.cluster is not None:
            args = ("--cluster", self.cluster, *args)
        return run_dlfs(self.home, *args, check=check, timeout=timeout)

    def ingest(self, src: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run("ingest", src, "--name", name, *extra)

    def mount(self, name: str, mountpoint: Path, *extra: str) -> Path:
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mounts.append(mountpoint)
        self.last_mount[name] = mountpoint
        self.run("mount", name, mountpoint, *extra)
        assert os.path.ismount(mountpoint)
        return mountpoint

    def umount(self, mountpoint: Path) -> None:
        self.run("umount", mountpoint)
        assert not os.path.ismount(mountpoint)

    def mount_log(self, name: str, mountpoint: Path | None = None) -> Path:
        """The log of the mount of `name` at `mountpoint` (default: the latest mount() of it; one file per
        mount); before any, a path that does not exist yet."""
        from dlfs.mount.records import mount_log

        return mount_log(self.home, name, mountpoint or self.last_mount.get(name, self.home / "not-mounted-yet"))

    def node_log(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        rc = stop_node(self.proc, sig)
        assert rc == 0, f"dlfs node exited {rc} after {signal.Signals(sig).name}:\n{self.node_log()}"

    def start(self) -> None:
        """Start the node again on the same home (after stop)."""
        assert self.proc.poll() is not None
        self.proc, self.log = start_node_process(self.home, *self.node_args())
        wait_for_node(self.home, self.proc, self.log, self.cluster)

    def node_args(self) -> list[str]:
        return [] if self.cluster is None else ["--cluster", str(self.cluster), "--name", str(self.name)]


def notify_socket() -> tuple[socket.socket, str]:
    """A datagram socket for systemd's readiness protocol, and the NOTIFY_SOCKET naming it (abstract)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    name = f"dlfs-test-{os.getpid()}-{os.urandom(6).hex()}"
    s.bind("\0" + name)
    return s, "@" + name


# A node started by start_node_process says READY=1 on its own socket once it serves (what a systemd unit
# waits for): the wait is that message, not a poll of `dlfs status` (a Python process each time).
_ready: weakref.WeakKeyDictionary[subprocess.Popen[bytes], socket.socket] = weakref.WeakKeyDictionary()


def wait_for_node(home: Path, proc: subprocess.Popen[bytes], log: Path, cluster: Path | None = None,
                  timeout: float = START_TIMEOUT) -> None:
    """Until the node says READY=1 (started by start_node_process), or else node.json exists (embedded
    node) and `dlfs status` succeeds; bounded."""
    deadline = time.monotonic() + timeout
    sock = _ready.pop(proc, None)
    runtime = home / "run" / "node.json"
    status = ["status"] if cluster is None else ["--cluster", str(cluster), "status"]

    def up() -> bool:
        if sock is not None:
            return bool(select.select([sock], [], [], 0.1)[0]) and b"READY=1" in sock.recv(4096).split(b"\n")
        if (cluster is not None or runtime.exists()) and run_dlfs(home, *status, check=False,
                                                                   timeout=10).returncode == 0:
            return True
        time.sleep(0.05)
        return False

    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"dlfs node exited {proc.returncode} while starting:\n{log.read_text()}")
            if up():
                return
        raise AssertionError(f"dlfs node did not come up within {timeout} s:\n{log.read_text()}")
    finally:
        if sock is not None:
            sock.close()


def start_node_process(home: Path, *node_args: str) -> tuple[subprocess.Popen[bytes], Path]:
    home.mkdir(parents=True, exist_ok=True, mode=0o700)  # as dlfs makes it: else the node tightens it, and says so
    log = home.parent / f"{home.name}-node.log"
    env = dlfs_env(home)
    sock, env["NOTIFY_SOCKET"] = notify_socket()
    try:
        with open(log, "ab") as logf:
            proc = subprocess.Popen([*DLFS, "node", *node_args], env=env, stdout=logf,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    except BaseException:
        sock.close()
        raise
    _ready[proc] = sock
    return proc, log


def stop_node(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
    """Signal the node and wait (bounded); kills it if it does not stop. Returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            raise AssertionError(f"dlfs node did not stop within {timeout} s of {signal.Signals(sig).name}") from None
    return proc.returncode


@contextmanager
def running_node(home: Path, scratch: Path, *node_args: str) -> Iterator[Node]:
    """A node under `home`; on leaving, unmounts everything under `scratch` and stops the node."""
    proc, log = start_node_process(home, *node_args)
    node = Node(home, proc, log)
    try:
        wait_for_node(home, proc, log)
        yield node
    finally:
        force_unmount(scratch)
        node.stop()


@contextmanager
def running_cluster(base: Path, n: int = 2, replicas: int = 2,
                    extra_args: list[list[str]] | None = None) -> Iterator[list[Node]]:
    """n nodes on localhost from one cluster file, each with its own home; stopped on leaving.
    extra_args[i]: more `dlfs node` arguments for node i."""
    base.mkdir(parents=True, exist_ok=True)
    run_dlfs(base, "keygen", base / "cluster.key")
    ports = _free_ports(2 * n)
    lines = [f"replicas = {replicas}", 'key_file = "cluster.key"']
    for i in range(n):
        lines += ["[[node]]", f'name = "n{i + 1}"', 'address = "127.0.0.1"',
                  f"meta_port = {ports[2 * i]}", f"data_port = {ports[2 * i + 1]}"]
    etcd = local_etcd(base) if n > 1 else None  # more than one node: the catalog lives in etcd
    cluster = base / "cluster.toml"
    cluster.write_text("\n".join(lines) + "\n" + (etcd.toml() if etcd else ""))
    nodes: list[Node] = []
    try:
        for i in range(n):
            home, name = base / f"h{i + 1}", f"n{i + 1}"
            more = extra_args[i] if extra_args else []
            proc, log = start_node_process(home, "--cluster", str(cluster), "--name", name, *more)
            nodes.append(Node(home, proc, log, cluster=cluster, name=name))
        for node in nodes:
            wait_for_node(node.home, node.proc, node.log, cluster)
        yield nodes
    finally:
        force_unmount(base)
        for node in nodes:
            node.stop()
        if etcd is not None:
            etcd.stop()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """A fresh node for one test, DLFS_HOME=tmp_path/home."""
    with running_node(tmp_path / "home", tmp_path) as n:
        yield n


@pytest.fixture
def mounted(node: Node, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mounted(src, name, *ingest_args) -> mountpoint: ingest, mount, and unmount at teardown, always."""
    stack: list[Path] = []

    def make(src: Path, name: str, *ingest_args: str) -> Path:
        mnt = tmp_path / f"mnt-{name}"
        node.ingest(src, name, *ingest_args)
        stack.append(mnt)
        return node.mount(name, mnt)

    yield make
    for mnt in reversed(stack):
        if os.path.ismount(mnt) and node.run("umount", mnt, check=False).returncode != 0:
            force_unmount(mnt)


def mount_stats(home: Path, mountpoint: Path, until: Callable[[dict], bool] = lambda s: True,
                timeout: float = 5.0) -> dict:
    """The counters a mount publishes (dlfs/mount/statsfile.py), once `until` holds of them or `timeout` has
    passed (the mount writes them once a second, and at once when asked with SAMPLE_NOW)."""
    from dlfs.mount.statsfile import SAMPLE_NOW, stats_file

    deadline = time.monotonic() + timeout
    while True:
        try:
            doc = json.loads(stats_file(home, mountpoint).read_text())
        except (OSError, ValueError):  # not written yet
            doc = None
        if doc is not None and (until(doc) or time.monotonic() > deadline):
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"no stats from the mount at {mountpoint} within {timeout} s")
        if doc is not None:  # its writer runs: a new sample now
            try:
                os.kill(doc["pid"], SAMPLE_NOW)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def mount_stats_from_now(home: Path, mountpoint: Path, timeout: float = 5.0) -> dict:
    """The first counters the mount writes after this call: they count everything done before it."""
    then = mount_stats(home, mountpoint, timeout=timeout)["time"]
    doc = mount_stats(home, mountpoint, until=lambda s: s["time"] > then, timeout=timeout)
    assert doc["time"] > then, f"the mount at {mountpoint} wrote no stats for {timeout} s"
    return doc


def mount_pids(home: Path) -> list[int]:
    """Pids of the mount processes recorded under a home."""
    pids = []
    for rec in (home / "run" / "mounts").glob("*.json"):
        try:
            pids.append(int(json.loads(rec.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            pass
    return pids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, not us, reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond: Callable[[], object], timeout: float, what: str, every: float = 0.01) -> None:
    """Until `cond()` is true, polled every `every` s; AssertionError naming `what` after `timeout` s.
    The bound only turns a hang into a failure: nothing is asserted about how long it took."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)


async def trio_wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    """wait_for inside trio, on any clock (a MockClock included): between polls every other task runs
    until all are blocked; `timeout` is real seconds."""
    import trio.testing

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await trio.testing.wait_all_tasks_blocked(0.01)


def one_line_error(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """The one `dlfs: error: ...` line a failed command printed, having exited with `code` (README, Errors)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlfs: error: "), proc.stderr
    return lines[0]
