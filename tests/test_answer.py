"""The native engine's answers (native/answer.c), request by request, without a mount: crafted FUSE
requests against real index files, decoded with an independent reading of the kernel ABI (fusewire.py).
The Python handlers (dlfs/mount/ops.py) answer metadata from the same C table: every answer they give
is held against the engine's for the same request, and ops.py sets no field of an answer itself. Crafted
indexes whose offsets point outside their sections get EIO for the request that touched them, and
nothing else."""

from __future__ import annotations

import ast
import errno
import io
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fusewire as fw
import pyfuse3
import pytest
import trio

from dlfs.data.store import chunk_path
from dlfs.errors import DlfsError
from dlfs.format.chunk import FLAG_LZ4, ChunkWriter
from dlfs.format.index import DIRENT, Index, IndexWriter
from dlfs.mount.ops import DlfsOperations
from dlfs.native import native

pytestmark = pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
DIR, REG, LNK = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o640, stat.S_IFLNK | 0o777
MTIME = 1_700_000_000_123_456_789
TIMEOUT = 86400.0
LONG = b"n" * 255


def write_index(path: Path, w: IndexWriter) -> Index:
    buf = io.BytesIO()
    w.write(buf)
    path.write_bytes(buf.getvalue())
    return Index(path)


@pytest.fixture
def index(tmp_path: Path) -> Index:
    """1 / : a, d, l, LONG   2 /a (300 bytes, two extents)   3 /d : x   4 /d/x (empty)   5 /l -> a   6 /LONG"""
    c = ChunkWriter(1 << 16)
    r1, r2 = c.add(b"A" * 100, compress=False), c.add(b"B" * 200, compress=False)
    cid, data = c.finish()
    w = IndexWriter(6, 1 << 16, created_ns=MTIME)
    w.add_extent(0, r1)
    w.add_extent(0, r2)
    w.add_chunk(cid, len(data), 0, 2)
    ref, n = w.add_dirents([(b"x", 4)])
    w.set_inode(3, DIR, 0, 0, 2, 0, MTIME, ref, n, 1)
    ref, n = w.add_dirents([(b"a", 2), (b"d", 3), (b"l", 5), (LONG, 6)])
    w.set_inode(1, DIR, 0, 0, 3, 0, MTIME, ref, n, 1)
    w.set_inode(2, REG, 1000, 100, 1, 300, MTIME, 0, 2, 1)
    w.set_inode(4, REG, 0, 0, 1, 0, -1_500_000_000, 0, 0, 3)  # before 1970: negative nanoseconds
    off, length = w.add_name(b"a")
    w.set_inode(5, LNK, 0, 0, 1, 1, MTIME, off, length, 1)
    w.set_inode(6, REG, 0, 0, 1, 0, MTIME, 0, 0, 1)
    return write_index(tmp_path / "t.idx", w)


def ask(index: Index, req: bytes, **kw: object) -> fw.Reply | str:
    kind, raw, _ = native.answer(index.sections(), req, timeout=TIMEOUT, **kw)
    return fw.reply(raw) if kind == "answered" else kind


