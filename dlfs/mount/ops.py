"""pyfuse3 Operations: thin handlers over the mmap'd index and the chunk cache.

Metadata never leaves this process. Domain errors become FUSEError(errno) here and nowhere else.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from functools import wraps
from time import perf_counter
from typing import Any, TypeVar

import pyfuse3

from dlfs.counters import LatencyHistogram
from dlfs.errors import CorruptData, DlfsError
from dlfs.format.index import NAME_MAX, Index, Inode
from dlfs.mount.cache import ChunkCache
from dlfs.native import fuse_hooked

log = logging.getLogger(__name__)
# A mounted version never changes: the kernel may keep names and attributes as long as it likes.
TIMEOUT = 86400.0
BLKSIZE = 128 << 10
CONTROL_XATTR = b"user.dlfs.control"  # on the root: the mount's control socket (dlfs.direct)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_errors(fn: F) -> F:
    """Map dlfs errors to errnos at the FUSE boundary."""

    @wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except DlfsError as exc:
            log.error("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            # A bug must cost one request an EIO, never the whole mount (pyfuse3 would end it).
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def _new_attrs() -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.generation = 0
    a.entry_timeout = TIMEOUT
    a.attr_timeout = TIMEOUT
    a.st_rdev = 0
    a.st_blksize = BLKSIZE
    return a


async def _erofs(*args: Any, **kwargs: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


class DlfsOperations(pyfuse3.Operations):
    def __init__(self, index: Index, cache: ChunkCache, label: str) -> None:
        super().__init__()
        self.index = index
        self.cache = cache
        self.label = label
        self.reads = 0
        self.bytes_read = 0
        self.errors = 0
        self.read_seconds = LatencyHistogram()
        self.control_path: bytes | None = None  # the control socket dlfs.direct attaches to

    def attrs(self, node: Inode) -> pyfuse3.EntryAttributes:
        return self.fill(_new_attrs(), node.ino)

    def fill(self, a: pyfuse3.EntryAttributes, ino: int) -> pyfuse3.EntryAttributes:
        """Set an inode's own fields on `a` (whose constant fields are already set)."""
        mode, uid, gid, nlink, size, mtime_ns, _, _, _ = self.index.inode_fields(ino)
        a.st_ino = ino
        a.st_mode = mode
        a.st_nlink = nlink
        a.st_uid = uid
        a.st_gid = gid
        a.st_size = size
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime_ns
        return a

    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if name == b".":
            return self.attrs(self.index.inode(parent_inode))
        if name == b"..":
            return self.attrs(self.index.inode(self.index.inode(parent_inode).parent))
        ino = self.index.lookup(parent_inode, name)
        if ino == -errno.ENOENT:
            # A negative entry, as the native engine answers: the mount's version never changes, so the
            # kernel may keep the miss (in its dentry cache, bounded, gone with the mount): ENOENT.
            miss = _new_attrs()
            miss.st_ino = 0
            return miss
        if ino < 0:
            raise pyfuse3.FUSEError(-ino)  # ENOTDIR, ENAMETOOLONG
        return self.attrs(self.index.inode(ino))

    async def forget(self, inode_list: Any) -> None:
        pass  # inodes live in the index for the life of the mount

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self.attrs(self.index.inode(inode))

    @fuse_errors
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        node = self.index.inode(inode)
        if not stat.S_ISLNK(node.mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self.index.readlink(inode)

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        if not stat.S_ISDIR(self.index.inode(inode).mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # Positions 0 and 1 are "." and ".."; entry i of the directory is position i + 2.
        if start_id == 0:
            node = self.index.inode(fh)
            if not pyfuse3.readdir_reply(token, b".", self.attrs(node), 1):
                return
            start_id = 1
        if start_id == 1:
            node = self.index.inode(fh)
            if not pyfuse3.readdir_reply(token, b"..", self.attrs(self.index.inode(node.parent)), 2):
                return
            start_id = 2
        # One attributes object for the whole listing: readdir_reply copies it at once.
        a = _new_attrs()
        for pos, name, ino in self.index.entries(fh, start_id - 2):
            if not pyfuse3.readdir_reply(token, name, self.fill(a, ino), pos + 3):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        if stat.S_ISDIR(self.index.inode(inode).mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if fuse_hooked():
            # no_open: the kernel stops sending OPEN and RELEASE and keeps every file's pages, and
            # READ still names the file (native/fusehook.c). The mount is ro, so the VFS refuses writes.
            raise pyfuse3.FUSEError(errno.ENOSYS)
        # The handle is the inode itself: open and release need no state at all.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # A view into the cache block is enough: pyfuse3 copies it straight into the reply.
        t0 = perf_counter()
        try:
            data = await self._read(fh, off, size)
        except DlfsError as exc:
            self.errors += 1
            log.error("read of %s in %s failed: %s", _named(fh), self.label, exc)
            raise pyfuse3.FUSEError(exc.errno if not isinstance(exc, CorruptData) else errno.EIO) from None
        except Exception:
            self.errors += 1
            log.exception("read of %s in %s failed", _named(fh), self.label)
            raise pyfuse3.FUSEError(errno.EIO) from None
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

    async def flush(self, fh: int) -> None:
        # ENOSYS once makes the kernel stop sending FLUSH on every close: nothing is ever dirty.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass  # nothing is ever dirty

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    @fuse_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        t = self.index.totals
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (t.bytes + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = t.inodes
        s.f_ffree = s.f_favail = 0
        s.f_namemax = NAME_MAX
        return s

    @fuse_errors
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        self.index.inode(inode)
        return True

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        # Not listed by listxattr: a copy of the tree must not carry it along.
        if inode == pyfuse3.ROOT_INODE and name == CONTROL_XATTR and self.control_path is not None:
            return self.control_path
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return []

    # Nothing changes a mounted version.
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    create = write = setxattr = removexattr = _erofs  # type: ignore[assignment]


def _named(ino: int) -> str:
    """How a log line names a file: its inode (the mount's st_ino), never a path found by scanning the
    index, which on a million-file dataset would stall the event loop for every failed read."""
    return f"inode {ino} (find MOUNTPOINT -inum {ino})"
