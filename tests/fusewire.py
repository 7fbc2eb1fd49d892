"""The FUSE kernel ABI (include/uapi/linux/fuse.h), written out again for tests: crafted requests for
the native engine's answer code and a decoder of its replies. A second, independent reading of the
header, so a layout mistake in C shows as a mismatch here."""

from __future__ import annotations

import struct
from dataclasses import dataclass

IN_HEADER = struct.Struct("<IIQQIII4x")  # len, opcode, unique, nodeid, uid, gid, pid, (extlen, padding)
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<6Q10I")  # ino size blocks atime mtime ctime; nsecs x3, mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid entry_nsec attr_nsec (+ attr)
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy (+ attr)
OPEN_OUT = struct.Struct("<QIi")
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
GETATTR_IN = struct.Struct("<IIQ")
OPEN_IN = struct.Struct("<II")
GETXATTR_IN = struct.Struct("<II")
ACCESS_IN = struct.Struct("<II")
IOCTL_IN = struct.Struct("<QIIQII")
DIRENT = struct.Struct("<QQII")  # ino off namelen type (+ name, padded to 8)
STATFS_OUT = struct.Struct("<5Q4I6I")
GETXATTR_OUT = struct.Struct("<II")

LOOKUP, FORGET, GETATTR, SETATTR, READLINK = 1, 2, 3, 4, 5
OPEN, READ, STATFS, RELEASE, GETXATTR, LISTXATTR, FLUSH = 14, 15, 17, 18, 22, 23, 25
OPENDIR, RELEASEDIR, ACCESS, INTERRUPT, IOCTL, READDIRPLUS = 27, 29, 34, 36, 39, 44
FOPEN_KEEP_CACHE, FOPEN_CACHE_DIR = 1 << 1, 1 << 3


def request(opcode: int, nodeid: int, body: bytes = b"", unique: int = 7) -> bytes:
    """A request as a reader of /dev/fuse gets it: header, then the opcode's arguments."""
    return IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 1) + body


def read_in(offset: int, size: int) -> bytes:
    return READ_IN.pack(0, offset, size, 0, 0, 0, 0)


@dataclass
class Attr:
    ino: int
    size: int
    mtime: int
    mtime_ns: int
    mode: int
    nlink: int
    uid: int
    gid: int
    blksize: int


def attr(buf: bytes, at: int = 0) -> Attr:
    f = ATTR.unpack_from(buf, at)
    return Attr(ino=f[0], size=f[1], mtime=f[4], mtime_ns=f[7], mode=f[9], nlink=f[10], uid=f[11], gid=f[12],
                blksize=f[14])


@dataclass
class Reply:
    error: int  # a positive errno, 0 for success
    unique: int
    body: bytes


def reply(raw: bytes) -> Reply:
    length, error, unique = OUT_HEADER.unpack_from(raw)
    assert length == len(raw), f"header says {length} bytes, the reply has {len(raw)}"
    return Reply(-error, unique, raw[OUT_HEADER.size :])


def entry(body: bytes) -> tuple[int, float, Attr]:
    """(nodeid, entry timeout in seconds, attributes) of a LOOKUP reply."""
    nodeid, _gen, entry_valid, _attr_valid, entry_nsec, _ = ENTRY_OUT.unpack_from(body)
    return nodeid, entry_valid + entry_nsec / 1e9, attr(body, ENTRY_OUT.size)


def direntplus(body: bytes) -> list[tuple[bytes, int, int, Attr]]:
    """(name, inode, next offset, attributes) of each entry of a READDIRPLUS reply."""
    out, pos = [], 0
    while pos < len(body):
        nodeid = ENTRY_OUT.unpack_from(body, pos)[0]
        a = attr(body, pos + ENTRY_OUT.size)
        d = pos + ENTRY_OUT.size + ATTR.size
        ino, off, namelen, _type = DIRENT.unpack_from(body, d)
        name = body[d + DIRENT.size : d + DIRENT.size + namelen]
        assert ino == nodeid
        out.append((name, ino, off, a))
        pos = d + ((DIRENT.size + namelen + 7) & ~7)
    return out