def test_lookup_hits_misses_and_not_a_directory(index: Index) -> None:
    r = ask(index, fw.request(fw.LOOKUP, 1, b"a\0", unique=42))
    assert isinstance(r, fw.Reply) and r.error == 0 and r.unique == 42
    nodeid, timeout, a = fw.entry(r.body)
    assert (nodeid, a.ino, a.size, a.mode, a.uid, a.gid, a.nlink) == (2, 2, 300, REG, 1000, 100, 1)
    assert (a.mtime, a.mtime_ns, a.blksize) == (MTIME // 10**9, MTIME % 10**9, 128 << 10) and timeout == TIMEOUT
    assert fw.entry(ask(index, fw.request(fw.LOOKUP, 1, LONG + b"\0")).body)[0] == 6  # type: ignore[union-attr]
    # A miss is a negative entry the kernel may keep (the namespace never changes): ENOENT to the caller.
    r = ask(index, fw.request(fw.LOOKUP, 1, b"nope\0"))
    assert isinstance(r, fw.Reply) and r.error == 0 and fw.entry(r.body)[:2] == (0, TIMEOUT)
    too_long = ask(index, fw.request(fw.LOOKUP, 1, LONG + b"n\0"))  # refused, never cut to LONG
    assert isinstance(too_long, fw.Reply) and too_long.error == errno.ENAMETOOLONG
    assert ask(index, fw.request(fw.LOOKUP, 2, b"x\0")).error == errno.ENOTDIR  # type: ignore[union-attr]
    # "." and ".." (NFS export only) from the index's parent links; a name without its NUL goes to Python.
    assert fw.entry(ask(index, fw.request(fw.LOOKUP, 3, b"..\0")).body)[0] == 1  # type: ignore[union-attr]
    assert fw.entry(ask(index, fw.request(fw.LOOKUP, 3, b".\0")).body)[0] == 3  # type: ignore[union-attr]
    assert fw.entry(ask(index, fw.request(fw.LOOKUP, 1, b"..\0")).body)[0] == 1  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.LOOKUP, 1, b"a")) == "forward"


def test_getattr_readlink_opendir_and_times_before_1970(index: Index) -> None:
    r = ask(index, fw.request(fw.GETATTR, 4, fw.GETATTR_IN.pack(0, 0, 0)))
    assert isinstance(r, fw.Reply) and r.error == 0
    valid, _nsec, _ = fw.ATTR_OUT.unpack_from(r.body)
    a = fw.attr(r.body, fw.ATTR_OUT.size)
    assert valid == TIMEOUT and (a.mtime - 2**64, a.mtime_ns) == (-2, 500_000_000)  # -1.5 s
    assert ask(index, fw.request(fw.READLINK, 5)).body == b"a"  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.READLINK, 2)).error == errno.EINVAL  # type: ignore[union-attr]
    r = ask(index, fw.request(fw.OPENDIR, 3, fw.OPEN_IN.pack(os.O_RDONLY, 0)))
    fh, flags, _ = fw.OPEN_OUT.unpack(r.body)  # type: ignore[union-attr]
    assert fh == 3 and flags == fw.FOPEN_KEEP_CACHE | fw.FOPEN_CACHE_DIR
    assert ask(index, fw.request(fw.OPENDIR, 2, fw.OPEN_IN.pack(0, 0))).error == errno.ENOTDIR  # type: ignore[union-attr]


def test_readdirplus_in_pieces_matches_python_positions(index: Index) -> None:
    whole = ask(index, fw.request(fw.READDIRPLUS, 1, fw.read_in(0, 4096)))
    entries = fw.direntplus(whole.body)  # type: ignore[union-attr]
    assert [(n, i, nxt) for n, i, nxt, _ in entries] == [
        (b".", 1, 1), (b"..", 1, 2), (b"a", 2, 3), (b"d", 3, 4), (b"l", 5, 5), (LONG, 6, 6)]
    assert entries[2][3].size == 300 and entries[4][3].mode == LNK
    # A small buffer: whole entries only (152 bytes + the name, 8-aligned), and the kernel asks again from
    # the next position; 408 bytes hold the 255-byte name alone, or two short ones.
    got, off, sizes = [], 0, []
    while True:
        body = ask(index, fw.request(fw.READDIRPLUS, 1, fw.read_in(off, 408))).body  # type: ignore[union-attr]
        part = fw.direntplus(body)
        if not part:
            break
        sizes.append((len(part), len(body)))
        got += part
        off = part[-1][2]
    assert sizes == [(2, 320), (2, 320), (1, 160), (1, 408)]
    assert [e[:3] for e in got] == [e[:3] for e in entries]
    assert fw.direntplus(ask(index, fw.request(fw.READDIRPLUS, 3, fw.read_in(0, 4096))).body)[1][1] == 1  # type: ignore[union-attr]


