"""Namespace scale: synthetic indexes of N files, committed as datasets; mount time and resident memory.

The index is real in shape and size: /train/<dir>/<file>.JPEG with about 1000 files per folder, and
every file has one extent. All extents point at the single record of one small real chunk, so the
commit (which checks that every chunk the index names is stored) passes without storing N files.
"""

from __future__ import annotations

import os
import random
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from dlfs.bench.baselines import DlfsMount, DlfsNode, rss_bytes
from dlfs.client.cluster import ClusterClient
from dlfs.config import load_cluster
from dlfs.errors import DlfsError
from dlfs.format.chunk import ChunkWriter, Record
from dlfs.format.index import IndexWriter
from dlfs.ingest.run import commit_index as ingest_commit
from dlfs.tasks import open_nursery
from dlfs.wire.messages import META_DAEMON, IngestBegun, reply
from dlfs.wire.protocol import Msg

PER_DIR = 1000
FILE_SIZE = 4096  # every synthetic file is the one record's raw length
CHUNK_SIZE = 8 << 20  # recorded in the index; nothing is packed


@dataclass(frozen=True)
class FakeChunk:
    id: bytes
    data: bytes
    record: Record


def fake_chunk(seed: int = 0) -> FakeChunk:
    """One real chunk with one incompressible record of FILE_SIZE bytes."""
    w = ChunkWriter(FILE_SIZE + (4 << 10))
    rec = w.add(random.Random(seed).randbytes(FILE_SIZE), compress=False)
    cid, view = w.finish()
    return FakeChunk(cid, bytes(view), rec)


def _dir_name(d: int) -> str:
    return f"n{d:08d}"  # fixed width: sorted by name is sorted by number


def deep_file(n_files: int, per_dir: int = PER_DIR) -> str:
    """The relative path of the last file of a synthetic tree (deepest folder, last entry)."""
    d = (n_files - 1) // per_dir
    return f"train/{_dir_name(d)}/{_dir_name(d)}_{n_files - 1}.JPEG"


