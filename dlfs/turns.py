"""A piece of work that one process does at a time: an exclusive flock on a private file, which its holder
removes when it is done, under the lock, so that such files do not pile up (one per mountpoint or dataset
ever used). A process that took its lock on a file that was removed meanwhile holds nothing (the next
holder's file is a new one): `take` checks the device and inode it locked against the name, and tries the
new file. The holder's pid is in the file, for a waiter to name; its mtime is when it last made progress.
Waiting is the caller's (a command sleeps, an event loop awaits): `take` never blocks.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from dlfs.private import private_dirs


class Turn:
    """A held turn at the work `path` stands for."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd
        self._touched = 0.0

    @classmethod
    def take(cls, path: Path) -> Turn | None:
        """This process's turn (its pid written in the file), or None while another process holds it."""
        private_dirs(path.parent)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                named, held = os.stat(path), os.fstat(fd)
                if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    return cls(path, fd)
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder was done and removed it: the next turn's file is a new one

    def touch(self, every: float = 1.0) -> None:
        """Progress made (at most one mtime update per `every` seconds): a waiter can tell a stalled holder."""
        now = time.monotonic()
        if self.fd is not None and now - self._touched >= every:
            self._touched = now
            os.utime(self.fd)

    def close(self) -> None:
        """Let go of this process's hold (another process sharing the descriptor, a forked child, keeps it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def done(self) -> None:
        """The work is done (or failed): the file removed under the lock, and the lock let go of."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            self.close()


def holder(path: Path) -> tuple[int | None, float | None]:
    """The pid that holds (or last held) the turn at `path`, and seconds since it last made progress;
    (None, None) where there is no such file (or it says nothing yet)."""
    try:
        with open(path, "rb") as f:
            text = f.read(32)
            since = time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None, None
    return (int(text) if text.strip().isdigit() else None), since
