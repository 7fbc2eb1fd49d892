"""`dlfs run -- CMD`: the command and its children run with the preload library, isatty() of a regular
file answers without an ioctl (a warm epoch through a real mount then sends the mount no request at
all), everything else still reaches libc's isatty, and the exit status is the command's own."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DLFS, REPO, Node, dlfs_env, mount_stats, needs_fuse

from dlfs.errors import DlfsError
from dlfs.native import native
from dlfs.preload import environ_with_preload, library_path

try:
    LIB = str(library_path())
except DlfsError as exc:
    pytest.skip(str(exc), allow_module_level=True)

# Run as the command (or its child): what isatty says of each kind of file, written as JSON to argv[1].
PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)

def isatty_errno(fd):
    ctypes.set_errno(0)
    return libc.isatty(fd), ctypes.get_errno()

with open(sys.argv[1] + ".reg", "wb"):
    pass
reg = open(sys.argv[1] + ".reg", "rb")
master, slave = os.openpty()
r, w = os.pipe()
closed = os.dup(r)
os.close(closed)
out = {
    "file": os.isatty(reg.fileno()), "file_errno": isatty_errno(reg.fileno()),
    "stdout": sys.stdout.isatty(), "pty": os.isatty(slave), "pty_libc": libc.isatty(slave),
    "pipe": os.isatty(r), "pipe_errno": isatty_errno(r), "closed_errno": isatty_errno(closed),
    "ld_preload": os.environ.get("LD_PRELOAD"),
    "mapped": sorted({line.split()[-1] for line in open("/proc/self/maps") if "_preload" in line}),
}
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""
# The command: starts the probe as a child process, as a DataLoader worker or a launcher would.
PARENT = r"""
import subprocess, sys
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]]).returncode)
"""


def dlfs_run(home: Path, *args: str | os.PathLike[str], env: dict[str, str] | None = None,
             **kw: object) -> subprocess.CompletedProcess[str]:
    """`dlfs run ARGS...` as a user runs it (stdout and stderr captured unless kw says otherwise)."""
    kw.setdefault("capture_output", True)
    return subprocess.run([*DLFS, "run", *map(str, args)], env=env or dlfs_env(home), text=True, timeout=60,
                          cwd=REPO, check=False, **kw)  # type: ignore[call-overload]


def probe(tmp_path: Path, *, child: bool = False, env: dict[str, str] | None = None,
          stdout: int | None = None) -> dict[str, object]:
    """The PROBE's findings, run under `dlfs run` (by a parent command that it starts, with child)."""
    result = tmp_path / "probe.json"
    cmd = [sys.executable, "-c", PARENT, PROBE, result] if child else [sys.executable, "-c", PROBE, result]
    stdout_file = open(tmp_path / "stdout", "wb") if stdout is None else None  # noqa: SIM115
    try:
        proc = dlfs_run(tmp_path / "home", "--", *cmd, env=env, capture_output=False, stderr=subprocess.PIPE,
                        stdout=stdout if stdout is not None else stdout_file)
    finally:
        if stdout_file is not None:
            stdout_file.close()
    assert proc.returncode == 0, proc.stderr
    return json.loads(result.read_text())


def check_probe(found: dict[str, object]) -> None:
    assert found["file"] is False and found["file_errno"] == [0, errno.ENOTTY]
    assert found["pty"] is True and found["pty_libc"] == 1
    assert found["pipe"] is False and found["pipe_errno"] == [0, errno.ENOTTY]
    assert found["closed_errno"] == [0, errno.EBADF]
    assert found["ld_preload"] == LIB and found["mapped"] == [LIB]


@pytest.mark.timeout(60)
def test_isatty_under_dlfs_run(tmp_path: Path) -> None:
    found = probe(tmp_path)  # stdout: a regular file
    check_probe(found)
    assert found["stdout"] is False
    # A terminal on stdout is still one.
    master, slave = os.openpty()
    try:
        assert probe(tmp_path, stdout=slave)["stdout"] is True
    finally:
        os.close(slave)
        os.close(master)