def test_trivial_requests(index: Index) -> None:
    assert ask(index, fw.request(fw.IOCTL, 2, fw.IOCTL_IN.pack(0, 0, 0x5401, 0, 0, 60))).error == errno.ENOTTY  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.OPEN, 2, fw.OPEN_IN.pack(os.O_RDONLY, 0))).error == errno.ENOSYS  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.FLUSH, 2, bytes(24))).error == errno.ENOSYS  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.RELEASEDIR, 3, bytes(24))).error == 0  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.ACCESS, 2, fw.ACCESS_IN.pack(os.W_OK, 0))).error == errno.EROFS  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.ACCESS, 2, fw.ACCESS_IN.pack(os.R_OK, 0))).error == 0  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.FORGET, 2, bytes(8))) == "no_reply"
    assert ask(index, fw.request(fw.INTERRUPT, 0, bytes(8))) == "no_reply"
    # From the index's header: 300 bytes of files are one 4 KiB block; 6 inodes; nothing free.
    r = ask(index, fw.request(fw.STATFS, 1))
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, *_ = fw.STATFS_OUT.unpack(r.body)  # type: ignore[union-attr]
    assert (blocks, bfree, bavail, files, ffree, bsize, namelen, frsize) == (1, 0, 0, 6, 0, 4096, 255, 4096)
    # What C does not answer goes to Python untouched: writes, SETATTR, a truncated argument struct.
    assert ask(index, fw.request(fw.SETATTR, 2, bytes(88))) == "forward"
    assert ask(index, fw.request(fw.GETATTR, 2, bytes(4))) == "forward"
    # No shared cache here: every READ with bytes to send goes to Python; past the end needs none.
    assert ask(index, fw.request(fw.READ, 2, fw.read_in(0, 4096))) == "forward"
    r = ask(index, fw.request(fw.READ, 2, fw.read_in(300, 4096)))
    assert isinstance(r, fw.Reply) and r.error == 0 and r.body == b""


def test_direct_io_opens_big_files_past_the_page_cache(index: Index) -> None:
    """`--direct-io` (set_direct_io(min)): OPEN is answered, the handle the inode; a file of `min` bytes
    or more FOPEN_DIRECT_IO, a smaller one FOPEN_KEEP_CACHE; a directory EISDIR, a write EROFS. With 0,
    the default, OPEN is refused (no_open) and the kernel keeps every page."""
    direct_io, keep_cache = 1 << 0, 1 << 1  # FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE (linux/fuse.h)

    def open_(ino: int, flags: int = os.O_RDONLY) -> fw.Reply:
        r = ask(index, fw.request(fw.OPEN, ino, fw.OPEN_IN.pack(flags, 0)))
        assert isinstance(r, fw.Reply)
        return r

    native.set_direct_io(300)
    try:
        for ino, want in ((2, direct_io), (6, keep_cache)):  # /a: 300 bytes; /LONG: empty
            r = open_(ino)
            assert r.error == 0 and fw.OPEN_OUT.unpack(r.body)[:2] == (ino, want), ino
        assert open_(3).error == errno.EISDIR and open_(2, os.O_WRONLY).error == errno.EROFS
        native.set_direct_io(301)
        assert fw.OPEN_OUT.unpack(open_(2).body)[1] == keep_cache
    finally:
        native.set_direct_io(0)
    assert open_(2).error == errno.ENOSYS


def test_control_xattr_on_the_root_only(index: Index) -> None:
    x = {"xattr_name": b"user.dlfs.control", "xattr_value": b"/run/dlfs/x.sock"}
    name = fw.GETXATTR_IN.pack(0, 0) + b"user.dlfs.control\0"
    size = ask(index, fw.request(fw.GETXATTR, 1, name), **x)
    assert fw.GETXATTR_OUT.unpack(size.body)[0] == 16  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.GETXATTR, 1, fw.GETXATTR_IN.pack(4, 0) + b"user.dlfs.control\0"),
               **x).error == errno.ERANGE  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.GETXATTR, 1, fw.GETXATTR_IN.pack(64, 0) + b"user.dlfs.control\0"),
               **x).body == b"/run/dlfs/x.sock"  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.GETXATTR, 2, name), **x).error == errno.ENODATA  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.GETXATTR, 1, name)).error == errno.ENODATA  # type: ignore[union-attr]
    assert ask(index, fw.request(fw.LISTXATTR, 1, fw.GETXATTR_IN.pack(0, 0)), **x).body == bytes(8)  # type: ignore[union-attr]


