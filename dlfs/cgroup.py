"""Memory cgroups: the limit this process really lives under, how much of it is in use, and groups that
the bench and the tests create to run a job within a limit (cgroup v1 or v2, whichever has the memory
controller here).

A container or a Slurm job sees the host's physical memory in /proc/meminfo, but the kernel kills it
at its group's limit: the cache's default size and the mount's pressure watch read the tightest limit
on the path from this process's group to the root instead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 62  # v1 writes "no limit" as a huge page-rounded number


@dataclass(frozen=True, slots=True)
class Mount:
    version: int  # 1 or 2
    root: str  # the cgroup path that the mount shows at its top (not "/" inside a cgroup namespace)
    path: Path  # where it is mounted


def _mounts() -> list[Mount]:
    """The cgroup mounts that carry the memory controller (v1) and the unified hierarchy (v2)."""
    out: list[Mount] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3:
            continue
        fstype, options = r[0], r[2].split(",") + f[5].split(",")
        if fstype == "cgroup2":
            out.append(Mount(2, f[3], Path(f[4])))
        elif fstype == "cgroup" and "memory" in options:
            out.append(Mount(1, f[3], Path(f[4])))
    return out


def _own_paths() -> dict[int, str]:
    """This process's memory cgroup path per version (1: the memory controller's line, 2: the "0::" line)."""
    paths: dict[int, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def _dir(m: Mount, path: str) -> Path:
    """The directory of cgroup `path` under mount `m`."""
    if m.root != "/" and (path == m.root or path.startswith(m.root + "/")):
        path = path[len(m.root):]
    elif m.root != "/" and path == "/":  # a cgroup namespace: "/" is the group the mount shows
        path = ""
    return m.path / path.lstrip("/")


def _read_int(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _stat(p: Path) -> dict[str, int]:
    out = {}
    try:
        for line in p.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The memory this process may use: physical memory, or a cgroup's limit where that is tighter."""

    physical: int
    limit: int | None  # the tightest cgroup limit on the way to the root; None: no limit
    group: Path | None  # the group that sets it

    @property
    def effective(self) -> int:
        if self.limit is None or (self.physical and self.limit >= self.physical):
            return self.physical
        return self.limit

    @property
    def limited(self) -> bool:
        return self.effective != self.physical

    def describe(self) -> str:
        from dlfs.units import human_bytes

        if not self.limited:
            return f"no memory cgroup limit below physical memory ({human_bytes(self.physical)})"
        v = "memory.max" if self.group is not None and (self.group / "memory.max").exists() else "memory.limit_in_bytes"
        return f"memory cgroup limit {human_bytes(self.effective)} ({self.group}/{v})"

    def unreclaimable(self) -> int | None:
        """Bytes of the limiting group the kernel cannot reclaim without swap (anonymous and shared
        memory, the memfd cache included): its page cache would be reclaimed before an OOM kill."""
        if self.group is None:
            return None
        return unreclaimable(self.group)


def unreclaimable(group: Path) -> int | None:
    """Anonymous + shared memory charged to `group` and its children (v1 or v2 memory.stat)."""
    st = _stat(group / "memory.stat")
    if not st:
        return None
    if "anon" in st:  # v2
        return st["anon"] + st.get("shmem", 0)
    return st.get("total_rss", st.get("rss", 0)) + st.get("total_shmem", st.get("shmem", 0))


def memory_limit() -> MemoryLimit:
    """The tightest memory limit on the path from this process's cgroup to the root, v1 and v2."""
    best: tuple[int, Path] | None = None
    own = _own_paths()
    for m in _mounts():
        path = own.get(m.version)
        if path is None:
            continue
        d = _dir(m, path)
        name = "memory.max" if m.version == 2 else "memory.limit_in_bytes"
        while True:
            value = _read_int(d / name)
            if value is not None and (best is None or value < best[0]):
                best = (value, d)
            if d == m.path or d.parent == d:
                break
            d = d.parent
    return MemoryLimit(physical_memory(), best[0] if best else None, best[1] if best else None)


class MemoryGroup:
    """A memory cgroup made for a job (root only): create it with a limit, start commands in it, read
    its OOM kills and peak, remove it. v1's memory controller where it is mounted, else v2's."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, name: str, limit: int) -> MemoryGroup:
        """A fresh group `name` (an old one of that name is removed first) with `limit` bytes; OSError
        (with why) where no memory cgroup can be made here."""
        mounts = _mounts()
        v1 = [m for m in mounts if m.version == 1]
        v2 = [m for m in mounts if m.version == 2
              and "memory" in _read_text(m.path / "cgroup.subtree_control").split()]
        if not v1 and not v2:
            raise OSError("no memory cgroup controller is mounted here (v1 memory, or v2 with memory in "
                          "the root's cgroup.subtree_control)")
        m = v1[0] if v1 else v2[0]
        # Nested in this process's own group, so the limits above it still hold for the job.
        own = _own_paths().get(m.version)
        parent = _dir(m, own) if own is not None else m.path
        path = (parent if parent.is_dir() else m.path) / name
        if path.exists():
            cls(path, m.version).remove()
        path.mkdir(mode=0o755)
        group = cls(path, m.version)
        try:
            if m.version == 1:
                (path / "memory.limit_in_bytes").write_text(str(limit))
                # No swap here, but where there is some the job should not use it to pass the limit.
                if (path / "memory.memsw.limit_in_bytes").exists():
                    try:
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                    except OSError:
                        pass
            else:
                (path / "memory.max").write_text(str(limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
        except OSError:
            group.remove()
            raise
        return group

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this group: the shell joins it, then becomes the command."""
        return ["/bin/sh", "-c", f'echo $$ > "{self.procs}" && exec "$@"', "sh", *argv]

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this group so far."""
        f = "memory.oom_control" if self.version == 1 else "memory.events"
        return _stat(self.path / f).get("oom_kill", 0)

    def peak(self) -> int | None:
        """The most memory the group has used, page cache included (v2 kernels before 5.19 cannot say)."""
        return _read_int(self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))

    def unreclaimable(self) -> int | None:
        return unreclaimable(self.path)

    def pids(self) -> list[int]:
        return [int(p) for p in _read_text(self.procs).split()]

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what still runs in the group, then remove it (bounded: gives up after `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            for pid in self.pids():
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _read_text(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""