@pytest.mark.timeout(60)
def test_children_inherit_it(tmp_path: Path) -> None:
    check_probe(probe(tmp_path, child=True))


@pytest.mark.timeout(60)
def test_the_command_runs_as_its_caller_would_run_it(tmp_path: Path) -> None:
    # dlfs's own umask (0077) and the signals Python ignores (`yes | head` must end) stay behind.
    umask = dlfs_run(tmp_path / "home", "sh", "-c", "umask", umask=0o022)
    assert (umask.returncode, umask.stdout) == (0, "0022\n")
    status = dlfs_run(tmp_path / "home", "--", "cat", "/proc/self/status").stdout
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)) == 0


@pytest.mark.timeout(60)
def test_ld_preload_gets_the_library_first_and_once(tmp_path: Path) -> None:
    assert environ_with_preload({})["LD_PRELOAD"] == LIB
    assert environ_with_preload({"LD_PRELOAD": "libm.so.6"})["LD_PRELOAD"] == f"{LIB}:libm.so.6"
    assert environ_with_preload({"LD_PRELOAD": f"libm.so.6 {LIB}:libc.so.6", "X": "1"}) == \
        {"LD_PRELOAD": f"{LIB}:libm.so.6:libc.so.6", "X": "1"}
    env = dlfs_env(tmp_path / "home")
    env["LD_PRELOAD"] = LIB
    assert probe(tmp_path, env=env)["ld_preload"] == LIB
    printed = dlfs_run(tmp_path / "home", "--print-preload")
    assert (printed.returncode, printed.stdout) == (0, LIB + "\n")


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.timeout(60)
def test_no_ioctl_for_a_regular_file(tmp_path: Path) -> None:
    # strace sees what the kernel is asked: the TCGETS of open(p, "rb") is gone under dlfs run.
    files = [tmp_path / f"f{i}" for i in range(20)]
    for f in files:
        f.write_bytes(b"x" * 100)
    code = f"for p in {[str(f) for f in files]!r}: open(p, 'rb').read()"
    env = dlfs_env(tmp_path / "home")
    env.pop("LD_PRELOAD", None)
    counts = {}
    for how, prefix in (("plain", []), ("run", [*DLFS, "run", "--"])):
        trace = tmp_path / f"{how}.strace"
        subprocess.run(["strace", "-f", "-y", "-e", "trace=ioctl", "-o", trace, *prefix, sys.executable, "-c", code],
                       env=env, check=True, timeout=50, capture_output=True, cwd=REPO)
        counts[how] = sum("TCGETS" in line and str(tmp_path / "f") in line for line in trace.read_text().splitlines())
    assert counts == {"plain": len(files), "run": 0}


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.timeout(60)
def test_the_bench_reads_an_epoch_under_it(tmp_path: Path) -> None:
    # `dlfs bench`'s warm_run row: read_epoch_preloaded's forked readers ask no file whether it is a terminal.
    files = [f"f{i}" for i in range(30)]
    for f in files:
        (tmp_path / f).write_bytes(b"y" * 1000)
    env = dlfs_env(tmp_path / "home")
    env.pop("LD_PRELOAD", None)
    trace = tmp_path / "trace"
    code = (f"from dlfs.bench.epoch import read_epoch_preloaded as r; e = r({str(tmp_path)!r}, {files!r}, "
            "readers=2); print(e.files, e.bytes, e.n_errors)")
    proc = subprocess.run(["strace", "-f", "-y", "-e", "trace=ioctl", "-o", trace, sys.executable, "-c", code],
                          env=env, check=True, timeout=50, capture_output=True, text=True, cwd=REPO)
    assert proc.stdout == f"{len(files)} {len(files) * 1000} 0\n"
    assert not [line for line in trace.read_text().splitlines() if "TCGETS" in line and str(tmp_path / "f") in line]


