"""Every way dlfs looks a name up gives the same answer: found (the inode), not found (ENOENT),
ENOTDIR, ENAMETOOLONG (a name over 255 bytes, never cut short), EIO where the index is damaged.

The paths: the Python lookup (format/index.py's lookup_in, where the C helper is not built), the C
lookup (native/indexview.c) as Index.lookup calls it, the FUSE handlers in Python (mount/ops.py) and
in C (the serving engine's LOOKUP, native/answer.c), and dlfs.direct's path resolution in C
(native/direct.c). The index has many names and the edge cases: an empty directory, unicode in both
normal forms, bytes that are not UTF-8, bytes above 0x7f (sorted unsigned), names that are prefixes
of each other, names of 254 and 255 bytes, and probes of 256, 4095, 4096 and 5000 bytes. (The index
does not hash names, it binary-searches sorted ones: there are no collisions to try.)"""

from __future__ import annotations

import errno
import io
import mmap
import os
import random
import stat
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dlfs.errors import CorruptData, SourceError
from dlfs.format.chunk import ChunkWriter
from dlfs.format.index import DIRENT, NAME_MAX, Index, IndexWriter, lookup_in
from dlfs.native import native

DIR, REG, LNK = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777
EIO = -errno.EIO
EDGE = [
    b"a", b"ab", b"abc", b"abcd", b"b" * 254, b"b" * 255, b"b" * 253 + b"c", b".hidden", b"with space", b"line\nbreak",
    unicodedata.normalize("NFC", "caf\u00e9").encode(), unicodedata.normalize("NFD", "caf\u00e9").encode(),
    "\u65e5\u672c\u8a9e".encode(), "\U0001f600".encode(), b"\xff\xfe not utf-8", b"\x7f", b"\x80", b"\x01",
    "\u00e9".encode() * 127,  # 254 bytes of two-byte characters
]
TOO_LONG = [b"b" * 256, b"b" * 4095, b"b" * 4096, b"z" * 5000, "\u00e9".encode() * 128]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Index, dict[int, dict[bytes, int]]]]:
    """/ : EDGE, 1500 random names, empty/, sub/ : EDGE again, link -> sub. Files are one record each."""
    rng = random.Random(16)
    randoms = {bytes(rng.choice(b"abcxyz._-\xc3\xa9") for _ in range(rng.randint(1, 24))) for _ in range(1500)}
    randoms -= {b".", b".."}
    root_names = sorted(set(EDGE) | randoms | {b"empty", b"sub", b"link"})
    sub_names = sorted(EDGE)
    n = 1 + len(root_names) + len(sub_names)
    c = ChunkWriter(1 << 16)
    rec = c.add(b"x" * 10, compress=False)
    cid, data = c.finish()
    w = IndexWriter(n, 1 << 16)
    w.add_extent(0, rec)
    w.add_chunk(cid, len(data), 0, 1)
    inos = iter(range(2, n + 1))
    dirs: dict[int, dict[bytes, int]] = {1: {name: next(inos) for name in root_names}}
    dirs[dirs[1][b"sub"]] = {name: next(inos) for name in sub_names}
    dirs[dirs[1][b"empty"]] = {}
    for d, entries in dirs.items():
        ref, count = w.add_dirents(list(entries.items()))
        w.set_inode(d, DIR, 0, 0, 2, 0, 0, ref, count, 1)
    for d, entries in dirs.items():
        for name, ino in entries.items():
            if ino in dirs:
                continue
            if name == b"link":
                off, length = w.add_name(b"sub")
                w.set_inode(ino, LNK, 0, 0, 1, 3, 0, off, length, d)
            else:
                w.set_inode(ino, REG, 0, 0, 1, 10, 0, 0, 1, d)
    path = tmp_path_factory.mktemp("lookup") / "t.idx"
    buf = io.BytesIO()
    w.write(buf)
    path.write_bytes(buf.getvalue())
    index = Index(path)
    yield index, dirs
    index.close()


def probes(index: Index, dirs: dict[int, dict[bytes, int]]) -> list[tuple[int, bytes, int]]:
    """(directory, name, the answer every path must give)."""
    out = []
    for d, entries in dirs.items():
        out += [(d, name, ino) for name, ino in entries.items()]
        absent = [b"", b"abcde", b"b" * 253, b"ac", b"\x00", b"\x81", b"caf", b"empty/", b"a\x00b"]
        absent += [name + b"\x00" for name in EDGE if len(name) < NAME_MAX] + [name[:-1] for name in EDGE]
        out += [(d, name, -errno.ENOENT) for name in absent if name not in entries]
        out += [(d, name, -errno.ENAMETOOLONG) for name in TOO_LONG]
    root = dirs[1]
    for not_dir in (root[b"a"], root[b"link"]):
        out += [(not_dir, b"a", -errno.ENOTDIR), (not_dir, b"b" * 4096, -errno.ENOTDIR)]
    out += [(0, b"a", EIO), (index.totals.inodes + 1, b"a", EIO)]
    return out


