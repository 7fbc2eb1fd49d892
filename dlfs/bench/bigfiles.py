"""`dlfs bench`'s big-file workloads, on a few big shard files (sample.make_shards) read by one reader.

  - random 4 KiB preads: `os.pread(fd, 4096, offset)` at random 4 KiB-aligned offsets of random files,
    every file opened once beforehand, on a fresh mount with the page cache dropped: preads/s, the
    serving process's CPU per pread, the bytes read from storage by the reader and the serving
    processes (/proc/PID/io), and for dlfs the bytes the mount read (its published counters), each
    divided by the bytes served; every pread is checked against the source afterwards;
  - sequential: every file read whole once, on a fresh mount with the page cache dropped, the
    framework way and the raw way (epoch.READS): MB/s.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlfs.bench.baselines import System, cpu_seconds, fresh_start, io_read_bytes
from dlfs.bench.epoch import timed_epoch
from dlfs.errors import CorruptData

PREAD_SIZE = 4096
PREAD_SEED = 12
SEQUENTIAL_SEED = 7
Say = Callable[[str], None]


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


def counters(s: System, after: float) -> dict[str, Any]:
    """What `s` has spent so far: the serving process's CPU seconds, the bytes this process and the
    serving ones read from storage, and the mount's own counters where it publishes them (waiting
    for it to go idle after `after`, so that prefetches a workload started are counted)."""
    mount = s.mount_counters(after)  # first: the others are read once the mount is idle
    return {"cpu_s": cpu_seconds(s.pid) if s.pid else None,
            # This process alone (its children include daemons of other systems), and the serving ones.
            "disk_read_bytes": io_read_bytes([os.getpid()], descendants=False) + io_read_bytes(s.serving_pids()),
            "mount_read_bytes": mount["fetched_bytes"] if mount else None,
            "mount_fetches": mount["fetches"] if mount else None}


def _spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: (after[k] - before[k] if before[k] is not None and after[k] is not None else None) for k in before}


def pread_pass(s: System, relpaths: Sequence[str], picks: Sequence[tuple[int, int]], src: str) -> dict[str, Any]:
    """Random preads on a fresh mount of `s` (page cache dropped); CorruptData if any differs from src."""
    fresh_start(s)
    with opened(str(s.root), relpaths) as fds:
        before = counters(s, time.time())
        got, seconds = timed_preads(fds, picks)
        spent = _spent(before, counters(s, time.time()))
    errors = check_preads(src, relpaths, picks, got)
    if errors:
        raise CorruptData(f"{s.label}: {len(errors)} of {len(picks)} preads differ from the source: {errors[0]}")
    return pread_figures(len(picks), seconds, spent)


def pread_figures(preads: int, seconds: float, spent: dict[str, Any]) -> dict[str, Any]:
    """The figures of a pread pass: rates, CPU per pread, and bytes read per byte served."""
    served = preads * PREAD_SIZE
    cpu, disk, mount = spent["cpu_s"], spent["disk_read_bytes"], spent["mount_read_bytes"]
    return {"preads": preads, "size": PREAD_SIZE, "bytes_served": served, "seconds": seconds,
            "preads_per_s": preads / seconds, "mb_per_s": served / 1e6 / seconds,
            "cpu_s": cpu, "cpu_us_per_pread": cpu * 1e6 / preads if cpu is not None else None,
            "disk_read_bytes": disk, "disk_read_ratio": disk / served,
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
    out: dict[str, Any] = {"pread": {}, "sequential": {}, "sequential_raw": {}}
    for s in systems:
        say(f"big files: {s.label}: {preads} random 4 KiB preads, then every file whole (open().read(), then raw), "
            "each on a fresh mount, page cache dropped")
        out["pread"][s.name] = pread_pass(s, relpaths, picks, str(src))
        out["sequential"][s.name] = sequential_pass(s, relpaths, "open")
        out["sequential_raw"][s.name] = sequential_pass(s, relpaths, "raw")
        s.unmount()
    return out