@pytest.mark.timeout(60)
def test_usage_errors_and_exit_status(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for args in ([], ["--"]):
        proc = dlfs_run(home, *args)
        assert proc.returncode == 2
        assert proc.stderr == "dlfs: error: dlfs run needs a command: dlfs run [--] CMD [ARGS...]\n"
    proc = dlfs_run(home, "--print-preload", "--", "true")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    proc = dlfs_run(home, "--", "dlfs-no-such-command")
    assert (proc.returncode, proc.stderr) == (127, "dlfs: error: dlfs-no-such-command: command not found\n")
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("not a program\n")
    proc = dlfs_run(home, not_executable)
    assert (proc.returncode, proc.stderr) == (126, f"dlfs: error: {not_executable}: cannot run it: Permission denied\n")
    # The command's own status, and its own death by a signal: exec replaced dlfs.
    assert dlfs_run(home, "sh", "-c", "exit 7").returncode == 7
    assert dlfs_run(home, "--", "sh", "-c", 'kill -TERM "$$"').returncode == -signal.SIGTERM
    echo = dlfs_run(home, "--", "sh", "-c", 'echo "$0 $1"', "--x", "--home")  # its options are its own
    assert (echo.returncode, echo.stdout) == (0, "--x --home\n")


# --- through a real mount -------------------------------------------------------------------------
READER = r"""
import sys
for path in open(sys.argv[1]).read().splitlines():
    with open(path, "rb") as f:  # default buffering: isatty() after the open, as frameworks read
        f.read()
"""


def epoch(paths_file: Path, env: dict[str, str], *prefix: str) -> None:
    subprocess.run([*prefix, sys.executable, "-c", READER, paths_file], env=env, check=True, timeout=60,
                   cwd=REPO, capture_output=True)


COUNTED = ("requests", "lookups", "getattrs", "readdirs", "ioctls", "opens", "reads")
NOTHING = dict.fromkeys(COUNTED, 0)


def engine_after(node: Node, mnt: Path) -> dict[str, int]:
    """The engine's counters from a snapshot the mount took after this call (it writes one a second)."""
    now = time.time()
    return mount_stats(node.home, mnt, lambda s: s["time"] > now)["engine"]


@pytest.mark.page_cache  # warm epochs: the kernel keeps dentries, inodes and pages between them
@needs_fuse
@pytest.mark.skipif(native is None, reason="dlfs's C helper is not built")
@pytest.mark.timeout(120)
def test_a_warm_epoch_under_dlfs_run_sends_the_mount_nothing(node: Node, mounted: Callable[..., Path],
                                                              tmp_path: Path) -> None:
    rng = random.Random(3)
    src = tmp_path / "src"
    n = 300
    for i in range(n):
        (src / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 7}" / f"f{i:03d}").write_bytes(rng.randbytes(rng.randrange(1, 30_000)))
    mnt = mounted(src, "warm")
    paths = [str(mnt / f"d{i % 7}" / f"f{i:03d}") for i in range(n)]
    rng.shuffle(paths)
    paths_file = tmp_path / "paths.txt"
    paths_file.write_text("\n".join(paths) + "\n")
    env = node.env
    env.pop("LD_PRELOAD", None)  # the control: a plain reader, whatever runs the tests
    for _attempt in range(8):
        epoch(paths_file, env)  # names, attributes and pages now sit in the kernel's caches
        before = engine_after(node, mnt)
        epoch(paths_file, env, *DLFS, "run", "--")
        under_run = engine_after(node, mnt)
        epoch(paths_file, env)
        plain = engine_after(node, mnt)
        run_sent = {k: under_run[k] - before[k] for k in COUNTED}
        plain_sent = {k: plain[k] - under_run[k] for k in COUNTED}
        assert (run_sent["ioctls"], plain_sent["ioctls"]) == (0, n)  # isatty asks the mount only without it
        # Under dlfs run a warm epoch sends nothing; without it, one request per file: the isatty ioctl.
        # Anything else (FORGET, LOOKUP, READ) means the kernel's caches were dropped meanwhile, by
        # drop_caches or memory pressure elsewhere on the machine: measure again.
        if run_sent == NOTHING and plain_sent == {**NOTHING, "requests": n, "ioctls": n}:
            break
    assert run_sent == NOTHING
    assert plain_sent == {**NOTHING, "requests": n, "ioctls": n}
