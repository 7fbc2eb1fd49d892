#!/usr/bin/env python3
"""What a commit's index check costs: builds an index of N files (directories of 1,000 files, one
record each) and times dlfs.format.check.check_index over it, the pass every COMMIT makes.

    .venv/bin/python scripts/check_index_cost.py --files 1000000
"""

from __future__ import annotations

import argparse
import os
import stat
import tempfile
import time

from dlfs.format.check import check_index
from dlfs.format.chunk import Record
from dlfs.format.index import Index, IndexWriter

PER_DIR = 1000


def build(path: str, files: int) -> None:
    dirs = -(-files // PER_DIR)
    w = IndexWriter(1 + files + dirs, 8 << 20, created_ns=1)
    ino, root, left = 2, [], files
    for c in range(dirs):
        d, ino = ino, ino + 1
        first, entries = w.extents_count(), []
        for k in range(min(PER_DIR, left)):
            ext = w.add_extent(c, Record(k * 100, 100, 100, 0, 0))
            w.set_inode(ino, stat.S_IFREG | 0o644, 0, 0, 1, 100, 0, ext, 1, d)
            entries.append((f"f{k:06d}".encode(), ino))
            ino += 1
        left -= len(entries)
        w.add_chunk(os.urandom(16), len(entries) * 100, first, len(entries))
        ref, n = w.add_dirents(entries)
        w.set_inode(d, stat.S_IFDIR | 0o755, 0, 0, 2, 0, 0, ref, n, 1)
        root.append((f"d{c:05d}".encode(), d))
    ref, n = w.add_dirents(root)
    w.set_inode(1, stat.S_IFDIR | 0o755, 0, 0, 2, 0, 0, ref, n, 1)
    with open(path, "wb") as f:
        w.write(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cost.idx")
        build(path, args.files)
        index = Index(path)
        t0 = time.perf_counter()
        check_index(index)
        seconds = time.perf_counter() - t0
        index.close()
        print(f"check_index: {args.files:,} files, {os.path.getsize(path) / 1e6:.0f} MB index: {seconds:.2f} s "
              f"({seconds / args.files * 1e6:.2f} us per file)")


if __name__ == "__main__":
    main()
