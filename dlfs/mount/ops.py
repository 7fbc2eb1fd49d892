"""pyfuse3 Operations: thin handlers over the mmap'd index and the chunk cache.

Metadata is answered from the table the native serving threads answer with (native/answer.h, through
dlfs.native.answers): no attribute, listing position or statfs sum is defined here. Handlers raise dlfs
errors (dlfs/errors.py: Refused where an errno is the answer itself); `fuse_boundary` alone turns them
into errnos.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from functools import wraps
from time import perf_counter
from typing import Any, TypeVar

import pyfuse3

from dlfs.counters import LatencyHistogram
from dlfs.errors import CorruptData, DlfsError, MountError, Refused
from dlfs.format.index import Index
from dlfs.mount.cache import ChunkCache
from dlfs.native import answers, fuse_hooked

log = logging.getLogger(__name__)
# A mounted version never changes: the kernel may keep names and attributes as long as it likes.
TIMEOUT = 86400.0
CONTROL_XATTR = b"user.dlfs.control"  # on the root: the mount's control socket (dlfs.direct)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_boundary(fn: F) -> F:
    """The one place where a handler's errors become errnos. A Refused is the answer itself; any other
    DlfsError gives its errno, any other exception EIO (a bug must cost one request, never the mount,
    which pyfuse3 would end); those two are counted and logged once, by inode and dataset."""

    @wraps(fn)
    async def boundary(self: DlfsOperations, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(self, *args, **kwargs)
        except Refused as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except DlfsError as exc:
            self.errors += 1
            log.error("%s of %s in %s: %s", fn.__name__, _named(args), self.label, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            self.errors += 1
            log.exception("%s of %s in %s failed", fn.__name__, _named(args), self.label)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return boundary  # type: ignore[return-value]


def _named(args: tuple[Any, ...]) -> str:
    """How a log line names a request's file: its inode (the mount's st_ino; every handler that has one
    takes it first), never a path found by scanning the index, which on a million-file dataset would
    stall the event loop for every failure."""
    if args and type(args[0]) is int:
        return f"inode {args[0]} (find MOUNTPOINT -inum {args[0]})"
    return "the mount"


def _answer(r: int) -> int:
    """A table answer (>= 0) as it is, or its -errno as a dlfs error."""
    if r == -errno.EIO:
        raise CorruptData("the index is damaged there, or the inode is out of range")
    if r < 0:
        raise Refused(-r)
    return r


def _new_attrs() -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.generation = 0
    a.entry_timeout = TIMEOUT
    a.attr_timeout = TIMEOUT
    return a


@fuse_boundary
async def _erofs(self: DlfsOperations, *args: Any, **kwargs: Any) -> Any:
    raise Refused(errno.EROFS)


class DlfsOperations(pyfuse3.Operations):
    def __init__(self, index: Index, cache: ChunkCache, label: str) -> None:
        super().__init__()
        if answers is None:  # setup.py builds it with the package: only a broken install lacks it
            raise MountError("dlfs's C helper (dlfs._native) is not built; a mount answers from it: "
                             "reinstall dlfs (make install)")
        self.table: Any = answers  # native/answer.h's table, as the serving threads answer
        self.index = index
        self.sections = index.sections()  # where the table reads the index
        self.cache = cache
        self.label = label
        self.reads = 0
        self.bytes_read = 0
        self.errors = 0  # requests that failed (not those refused by design)
        self.read_seconds = LatencyHistogram()
        self.control_path: bytes | None = None  # the control socket dlfs.direct attaches to
        self.direct_io_min = 0  # --direct-io: files this big are opened past the page cache (0: none)

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = _new_attrs()
        _answer(self.table.attr_of(self.sections, ino, a))
        return a

    def listing(self, ino: int, pos: int) -> Iterator[tuple[bytes, pyfuse3.EntryAttributes, int]]:
        """Directory `ino`'s listing from position `pos`: (name, attributes, the next position). One
        attributes object serves the whole listing: readdir_reply copies it at once."""
        a = _new_attrs()
        while True:
            name, pos = self.table.dirent_of(self.sections, ino, pos, a)
            if _answer(pos) == 0:
                return
            yield name, a, pos

    @fuse_boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        # st_ino 0 is a negative entry: the version never changes, so the kernel keeps the miss (ENOENT).
        a = _new_attrs()
        _answer(self.table.entry_of(self.sections, parent_inode, name, a))
        return a

    async def forget(self, inode_list: Any) -> None:
        pass  # inodes live in the index for the life of the mount

    @fuse_boundary
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self.attrs(inode)

    @fuse_boundary
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        target = self.table.link_of(self.sections, inode)
        return _answer(target) if isinstance(target, int) else target  # type: ignore[return-value]

    @fuse_boundary
    async def opendir(self, inode: int, ctx: Any) -> int:
        _answer(self.table.dir_of(self.sections, inode))
        return inode

    @fuse_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for name, attrs, following in self.listing(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, attrs, following):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    @fuse_boundary
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise Refused(errno.EROFS)
        attrs = self.attrs(inode)
        if stat.S_ISDIR(attrs.st_mode):
            raise Refused(errno.EISDIR)
        if self.direct_io_min:  # as native/answer.c's open_: a big file is read past the page cache
            direct = attrs.st_size >= self.direct_io_min
            return pyfuse3.FileInfo(fh=inode, direct_io=direct, keep_cache=not direct)
        if fuse_hooked():
            # no_open: the kernel stops sending OPEN and RELEASE and keeps every file's pages, and
            # READ still names the file (native/fusehook.c). The mount is ro, so the VFS refuses writes.
            raise Refused(errno.ENOSYS)
        # The handle is the inode itself: open and release need no state at all.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @fuse_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # A view into the cache block is enough: pyfuse3 copies it straight into the reply.
        t0 = perf_counter()
        try:
            data = await self._read(fh, off, size)
        finally:
            self.cache.answered(fh)
        self.reads += 1
        self.bytes_read += len(data)
        self.read_seconds.observe(perf_counter() - t0)
        return data

    async def _read(self, ino: int, off: int, size: int) -> bytes | bytearray | memoryview:
        node = self.index.inode(ino)
        if off >= node.size or size <= 0 or node.count == 0:
            return b""
        end = min(off + size, node.size)
        file_end = node.ref + node.count
        # The kernel keeps what it is sent (keep_cache, or no_open): the cache may then drop it.
        if node.count == 1:
            data = await self.cache.read(node.ref, off, end, node.ref, file_end, size)
            self.cache.consume(node.ref, len(data))
            return data
        # The record holding `off`, found once; a READ (at most 1 MiB) that lies in it is answered with
        # a view of it, no copy.
        start, pos = node.ref, 0
        while start < file_end:
            n = self.index.extent(start).record.raw_len
            if pos + n > off:
                break
            pos += n
            start += 1
        if start < file_end and end <= pos + n:
            data = await self.cache.read(start, off - pos, end - pos, node.ref, file_end, size)
            self.cache.consume(start, len(data))
            return data
        # Each piece is copied out before the next await: a view could outlive its cache slab.
        out = bytearray(end - off)
        for ext in range(start, file_end):
            n = self.index.extent(ext).record.raw_len
            lo = max(off - pos, 0)
            piece = await self.cache.read(ext, lo, min(end - pos, n), node.ref, file_end, size)
            out[pos + lo - off : pos + lo - off + len(piece)] = piece
            self.cache.consume(ext, len(piece))
            pos += n
            if pos >= end:
                break
        return out

    async def release(self, fh: int) -> None:
        pass

    @fuse_boundary
    async def flush(self, fh: int) -> None:
        # ENOSYS once makes the kernel stop sending FLUSH on every close: nothing is ever dirty.
        raise Refused(errno.ENOSYS)

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass  # nothing is ever dirty

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    @fuse_boundary
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        self.table.statfs_of(self.sections, s)
        return s

    @fuse_boundary
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        _answer(self.table.access_of(self.sections, inode, mode))
        return True

    @fuse_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        # Not listed by listxattr: a copy of the tree must not carry it along.
        if inode == pyfuse3.ROOT_INODE and name == CONTROL_XATTR and self.control_path is not None:
            return self.control_path
        raise Refused(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return []

    # Nothing changes a mounted version.
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    create = write = setxattr = removexattr = _erofs  # type: ignore[assignment]
