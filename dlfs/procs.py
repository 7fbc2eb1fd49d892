"""Process matters: whether a daemon or mount recorded in a pid file is still alive; one process at a time
on a state directory (a held lock file); how many descriptors it may open; how its memory goes back;
what `ps` calls it; which processes use files under a path (as `fuser -m` finds them)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dlfs.private import FILE_MODE

log = logging.getLogger(__name__)
HOLDER_SCAN_BUDGET = 3.0  # seconds: /proc of a machine with many processes and open files is read no longer
COMMAND_SHOWN = 80  # characters of a holder's command line in a message


def stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the command name, which may itself hold ") " (state first, ppid 2nd,
    utime to cstime 12th to 15th, start time 20th); [] where it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


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
    fields = stat_fields(pid)
    return not fields or fields[0] != b"Z"


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters (glibc's malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's default, fixed


def hold_lock(path: str | os.PathLike[str]) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (made private) for as long as this process keeps
    it; None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit (connections, chunk
    files and a flood's half-open connections all take one); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        try:  # the kernel's own ceiling: setrlimit refuses more
            hard = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            hard = soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            soft = hard
        except (OSError, ValueError) as exc:
            log.info("cannot raise the open files limit from %d to %d: %s", soft, hard, exc)
    return soft


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


def set_title(title: str, name: str) -> None:
    """What `ps` shows for this process: `title` as its args line (`ps -ef`; at most as long as its own command
    line was), `name` as its name (`top`, `pgrep`; 15 bytes). The name has no spaces: tools that parse
    /proc/PID/stat with scanf split it there (Slurm's proctrack/linuxproc then loses the process)."""
    keep_env = "SPT_NOENV" not in os.environ
    if keep_env:  # title within the args' own bytes: /proc/PID/environ stays whole for tools that read it
        os.environ["SPT_NOENV"] = "1"
    import setproctitle

    setproctitle.setproctitle(title)
    if keep_env:
        os.environ.pop("SPT_NOENV", None)  # the processes this one starts keep their own choice
    setproctitle.setthreadtitle(name)


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot): with its pid, it names one process for good."""
    try:
        return int(stat_fields(pid)[19])
    except (IndexError, ValueError):
        return None


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a suspended job, a tracer): it runs nothing until continued."""
    return stat_fields(pid)[:1] in ([b"T"], [b"t"])


def command_line(pid: int) -> str:
    """A process's command line as `ps -ef` shows it; [name] for one without (a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())  # one line, spaced
        if argv:
            return argv if len(argv) <= COMMAND_SHOWN else argv[: COMMAND_SHOWN - 3] + "..."
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f"[{f.read().strip().decode(errors='replace')}]"
    except OSError:
        return "?"


@dataclass(frozen=True)
class Holder:
    """A process using something under a path: how, as fuser's letters say it (f open file, c working
    directory, r root directory, e executable, m mapped file)."""

    pid: int
    command: str
    uses: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}) [{self.uses}]"


def _uses_under(pid: int, under: Callable[[str], bool]) -> str:
    uses = ""
    for link, letter in (("cwd", "c"), ("root", "r"), ("exe", "e")):
        try:
            if under(os.readlink(f"/proc/{pid}/{link}")):
                uses += letter
        except PermissionError:
            pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        fds = []
    for fd in fds:
        try:
            if under(os.readlink(f"/proc/{pid}/fd/{fd}")):
                uses = "f" + uses
                break
        except FileNotFoundError:  # closed meanwhile
            continue
        except PermissionError:  # another user's process: not ours to read
            break
    try:
        with open(f"/proc/{pid}/maps") as f:
            if any(len(fields) == 6 and under(fields[5].rstrip("\n")) for fields in (line.split(maxsplit=5) for line in f)):
                uses += "m"
    except PermissionError:
        pass
    return uses


def holders(path: str, budget: float = HOLDER_SCAN_BUDGET) -> list[Holder]:
    """The processes with a file open, a working or root directory, an executable or a mapping at or
    under `path` (read from /proc, as `fuser -m` does; processes that end meanwhile are skipped)."""
    prefix = os.path.abspath(path).rstrip("/")

    def under(target: str) -> bool:
        return target == prefix or target.startswith(prefix + "/")

    found = []
    deadline = time.monotonic() + budget
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        if time.monotonic() > deadline:
            log.warning("stopped looking for processes using %s after %g s: the list may be short", path, budget)
            break
        pid = int(entry.name)
        try:
            uses = _uses_under(pid, under)
        except (FileNotFoundError, ProcessLookupError):  # the process ended meanwhile
            continue
        if uses:
            found.append(Holder(pid, command_line(pid), uses))
    return sorted(found, key=lambda h: h.pid)