def build_index(n_files: int, chunk: FakeChunk, per_dir: int = PER_DIR, created_ns: int = 0) -> IndexWriter:
    """An index of /train/<dir>/<file> with `per_dir` files a folder, every file one extent in `chunk`."""
    n_dirs = max(1, -(-n_files // per_dir))
    created_ns = created_ns or time.time_ns()
    writer = IndexWriter(2 + n_dirs + n_files, CHUNK_SIZE, created_ns)
    reg, folder = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755
    size = chunk.record.raw_len
    ino = 3 + n_dirs  # 1 the root, 2 train/, then the folders, then the files
    top: list[tuple[bytes, int]] = []
    for d in range(n_dirs):
        name = _dir_name(d)
        entries = []
        for i in range(d * per_dir, min(n_files, (d + 1) * per_dir)):
            ext = writer.add_extent(0, chunk.record)
            writer.set_inode(ino, reg, 0, 0, 1, size, created_ns, ext, 1, 3 + d)
            entries.append((f"{name}_{i}.JPEG".encode(), ino))
            ino += 1
        ref, count = writer.add_dirents(entries)
        writer.set_inode(3 + d, folder, 0, 0, 2, 0, created_ns, ref, count, 2)
        top.append((name.encode(), 3 + d))
    ref, count = writer.add_dirents(top)
    writer.set_inode(2, folder, 0, 0, 2 + n_dirs, 0, created_ns, ref, count, 1)
    ref, count = writer.add_dirents([(b"train", 2)])
    writer.set_inode(1, folder, 0, 0, 3, 0, created_ns, ref, count, 1)
    writer.add_chunk(chunk.id, len(chunk.data), 0, writer.extents_count())
    return writer


async def commit_index(home: Path, name: str, writer: IndexWriter, chunk: FakeChunk) -> int:
    """Commit `writer` as dataset `name` on the node under `home`, through the metadata protocol
    (BEGIN_INGEST, PIN_CHUNKS, PUT_CHUNK, PUT_INDEX, COMMIT); returns the index's size in bytes."""
    cluster = load_cluster(None, home)
    async with open_nursery() as nursery:
        client = ClusterClient(cluster, nursery)
        meta, _ = await client.call_meta(Msg.BEGIN_INGEST, {"name": name})
        session = reply(IngestBegun, meta, Msg.BEGIN_INGEST, META_DAEMON).session
        await client.call_meta(Msg.PIN_CHUNKS, {"session": session, "ids": [chunk.id]})
        for spec in cluster.data_nodes:
            await client.call(spec, "data", Msg.PUT_CHUNK, {"id": chunk.id}, chunk.data)
        info = await ingest_commit(client, session, writer, home)
        nursery.cancel_scope.cancel()
    return info.index_size


@dataclass
class ScalePoint:
    files: int
    index_bytes: int
    build_s: float  # building and committing the synthetic index (not a dlfs figure)
    mount_s: float  # `dlfs mount` wall time, first mount: includes fetching the index from the node
    remount_s: float  # the same with the index already in the mount's local index cache
    rss_mount: int  # VmRSS of the mount process right after the first mount
    rss_stat: int  # ... and after a stat of one file in the deepest folder
    rss_remount: int  # the same two after the remount (no index transfer in this process)
    rss_remount_stat: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure(node: DlfsNode, mountpoint: Path, n_files: int, chunk: FakeChunk) -> ScalePoint:
    """Commit an n-file synthetic dataset, mount it twice, and read the mount's time and memory."""
    name = f"scale-{n_files}"
    t0 = time.perf_counter()
    index_bytes = trio.run(commit_index, node.home, name, build_index(n_files, chunk), chunk)
    build_s = time.perf_counter() - t0
    mountpoint.mkdir(parents=True, exist_ok=True)
    mnt = DlfsMount(node, name, mountpoint)
    try:
        mnt.mount()
        first = _rss_around_stat(node, mountpoint, n_files, chunk)
        mount_s = mnt.mount_seconds
        mnt.remount()
        again = _rss_around_stat(node, mountpoint, n_files, chunk)
        remount_s = mnt.mount_seconds
    finally:
        mnt.unmount()
    return ScalePoint(n_files, index_bytes, build_s, mount_s, remount_s, *first, *again)


def _rss_around_stat(node: DlfsNode, mountpoint: Path, n_files: int, chunk: FakeChunk) -> tuple[int, int]:
    """The mount process's VmRSS now, and after a stat of the deepest folder's last file."""
    pid = node.mount_pid(mountpoint)
    before = rss_bytes(pid)
    st = os.stat(mountpoint / deep_file(n_files))
    if st.st_size != chunk.record.raw_len:
        raise DlfsError(f"{mountpoint}: a synthetic file shows {st.st_size} bytes, not {chunk.record.raw_len}")
    return before, rss_bytes(pid)


def index_bytes_per_file(points: list[ScalePoint]) -> float | None:
    """The index file's own size per file, by the same slope: the mount pins it in memory (mlock, so
    no LOOKUP waits for the disk), so it is part of what bytes_per_file counts."""
    lo, hi = min(points, key=lambda p: p.files), max(points, key=lambda p: p.files)
    return None if hi.files == lo.files else (hi.index_bytes - lo.index_bytes) / (hi.files - lo.files)


def bytes_per_file(points: list[ScalePoint], remount: bool = False) -> float | None:
    """Resident memory per file beyond a fixed base: the slope of VmRSS after the stat between the
    smallest and the largest index (of the first mounts, or of the remounts); None with one size."""
    lo, hi = min(points, key=lambda p: p.files), max(points, key=lambda p: p.files)
    if hi.files == lo.files:
        return None
    if remount:
        return (hi.rss_remount_stat - lo.rss_remount_stat) / (hi.files - lo.files)
    return (hi.rss_stat - lo.rss_stat) / (hi.files - lo.files)
