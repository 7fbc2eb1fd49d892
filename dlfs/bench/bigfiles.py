"""`dlfs bench`'s big-file workloads, on a few big shard files (sample.make_shards) read by one reader.

  - random 4 KiB preads: `os.pread(fd, 4096, offset)` at random 4 KiB-aligned offsets of random files,
    every file opened once beforehand, on a fresh mount with the page cache dropped: preads/s, the
    serving process's CPU per pread, the bytes read from storage by the reader and the serving
    processes (/proc/PID/io), the bytes read from the block device that holds the data (its sectors
    read, less those of an idle run as long right after), and for dlfs the bytes the mount read (its
    published counters), each divided by the bytes served; every pread is checked against the source
    afterwards;
  - sequential: every file read whole once, on a fresh mount with the page cache dropped, the
    framework way and the raw way (epoch.READS): MB/s.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlfs.bench.baselines import System, cpu_seconds, fresh_start, io_read_bytes
from dlfs.bench.epoch import timed_epoch
from dlfs.errors import CorruptData

PREAD_SIZE = 4096
PREAD_SEED = 12
SEQUENTIAL_SEED = 7
SECTOR = 512  # the unit of /sys/block/*/stat, whatever the device's own block size
Say = Callable[[str], None]


@dataclass(frozen=True)
class BlockDevice:
    """The disk under a directory, whose sectors-read counter a pass reads: whatever reaches it,
    page-cache misses, read-ahead, metadata and other processes alike, is counted."""

    name: str  # under /sys/block

    def read_bytes(self) -> int:
        """Bytes read from it since boot (field 3 of /sys/block/NAME/stat, sectors read, x 512)."""
        return int(Path(f"/sys/block/{self.name}/stat").read_text().split()[2]) * SECTOR


def block_device(path: str | Path) -> tuple[BlockDevice | None, str]:
    """The disk holding `path`'s file system (the whole disk, not a partition of it), and a line
    that says which, or why there is none (tmpfs, overlayfs, a network file system)."""
    dev = os.stat(path).st_dev
    number = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        sys_dev = Path(f"/sys/dev/block/{number}").resolve(strict=True)
    except OSError:
        return None, f"no block device found for {path} (its file system is on device {number}, not a block device)"
    if (sys_dev / "partition").exists():
        sys_dev = sys_dev.parent
    if not Path(f"/sys/block/{sys_dev.name}/stat").exists():
        return None, f"no block device found for {path} (device {number}: no /sys/block/{sys_dev.name}/stat)"
    return BlockDevice(sys_dev.name), f"/dev/{sys_dev.name} (holds {path}; /sys/block/{sys_dev.name}/stat)"


def pick_preads(sizes: Sequence[int], count: int, seed: int = PREAD_SEED) -> list[tuple[int, int]]:
    """`count` (file number, offset) pairs: files drawn uniformly among those holding a whole 4 KiB,
    offsets 4 KiB-aligned with the whole 4 KiB inside the file."""
    usable = [i for i, size in enumerate(sizes) if size >= PREAD_SIZE]
    if not usable:
        raise ValueError(f"no file holds {PREAD_SIZE} bytes")
    rng = random.Random(seed)
    picks = []
    for _ in range(count):
        i = rng.choice(usable)
        picks.append((i, rng.randrange(sizes[i] // PREAD_SIZE) * PREAD_SIZE))
    return picks


@contextmanager
def opened(root: str, relpaths: Sequence[str]) -> Iterator[list[int]]:
    """Every file under root opened read-only (os.open: no buffering, no isatty), closed on the way out."""
    fds: list[int] = []
    try:
        for rel in relpaths:
            fds.append(os.open(os.path.join(root, rel), os.O_RDONLY | os.O_CLOEXEC))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def timed_preads(fds: Sequence[int], picks: Sequence[tuple[int, int]]) -> tuple[list[bytes], float]:
    """One pread of PREAD_SIZE per pick, in order; the bytes read and the seconds they took."""
    t0 = time.perf_counter()
    got = [os.pread(fds[i], PREAD_SIZE, off) for i, off in picks]
    return got, time.perf_counter() - t0


def check_preads(src: str, relpaths: Sequence[str], picks: Sequence[tuple[int, int]],
                 got: Sequence[bytes]) -> list[str]:
    """A line for each pread whose bytes differ from the same range of the source file."""
    errors = []
    with opened(src, relpaths) as fds:
        for (i, off), data in zip(picks, got, strict=True):
            if data != os.pread(fds[i], PREAD_SIZE, off):
                errors.append(f"{relpaths[i]} at offset {off}: the {len(data)} bytes read differ from the source's")
    return errors


def counters(s: System, after: float, device: BlockDevice | None = None) -> dict[str, Any]:
    """What `s` has spent so far: the serving process's CPU seconds, the bytes this process and the
    serving ones read from storage, the bytes read from `device` (and when), and the mount's own
    counters where it publishes them (waiting for it to go idle after `after`, so that prefetches a
    workload started are counted)."""
    mount = s.mount_counters(after)  # first: the others are read once the mount is idle
    return {"cpu_s": cpu_seconds(s.pid) if s.pid else None,
            # This process alone (its children include daemons of other systems), and the serving ones.
            "disk_read_bytes": io_read_bytes([os.getpid()], descendants=False) + io_read_bytes(s.serving_pids()),
            "blockdev_read_bytes": device.read_bytes() if device else None,
            "blockdev_s": time.monotonic(),
            "mount_read_bytes": mount["fetched_bytes"] if mount else None,
            "mount_fetches": mount["fetches"] if mount else None}


def null_run(device: BlockDevice | None, seconds: float) -> int | None:
    """Bytes read from `device` in `seconds` of doing nothing: what the rest of the machine reads meanwhile."""
    if device is None:
        return None
    before = device.read_bytes()
    time.sleep(seconds)
    return device.read_bytes() - before


def _spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: (after[k] - before[k] if before[k] is not None and after[k] is not None else None) for k in before}


def pread_pass(s: System, relpaths: Sequence[str], picks: Sequence[tuple[int, int]], src: str,
               device: tuple[BlockDevice | None, str] | None = None) -> dict[str, Any]:
    """Random preads on a fresh mount of `s` (page cache dropped); CorruptData if any differs from src.
    `device`: the disk holding the data and its line (`block_device`; by default that of src)."""
    disk, where = device if device is not None else block_device(src)
    fresh_start(s)
    with opened(str(s.root), relpaths) as fds:
        before = counters(s, time.time(), disk)
        got, seconds = timed_preads(fds, picks)
        spent = _spent(before, counters(s, time.time(), disk))
    null = null_run(disk, spent["blockdev_s"])  # before the check below reads the source
    errors = check_preads(src, relpaths, picks, got)
    if errors:
        raise CorruptData(f"{s.label}: {len(errors)} of {len(picks)} preads differ from the source: {errors[0]}")
    return {**pread_figures(len(picks), seconds, spent, null), "blockdev": where}


def pread_figures(preads: int, seconds: float, spent: dict[str, Any], null_bytes: int | None = None) -> dict[str, Any]:
    """The figures of a pread pass: rates, CPU per pread, and bytes read per byte served (from the
    block device: less `null_bytes`, what an idle run as long read from it, never below 0)."""
    served = preads * PREAD_SIZE
    cpu, disk, mount, blockdev = (spent["cpu_s"], spent["disk_read_bytes"], spent["mount_read_bytes"],
                                  spent["blockdev_read_bytes"])
    net = max(0, blockdev - null_bytes) if blockdev is not None and null_bytes is not None else None
    return {"preads": preads, "size": PREAD_SIZE, "bytes_served": served, "seconds": seconds,
            "preads_per_s": preads / seconds, "mb_per_s": served / 1e6 / seconds,
            "cpu_s": cpu, "cpu_us_per_pread": cpu * 1e6 / preads if cpu is not None else None,
            "disk_read_bytes": disk, "disk_read_ratio": disk / served,
            "blockdev_read_bytes": blockdev, "blockdev_null_bytes": null_bytes, "blockdev_s": spent["blockdev_s"],
            "blockdev_raw_ratio": blockdev / served if blockdev is not None else None,
            "blockdev_read_ratio": net / served if net is not None else None,
            "mount_read_bytes": mount, "mount_fetches": spent["mount_fetches"],
            "mount_read_ratio": mount / served if mount is not None else None}


def sequential_pass(s: System, relpaths: Sequence[str], read: str) -> dict[str, Any]:
    """Every file read whole once by one reader, the `read` way, on a fresh mount of `s` (page cache dropped)."""
    fresh_start(s)
    return timed_epoch(s, relpaths, readers=1, seed=SEQUENTIAL_SEED, read=read)


def run_bigfiles(systems: Sequence[System], src: Path, relpaths: Sequence[str], preads: int,
                 say: Say) -> dict[str, Any]:
    """The random-pread pass and both sequential passes on each system, each unmounted after."""
    picks = pick_preads([os.path.getsize(src / r) for r in relpaths], preads)
    device = block_device(src)  # the work dir's disk: the source, the images and dlfs's chunks
    out: dict[str, Any] = {"pread": {}, "sequential": {}, "sequential_raw": {}}
    for s in systems:
        say(f"big files: {s.label}: {preads} random 4 KiB preads, then every file whole (open().read(), then raw), "
            "each on a fresh mount, page cache dropped")
        out["pread"][s.name] = pread_pass(s, relpaths, picks, str(src), device)
        out["sequential"][s.name] = sequential_pass(s, relpaths, "open")
        out["sequential_raw"][s.name] = sequential_pass(s, relpaths, "raw")
        s.unmount()
    return out
