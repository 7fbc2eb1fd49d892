"""Readers for fault scenarios: threads that read a mount's files whole with `open(p, "rb").read()`,
compare every byte with the source, and time every read, until told to stop. After each read the
file's pages are dropped (POSIX_FADV_DONTNEED on that file alone), so the next read of it reaches the
mount again: the reads keep going to the nodes however long a scenario runs. Used by
tests/test_ride_out.py, tests/chaosfaults.py and scripts/chaos.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SLOW_S = 1.0  # a read this slow is counted apart


def make_files(root: Path, n: int, seed: int, sizes: tuple[int, int] = (20_000, 120_000),
               dirs: int = 4) -> dict[str, bytes]:
    """`n` files of random bytes under `root` in `dirs` folders; relative path -> bytes."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n):
        rel = f"d{i % dirs}/f{i:05d}.bin"
        data = rng.randbytes(rng.randint(*sizes))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


@dataclass
class ReadLog:
    """What the readers saw."""

    reads: int = 0
    errors: list[str] = field(default_factory=list)  # reads that raised
    wrong: list[str] = field(default_factory=list)  # reads whose bytes differ from the source
    longest: float = 0.0  # seconds, of one open+read
    slow: int = 0  # reads over SLOW_S
    times: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        if not self.times:
            return 0.0
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Readers:
    """`threads` readers of the files under `mnt` (or under several mounts of one dataset, reader i on
    mount i modulo their number), each in its own shuffled order, round and round; a context manager:
    they start on entry and stop (joined, bounded) on exit."""

    def __init__(self, mnt: Path | list[Path], files: dict[str, bytes], threads: int = 4, seed: int = 0) -> None:
        self.mnts = mnt if isinstance(mnt, list) else [mnt]
        self.files, self.seed = files, seed
        self.log = ReadLog()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"chaos-reader-{i}", daemon=True)
                         for i in range(threads)]

    def __enter__(self) -> Readers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 120.0) -> ReadLog:
        """Stop the readers (each finishes its read in progress) and return what they saw."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._threads)
        if stuck:
            with self._lock:
                self.log.errors.append(f"{stuck} readers still blocked {timeout:g} s after being told to stop")
        return self.log

    def wait_reads(self, n: int, timeout: float = 60.0) -> int:
        """Until `n` more reads than now have ended (or `timeout`); the count then."""
        target = self.log.reads + n
        deadline = time.monotonic() + timeout
        while self.log.reads < target and time.monotonic() < deadline and any(t.is_alive() for t in self._threads):
            time.sleep(0.02)
        return self.log.reads

    def _run(self, i: int) -> None:
        order = list(self.files)
        mnt = self.mnts[i % len(self.mnts)]
        rng = random.Random(self.seed * 1000 + i)
        while not self._stop.is_set():
            rng.shuffle(order)
            for rel in order:
                if self._stop.is_set():
                    return
                self._read_one(mnt, rel)

    def _read_one(self, mnt: Path, rel: str) -> None:
        error = wrong = None
        t0 = time.perf_counter()
        try:
            with open(mnt / rel, "rb") as f:
                data = f.read()
                took = time.perf_counter() - t0
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the next read reaches the mount
            if data != self.files[rel]:
                wrong = f"{mnt.name}/{rel}: {len(data)} bytes differ from the source's {len(self.files[rel])}"
        except OSError as exc:
            took = time.perf_counter() - t0
            error = f"{mnt.name}/{rel}: {exc!r}"
        with self._lock:
            log = self.log
            log.reads += 1
            log.times.append(took)
            log.longest = max(log.longest, took)
            log.slow += took > SLOW_S
            if error:
                log.errors.append(error)
            if wrong:
                log.wrong.append(wrong)