def _crafted(tmp_path: Path, damage: str) -> Index:
    """A checksummed index whose offsets point outside their sections (what a checksum cannot catch)."""
    w = IndexWriter(3, 1 << 16)
    ref, n = w.add_dirents([(b"a", 2), (b"b", 3)])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    w.set_inode(2, DIR, 0, 0, 2, 0, 0, 0, 0, 1)
    w.set_inode(3, REG, 0, 0, 1, 0, 0, 0, 0, 1)
    if damage == "dir-count":
        w.set_inode(2, DIR, 0, 0, 2, 0, 0, 1, 1_000_000, 1)  # entries past the dirents
    elif damage == "child-ino":
        DIRENT.pack_into(w.dirents, DIRENT.size, *DIRENT.unpack_from(w.dirents, DIRENT.size)[:2], 99)
    elif damage == "name-offset":
        off, length, ino = DIRENT.unpack_from(w.dirents, 0)
        DIRENT.pack_into(w.dirents, 0, 1 << 40, length, ino)
    elif damage == "symlink":
        w.set_inode(3, LNK, 0, 0, 1, 5, 0, 1 << 40, 5, 1)
    return write_index(tmp_path / f"{damage}.idx", w)


@pytest.mark.parametrize("damage", ["dir-count", "child-ino", "name-offset", "symlink"])
def test_crafted_offsets_give_eio_for_that_request_alone(tmp_path: Path, damage: str) -> None:
    ix = _crafted(tmp_path, damage)
    requests = [fw.request(fw.READDIRPLUS, 1, fw.read_in(0, 4096)), fw.request(fw.LOOKUP, 1, b"b\0"),
                fw.request(fw.LOOKUP, 2, b"q\0"), fw.request(fw.READDIRPLUS, 2, fw.read_in(0, 4096)),
                fw.request(fw.GETATTR, 99, bytes(16)), fw.request(fw.READLINK, 3), fw.request(fw.LOOKUP, 1, b"a\0")]
    answers = [ask(ix, r) for r in requests]
    errors = [a.error if isinstance(a, fw.Reply) else a for a in answers]
    assert errors[4] == errno.EIO  # an inode past the table, whatever the damage
    # A binary search touches only the entries on its way: "b" is the first probe of the root's two.
    expect_eio = {"dir-count": {2, 3}, "child-ino": {0, 1}, "name-offset": {0, 6}, "symlink": {5}}[damage]
    for i in expect_eio:
        assert errors[i] == errno.EIO, (damage, i, errors)
    # The same index still answers what the damage does not touch.
    assert ask(ix, fw.request(fw.GETATTR, 1, bytes(16))).error == 0  # type: ignore[union-attr]
    for i, e in enumerate(errors):
        if i not in expect_eio | {4}:
            assert e != errno.EIO, (damage, i, errors)


# --- the Python handlers answer from this table -------------------------------------------------
def _c_attr(buf: bytes, at: int) -> tuple[int, ...]:
    """Every field of a reply's struct fuse_attr, times in signed nanoseconds (flags left out)."""
    ino, size, blocks, atime, mtime, ctime, ans, mns, cns, mode, nlink, uid, gid, rdev, blksize, _ = \
        fw.ATTR.unpack_from(buf, at)
    signed = [t - (1 << 64) if t >= 1 << 63 else t for t in (atime, mtime, ctime)]
    return (ino, size, blocks, signed[0] * 10**9 + ans, signed[1] * 10**9 + mns, signed[2] * 10**9 + cns, mode,
            nlink, uid, gid, rdev, blksize)


def _py_attr(a: Any) -> tuple[int, ...]:
    return (a.st_ino, a.st_size, a.st_blocks, a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns, a.st_mode, a.st_nlink,
            a.st_uid, a.st_gid, a.st_rdev, a.st_blksize)


def _through_ops(handler: Callable[..., Any], *args: Any) -> Any:
    """A handler's answer, or the errno its FUSE boundary gave."""
    try:
        return trio.run(handler, *args)
    except pyfuse3.FUSEError as exc:
        return exc.errno


