"""A FUSE file system whose one file, `stall`, answers LOOKUP, GETATTR and OPEN but never a READ: a disk
that hangs. A read of it blocks in the kernel until this process dies, and no signal but a fatal one ends
the wait. Run as `python stallfs.py MOUNTPOINT SIZE`; it prints "ready" once mounted."""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio

INO = 2
NAME = b"stall"


class StallFs(pyfuse3.Operations):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o644)
        a.st_size = self.size if ino == INO else 0
        a.st_nlink = 1
        a.attr_timeout = a.entry_timeout = 300
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def lookup(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if parent != pyfuse3.ROOT_INODE or name != NAME:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(INO)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        print("read", flush=True)  # for the test: a reader now waits
        await trio.sleep_forever()  # the hung disk
        return b""


async def main(mountpoint: str, size: int) -> None:
    pyfuse3.init(StallFs(size), mountpoint, {"fsname=stallfs", "ro"})
    print("ready", flush=True)
    try:
        await pyfuse3.main()
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    os.umask(0o077)
    trio.run(main, sys.argv[1], int(sys.argv[2]))
