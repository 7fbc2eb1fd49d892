#!/usr/bin/env python3
"""How fast this machine's disk fills the mount's cache: 4 MiB O_DIRECT reads of chunk files (as the
mount reads windows of local chunks) into a buffer of the cache's own kind (a shared file on 2 MiB
pages: dlfs/mount/slabs.py) beside the same reads into a memfd of 4 KiB pages, page cache dropped
before each pass, 1, 2 and 4 threads; GB/s and the ratio. With --records: 112 KiB reads at random
page-aligned offsets (as the serving threads read small files' records in scan mode, native/hugebuf.h)
into private memory on 4 KiB pages beside the same reads into a 2 MiB page; the median read and the ratio.

    scripts/direct-read-pages.py [CHUNK_DIR] [--files N] [--records]     (root: it drops the page cache)

CHUNK_DIR defaults to the local node's chunks ($DLFS_HOME/data/chunks). On 4 KiB pages a 4 MiB read
is split into requests of at most 254 segments; a virtio disk without indirect descriptors takes one
such request at a time, which huge pages avoid (a few segments per request).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import statistics
import threading
import time
from pathlib import Path

from dlfs.config import home_dir
from dlfs.mount.slabs import arena_file

WINDOW = 4 << 20
RECORD = 112 << 10  # about the bench's small files (~110 KB), page-aligned
HUGE_PAGE = 2 << 20
READS_PER_FILE = 30


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def buffer(huge: bool) -> tuple[mmap.mmap, bool]:
    """A window-sized shared buffer: the cache's kind, or a plain memfd; and whether it is on huge pages."""
    size = WINDOW + (2 << 20)
    if huge:
        fd, on_huge = arena_file(size)
    else:
        fd, on_huge = os.memfd_create("direct-read-pages", os.MFD_CLOEXEC), False
        os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    os.close(fd)
    m.write(b"\1" * size)  # faulted in before the clock starts: the disk is what is measured
    return m, on_huge


def one_pass(files: list[Path], threads: int, huge: bool) -> float:
    """GB/s of reading every whole window of `files` with `threads` threads."""
    drop_caches()
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, WINDOW)]
    lock, done = threading.Lock(), [0]

    def work() -> None:
        m, _ = buffer(huge)
        view = memoryview(m)[:WINDOW]
        while True:
            with lock:
                if not jobs:
                    break
                path, off = jobs.pop()
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                got = os.preadv(fd, [view], off)
            finally:
                os.close(fd)
            with lock:
                done[0] += got
        view.release()
        m.close()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return done[0] / (time.perf_counter() - t0) / 1e9


def record_buffer(huge: bool) -> tuple[mmap.mmap, memoryview]:
    """A record-sized private buffer: in a 2 MiB-aligned range asked to be on a huge page, or plain."""
    m = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE if huge else 0
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE, start, HUGE_PAGE)
    view = memoryview(m)[start: start + RECORD]
    view[:] = b"\1" * RECORD  # faulted in before the clock starts
    return m, view


def record_pass(files: list[Path], threads: int, huge: bool) -> float:
    """The median microseconds of a RECORD-sized O_DIRECT read at a random page of `files`."""
    drop_caches()
    rng = random.Random(threads)
    jobs = [(f, rng.randrange((f.stat().st_size - RECORD) // 4096) * 4096) for f in files for _ in range(READS_PER_FILE)]
    rng.shuffle(jobs)
    lock, took = threading.Lock(), []

    def work() -> None:
        m, view = record_buffer(huge)
        fds: dict[Path, int] = {}
        while True:
            with lock:
                if not jobs:
                    break
                path, off = jobs.pop()
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY | os.O_DIRECT))
            t0 = time.perf_counter()
            os.preadv(fd, [view], off)
            t = time.perf_counter() - t0
            with lock:
                took.append(t)
        for fd in fds.values():
            os.close(fd)
        view.release()
        m.close()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return statistics.median(took) * 1e6


def anon_huge() -> int:
    """Bytes of this process's private memory on transparent huge pages."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) << 10 for line in f if line.startswith("AnonHugePages:")), 0)


def records(files: list[Path]) -> None:
    m, view = record_buffer(True)
    on_huge = anon_huge() >= HUGE_PAGE
    view.release()
    m.close()
    print(f"{len(files)} chunk files, {READS_PER_FILE} reads of {RECORD >> 10} KiB each per pass; the huge buffer is "
          f"{'on a 2 MiB page' if on_huge else 'on 4 KiB pages (no transparent huge pages here)'}")
    print("threads  4 KiB pages us  2 MiB page us  ratio")
    for threads in (1, 2):
        plain, huge = record_pass(files, threads, False), record_pass(files, threads, True)
        print(f"{threads:7d}  {plain:14.0f}  {huge:13.0f}  {plain / huge:4.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chunk_dir", nargs="?", type=Path, default=home_dir() / "data" / "chunks")
    ap.add_argument("--files", type=int, default=120, help="chunk files read per pass (default 120)")
    ap.add_argument("--records", action="store_true", help="112 KiB reads at random offsets, not whole windows")
    args = ap.parse_args()
    files = sorted(p for p in args.chunk_dir.glob("*/*") if p.is_file() and p.stat().st_size >= WINDOW)[: args.files]
    if not files:
        raise SystemExit(f"direct-read-pages: no chunk file of 4 MiB or more under {args.chunk_dir}")
    if args.records:
        return records(files)
    _, on_huge = buffer(True)
    print(f"{len(files)} chunk files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB; the cache's buffer is "
          f"{'on 2 MiB pages' if on_huge else 'a memfd (no huge pages here)'}")
    print("threads  memfd GB/s  cache GB/s  ratio")
    for threads in (1, 2, 4):
        plain, cache = one_pass(files, threads, False), one_pass(files, threads, True)
        print(f"{threads:7d}  {plain:10.2f}  {cache:10.2f}  {cache / plain:4.2f}x")


if __name__ == "__main__":
    main()
