"""Private at rest: what dlfs keeps under $DLFS_HOME is its owner's alone (directories 0700, files 0600).

The chunk store holds the bytes of every file ingested, whatever their modes were at the source, so a
state directory other users can read hands them every dataset, past every permission a mount enforces.
dlfs runs with umask 077 (dlfs/cli.py), gives what it creates there these modes explicitly as well (for
callers with another umask), and a node or mount that finds its home looser tightens it once, at start.
A directory that must be private and may have been made by someone else (the control socket's, in the
temp dir) is checked, never trusted.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from dlfs.errors import NO_ROOM, StorageFull, UsageError

log = logging.getLogger(__name__)
UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
OTHERS = 0o077  # the group's and others' bits


def private_opener(path: str, flags: int) -> int:
    """open()'s opener for a file only its owner may read: created 0600."""
    return os.open(path, flags, FILE_MODE)


def write_private(path: Path, text: str) -> None:
    with open(path, "w", opener=private_opener) as f:
        f.write(text)


def private_dirs(path: Path) -> Path:
    """mkdir -p `path`, every directory it creates 0700 (pathlib's parents=True gives the parents the
    umask's mode)."""
    missing = []
    at = path.absolute()
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile (another process starting on the same home)
        except OSError as exc:  # a read-only or full file system, a directory of another user's
            error = StorageFull if exc.errno in NO_ROOM else UsageError
            raise error(f"cannot make the directory {d}: {exc.strerror}") from None
    return path


def owned_private_dir(path: Path) -> Path:
    """`path`, a directory no other user can reach or replace: made here (0700), or found to be a real
    directory (not a symlink) of ours with no group or other bits; else a one-line UsageError."""
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        why = f"a symlink to {os.readlink(path)}"
    elif not stat.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != os.getuid():
        why = f"owned by uid {st.st_uid}, not {os.getuid()}"
    elif st.st_mode & OTHERS:
        why = f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    else:
        return path
    raise UsageError(f"{path} is {why}: another user could take over what dlfs keeps there; remove it "
                     f"(`rm -r {path}`) and try again")


def tighten(home: Path) -> tuple[int, int, list[str]]:
    """Take the group's and others' bits off `home` and everything under it (symlinks are neither
    followed nor changed; FUSE mounts inside are not dlfs's state). Returns (files, directories)
    changed and what could not be changed."""
    from dlfs.procmounts import fuse_mount_points

    skip = fuse_mount_points()
    files = dirs = 0
    failed: list[str] = []

    def fix(path: str, st: os.stat_result) -> bool:
        if not st.st_mode & OTHERS:
            return False
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~OTHERS)
        except OSError as exc:
            failed.append(f"{path}: {exc.strerror}")
            return False
        return True

    pending = [str(home)]
    try:
        dirs += fix(pending[0], os.stat(pending[0]))
    except FileNotFoundError:
        return 0, 0, []
    while pending:
        top = pending.pop()
        try:
            with os.scandir(top) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed meanwhile (a chunk collected, a temp file renamed)
                    if stat.S_ISLNK(st.st_mode) or entry.path in skip:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        dirs += fix(entry.path, st)
                        pending.append(entry.path)
                    else:
                        files += fix(entry.path, st)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failed.append(f"{top}: {exc.strerror}")
    return files, dirs, failed


def tighten_home(home: Path) -> None:
    """At a node's or mount's start: `home` private through and through, and one warning if it was not."""
    files, dirs, failed = tighten(home)
    if files or dirs:
        log.warning("tightened %d files and %d directories under %s that other users could read (dlfs keeps its "
                    "state private)", files, dirs, home)
    if failed:
        log.warning("could not make %d entries under %s private (first: %s): other users may read them",
                    len(failed), home, failed[0])