def _listing(ops: DlfsOperations, ino: int, pos: int) -> list[tuple[bytes, int, int, tuple[int, ...]]] | int:
    """What ops.readdir hands readdir_reply from `pos` on, or the errno; (name, inode, next, attributes)."""
    try:
        return [(name, a.st_ino, following, _py_attr(a)) for name, a, following in ops.listing(ino, pos)]
    except DlfsError as exc:
        return exc.errno


def _c_listing(index: Index, ino: int, pos: int) -> list[tuple[bytes, int, int, tuple[int, ...]]] | int:
    r = ask(index, fw.request(fw.READDIRPLUS, ino, fw.read_in(pos, 1 << 16)))
    assert isinstance(r, fw.Reply)
    if r.error:
        return r.error
    out, at = [], 0
    for name, child, following, _ in fw.direntplus(r.body):
        at_attr = r.body.index(name, at) - fw.DIRENT.size - fw.ATTR.size  # this entry's struct fuse_attr
        out.append((name, child, following, _c_attr(r.body, at_attr)))
        at = at_attr + fw.ATTR.size + fw.DIRENT.size + len(name)
    return out


@pytest.mark.parametrize("damage", [None, "dir-count", "child-ino", "name-offset", "symlink"])
def test_python_handlers_answer_as_the_engine_does(tmp_path: Path, index: Index, damage: str | None) -> None:
    # Every metadata request, through ops.py's handlers (and their FUSE boundary) and through the engine,
    # over a sound index and over damaged ones: the same attributes, entries, positions, sums and errnos.
    ix = index if damage is None else _crafted(tmp_path, damage)
    ops = DlfsOperations(ix, None, "t@1")  # type: ignore[arg-type]  # metadata never reads data
    n = ix.totals.inodes
    for ino in range(0, n + 2):
        r = ask(ix, fw.request(fw.GETATTR, ino, fw.GETATTR_IN.pack(0, 0, 0)))
        py = _through_ops(ops.getattr, ino)
        assert (_py_attr(py) if not isinstance(py, int) else py) == \
               (_c_attr(r.body, fw.ATTR_OUT.size) if not r.error else r.error), (damage, ino)  # type: ignore[union-attr]
        if not r.error:  # type: ignore[union-attr]
            assert py.attr_timeout == fw.ATTR_OUT.unpack_from(r.body)[0] == TIMEOUT  # type: ignore[union-attr]
        r = ask(ix, fw.request(fw.READLINK, ino))
        assert _through_ops(ops.readlink, ino, None) == (r.body if not r.error else r.error)  # type: ignore[union-attr]
        r = ask(ix, fw.request(fw.OPENDIR, ino, fw.OPEN_IN.pack(os.O_RDONLY, 0)))
        assert _through_ops(ops.opendir, ino, None) == (ino if not r.error else r.error), (damage, ino)  # type: ignore[union-attr]
        for mask in (os.R_OK, os.W_OK):
            r = ask(ix, fw.request(fw.ACCESS, ino, fw.ACCESS_IN.pack(mask, 0)))
            assert _through_ops(ops.access, ino, mask, None) == (True if not r.error else r.error)  # type: ignore[union-attr]
        names = {b".", b"..", b"", b"nope", LONG, LONG + b"n", b"a", b"b", b"d", b"l", b"x", b"q"}
        for name in sorted(names):
            r = ask(ix, fw.request(fw.LOOKUP, ino, name + b"\0"))
            py = _through_ops(ops.lookup, ino, name)
            if r.error:  # type: ignore[union-attr]
                assert py == r.error, (damage, ino, name)  # type: ignore[union-attr]
                continue
            nodeid, timeout, _ = fw.entry(r.body)  # type: ignore[union-attr]
            # st_ino 0 is the negative entry, kept for the same timeout.
            assert (py.st_ino, py.entry_timeout, _py_attr(py)) == \
                   (nodeid, timeout, _c_attr(r.body, fw.ENTRY_OUT.size)), (damage, ino, name)  # type: ignore[union-attr]
        count = ix.inode(ino).count if 1 <= ino <= n else 0
        # Every offset the kernel may ask from, and past the end ("dir-count" claims a million entries).
        for pos in sorted(set(range(min(count, 6) + 4)) | {count + 1, count + 2, count + 3}):
            assert _listing(ops, ino, pos) == _c_listing(ix, ino, pos), (damage, ino, pos)
    r = ask(ix, fw.request(fw.STATFS, 1))
    s = _through_ops(ops.statfs, None)
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, *_ = fw.STATFS_OUT.unpack(r.body)  # type: ignore[union-attr]
    assert (s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_favail, s.f_bsize, s.f_namemax, s.f_frsize) == \
           (blocks, bfree, bavail, files, ffree, ffree, bsize, namelen, frsize)


