"""A dataset ingested with one replica, then damaged on disk: one flipped byte inside one file's
record, and another chunk file cut to half its length. The FUSE and dlfs.direct tests read it."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from conftest import Node

from dlfs.format.index import ROOT_INO, Index


@dataclass
class Damaged:
    src: Path
    files: list[str]  # every file, relative
    flipped: str  # the file with a flipped byte
    flipped_chunk: bytes
    cut: list[str]  # the files past the end of the truncated chunk
    cut_chunk: bytes

    @property
    def broken(self) -> set[str]:
        return {self.flipped, *self.cut}


def inode_of(idx: Index, rel: str) -> int:
    ino = ROOT_INO
    for part in rel.split("/"):
        ino = idx.lookup(ino, part.encode())
        assert ino > 0, rel
    return ino


def damaged_dataset(node: Node, base: Path, name: str, seed: int = 3) -> Damaged:
    """60 files of 10 kB in 64 KiB chunks under base/src, ingested as `name`, then damaged."""
    src = base / "src"
    (src / "c").mkdir(parents=True)
    rng = random.Random(seed)
    for i in range(60):
        (src / f"c/f{i:02d}").write_bytes(rng.randbytes(10_000))
    node.ingest(src, name, "--chunk-size", "64K")
    idx = Index(node.home / f"meta/index/{name}/1.idx")
    try:
        where: dict[str, tuple[bytes, int, int]] = {}  # file -> (chunk id, record start, record end)
        for i in range(60):
            rel = f"c/f{i:02d}"
            inode = idx.inode(inode_of(idx, rel))
            assert inode.count == 1  # 10 kB files never split at 64K chunks
            ext = idx.extent(inode.ref)
            where[rel] = (idx.chunk(ext.chunk).id, ext.record.offset, ext.record.offset + ext.record.stored_len)
    finally:
        idx.close()

    def chunk_file(cid: bytes) -> Path:
        return node.home / "data/chunks" / cid.hex()[:2] / cid.hex()

    chunk_ids = sorted({w[0] for w in where.values()}, key=lambda c: min(w[1] for w in where.values() if w[0] == c))
    assert len(chunk_ids) >= 4
    # One flipped byte inside f-something's record in one chunk...
    flipped = next(r for r, w in sorted(where.items()) if w[0] == chunk_ids[1])
    cid_a, off_a, _ = where[flipped]
    with open(chunk_file(cid_a), "r+b") as f:
        f.seek(off_a + 100)
        byte = f.read(1)
        f.seek(off_a + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    # ...and another chunk cut to half its length.
    cid_b = chunk_ids[2]
    size_b = chunk_file(cid_b).stat().st_size
    os.truncate(chunk_file(cid_b), size_b // 2)
    cut = sorted(r for r, w in where.items() if w[0] == cid_b and w[2] > size_b // 2)
    assert cut
    return Damaged(src, sorted(where), flipped, cid_a, cut, cid_b)
