"""The FUSE boundary (dlfs/mount/ops.py's fuse_boundary): the one place where the handlers' errors become
errnos. Each dlfs error class gives its documented errno; a Refused (an errno by design: EROFS,
ENOTDIR...) is the answer itself, neither logged nor counted; anything unexpected costs that one request
an EIO and one log line naming the inode and the dataset, never the mount. Every handler pyfuse3 calls
that can fail goes through it."""

from __future__ import annotations

import errno
import io
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from dlfs import errors
from dlfs.control.etcd import EtcdFull, EtcdRefused, EtcdUnavailable
from dlfs.errors import DlfsError, Refused
from dlfs.format.chunk import ChunkWriter
from dlfs.format.index import Index, IndexWriter
from dlfs.ingest.walk import PathClash
from dlfs.meta.catalog import CatalogDamaged
from dlfs.mount.ops import DlfsOperations, fuse_boundary
from dlfs.native import answers

pytestmark = pytest.mark.skipif(answers is None, reason="dlfs's C helper is not built")
LABEL = "photos@3"
DIR, REG, LNK = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777
# What each class of dlfs/errors.py answers through FUSE (its `errno`); a new class must say here.
ERRNO = {
    errors.DlfsError: errno.EIO, errors.UsageError: errno.EINVAL, errors.KeyExposed: errno.EINVAL,
    errors.Unreachable: errno.EIO, errors.NoNode: errno.EIO, errors.NotFound: errno.ENOENT, errors.CorruptData: errno.EIO,
    errors.SourceError: errno.EIO, errors.StorageFull: errno.ENOSPC, errors.ProtocolError: errno.EIO,
    errors.AuthError: errno.EACCES, errors.Conflict: errno.EBUSY, errors.OperationPending: errno.EBUSY,
    errors.MountError: errno.EIO, errors.CommandFailed: errno.EIO, errors.TransportUnavailable: errno.EINVAL,
    errors.RdmaFailure: errno.EIO, errors.ControlUnavailable: errno.EIO,
    PathClash: errno.EIO, EtcdUnavailable: errno.EIO, EtcdRefused: errno.EIO, EtcdFull: errno.ENOSPC,
    CatalogDamaged: errno.EIO,
}
# Modules that define DlfsError classes are imported above; this finds any other (a new module with one).
DEFINED_IN = {"dlfs.errors", "dlfs.control.etcd", "dlfs.ingest.walk", "dlfs.meta.catalog"}


def _classes(cls: type[DlfsError]) -> set[type[DlfsError]]:
    return {cls}.union(*(_classes(sub) for sub in cls.__subclasses__()))


def _instance(cls: type[DlfsError]) -> DlfsError:
    message = f"a {cls.__name__}"
    if cls is errors.KeyExposed:
        return cls(message, "/k")  # type: ignore[call-arg]
    if cls is errors.CommandFailed:
        return cls(message, 127)  # type: ignore[call-arg]
    if cls is errors.NoNode:
        return cls(message, "start one")  # type: ignore[call-arg]
    if cls is PathClash:
        return cls(message, b"a/b")  # type: ignore[call-arg]
    return cls(message)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    """1 / : f (3 bytes, one record), l -> f."""
    c = ChunkWriter(1 << 16)
    rec = c.add(b"abc", compress=False)
    cid, data = c.finish()
    w = IndexWriter(3, 1 << 16)
    w.add_extent(0, rec)
    w.add_chunk(cid, len(data), 0, 1)
    ref, n = w.add_dirents([(b"f", 2), (b"l", 3)])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    w.set_inode(2, REG, 0, 0, 1, 3, 0, 0, 1, 1)
    off, length = w.add_name(b"f")
    w.set_inode(3, LNK, 0, 0, 1, 1, 0, off, length, 1)
    buf = io.BytesIO()
    w.write(buf)
    (tmp_path / "t.idx").write_bytes(buf.getvalue())
    ix = Index(tmp_path / "t.idx")
    yield ix
    ix.close()


class Raising(DlfsOperations):
    """The mount's operations, with one more handler that raises what it is given, through the same boundary."""

    @fuse_boundary
    async def fails(self, inode: int, exc: BaseException) -> None:
        raise exc


def _errno_of(call: Any, *args: Any) -> int:
    try:
        trio.run(call, *args)
    except pyfuse3.FUSEError as exc:
        return exc.errno
    raise AssertionError(f"{call.__name__}{args} did not fail")


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dlfs.mount.ops"]


def _import_all() -> None:
    import importlib
    import pkgutil

    import dlfs

    for m in pkgutil.walk_packages(dlfs.__path__, "dlfs."):
        if m.name not in ("dlfs.__main__", "dlfs._native", "dlfs._preload"):
            importlib.import_module(m.name)


