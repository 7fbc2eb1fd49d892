"""Unit tests for the index format: writing a namespace, reading it back mmap'd, and refusing bad files."""

from __future__ import annotations

import errno
import random
import re
import stat
import struct
from pathlib import Path

import pytest
import xxhash

from dlfs.errors import CorruptData
from dlfs.format.chunk import ChunkWriter, decode_record
from dlfs.format.index import HEADER, INODE, ROOT_INO, Index, IndexWriter, file_checksum

DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
LNK = stat.S_IFLNK | 0o777
MTIME = 1_700_000_000_123_456_789

# Names a POSIX file system allows: anything but "/" and NUL.
SPACE = b"a file with spaces"
NEWLINE = b"line\nbreak"
RAW = b"\xff\xfe not utf-8"
TARGET = b"sub/inner \xe9"


def _tree(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    """A small namespace backed by two real chunks.

    1 /                 dir: SPACE -> 3, NEWLINE -> 4, RAW -> 5 (symlink), b"sub" -> 2
    2 /sub              dir: b"hard" -> 3 (a hard link), b"inner \xe9" -> 6
    3 /SPACE            3 extents over 2 chunks, nlink 2
    4 /NEWLINE          empty file
    6 /sub/inner \xe9   1 extent
    """
    rng = random.Random(7)
    f3 = [rng.randbytes(3000), b"z" * 5000, rng.randbytes(2000)]
    f6 = b"inner file\n" * 10
    c0 = ChunkWriter(1 << 16)
    r6 = c0.add(f6, compress=False)
    r3a = c0.add(f3[0], compress=False)
    r3b = c0.add(f3[1], compress=True)
    cid0, data0 = c0.finish()
    c1 = ChunkWriter(1 << 16)
    r3c = c1.add(f3[2], compress=False)
    cid1, data1 = c1.finish()

    w = IndexWriter(6, 1 << 16, created_ns=MTIME)
    w.add_extent(0, r6)
    w.add_extent(0, r3a)
    w.add_extent(0, r3b)
    w.add_extent(1, r3c)
    assert w.add_chunk(cid0, len(data0), 0, 3) == 0
    assert w.add_chunk(cid1, len(data1), 3, 1) == 1
    # Inodes set out of order on purpose (the writer allows any order).
    ref, n = w.add_dirents([(b"inner \xe9", 6), (b"hard", 3)])
    w.set_inode(2, DIR, 1000, 1000, 2, 0, MTIME, ref, n, 1)
    ref, n = w.add_dirents([(SPACE, 3), (NEWLINE, 4), (RAW, 5), (b"sub", 2)])
    w.set_inode(1, DIR, 0, 0, 3, 0, MTIME, ref, n, 1)
    w.set_inode(3, REG, 1000, 100, 2, sum(map(len, f3)), MTIME + 1, 1, 3, 1)
    w.set_inode(4, REG, 1000, 100, 1, 0, MTIME, 0, 0, 1)
    ref, n = w.add_name(TARGET)
    w.set_inode(5, LNK, 1000, 100, 1, len(TARGET), MTIME, ref, n, 1)
    w.set_inode(6, REG, 1000, 100, 1, len(f6), MTIME, 0, 1, 2)
    path = tmp_path / "v1.idx"
    with open(path, "wb") as out:
        whole = w.write(out)
    assert whole == file_checksum(path) == xxhash.xxh3_64_intdigest(path.read_bytes())
    chunks = {cid0: bytes(data0), cid1: bytes(data1)}
    return path, {"f3": b"".join(f3), "f6": f6, "chunks": chunks}


def _read_file(idx: Index, ino: int, chunks: dict[bytes, bytes]) -> bytes:
    node = idx.inode(ino)
    out = b""
    for i in range(node.ref, node.ref + node.count):
        ext = idx.extent(i)
        data = chunks[idx.chunk(ext.chunk).id]
        rec = ext.record
        out += bytes(decode_record(data[rec.offset : rec.offset + rec.stored_len], rec, f"extent {i}"))
    return out


@pytest.mark.timeout(10)
def test_lookup_inodes_and_file_contents(tmp_path: Path) -> None:
    path, want = _tree(tmp_path)
    idx = Index(path)
    try:
        assert idx.lookup(ROOT_INO, SPACE) == 3
        assert idx.lookup(ROOT_INO, NEWLINE) == 4
        assert idx.lookup(ROOT_INO, RAW) == 5
        assert idx.lookup(ROOT_INO, b"sub") == 2
        assert idx.lookup(2, b"hard") == 3  # the hard link: same inode as /SPACE
        assert idx.lookup(2, b"inner \xe9") == 6
        for miss in (b"", b"su", b"subb", b"hard", b"a file with space", b"\xff"):
            assert idx.lookup(ROOT_INO, miss) == -errno.ENOENT
        root = idx.inode(ROOT_INO)
        assert stat.S_ISDIR(root.mode) and root.ino == 1 and root.parent == 1 and root.count == 4
        f = idx.inode(3)
        assert (f.mode, f.uid, f.gid, f.nlink, f.size, f.mtime_ns, f.count, f.parent) == (
            REG, 1000, 100, 2, len(want["f3"]), MTIME + 1, 3, 1)
        assert idx.inode(2).parent == 1 and idx.inode(6).parent == 2
        assert idx.inode(4).size == 0 and idx.inode(4).count == 0
        # Extents lead to the right bytes in the right chunks, compressed or not.
        chunks = want["chunks"]
        assert _read_file(idx, 3, chunks) == want["f3"]  # type: ignore[arg-type]
        assert _read_file(idx, 6, chunks) == want["f6"]  # type: ignore[arg-type]
        assert idx.chunk_ids() == list(chunks)  # type: ignore[call-overload]
        c1 = idx.chunk(1)
        assert (c1.first_extent, c1.n_extents, c1.size) == (3, 1, len(chunks[c1.id]))  # type: ignore[index]
        assert idx.extent(2).record.flags == 1  # the compressible piece was stored lz4
        # Symlinks.
        assert stat.S_ISLNK(idx.inode(5).mode)
        assert idx.readlink(5) == TARGET
    finally:
        idx.close()


@pytest.mark.timeout(10)
def test_entries_sorted_and_resumable(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    idx = Index(path)
    try:
        names = [(name, ino) for _, name, ino in idx.entries(ROOT_INO)]
        assert names == sorted([(SPACE, 3), (NEWLINE, 4), (RAW, 5), (b"sub", 2)])
        assert [n for n, _ in names] == [SPACE, NEWLINE, b"sub", RAW]  # bytewise: 0xff sorts last
        # readdir resumes from a position.
        assert list(idx.entries(ROOT_INO, 2)) == [(2, b"sub", 2), (3, RAW, 5)]
        assert list(idx.entries(ROOT_INO, 4)) == []
    finally:
        idx.close()


@pytest.mark.timeout(10)
def test_walk_and_totals(tmp_path: Path) -> None:
    path, want = _tree(tmp_path)
    idx = Index(path)
    try:
        walked = {p: node.ino for p, node in idx.walk()}
        assert walked == {
            b"": 1, SPACE: 3, NEWLINE: 4, RAW: 5, b"sub": 2, b"sub/hard": 3, b"sub/inner \xe9": 6,
        }
        t = idx.totals
        assert (t.inodes, t.dirents, t.extents, t.chunks) == (6, 6, 4, 2)
        assert t.files == 3 and t.bytes == len(want["f3"]) + len(want["f6"])  # type: ignore[arg-type]
        assert t.chunk_size == 1 << 16 and t.created_ns == MTIME
        assert t.names_size == len(SPACE + NEWLINE + RAW + b"sub" + b"hard" + b"inner \xe9" + TARGET)
    finally:
        idx.close()


@pytest.mark.timeout(20)
def test_big_directory_binary_search(tmp_path: Path) -> None:
    rng = random.Random(11)
    alphabet = bytes(b for b in range(1, 256) if b != ord("/"))
    names: set[bytes] = set()
    while len(names) < 1000:
        names.add(bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 40))))
    by_name = {name: 2 + i for i, name in enumerate(names)}
    w = IndexWriter(1 + len(names), 1 << 20)
    ref, n = w.add_dirents(list(by_name.items()))
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    for ino in by_name.values():
        w.set_inode(ino, REG, 0, 0, 1, ino, 0, 0, 0, 1)
    path = tmp_path / "big.idx"
    with open(path, "wb") as out:
        w.write(out)
    idx = Index(path)
    try:
        for name, ino in by_name.items():
            assert idx.lookup(ROOT_INO, name) == ino
            assert idx.inode(ino).size == ino
        misses = 0
        while misses < 200:
            probe = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
            if probe not in by_name:
                assert idx.lookup(ROOT_INO, probe) == -errno.ENOENT
                misses += 1
        listed = [name for _, name, _ in idx.entries(ROOT_INO)]
        assert listed == sorted(names) and len(listed) == 1000
        assert idx.totals.files == 1000
    finally:
        idx.close()


