"""A mount's record under $DLFS_HOME/run/mounts/: what this machine's commands (`dlfs mounts`, `status`,
`umount`, `rm`) and the CSI driver know of the mounts made from that home.

The mount process writes its record once the mount answers and removes it when it ends; a record
outliving its process (SIGKILL, OOM) is judged against the process table and the mount table. The
record is private JSON (0600), one file per mountpoint, replaced whole.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dlfs.errors import MountError
from dlfs.private import private_dirs, write_private
from dlfs.procmounts import mount_points
from dlfs.procs import running, start_ticks, stopped
from dlfs.turns import Turn
from dlfs.units import iso_time

LIVE, DETACHED, DEAD = "live", "detached", "dead"
STEM_MAX = 200  # bytes of a name made from a mountpoint (a log, a record), before its suffix (NAME_MAX is 255)
START_WAIT = 120.0  # seconds a `dlfs mount` waits for another one that is starting at its mountpoint


class MountRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One mount of this machine, as its process wrote it (older records hold only the first three)."""

    pid: int
    mountpoint: str
    dataset: str  # NAME@VERSION
    started: float = 0.0  # when it was mounted (Unix time)
    pid_start: int = 0  # /proc/PID/stat's start time: a pid reused by another process is not this mount
    cache_size: int = 0  # bytes of memory for data fetched but not yet read
    cache_dir: str | None = None  # the disk cache, where the mount has one
    cache_dir_size: int | None = None
    log: str | None = None  # its log file; None: it logs to its stderr (a foreground mount)


@dataclass(frozen=True)
class MountState:
    """A record judged now: `live` (mounted and served), `detached` (its process still serves files
    held open, but it is no longer mounted: `umount --lazy`), or `dead` (its process is gone and the
    mount table still lists it: `dlfs umount` clears it)."""

    record: MountRecord
    state: str
    problem: str = ""  # one line: for a state other than live, or a live mount whose process is stopped

    def as_json(self) -> dict[str, Any]:
        r = self.record
        name, _, version = r.dataset.rpartition("@")
        out: dict[str, Any] = {"dataset": r.dataset, "name": name, "version": int(version) if version.isdigit() else None,
                               "mountpoint": r.mountpoint, "pid": r.pid, "state": self.state,
                               "cache_size": r.cache_size, "since": iso_time(r.started) if r.started else None,
                               "since_unix": r.started or None, "log": r.log}
        if r.cache_dir is not None:
            out["cache_dir"] = r.cache_dir
            out["cache_dir_size"] = r.cache_dir_size
        if self.problem:
            out["problem"] = self.problem
        return out


