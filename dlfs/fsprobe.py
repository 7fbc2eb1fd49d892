"""Whether the file system at a path answers: the one look at a mount that may be dead or hung.

statvfs always reaches the file system (a stat may be answered from the kernel's cache). A FUSE mount
whose process is gone fails it at once (ENOTCONN); one whose process lives but is stopped or stuck
never answers, and a request the daemon has taken holds its caller even against SIGKILL until it is
answered or the mount goes. So the call is made by a child process, waited for `bound` seconds and then
left (killed: it ends as soon as the kernel lets it), and the caller always goes on. While such a child
is still there, a later probe of the same path reports the mount silent without another one, until the
mount there is taken off (`forget`).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

PROBE_BOUND = 5.0  # seconds a file system has to answer statvfs (a dlfs mount answers it in C at once)
ANSWERS, DEAD, SILENT, FAILED = "answers", "dead", "silent", "failed"
# The child: statvfs, its errno as the exit status (0: it answered).
_LOOK = "import os, sys\ntry:\n    os.statvfs(sys.argv[1])\nexcept OSError as e:\n    sys.exit(e.errno or 255)\n"

_stuck: dict[str, subprocess.Popen[bytes]] = {}  # path -> a child still waiting there for an answer
_lock = threading.Lock()


class Probe(NamedTuple):
    state: str  # ANSWERS, DEAD (its FUSE process is gone), SILENT (no answer within the bound), FAILED
    error: OSError | None = None  # what statvfs failed with (DEAD, FAILED)

    def describe(self, bound: float = PROBE_BOUND) -> str:
        if self.state == SILENT:
            return f"no answer to statvfs within {bound:g} s"
        return str(self.error.strerror if self.error is not None else self.state)


def probe(path: Path | str, bound: float = PROBE_BOUND) -> Probe:
    """How the file system at `path` answers statvfs, within `bound` seconds."""
    key = os.path.abspath(path)
    with _lock:
        left = _stuck.get(key)
        if left is not None:
            if left.poll() is None:
                return Probe(SILENT)
            del _stuck[key]
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LOOK, key], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = child.wait(bound)
    except subprocess.TimeoutExpired:
        child.kill()  # pending there: it goes now; taken by a stopped daemon: once that answers or the mount goes
        with _lock:
            _stuck[key] = child
        return Probe(SILENT)
    if rc == 0:
        return Probe(ANSWERS)
    if rc < 0 or rc == 255:  # killed by a signal, or no errno: say so rather than guess a state
        return Probe(FAILED, OSError(errno.EIO, f"statvfs of {key} ended with status {rc}"))
    return Probe(DEAD if rc == errno.ENOTCONN else FAILED, OSError(rc, os.strerror(rc)))


def forget(path: Path | str) -> None:
    """What was mounted at `path` is gone: a probe's child still stuck there says nothing of what is now."""
    with _lock:
        _stuck.pop(os.path.abspath(path), None)
