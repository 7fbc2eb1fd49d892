"""Read-only bind mounts, made and undone with the mount(2) and umount2(2) system calls."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from dlfs.errors import MountError

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(rc: int, what: str, path: Path) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(f"cannot {what} {path}: {os.strerror(err)}")


def bind_readonly(source: Path, target: Path) -> None:
    """Show `source` at `target` as well, read-only, no device files, no set-uid."""
    _check(_libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None), "bind-mount onto", target)
    # A bind takes its source's flags; read-only needs a remount of the bind itself.
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    if _libc.mount(None, os.fsencode(target), None, flags, None) != 0:
        err = ctypes.get_errno()
        _libc.umount2(os.fsencode(target), 0)
        raise MountError(f"cannot make the bind mount at {target} read-only: {os.strerror(err)}")


def unmount_one(target: Path) -> bool:
    """Unmount the topmost mount at `target`; False when nothing was mounted there. Never stats the
    mount, so a dead FUSE mount (its process gone) comes off as well."""
    if _libc.umount2(os.fsencode(target), 0) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point, or no such path
        return False
    if err == errno.EBUSY:
        raise MountError(f"cannot unmount {target}: it is busy (a process has a file open there)")
    raise MountError(f"cannot unmount {target}: {os.strerror(err)}")
