"""Whether a daemon or mount process recorded in a pid file is still alive."""

from __future__ import annotations

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