def through_python_fuse(index: Index, asks: list[tuple[int, bytes]]) -> list[int | str]:
    """Each answer of mount/ops.py; a miss is a negative entry the kernel keeps for the mount's timeout
    (its version never changes), so it counts as ENOENT only with that timeout."""
    from pyfuse3 import FUSEError

    from dlfs.mount.ops import TIMEOUT, DlfsOperations

    ops = DlfsOperations(index, None, "t")  # type: ignore[arg-type]  # lookup never reads data

    async def run() -> list[int | str]:
        got: list[int | str] = []
        for d, name in asks:
            try:
                a = await ops.lookup(d, name)
                got.append(a.st_ino or (-errno.ENOENT if a.entry_timeout == TIMEOUT else "uncached miss"))
            except FUSEError as exc:
                got.append(-exc.errno)
        return got

    return trio.run(run)


def through_c_fuse(index: Index, asks: list[tuple[int, bytes]]) -> list[int | str]:
    """Each answer of the serving engine (native/answer.c), a miss as through_python_fuse counts it."""
    import fusewire as fw

    assert native is not None
    got: list[int | str] = []
    for d, name in asks:
        kind, raw, _ = native.answer(index.sections(), fw.request(fw.LOOKUP, d, name + b"\0"), timeout=86400.0)
        assert kind == "answered", (d, name)
        reply = fw.reply(raw)
        nodeid, timeout, _ = fw.entry(reply.body) if not reply.error else (0, 0.0, None)
        got.append(-reply.error if reply.error else nodeid or (-errno.ENOENT if timeout == 86400.0 else "uncached miss"))
    return got


def test_python_lookups_answer_alike(tree: tuple[Index, dict[int, dict[bytes, int]]]) -> None:
    index, dirs = tree
    asks = probes(index, dirs)
    assert len(asks) > 1600
    want = [ans for _, _, ans in asks]
    assert [lookup_in(index, d, name) for d, name, _ in asks] == want

    def public(d: int, name: bytes) -> int:  # the C lookup where the helper is built
        try:
            return index.lookup(d, name)
        except CorruptData:
            return EIO

    assert [public(d, name) for d, name, _ in asks] == want
    assert through_python_fuse(index, [(d, name) for d, name, _ in asks]) == want


@pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
def test_c_lookups_answer_alike(tree: tuple[Index, dict[int, dict[bytes, int]]]) -> None:
    index, dirs = tree
    assert native is not None
    asks = probes(index, dirs)
    view = native.IndexView(index.sections())
    assert [view.lookup(d, name) for d, name, _ in asks] == [ans for _, _, ans in asks]
    # The kernel sends a name up to its NUL: one with a NUL inside cannot be asked.
    fuse = [(d, name, ans) for d, name, ans in asks if b"\0" not in name]
    assert through_c_fuse(index, [(d, name) for d, name, _ in fuse]) == [ans for *_, ans in fuse]
    view.close()


@pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
def test_direct_path_resolution_answers_alike(tree: tuple[Index, dict[int, dict[bytes, int]]]) -> None:
    _, dirs = tree
    assert native is not None
    index = Index(tree[0].path)  # its own: the client's hold on the mapping ends when the test's frame does
    # A mount's shared cache and one client of it, as dlfs.direct attaches (its row handed out first).
    fd = os.memfd_create("dlfs-test-control", os.MFD_CLOEXEC)
    os.ftruncate(fd, native.shared_size(1 << 16, 1, index.totals.extents, 2))
    ctl, arena = mmap.mmap(fd, 0), mmap.mmap(-1, 1 << 16)
    mount = native.CacheOwner(ctl, arena, slab_size=1 << 16, nslabs=1, n_extents=index.totals.extents, n_rows=2)
    mount.hand_out(1)
    client = native.CacheView(mmap.mmap(fd, 0, prot=mmap.PROT_READ), arena, row=1, sections=index.sections())
    os.close(fd)
    path_of = {1: b"", dirs[1][b"sub"]: b"sub/", dirs[1][b"empty"]: b"empty/"}
    asks: list[tuple[bytes, Any]] = []
    for d, name, ans in probes(index, dirs):
        if d in path_of and b"/" not in name and name not in (b"", b".", b".."):
            # A directory is found, then refused as EISDIR; a file is found and left to Python (not cached).
            asks.append((path_of[d] + name, -errno.EISDIR if ans in dirs else ans))
    asks += [(b"a/x", -errno.ENOTDIR), (b"link/a", dirs[1][b"link"]), (b"sub/../a", dirs[1][b"a"])]
    assert client.read_many([p for p, _ in asks]) == [ans for _, ans in asks]


