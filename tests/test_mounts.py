"""Mounts you can find: `dlfs mounts` and its JSON, the mounts in `dlfs status [--json]`, the mount
process's title in `ps` and its own log, a busy unmount that names its holders, `umount --lazy`, and
the refusal of a non-empty mountpoint. Real node, real CLI, real FUSE mounts."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Node, mount_pids, needs_fuse, pid_alive

from dlfs.mount.records import mount_record

EXIT_TIMEOUT = 20.0  # seconds a mount process is given to end once nothing holds it


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlfs: error: "), proc.stderr
    return lines[0]


def two_versions(node: Node, tmp_path: Path) -> Path:
    """Dataset `ds`: version 1 (two files), version 2 (one file more)."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "hello.txt").write_text("hello\n")
    (src / "top.bin").write_bytes(os.urandom(40_000))
    node.ingest(src, "ds")
    (src / "two.txt").write_text("version two\n")
    node.ingest(src, "ds")
    return src


def mounts_json(node: Node) -> dict[str, dict]:
    doc = json.loads(node.run("mounts", "--json").stdout)
    assert doc["home"] == str(node.home)
    return {m["mountpoint"]: m for m in doc["mounts"]}


def ps_args(pid: int) -> str:
    return subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, timeout=10).stdout.strip()


