#!/usr/bin/env python3
"""How fast this machine's disk fills the mount's cache: 4 MiB O_DIRECT reads of chunk files (as the
mount reads windows of local chunks) into a buffer of the cache's own kind (a shared file on 2 MiB
pages: dlfs/mount/slabs.py) beside the same reads into a memfd of 4 KiB pages, page cache dropped
before each pass, 1, 2 and 4 threads; GB/s and the ratio.

    scripts/direct-read-pages.py [CHUNK_DIR] [--files N]     (root: it drops the page cache)

CHUNK_DIR defaults to the local node's chunks ($DLFS_HOME/data/chunks). On 4 KiB pages a 4 MiB read
is split into requests of at most 254 segments; a virtio disk without indirect descriptors takes one
such request at a time, which huge pages avoid (a few segments per request).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from pathlib import Path

from dlfs.config import home_dir
from dlfs.mount.slabs import arena_file

WINDOW = 4 << 20


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chunk_dir", nargs="?", type=Path, default=home_dir() / "data" / "chunks")
    ap.add_argument("--files", type=int, default=120, help="chunk files read per pass (default 120)")
    args = ap.parse_args()
    files = sorted(p for p in args.chunk_dir.glob("*/*") if p.is_file() and p.stat().st_size >= WINDOW)[: args.files]
    if not files:
        raise SystemExit(f"direct-read-pages: no chunk file of 4 MiB or more under {args.chunk_dir}")
    _, on_huge = buffer(True)
    print(f"{len(files)} chunk files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB; the cache's buffer is "
          f"{'on 2 MiB pages' if on_huge else 'a memfd (no huge pages here)'}")
    print("threads  memfd GB/s  cache GB/s  ratio")
    for threads in (1, 2, 4):
        plain, cache = one_pass(files, threads, False), one_pass(files, threads, True)
        print(f"{threads:7d}  {plain:10.2f}  {cache:10.2f}  {cache / plain:4.2f}x")


if __name__ == "__main__":
    main()
