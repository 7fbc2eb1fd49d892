"""Process matters: whether a daemon or mount recorded in a pid file is still alive; how its memory goes back."""

from __future__ import annotations

import ctypes
import os


def running(pid: int) -> bool:
    """Whether a process is alive; an exited one that its parent (often init) has not reaped yet is not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters (glibc's malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's default, fixed


def give_freed_memory_back() -> None:
    """Make glibc return freed buffers to the kernel at once: by default it raises its mmap threshold
    after each big buffer freed (up to 32 MiB), so later fetch buffers and answers come from the heap
    and stay in the process's memory after they are freed (a mount's heap held 65 MB this way)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc: its own policy stands
        pass