def test_ops_sets_no_field_of_an_answer_but_its_timeouts() -> None:
    # The table is C's alone: ops.py assigns none of an answer's fields (st_*, f_*) and names none of the
    # table's numbers (the block size, 512-byte blocks, 4 KiB statfs blocks, the name limit).
    import dlfs.mount.ops as ops_module

    tree = ast.parse(Path(ops_module.__file__).read_text())
    stores = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
              for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
              for t in ([t] if not isinstance(t, ast.Tuple) else t.elts) if isinstance(t, ast.Attribute)}
    assert {s for s in stores if s.startswith(("st_", "f_"))} == set()
    assert {"entry_timeout", "attr_timeout"} <= stores
    numbers = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and type(node.value) is int}
    assert numbers & {255, 511, 512, 4095, 4096, 128 << 10} == set()
    assert not {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & {"BLKSIZE", "NAME_MAX"}


def _chunk_file(tmp_path: Path, cid: bytes, data: bytes | memoryview) -> tuple[Path, Path]:
    """A chunk file as this machine's data daemon keeps it: (its chunk directory, its path)."""
    chunks = tmp_path / "chunks"
    path = chunk_path(chunks, cid)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(data))
    return chunks, path


def test_random_reads_of_local_chunks_are_read_and_checked_block_by_block(tmp_path: Path) -> None:
    # A random read inside a big record of a chunk this machine holds is read here, its 4 KiB blocks
    # alone, and checked against the record's sums; anything else (too big to be random, a bad block, a chunk held
    # elsewhere, a read across records) goes to Python, which fetches it its own way.
    rng = random.Random(4)
    big = [rng.randbytes(300_000), rng.randbytes(400_000)]  # both carry block sums (>= 256 KiB)
    c = ChunkWriter(1 << 20)
    recs = [c.add(b, compress=False) for b in big]
    assert all(r.has_block_sums for r in recs)
    cid, data = c.finish()
    chunks, path = _chunk_file(tmp_path, cid, data)
    w = IndexWriter(2, 1 << 20)
    w.add_extent(0, recs[0])
    w.add_extent(0, recs[1])
    w.add_chunk(cid, len(data), 0, 2)
    ref, n = w.add_dirents([(b"f", 2)])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    w.set_inode(2, REG, 0, 0, 1, 700_000, 0, 0, 2, 1)
    ix = write_index(tmp_path / "b.idx", w)
    local = os.fsencode(chunks)
    whole = big[0] + big[1]

    def read(off: int, size: int, where: bytes | None = local) -> tuple[str, bytes, dict[str, int]]:
        kind, raw, counts = native.answer(ix.sections(), fw.request(fw.READ, 2, fw.read_in(off, size)),
                                          local_dir=where)
        return kind, fw.reply(raw).body if kind == "answered" else b"", counts

    for off in (0, 4096 * 17, 299_000 - 4096, 300_000, 300_000 + 4096 * 50, 700_000 - 100):
        kind, body, counts = read(off, 4096)
        assert kind == "answered" and body == whole[off : off + 4096], off
        rec = big[off >= 300_000]
        start = off - (300_000 if off >= 300_000 else 0)
        first, last = start // 4096, (min(start + 4096, len(rec)) - 1) // 4096
        span = min((last + 1) * 4096, len(rec)) - first * 4096  # whole blocks, the record's last one short
        # The record's whole sum table is read the first time (a serving thread keeps it): 8 B a block.
        assert counts == {"block_reads": 1, "block_bytes": span + 8 * -(-len(rec) // 4096), "block_failures": 0,
                          "record_reads": 0, "record_bytes": 0, "record_failures": 0, "remote_reads": 0,
                          "remote_failures": 0, "disk_cache_reads": 0}
    assert read(1000, 64 << 10)[0] == "answered"
    assert read(1000, (64 << 10) + 1)[0] == "forward"  # read-ahead size: Python fetches windows
    assert read(299_000, 4096)[0] == "forward"  # across two records
    assert read(4096, 4096, None)[0] == "forward"  # no local chunk files
    # A flipped byte in block 3 of record 0: that block's reads go to Python; the others are still read here.
    blob = bytearray(path.read_bytes())
    blob[recs[0].offset + 3 * 4096 + 10] ^= 1
    path.write_bytes(bytes(blob))
    kind, _, counts = read(3 * 4096, 4096)
    assert kind == "forward" and counts["block_failures"] == 1 and counts["block_reads"] == 0
    assert read(5 * 4096, 4096)[1] == whole[5 * 4096 : 6 * 4096]
    path.unlink()  # the chunk is held elsewhere
    assert read(5 * 4096, 4096)[0] == "forward"


def test_scan_mode_reads_whole_small_local_records_and_checks_them(tmp_path: Path) -> None:
    # With read-ahead out of room (scan mode), a READ of a whole small file of a local chunk is read from
    # the chunk file and checked against the record's checksum here; otherwise, or when the bytes are
    # bad, a read of part of the file, or a compressed record, it goes to Python.
    rng = random.Random(5)
    small = [rng.randbytes(100_000), rng.randbytes(200_000), b"z" * 50_000]
    c = ChunkWriter(1 << 20)
    recs = [c.add(small[0], compress=False), c.add(small[1], compress=False), c.add(small[2], compress=True)]
    assert not any(r.has_block_sums for r in recs) and recs[2].flags & FLAG_LZ4
    cid, data = c.finish()
    chunks, path = _chunk_file(tmp_path, cid, data)
    w = IndexWriter(4, 1 << 20)
    for r in recs:
        w.add_extent(0, r)
    w.add_chunk(cid, len(data), 0, 3)
    ref, n = w.add_dirents([(b"a", 2), (b"b", 3), (b"c", 4)])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    for ino, (i, blob) in zip((2, 3, 4), enumerate(small)):
        w.set_inode(ino, REG, 0, 0, 1, len(blob), 0, i, 1, 1)
    ix = write_index(tmp_path / "s.idx", w)

    def read(ino: int, off: int, size: int) -> tuple[str, bytes, dict[str, int]]:
        kind, raw, counts = native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(off, size)),
                                          local_dir=os.fsencode(chunks))
        return kind, fw.reply(raw).body if kind == "answered" else b"", counts

    try:
        native.set_scan(False)
        assert read(2, 0, 128 << 10)[0] == "forward"  # read-ahead has room: Python fetches the window
        native.set_scan(True)
        kind, body, counts = read(2, 0, 128 << 10)
        assert kind == "answered" and body == small[0]
        assert (counts["record_reads"], counts["record_bytes"]) == (1, 100_000)
        assert read(3, 0, 256 << 10)[1] == small[1]
        assert read(3, 0, 128 << 10)[0] == "forward"  # part of the record: its checksum covers it all
        assert read(2, 4096, 128 << 10)[0] == "forward"
        assert read(4, 0, 128 << 10)[0] == "forward"  # compressed: Python decodes it
        blob = bytearray(path.read_bytes())
        blob[recs[0].offset + 77_777] ^= 1
        path.write_bytes(bytes(blob))
        kind, _, counts = read(2, 0, 128 << 10)
        assert kind == "forward" and counts["record_failures"] == 1 and counts["record_reads"] == 0
        assert read(3, 0, 256 << 10)[1] == small[1]  # the damage is record 0's alone
    finally:
        native.set_scan(False)