def wait_gone(pid: int, timeout: float = EXIT_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@needs_fuse
@pytest.mark.timeout(120)
def test_mounts_and_status_show_each_mount_its_pid_title_and_log(node: Node, tmp_path: Path) -> None:
    two_versions(node, tmp_path)
    a = node.mount("ds@1", tmp_path / "mnt-a")
    b = node.mount("ds", tmp_path / "mnt-b", "--cache-dir", str(tmp_path / "disk-cache"))  # the newest: version 2
    found = mounts_json(node)
    assert sorted(found) == sorted([str(a), str(b)])
    ma, mb = found[str(a)], found[str(b)]
    assert (ma["dataset"], ma["name"], ma["version"], ma["state"]) == ("ds@1", "ds", 1, "live")
    assert (mb["dataset"], mb["name"], mb["version"], mb["state"]) == ("ds@2", "ds", 2, "live")
    assert sorted([ma["pid"], mb["pid"]]) == sorted(mount_pids(node.home)) and ma["pid"] != mb["pid"]
    for m, mnt in ((ma, a), (mb, b)):
        # The pid is the process serving that mountpoint: ps shows it so, by its full args line.
        assert ps_args(m["pid"]) == f"dlfs mount {m['dataset']} {mnt}"
        # Its name has no spaces (scanf-parsers of /proc/PID/stat), and its environment is left whole.
        assert Path(f"/proc/{m['pid']}/comm").read_text() == "dlfs-mount\n"
        assert f"DLFS_HOME={node.home}\0".encode() in Path(f"/proc/{m['pid']}/environ").read_bytes()
        assert m["cache_size"] > 0
        assert datetime.datetime.fromisoformat(m["since"]) <= datetime.datetime.now().astimezone()
    # One log per mount, each telling its own mount's story.
    assert "cache_dir" not in ma and mb["cache_dir"] == str(tmp_path / "disk-cache")
    assert ma["log"] != mb["log"]
    log_a, log_b = Path(ma["log"]).read_text(), Path(mb["log"]).read_text()
    assert f"mounted ds@1 at {a}" in log_a and str(b) not in log_a
    assert f"mounted ds@2 at {b}" in log_b and str(a) not in log_b
    assert Path(ma["log"]) == node.mount_log("ds@1") and Path(mb["log"]) == node.mount_log("ds")
    ps_ef = subprocess.run(["ps", "-efww"], capture_output=True, text=True, timeout=10).stdout
    assert f"dlfs mount ds@1 {a}" in ps_ef and f"dlfs mount ds@2 {b}" in ps_ef

    table = node.run("mounts").stdout.splitlines()
    assert table[0].split() == ["DATASET", "MOUNTPOINT", "PID", "STATE", "CACHE", "SINCE", "LOG"]
    for m in (ma, mb):
        row = next(line for line in table if f" {m['mountpoint']} " in line)
        assert row.split()[:4] == [m["dataset"], m["mountpoint"], str(m["pid"]), "live"] and row.endswith(m["log"])
        assert (f"+ disk {tmp_path / 'disk-cache'}" in row) == (m is mb)

    status = json.loads(node.run("status", "--json").stdout)
    assert [(n["name"], n["state"], n["roles"]) for n in status["nodes"]] == [("local", "up", ["data", "meta"])]
    assert status["nodes"][0]["datasets"] == {"datasets": 1, "versions": 2, "ingests": 0}
    assert status["nodes"][0]["chunks"]["root"] == str(node.home / "data")
    assert [(v["name"], v["version"], v["files"]) for v in status["census"]["versions"]] == [("ds", 1, 2), ("ds", 2, 3)]
    assert status["down"] == 0 and status["census"]["short"] == [] and status["etcd"] is None
    assert sorted(status["mounts"], key=lambda m: m["pid"]) == sorted(found.values(), key=lambda m: m["pid"])
    text = node.run("status").stdout
    assert f"mounts on this machine from {node.home}: 2" in text
    assert f"ds@1 at {a}: pid {ma['pid']}, live" in text and f"ds@2 at {b}: pid {mb['pid']}, live" in text

    # A mount whose process is killed: listed dead, with the command that clears it.
    os.kill(mb["pid"], signal.SIGKILL)
    assert wait_gone(mb["pid"])
    dead = mounts_json(node)[str(b)]
    assert dead["state"] == "dead" and f"dlfs umount {b}" in dead["problem"]
    # Cleared by hand (not by dlfs): nothing is left of it, so its record is removed when listed.
    subprocess.run(["fusermount3", "-u", "-z", str(b)], check=True, timeout=30)
    assert sorted(mounts_json(node)) == [str(a)]
    assert not mount_record(node.home, b).exists()
    node.umount(a)
    assert node.run("mounts").stdout.startswith(f"no mounts from {node.home} on this machine")
    assert mounts_json(node) == {} and json.loads(node.run("status", "--json").stdout)["mounts"] == []


HOLD = """import sys
f = open(sys.argv[1], "rb")
print(f.read(3).decode(), flush=True)
sys.stdin.readline()
print(f.read().decode(), flush=True)
"""


@needs_fuse
@pytest.mark.timeout(120)
def test_busy_umount_names_its_holders_and_lazy_detaches(node: Node, tmp_path: Path) -> None:
    two_versions(node, tmp_path)
    mnt = node.mount("ds", tmp_path / "mnt")
    pid = mount_pids(node.home)[0]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(mnt / "two.txt")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    sitter = subprocess.Popen(["sleep", "600"], cwd=mnt / "sub")  # in the mount by its working directory
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "ver\n"
        busy = node.run("umount", mnt, check=False)
        assert busy.returncode == 11
        line = one_line_error(busy)
        assert f"cannot unmount {mnt}: it is busy" in line
        assert f"pid {holder.pid} ({sys.executable} -c import sys" in line and "[f]" in line  # a file open
        assert f"pid {sitter.pid} (sleep 600) [c]" in line and f"`dlfs umount --lazy {mnt}`" in line
        assert os.path.ismount(mnt) and pid_alive(pid)
        sitter.kill()
        sitter.wait(timeout=10)

        out = node.run("umount", "--lazy", mnt).stdout
        assert out.startswith(f"detached {mnt}; its mount process ends when the last of these closes")
        assert f"pid {holder.pid} (" in out and f"pid {sitter.pid}" not in out
        assert not os.path.ismount(mnt) and os.listdir(mnt) == []
        assert pid_alive(pid)  # it still serves the file held open
        detached = mounts_json(node)[str(mnt)]
        assert (detached["state"], detached["pid"]) == ("detached", pid)
        again = node.run("mount", "ds", mnt, check=False)
        assert again.returncode == 11 and "detached lazily" in one_line_error(again)
        rm = node.run("rm", "ds@2", check=False)  # its chunks are still read through the detached mount
        assert rm.returncode == 10 and f"ds@2 is still read through its mount detached from {mnt}" in one_line_error(rm)

        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "sion two\n"  # the rest of the file, read after the detach
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        # Its last user gone, the kernel ends the session and the mount process finishes by itself.
        assert wait_gone(pid), f"mount process {pid} still running after its last user closed"
        assert mounts_json(node) == {} and not mount_record(node.home, mnt).exists()
        log = node.mount_log("ds").read_text()
        assert f"ds@2: unmounted from {mnt}" in log
        node.mount("ds", mnt)  # the mountpoint is free again
        node.umount(mnt)
    finally:
        for proc in (holder, sitter):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@needs_fuse
@pytest.mark.timeout(90)
def test_non_empty_mountpoint_is_refused_unless_nonempty(node: Node, tmp_path: Path) -> None:
    two_versions(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "mine.txt").write_text("keep me\n")
    refused = node.run("mount", "ds", mnt, check=False)
    assert refused.returncode == 2
    line = one_line_error(refused)
    assert f"mountpoint {mnt} is not empty" in line and "--nonempty" in line
    assert not os.path.ismount(mnt) and mount_pids(node.home) == []
    node.mount("ds", mnt, "--nonempty")
    assert sorted(os.listdir(mnt)) == ["sub", "top.bin", "two.txt"]  # the dataset hides what was there
    node.umount(mnt)
    assert (mnt / "mine.txt").read_text() == "keep me\n"


@needs_fuse
@pytest.mark.timeout(120)
def test_two_mounts_of_one_mountpoint_at_once_take_turns(node: Node, tmp_path: Path) -> None:
    """Two `dlfs mount`s of one mountpoint started together: one mounts, the other says the mountpoint is
    taken by it, in one line (exit 11). Before, both passed their checks and the second failed halfway
    through its start: "mount process exited (1) before the mount was ready; see LOG", and the log they
    shared said "Address already in use"."""
    two_versions(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    node.mounts.append(mnt)  # unmounted at the end whichever won
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "-m", "dlfs", "mount", "ds", str(mnt)], env=node.env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [(p, *p.communicate(timeout=60)) for p in procs]
        won = [o for o in outs if o[0].returncode == 0]
        lost = [o for o in outs if o[0].returncode != 0]
        assert len(won) == 1 and len(lost) == 1, outs
        assert won[0][1].startswith(f"mounted ds@2 at {mnt}"), won
        (pid,) = mount_pids(node.home)
        assert lost[0][0].returncode == 11 and lost[0][2].splitlines() == [
            f"dlfs: error: {mnt} is already a mount point of ds@2, process {pid} (unmount it first)"], lost
        assert sorted(os.listdir(mnt)) == ["sub", "top.bin", "two.txt"]
        node.umount(mnt)
    # The lock on the start leaves nothing behind (a file per mountpoint ever used would pile up).
    assert [p.name for p in (node.home / "run" / "mounts").iterdir() if p.suffix == ".starting"] == []


@needs_fuse
@pytest.mark.timeout(120)
def test_a_mountpoint_deeper_than_a_file_name_mounts(node: Node, tmp_path: Path) -> None:
    """A mountpoint whose path is longer than a file name may be (255 bytes): its record, stats and log
    are named for a hash of it and its tail. The record's name was the whole path: `File name too long`."""
    two_versions(node, tmp_path)
    mnt = tmp_path.joinpath(*["d" * 60] * 5)
    assert len(os.fsencode(mnt)) > 300
    node.mount("ds", mnt)
    assert sorted(os.listdir(mnt)) == ["sub", "top.bin", "two.txt"]
    assert str(mnt) in mounts_json(node) and str(mnt) in node.run("stats", mnt).stdout.replace("\n", "")
    node.umount(mnt)
    assert mounts_json(node) == {}
    # Unmounting what is not there says which it is (a missing path was "not mounted" too).
    assert one_line_error(node.run("umount", mnt, check=False)) == f"dlfs: error: {mnt} is not mounted"
    assert one_line_error(node.run("umount", mnt / "x", check=False)) == f"dlfs: error: {mnt / 'x'} does not exist"


@needs_fuse
@pytest.mark.timeout(120)
def test_a_stopped_mount_is_shown_refused_and_detached_within_a_bound(node: Node, tmp_path: Path) -> None:
    """A mount whose process is stopped (SIGSTOP, a suspended job) answers nothing: `dlfs mounts` says
    so, a mount onto it is refused and `dlfs umount` detaches it, each within the probe's bound (both
    waited in statvfs until the process ran again), and the process ends once it runs."""
    from dlfs.fsprobe import PROBE_BOUND

    two_versions(node, tmp_path)
    mnt = node.mount("ds", tmp_path / "mnt")
    assert (mnt / "two.txt").read_text() == "version two\n"
    pid = mount_pids(node.home)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        shown = mounts_json(node)[str(mnt)]
        assert shown["state"] == "live" and f"its process {pid} is stopped" in shown["problem"]
        assert f"`kill -CONT {pid}`" in node.run("mounts").stdout

        t0 = time.monotonic()
        refused = node.run("mount", "ds", mnt, check=False, timeout=PROBE_BOUND + 20)
        assert time.monotonic() - t0 < PROBE_BOUND + 10
        assert refused.returncode == 11
        line = one_line_error(refused)
        assert f"{mnt} is a mount whose process does not answer" in line and f"`dlfs umount {mnt}`" in line

        t0 = time.monotonic()
        done = node.run("umount", mnt, timeout=PROBE_BOUND + 20)
        assert time.monotonic() - t0 < PROBE_BOUND + 10
        assert done.stdout == f"detached {mnt}\n"
        assert done.stderr.startswith(f"dlfs: warning: the mount process of {mnt} does not answer"), done.stderr
        assert str(mnt) not in open("/proc/self/mounts").read() and pid_alive(pid)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_gone(pid), f"mount process {pid} still running once continued, its mount detached"
    assert mounts_json(node) == {}
    node.mount("ds", mnt)  # the mountpoint is free again
    assert (mnt / "two.txt").read_text() == "version two\n"
    node.umount(mnt)


@needs_fuse
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_mount_unmounts_itself(node: Node, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or SIGHUP (a terminal closed under a --foreground mount, as libfuse's handlers take it)
    unmounts: the mountpoint is free, no record is left. SIGHUP killed the process and left a dead
    mount (`Transport endpoint is not connected`), logging nothing."""
    two_versions(node, tmp_path)
    mnt = node.mount("ds", tmp_path / "mnt")
    pid = mount_pids(node.home)[0]
    os.kill(pid, sig)
    assert wait_gone(pid), f"mount process {pid} still running after {sig.name}"
    assert str(mnt) not in open("/proc/self/mounts").read() and os.listdir(mnt) == []
    assert mounts_json(node) == {}
    assert f"ds@2: {sig.name}, unmounting" in node.mount_log("ds").read_text()