def _corrupt(path: Path, pos: int, xor: int = 0x01) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= xor
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(10)
def test_truncated_file(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: truncated"):
        Index(path)


@pytest.mark.timeout(10)
def test_file_with_extra_bytes(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: 8 stray bytes"):
        Index(path)


@pytest.mark.timeout(10)
def test_flipped_body_byte(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    _corrupt(path, path.stat().st_size - 3)
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: checksum mismatch"):
        Index(path)
    _corrupt(path, path.stat().st_size - 3)  # undo: it opens again
    Index(path).close()
    _corrupt(path, HEADER.size + 5)  # the first chunk id
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: checksum mismatch"):
        Index(path)


@pytest.mark.timeout(10)
def test_flipped_header_byte(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    _corrupt(path, 20)  # inside the inode count
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: header checksum mismatch"):
        Index(path)


@pytest.mark.timeout(10)
def test_wrong_magic(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[:8] = b"DLFSCHNK"
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: not a dlfs index"):
        Index(path)


@pytest.mark.timeout(10)
def test_unsupported_version(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 7)
    raw[HEADER.size - 8 : HEADER.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw[: HEADER.size - 8])))
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: index format version 7 is not supported"):
        Index(path)


@pytest.mark.timeout(10)
def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.idx"
    path.write_bytes(b"")
    with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: truncated header"):
        Index(path)


@pytest.mark.timeout(10)
def test_out_of_range_references(tmp_path: Path) -> None:
    path, _ = _tree(tmp_path)
    idx = Index(path)
    try:
        for ino in (0, 7, -1, 1 << 40):
            with pytest.raises(CorruptData, match=f"index {re.escape(str(path))}: inode {ino} out of range"):
                idx.inode(ino)
        with pytest.raises(CorruptData, match="extent 4 out of range"):
            idx.extent(4)
        with pytest.raises(CorruptData, match="chunk 2 out of range"):
            idx.chunk(2)
    finally:
        idx.close()


def _bad_index(tmp_path: Path, build: object) -> Index:
    """An index whose checksums are right but whose tables point wrong (a writer's bug)."""
    w = IndexWriter(3, 1 << 16)
    build(w)  # type: ignore[operator]
    path = tmp_path / "bad.idx"
    with open(path, "wb") as out:
        w.write(out)
    return Index(path)


@pytest.mark.timeout(10)
def test_pointers_past_their_sections(tmp_path: Path) -> None:
    def dirents_past_end(w: IndexWriter) -> None:
        ref, n = w.add_dirents([(b"a", 2), (b"b", 3)])
        w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n + 5, 1)
        w.set_inode(2, REG, 0, 0, 1, 0, 0, 0, 0, 1)
        w.set_inode(3, LNK, 0, 0, 1, 0, 0, 100, 4, 1)

    idx = _bad_index(tmp_path, dirents_past_end)
    try:
        with pytest.raises(CorruptData, match="directory inode 1 points past the dirents"):
            list(idx.entries(ROOT_INO))
        with pytest.raises(CorruptData, match="directory inode 1: out of range, or an entry lies outside"):
            idx.lookup(ROOT_INO, b"a")
        with pytest.raises(CorruptData, match="name runs past the names section"):
            idx.readlink(3)
    finally:
        idx.close()


@pytest.mark.timeout(10)
def test_walk_refuses_a_directory_cycle(tmp_path: Path) -> None:
    def cycle(w: IndexWriter) -> None:
        ref, n = w.add_dirents([(b"d", 2)])
        w.set_inode(1, DIR, 0, 0, 3, 0, 0, ref, n, 1)
        ref, n = w.add_dirents([(b"loop", 1), (b"f", 3)])  # a directory entry back to the root
        w.set_inode(2, DIR, 0, 0, 2, 0, 0, ref, n, 1)
        w.set_inode(3, REG, 0, 0, 1, 0, 0, 0, 0, 2)

    idx = _bad_index(tmp_path, cycle)
    try:
        with pytest.raises(CorruptData, match="directory cycle"):
            for _ in idx.walk():
                pass
    finally:
        idx.close()


@pytest.mark.timeout(10)
def test_inode_table_size_matches_layout(tmp_path: Path) -> None:
    # The layout promise the FUSE side relies on: inode i sits at a fixed offset after the chunks.
    path, _ = _tree(tmp_path)
    raw = path.read_bytes()
    idx = Index(path)
    try:
        start = HEADER.size + 2 * 32
        mode = struct.unpack_from("<I", raw, start + 4 * INODE.size)[0]  # inode 5
        assert mode == idx.inode(5).mode == LNK
    finally:
        idx.close()