def test_damaged_entries_are_eio_on_both_paths(tmp_path: Path) -> None:
    """Dirents written past IndexWriter's checks: inode 0, an inode out of range, a name outside the
    names section, a 300-byte name; and a directory whose entries run past the dirents."""
    w = IndexWriter(3, 1 << 16)
    for name, ino in ((b"a", 2), (b"b", 0), (b"c", 99), (b"d", 2), (b"e" * 300, 2)):
        off, n = w.add_name(name)
        w.dirents += DIRENT.pack(off + (10_000 if name == b"d" else 0), n, ino)
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, 0, 5, 1)
    w.set_inode(2, REG, 0, 0, 1, 0, 0, 0, 0, 1)
    w.set_inode(3, DIR, 0, 0, 2, 0, 0, 3, 7, 1)
    path = tmp_path / "bad.idx"
    with open(path, "wb") as out:
        w.write(out)
    index = Index(path)
    asks = [(1, b"a", 2), (1, b"b", EIO), (1, b"c", EIO), (1, b"d", EIO), (1, b"e" * 300, -errno.ENAMETOOLONG),
            (1, b"f", -errno.ENOENT), (3, b"a", EIO), (3, b"e" * 300, -errno.ENAMETOOLONG)]
    assert [lookup_in(index, d, name) for d, name, _ in asks] == [ans for *_, ans in asks]
    if native is not None:
        view = native.IndexView(index.sections())
        assert [view.lookup(d, name) for d, name, _ in asks] == [ans for *_, ans in asks]
        view.close()
    with pytest.raises(CorruptData, match="directory inode 1: out of range, or an entry lies outside the index"):
        index.lookup(1, b"b")
    index.close()


def test_the_index_holds_no_name_a_lookup_refuses() -> None:
    w = IndexWriter(3, 1 << 16)
    assert w.add_dirents([(b"b" * NAME_MAX, 2)]) == (0, 1)
    for bad, why in ((b"b" * (NAME_MAX + 1), r"is 256 bytes \(a name is at most 255\)"),
                     (b"b" * 4096, r"is 4096 bytes \(a name is at most 255\)"), (b"", "is empty"),
                     (b"a/b", "holds a /"), (b"a\0b", "holds a NUL byte"), (b".", r"is \.$"), (b"..", r"is \.\.$")):
        with pytest.raises(SourceError, match=r"cannot store the name .*: it " + why):
            w.add_dirents([(b"ok", 2), (bad, 3)])
    assert len(w.dirents) == DIRENT.size  # nothing of a refused directory was written


def sized_index(path: Path, sizes: list[int]) -> Index:
    """An index of one folder of regular files of these sizes (every one pointing at one small record:
    what is measured here is the inode table)."""
    c = ChunkWriter(1 << 16)
    rec = c.add(b"x" * 10, compress=False)
    cid, data = c.finish()
    w = IndexWriter(1 + len(sizes), 1 << 16)
    w.add_extent(0, rec)
    w.add_chunk(cid, len(data), 0, 1)
    ref, count = w.add_dirents([(f"f{i}".encode(), i + 2) for i in range(len(sizes))])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, count, 1)
    for i, size in enumerate(sizes):
        w.set_inode(i + 2, REG, 0, 0, 1, size, 0, 0, 1, 1)
    buf = io.BytesIO()
    w.write(buf)
    path.write_bytes(buf.getvalue())
    return Index(path)


@pytest.mark.parametrize("helper", [True, False], ids=["c", "python"])
def test_bulk_file_size_is_where_half_the_bytes_are(tmp_path: Path, helper: bool) -> None:
    # What a mount chooses its serving path by (lifecycle.want_io_uring, want_direct_io): 8 shards of 16 MiB
    # and a 148-byte manifest average under 16 MiB, but every byte read is a shard's.
    mib = 1 << 20
    cases = [([16 * mib] * 8 + [148], 16 * mib), ([110_000] * 1000, 1 << 16), ([110_000] * 100 + [40 * mib], 32 * mib),
             ([110_000] * 1000 + [40 * mib], 1 << 16), ([0, 0], 0), ([], 0), ([1], 1)]
    for n, (sizes, want) in enumerate(cases):
        index = sized_index(tmp_path / f"{n}.idx", sizes)
        try:
            if not helper:
                index._view = False  # the loop Python runs where the C helper is not built
            elif native is None:
                pytest.skip("dlfs's C helper is not built")
            assert index.bulk_file_size() == want, (sizes[:3], len(sizes))
        finally:
            index.close()
