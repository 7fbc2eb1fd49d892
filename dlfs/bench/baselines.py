"""The systems `dlfs bench` compares, each set up and torn down by the benchmark itself.

    LocalDisk        the source tree on local disk
    SquashfuseLL     a squashfs image (mksquashfs -comp lz4) served by squashfuse_ll
    KernelSquashfs   the same image through the kernel's squashfs on a loop device
    DlfsMount        the dataset ingested into the embedded node, through `dlfs mount`

Each has mount(), unmount() and remount(), a `root` to read under, a `pid` (the FUSE daemons only)
whose CPU time the benchmark charges to it, the processes whose storage reads it charges to it
(serving_pids), and the counters the mount itself publishes, if any (mount_counters: dlfs's bytes
fetched). DlfsNode runs the embedded one-node cluster.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlfs.errors import DlfsError, MountError, NotFound, UsageError
from dlfs.private import private_dirs, private_opener
from dlfs.procmounts import mounts_under
from dlfs.procs import stat_fields

log = logging.getLogger(__name__)
MOUNT_TIMEOUT = 30.0
STATS_TIMEOUT = 30.0  # for a mount to go idle after a workload
IDLE_GAP = 0.25  # seconds over which a mount's fetch counters stay unchanged: it is idle (prefetches done)
# The mount's published counters of what it read to serve reads: chunk bytes read from this node's chunk
# files in place or fetched over the network, prefetches included (dlfs/mount/statsfile.py).
FETCH_COUNTERS = ("fetched_bytes", "fetches")
CLI_TIMEOUT = 1800.0  # an ingest of a big tree
TOOLS = ("mksquashfs", "squashfuse_ll", "fusermount3", "mount", "umount")


# --- the machine ---------------------------------------------------------------------------------
def check_machine() -> None:
    """A one-line UsageError unless this process can drop caches, mount FUSE and loop-mount squashfs."""
    if os.geteuid() != 0:
        raise UsageError("dlfs bench must run as root: it drops the page cache (/proc/sys/vm/drop_caches) "
                         "and loop-mounts squashfs images")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise UsageError(f"dlfs bench needs {', '.join(missing)}: run scripts/install-system-deps.sh "
                         "(Debian: apt-get install squashfs-tools squashfuse fuse3)")
    if not os.path.exists("/dev/fuse"):
        raise UsageError("dlfs bench needs /dev/fuse: this machine cannot mount FUSE file systems")


def drop_caches() -> None:
    """Write dirty pages out, then drop the page cache, dentries and inodes."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process descended from it (found by their parent ids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(stat_fields(int(entry.name))[1])
            except (IndexError, ValueError):
                continue  # exited while listed
            children.setdefault(ppid, []).append(int(entry.name))
    tree = [pid]
    for p in tree:  # grows while walked: breadth first
        tree.extend(children.get(p, ()))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by a process (all its threads: /proc/PID/stat covers them),
    by the processes it started that are still running, and by those it has reaped."""
    total = 0
    for p in process_tree(pid):
        # (a helper that exited since the tree was listed: no fields, nothing to add)
        total += sum(int(f) for f in stat_fields(p)[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def io_read_bytes(pids: list[int], descendants: bool = True) -> int:
    """Bytes the processes `pids` (and their descendants) caused to be read from block devices
    (read_bytes of /proc/PID/io: storage reads, page-cache hits excluded; all threads counted)."""
    total = 0
    for p in {q for pid in pids for q in (process_tree(pid) if descendants else [pid])}:
        try:
            text = Path(f"/proc/{p}/io").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in text.splitlines() if line.startswith("read_bytes:"))
    return total


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise DlfsError(f"process {pid} reports no VmRSS")


def unmount_all_under(base: Path) -> list[Path]:
    """Unmount whatever is still mounted at or below `base` (FUSE or not, lazily if busy)."""
    left = mounts_under(base)
    for mnt in left:
        log.warning("unmounting leftover mount %s", mnt)
        for cmd in (["fusermount3", "-u", str(mnt)], ["umount", str(mnt)], ["umount", "-l", str(mnt)]):
            if subprocess.run(cmd, capture_output=True, check=False).returncode == 0:
                break
    return left


def _wait_mounted(mountpoint: Path, proc: subprocess.Popen[bytes] | None, what: str) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not os.path.ismount(mountpoint):
        if proc is not None and proc.poll() is not None:
            raise MountError(f"{what} exited ({proc.returncode}) before {mountpoint} was mounted")
        if time.monotonic() > deadline:
            raise MountError(f"{what} did not mount {mountpoint} within {MOUNT_TIMEOUT:.0f} s")
        time.sleep(0.01)


def _run(cmd: list[str], what: str, timeout: float = 60.0) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise MountError(f"{what} failed: {why}")


def build_squashfs(src: Path, image: Path) -> None:
    """`mksquashfs SRC IMAGE -comp lz4 -noappend -quiet` (all cores, mksquashfs's default)."""
    image.unlink(missing_ok=True)
    _run(["mksquashfs", str(src), str(image), "-comp", "lz4", "-noappend", "-quiet"], "mksquashfs", CLI_TIMEOUT)


# --- the systems -----------------------------------------------------------------------------------
class System:
    """One way of reading the dataset."""

    name = ""
    label = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounted = False

    @property
    def pid(self) -> int | None:
        """The process serving reads, if one does (FUSE daemons); the kernel's work is not charged."""
        return None

    def serving_pids(self) -> list[int]:
        """The processes that read storage to serve this system (with their descendants: io_read_bytes)."""
        return [self.pid] if self.pid is not None else []

    def mount_counters(self, after: float) -> dict[str, int] | None:
        """FETCH_COUNTERS as the mount publishes them, once idle after `after`; None where none are published."""
        return None

    def mount(self) -> None:
        self.mounted = True

    def unmount(self) -> None:
        self.mounted = False

    def remount(self) -> None:
        """A fresh mount: the kernel's caches of the old one, and the daemon's own, are gone."""
        if self.mounted:
            self.unmount()
        self.mount()


def fresh_start(s: System) -> None:
    """Unmount, drop the page cache, mount: nothing of the dataset is cached anywhere."""
    if s.mounted:
        s.unmount()
    drop_caches()
    s.mount()


class LocalDisk(System):
    name, label = "local", "local disk"


class SquashfuseLL(System):
    name, label = "squashfuse_ll", "squashfuse_ll"

    def __init__(self, image: Path, mountpoint: Path, log_path: Path) -> None:
        super().__init__(mountpoint)
        self.image, self.log_path = image, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wrap(self, argv: list[str]) -> list[str]:
        """How the server's command line is run (a subclass may start it inside a memory group)."""
        return argv

    def mount(self) -> None:
        # -f: stays our child, so its pid is known for CPU accounting (and it is multi-threaded as usual).
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.wrap(["squashfuse_ll", "-f", str(self.image), str(self.root)]),
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        self.mounted = True
        _wait_mounted(self.root, self.proc, "squashfuse_ll")

    def unmount(self) -> None:
        self.mounted = False
        if os.path.ismount(self.root):
            _run(["fusermount3", "-u", str(self.root)], f"fusermount3 -u {self.root}")
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None


class KernelSquashfs(System):
    name, label = "kernel_squashfs", "kernel squashfs"

    def __init__(self, image: Path, mountpoint: Path) -> None:
        super().__init__(mountpoint)
        self.image = image

    def mount(self) -> None:
        # mount(8) sets up the loop device with autoclear: unmounting frees it again.
        _run(["mount", "-t", "squashfs", "-o", "loop,ro", str(self.image), str(self.root)], "mount -t squashfs")
        self.mounted = True

    def unmount(self) -> None:
        self.mounted = False
        if os.path.ismount(self.root):
            _run(["umount", str(self.root)], f"umount {self.root}")


class DlfsNode:
    """The embedded one-node cluster under a private DLFS_HOME, and the CLI pointed at it."""

    def __init__(self, home: Path, transport: str | None = None, io_uring: str | None = None) -> None:
        self.home = home
        self.transport = transport  # passed on to `dlfs node` and `dlfs mount`
        self.io_uring = io_uring  # passed on to `dlfs mount` (None: its default)
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = dict(os.environ, DLFS_HOME=str(home))
        self.env.pop("DLFS_CLUSTER", None)

    def wrap(self, argv: list[str]) -> list[str]:
        """How `dlfs node` and `dlfs mount` are run (a subclass may start them inside a memory group)."""
        return argv

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT, code: Path | None = None) -> str:
        """Run `dlfs ARGS` against this node (with the dlfs of checkout `code`, its native module built in
        place, where given); its stdout, or a DlfsError with its last error line."""
        argv = [sys.executable, "-m", "dlfs", *args]
        # PYTHONSAFEPATH: `-m` puts the working directory first in sys.path, ahead of PYTHONPATH, so run from
        # a checkout (the repository's root) it would import that checkout's dlfs, not `code`'s.
        env = self.env if code is None else dict(self.env, PYTHONPATH=str(code), PYTHONSAFEPATH="1")
        proc = subprocess.run(self.wrap(argv) if args[:1] == ("mount",) else argv, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            if self.proc is not None and self.proc.poll() is not None:  # the cause, not its symptom
                raise DlfsError(f"the bench's dlfs node stopped (exit {self.proc.returncode}, was something else "
                                f"signalling it?) before `dlfs {args[0]}`; see {self.home / 'node.log'}")
            lines = proc.stderr.strip().splitlines()
            raise DlfsError(f"`dlfs {' '.join(args)}` exited {proc.returncode}: {lines[-1] if lines else ''}")
        return proc.stdout

    def start(self, timeout: float = 30.0) -> None:
        private_dirs(self.home)  # the node's state is private (dlfs/private.py), its log with it
        with open(self.home / "node.log", "ab", opener=private_opener) as logf:
            self.proc = subprocess.Popen(self.wrap([sys.executable, "-m", "dlfs", "node", *self.transport_args()]), env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        runtime = self.home / "run" / "node.json"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DlfsError(f"the bench's dlfs node exited ({self.proc.returncode}); see {self.home / 'node.log'}")
            if runtime.exists():
                try:
                    self.cli("status", timeout=10)
                    return
                except DlfsError:
                    pass
            if time.monotonic() > deadline:
                raise DlfsError(f"the bench's dlfs node did not start within {timeout:.0f} s; see {self.home / 'node.log'}")
            time.sleep(0.1)

    def transport_args(self) -> list[str]:
        return [f"--transport={self.transport}"] if self.transport else []

    def mount_args(self) -> list[str]:
        return [*self.transport_args(), *([f"--io-uring={self.io_uring}"] if self.io_uring else [])]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("dlfs node %d did not stop within 30 s of SIGTERM; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop_leftover(self) -> None:
        """Stop a node a previous, interrupted bench left running under this home."""
        try:
            pid = int(json.loads((self.home / "run" / "node.json").read_text())["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, KeyError):
            return
        if any(a == b"dlfs" or a.endswith(b"/dlfs") for a in cmdline) and b"node" in cmdline:
            log.warning("stopping dlfs node %d left by an earlier bench", pid)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def check_unused(self) -> None:
        """Refuse to reuse the home while any node still holds its lock (its state would be wiped)."""
        try:
            fd = os.open(self.home / "run" / "node.lock", os.O_RDWR)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DlfsError(f"a dlfs node is still running on {self.home} (see `fuser {self.home / 'run' / 'node.lock'}`); "
                            "stop it, or give the bench another --dir") from None
        finally:
            os.close(fd)

    def mount_pid(self, mountpoint: Path) -> int:
        """The pid of the mount process serving `mountpoint`, from its record under run/mounts."""
        for record in (self.home / "run" / "mounts").glob("*.json"):
            try:
                doc = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if Path(doc.get("mountpoint", "")) == mountpoint.absolute():
                return int(doc["pid"])
        raise MountError(f"no mount record for {mountpoint} under {self.home / 'run' / 'mounts'}")


class DlfsMount(System):
    name, label = "dlfs", "dlfs"
    DIRECT_IO = ("dlfs_direct_io", "dlfs --direct-io")  # the name and label of a mount with --direct-io
    # ... and of one that reads its chunks through the data daemon (--no-short-circuit), as a compute node
    # without the data does
    VIA_DAEMON = ("dlfs_via_daemon", "dlfs via daemon")
    # ... with a cache of a quarter of the dataset: every epoch of a dataset bigger than the memory the mount
    # may use, read at random (scan mode: each miss a record of its own)
    VIA_DAEMON_SMALL_CACHE = ("dlfs_via_daemon_quarter_cache", "dlfs via daemon, cache 1/4")
    # ... and the same with a disk cache (--cache-dir) that `dlfs warmup` filled: a compute node's later epochs
    VIA_DISK_CACHE = ("dlfs_disk_cache_quarter_cache", "dlfs --cache-dir, cache 1/4")

    def __init__(self, node: DlfsNode, dataset: str, mountpoint: Path, direct_io: bool = False,
                 short_circuit: bool = True, cache_size: int | None = None, cache_dir: Path | None = None,
                 options: Sequence[str] = (), code: Path | None = None) -> None:
        super().__init__(mountpoint)
        self.node, self.dataset = node, dataset
        self.direct_io = direct_io  # mounted with --direct-io: then named dlfs_direct_io
        self.short_circuit = short_circuit
        self.cache_size = cache_size  # --cache-size, in bytes (None: the default)
        self.cache_dir = cache_dir  # --cache-dir (None: none)
        self.options = list(options)  # more `dlfs mount` options, as given
        self.code = code  # the checkout whose dlfs runs the mount (scripts/cold_ab.py); None: this one
        if direct_io:
            self.name, self.label = self.DIRECT_IO
        elif not short_circuit:
            self.name, self.label = (self.VIA_DAEMON if cache_size is None else self.VIA_DAEMON_SMALL_CACHE
                                     if cache_dir is None else self.VIA_DISK_CACHE)
        self._pid: int | None = None
        self.mount_seconds = 0.0

    @property
    def pid(self) -> int | None:
        return self._pid

    def serving_pids(self) -> list[int]:
        """The mount and the node: chunks are read by the mount in place, or fetched from the node."""
        node = self.node.proc.pid if self.node.proc is not None else None
        return [p for p in (self._pid, node) if p is not None]

    def mount_counters(self, after: float, timeout: float = STATS_TIMEOUT) -> dict[str, int]:
        """FETCH_COUNTERS from the mount's published stats (`dlfs stats`'s sample) once it is idle: the
        first sample written at or after `after` (time.time()) whose counters equal those of a sample
        written IDLE_GAP or more before it, also after `after` (nothing fetched meanwhile: prefetches are
        done). The mount is asked for each sample (SAMPLE_NOW) rather than waited for (once a second)."""
        from dlfs.mount.statsfile import SAMPLE_NOW
        from dlfs.stats import read_sample

        deadline = time.monotonic() + timeout
        prev: dict[str, Any] | None = None
        missing_file: str | None = None
        while time.monotonic() < deadline:
            try:
                doc = read_sample(self.node.home, self.root.absolute())
            except NotFound as exc:  # not written yet (a mount just made), or the mount is gone
                missing_file = str(exc)
                time.sleep(0.05)
                continue
            missing_file = None
            if doc["time"] >= after and (prev is None or doc["time"] >= prev["time"] + IDLE_GAP):
                missing = [k for k in FETCH_COUNTERS if k not in doc]
                if missing:
                    raise DlfsError(f"the dlfs mount's stats have no {', '.join(missing)}: the bench cannot count "
                                    "the bytes it read")
                if prev is not None and all(doc[k] == prev[k] for k in FETCH_COUNTERS):
                    return {k: int(doc[k]) for k in FETCH_COUNTERS}
                prev = doc
            if self._pid is not None and time.time() >= (after if prev is None else prev["time"] + IDLE_GAP):
                try:  # its writer runs (it wrote the file read above): a sample now, not in up to a second
                    os.kill(self._pid, SAMPLE_NOW)
                except ProcessLookupError:
                    pass  # gone: its stats file too, said on the next read
            time.sleep(0.05)
        raise DlfsError(missing_file or f"the dlfs mount at {self.root} kept fetching for {timeout:.0f} s "
                        "after a workload ended")

    def engine(self, timeout: float = STATS_TIMEOUT) -> dict[str, Any]:
        """The mount's serving engine as its published stats say (threads, io_uring); {} without one."""
        from dlfs.stats import read_sample

        deadline = time.monotonic() + timeout
        while True:
            try:
                return dict(read_sample(self.node.home, self.root.absolute()).get("engine") or {})
            except NotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def mount(self) -> None:
        """`dlfs mount`; mount_seconds is the command's wall time until it returned with the mount ready."""
        t0 = time.perf_counter()
        self.node.cli("mount", *self.node.mount_args(), *(["--direct-io", "on"] if self.direct_io else []),
                      *([] if self.short_circuit else ["--no-short-circuit"]),
                      *([] if self.cache_size is None else ["--cache-size", str(self.cache_size)]),
                      *([] if self.cache_dir is None else ["--cache-dir", str(self.cache_dir)]),
                      *self.options, self.dataset, str(self.root), timeout=300, code=self.code)
        self.mount_seconds = time.perf_counter() - t0
        self.mounted = True
        self._pid = self.node.mount_pid(self.root)

    def unmount(self) -> None:
        self.mounted = False
        self._pid = None
        if os.path.ismount(self.root):
            self.node.cli("umount", str(self.root), timeout=60)