def test_every_error_class_is_in_the_table() -> None:
    _import_all()  # whatever else this run imported, the same set
    assert {c.__module__ for c in _classes(DlfsError)} == DEFINED_IN
    assert _classes(DlfsError) - {Refused} == set(ERRNO)  # a new class says what it answers


def test_every_error_class_has_its_errno_at_the_boundary(index: Index, caplog: pytest.LogCaptureFixture) -> None:
    ops = Raising(index, None, LABEL)  # type: ignore[arg-type]
    for n, (cls, want) in enumerate(sorted(ERRNO.items(), key=lambda kv: kv[0].__name__), start=1):
        caplog.clear()
        exc = _instance(cls)
        with caplog.at_level(logging.ERROR, logger="dlfs.mount.ops"):
            assert _errno_of(ops.fails, 2, exc) == want, cls
        # Logged once, by inode and dataset, and counted: a failure, unlike a refusal.
        (rec,) = _ours(caplog)
        assert rec.getMessage() == f"fails of inode 2 (find MOUNTPOINT -inum 2) in {LABEL}: {exc}"
        assert rec.exc_info is None and ops.errors == n


def test_refusals_are_answers_not_failures(index: Index, caplog: pytest.LogCaptureFixture) -> None:
    ops = DlfsOperations(index, None, LABEL)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="dlfs.mount.ops"):
        assert _errno_of(ops.readlink, 2, None) == errno.EINVAL  # not a symlink
        assert _errno_of(ops.opendir, 2, None) == errno.ENOTDIR
        assert _errno_of(ops.lookup, 2, b"x") == errno.ENOTDIR
        assert _errno_of(ops.lookup, 1, b"n" * 256) == errno.ENAMETOOLONG
        assert _errno_of(ops.open, 2, os.O_WRONLY, None) == errno.EROFS
        assert _errno_of(ops.open, 1, os.O_RDONLY, None) == errno.EISDIR
        assert _errno_of(ops.access, 2, os.W_OK, None) == errno.EROFS
        assert _errno_of(ops.unlink, 1, b"f", None) == errno.EROFS
        assert _errno_of(ops.flush, 2) == errno.ENOSYS
        assert _errno_of(ops.getxattr, 2, b"user.x", None) == pyfuse3.ENOATTR
        for exc in (Refused(errno.EXDEV), Refused(errno.EPERM, "not here")):
            assert _errno_of(Raising.fails, ops, 2, exc) == exc.errno
    assert _ours(caplog) == [] and ops.errors == 0


def test_damage_and_bugs_cost_one_request_an_eio_and_one_line(index: Index, caplog: pytest.LogCaptureFixture) -> None:
    ops = DlfsOperations(index, None, LABEL)  # type: ignore[arg-type]  # no cache: a READ is a bug here
    with caplog.at_level(logging.ERROR, logger="dlfs.mount.ops"):
        assert _errno_of(ops.getattr, 99) == errno.EIO  # past the inode table: CorruptData from the C table
        (rec,) = _ours(caplog)
        assert rec.getMessage().startswith(f"getattr of inode 99 (find MOUNTPOINT -inum 99) in {LABEL}: ")
        caplog.clear()
        assert _errno_of(ops.read, 2, 0, 4096) == errno.EIO  # AttributeError: an exception nobody expected
        (rec,) = _ours(caplog)
    assert rec.getMessage() == f"read of inode 2 (find MOUNTPOINT -inum 2) in {LABEL} failed"
    assert rec.exc_info is not None and rec.exc_info[0] is AttributeError  # its traceback, in that one record
    assert ops.errors == 2 and ops.reads == 0
    # The mount goes on: the next request is answered.
    assert trio.run(ops.getattr, 2).st_size == 3
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="dlfs.mount.ops"):
        assert _errno_of(Raising.fails, ops, 7, KeyError("x")) == errno.EIO
    assert [r.getMessage() for r in _ours(caplog)] == [f"fails of inode 7 (find MOUNTPOINT -inum 7) in {LABEL} failed"]


def test_every_handler_that_can_fail_goes_through_the_boundary() -> None:
    boundary = fuse_boundary(DlfsOperations.getattr.__wrapped__).__code__  # type: ignore[attr-defined]
    no_errors = {"forget", "releasedir", "release", "fsync", "fsyncdir", "listxattr"}  # answer nothing but success
    handlers = {name for name, fn in vars(pyfuse3.Operations).items() if callable(fn) and not name.startswith("_")}
    ours = {name for name in handlers if getattr(DlfsOperations, name) is not getattr(pyfuse3.Operations, name)}
    assert {"lookup", "getattr", "read", "readdir", "open", "statfs", "write", "unlink"} <= ours
    unwrapped = {name for name in ours - no_errors if getattr(DlfsOperations, name).__code__ is not boundary}
    assert unwrapped == set()