def _fitted(prefix: str, where: str) -> str:
    """prefix + where as a file name's stem, within STEM_MAX bytes: for a deep mountpoint, a hash of
    the whole `where` (unique) and as much of its tail as fits (readable)."""
    name = prefix + where
    if len(os.fsencode(name)) <= STEM_MAX:
        return name
    prefix += hashlib.sha256(os.fsencode(where)).hexdigest()[:12] + "-"
    tail = where[-(STEM_MAX // 2):]
    while len(os.fsencode(prefix + tail)) > STEM_MAX:  # many-byte characters
        tail = tail[1:]
    return prefix + tail


def mount_record(home: Path, mountpoint: Path) -> Path:
    key = os.path.abspath(mountpoint).replace("/", "%")  # never resolve(): it would stat the mount itself
    return home / "run" / "mounts" / f"{_fitted('', key)}.json"


class StartLock:
    """The start of a mount at one mountpoint from one home, held by one `dlfs mount` at a time: two at
    once take turns, so that the second finds the first's mount and says so, rather than fail halfway
    through its own start. A turn (dlfs/turns.py) on a file beside the mount's record, held until the
    mount is in place or has failed (`done`)."""

    def __init__(self, home: Path, mountpoint: Path, wait: float = START_WAIT) -> None:
        path = mount_record(home, mountpoint).with_suffix(".starting")
        deadline = time.monotonic() + wait
        while (turn := Turn.take(path)) is None:
            if time.monotonic() >= deadline:
                raise MountError(f"another `dlfs mount` at {mountpoint} has been starting for {wait:.0f} s: "
                                 "wait for it (`dlfs mounts` lists it once it is up), or mount elsewhere")
            time.sleep(0.05)
        self.turn = turn

    def close(self) -> None:
        """Let go of this process's hold (another process sharing the descriptor, a forked mount, keeps it)."""
        self.turn.close()

    def done(self) -> None:
        """Mounted (the next `dlfs mount` here may look, and finds this mount), or failed to."""
        self.turn.done()


def mount_log(home: Path, dataset: str, mountpoint: Path) -> Path:
    """Where a mount started in the background logs: one file per mount, named for the dataset as given
    (NAME or NAME@VERSION) and its mountpoint, `/` written `-` (as systemd names mount units)."""
    where = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return home / "logs" / f"{_fitted(f'mount-{dataset}-', where)}.log"


def stats_file(home: Path, mountpoint: Path) -> Path:
    """Where the mount publishes its counters (dlfs/mount/statsfile.py): beside its record."""
    return mount_record(home, mountpoint).with_suffix(".stats")


def drop_record(home: Path, mountpoint: Path) -> None:
    """Remove the record of the mount at `mountpoint`, and its stats: its process is gone or let go of."""
    mount_record(home, mountpoint).unlink(missing_ok=True)
    stats_file(home, mountpoint).unlink(missing_ok=True)


def write_record(home: Path, record: MountRecord) -> Path:
    """Write (replace whole) the record of this process's mount; returns its path."""
    path = mount_record(home, Path(record.mountpoint))
    private_dirs(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_private(tmp, msgspec.json.encode(record).decode())
    os.replace(tmp, path)
    return path


def read_record(path: Path) -> MountRecord | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=MountRecord)
    except (OSError, msgspec.DecodeError):
        return None  # gone meanwhile, or not one of ours


def forget_record(path: Path, pid: int) -> bool:
    """Remove a record if it is still `pid`'s (a later mount on the same mountpoint may have replaced it)."""
    record = read_record(path)
    if record is None or record.pid != pid:
        return False
    path.unlink(missing_ok=True)
    return True


def alive(record: MountRecord) -> bool:
    """Whether the record's process still runs (and is the same process, not a reused pid)."""
    return running(record.pid) and (not record.pid_start or start_ticks(record.pid) == record.pid_start)


def judge(record: MountRecord, table: list[str]) -> MountState | None:
    """The record's state; None when nothing is left of the mount (no process, not mounted)."""
    if alive(record):
        try:  # its own mount namespace's table (`ip netns exec` gives a mount one of its own)
            mounted = record.mountpoint in mount_points(record.pid)
        except OSError:
            mounted = record.mountpoint in table
        if mounted:
            if stopped(record.pid):  # mounted, but every request there waits until it runs again
                return MountState(record, LIVE, f"its process {record.pid} is stopped by a signal or a suspended "
                                                f"job; the mount answers nothing until `kill -CONT {record.pid}`, or "
                                                f"`dlfs umount {record.mountpoint}` detaches it")
            return MountState(record, LIVE)
        return MountState(record, DETACHED, f"no longer mounted (detached lazily); process {record.pid} still "
                                            "serves files open there and ends when the last is closed")
    if record.mountpoint in table:
        return MountState(record, DEAD, f"its process {record.pid} is gone; `dlfs umount {record.mountpoint}` "
                                        "clears the dead mount")
    return None


def mount_states(home: Path, clean: bool = True) -> list[MountState]:
    """Every mount recorded under `home` on this machine, by mountpoint. With `clean`, records of
    mounts with nothing left of them (process gone, not mounted) are removed, with their stats files."""
    table = mount_points()
    out = []
    for path in sorted((home / "run" / "mounts").glob("*.json")):
        record = read_record(path)
        if record is None:
            continue
        state = judge(record, table)
        if state is not None:
            out.append(state)
        elif clean and forget_record(path, record.pid):
            stats_file(home, Path(record.mountpoint)).unlink(missing_ok=True)
    return out


def local_mounts(home: Path) -> list[tuple[str, Path]]:
    """(dataset@version, mountpoint) of every live mount made from this home on this machine."""
    return [(s.record.dataset, Path(s.record.mountpoint)) for s in mount_states(home, clean=False)
            if s.state == LIVE]
