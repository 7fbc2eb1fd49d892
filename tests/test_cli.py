"""The `dlfs` command as a user meets it: help, exit codes, one-line errors, mount and umount
lifecycles, and the node's own start and stop."""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    DLFS,
    REPO,
    Node,
    dlfs_env,
    mount_pids,
    needs_fuse,
    one_line_error,
    pid_alive,
    run_dlfs,
    start_node_process,
    stop_node,
    wait_for_node,
)

from dlfs.cli import main

SUBCOMMANDS = {
    "node": ["--name", "--host", "--meta-port", "--data-port"],
    "ingest": ["SRC", "--name", "--chunk-size", "--compress"],
    "datasets": [],
    "rm": ["NAME[@VERSION]"],
    "mount": ["NAME[@VERSION]", "MOUNTPOINT", "--foreground", "--cache-size", "--readahead"],
    "umount": ["MOUNTPOINT"],
    "status": [],
    "keygen": ["FILE"],
    "run": ["CMD [ARGS...]", "--print-preload", "inherit", "127"],
}


def _small_dataset(node: Node, tmp_path: Path, name: str = "small") -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "hello.txt").write_text("hello\n")
    (src / "top.bin").write_bytes(os.urandom(50_000))
    node.ingest(src, name)
    return src


@pytest.mark.timeout(60)
def test_help_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = run_dlfs(tmp_path, "--help")  # the installed entry point, once
    assert top.returncode == 0
    for name, words in SUBCOMMANDS.items():
        assert name in top.stdout
        with pytest.raises(SystemExit) as info:  # the rest in-process: the same parser, faster
            main([name, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: dlfs {name}")
        for word in words:
            assert word in out, (name, word)
    bare = run_dlfs(tmp_path, check=False)
    assert bare.returncode == 2
    assert "usage: dlfs" in bare.stderr
    assert not (tmp_path / "run").exists()  # --help touches no state


@needs_fuse
@pytest.mark.timeout(60)
def test_common_options_before_or_after_the_subcommand(node: Node, tmp_path: Path) -> None:
    _small_dataset(node, tmp_path)
    env = dlfs_env(node.home)
    del env["DLFS_HOME"]
    env["HOME"] = str(tmp_path / "elsewhere")  # ~/.dlfs: no node there

    def dlfs(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*DLFS, *map(str, args)], env=env, capture_output=True, text=True, timeout=60,
                              check=False)

    home = str(node.home)
    for args in (["--home", home, "status"], ["status", "--home", home],
                 ["--home", "/nowhere", "status", "--home", home], ["--home", home, "--log-level", "debug", "datasets"]):
        proc = dlfs(*args)
        assert proc.returncode == 0, (args, proc.stderr)
    assert "small" in dlfs("--home", home, "datasets").stdout
    assert "no dlfs node" in one_line_error(dlfs("status"), 3)
    # The background mount process gets the same home as the command that started it.
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = dlfs("--home", home, "mount", "small", mnt)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(mnt)) == ["sub", "top.bin"]
    assert dlfs("umount", "--home", home, mnt).returncode == 0
    assert not os.path.ismount(mnt)


@pytest.mark.timeout(30)
def test_status_without_a_node(tmp_path: Path) -> None:
    proc = run_dlfs(tmp_path / "empty", "status", check=False)
    assert "no dlfs node" in one_line_error(proc, 3)
    proc = run_dlfs(tmp_path / "empty", "datasets", check=False)
    one_line_error(proc, 3)


@pytest.mark.timeout(60)
def test_a_home_or_file_on_a_read_only_disk_is_one_line(tmp_path: Path) -> None:
    """What the system refuses (a read-only file system here) is one line naming the path, not a
    traceback: `dlfs node` whose home cannot be made said `OSError: [Errno 30] ...` in 15 lines."""
    from test_ingest_cleanup import tmpfs

    with tmpfs(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        proc = run_dlfs(ro / "home", "node", check=False, timeout=30)
        assert one_line_error(proc, 2) == f"dlfs: error: cannot make the directory {ro / 'home'}: Read-only file system"
        proc = run_dlfs(tmp_path / "empty", "keygen", ro / "key", check=False)
        assert one_line_error(proc, 1) == f"dlfs: error: {ro / 'key'}: Read-only file system"


@needs_fuse
@pytest.mark.timeout(30)
def test_mount_without_a_node(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run_dlfs(tmp_path / "empty", "mount", "anything", mnt, check=False)
    assert proc.returncode == 3  # Unreachable, as every other command says it
    assert "no dlfs node" in one_line_error(proc, 3)
    assert not os.path.ismount(mnt)
    proc = run_dlfs(tmp_path / "empty", "mount", "anything", mnt, "--cache-size", "1Q", check=False)
    assert proc.returncode == 2
    assert "1Q" in one_line_error(proc, 2)


@pytest.mark.timeout(30)
def test_status_with_the_node_up(node: Node) -> None:
    out = node.run("status").stdout
    assert "node local: up" in out
    assert "datasets 0 (0 versions), ingests in progress 0" in out
    assert str(node.home / "data") in out
    # The same words for R = 1: deploy/slurm/dlfs-slurm greps them ("1 healthy replica" broke its skip).
    assert "chunks with fewer than 1 healthy replicas: 0" in out


@pytest.mark.timeout(30)
def test_status_after_the_node_was_killed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, log = start_node_process(home)
    try:
        wait_for_node(home, proc, log)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    status = run_dlfs(home, "status", check=False)
    assert status.returncode == 3, "a node that cannot be reached is exit 3 (README's errors table)"
    one_line_error(status, 3)


def test_status_into_a_closed_pipe(node: Node) -> None:
    """`dlfs status | head` where head is gone before status writes: no traceback, SIGPIPE's status."""
    proc = subprocess.run(f"{shlex.join(DLFS)} status | true; echo ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, env=dlfs_env(node.home),
                          cwd=REPO, timeout=60)
    assert proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "141"


@needs_fuse
@pytest.mark.timeout(60)
def test_mount_errors(node: Node, tmp_path: Path) -> None:
    _small_dataset(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = node.run("mount", "missing-dataset", mnt, check=False)
    assert "missing-dataset" in one_line_error(proc, 4)
    assert not os.path.ismount(mnt)
    proc = node.run("mount", "small@7", mnt, check=False)
    assert "7" in one_line_error(proc, 4)
    assert not os.path.ismount(mnt)
    proc = node.run("mount", "small", tmp_path / "nowhere", check=False)
    assert "nowhere" in one_line_error(proc, 2)
    (tmp_path / "a-file").write_text("x")
    proc = node.run("mount", "small", tmp_path / "a-file", check=False)
    assert "a-file" in one_line_error(proc, 2)
    proc = node.run("umount", mnt, check=False)
    assert "not mounted" in one_line_error(proc, 4)
    assert mount_pids(node.home) == []


@needs_fuse
@pytest.mark.timeout(60)
def test_mount_and_umount(node: Node, tmp_path: Path) -> None:
    src = _small_dataset(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = node.run("mount", "small", mnt)
    assert out.stdout.startswith(f"mounted small@1 at {mnt}")
    # Ready when the command returns: no waiting, no retries.
    assert sorted(os.listdir(mnt)) == ["sub", "top.bin"]
    assert (mnt / "top.bin").read_bytes() == (src / "top.bin").read_bytes()
    pids = mount_pids(node.home)
    assert len(pids) == 1 and pid_alive(pids[0])
    # A second mount on the same mountpoint is refused, the first keeps serving.
    proc = node.run("mount", "small", mnt, check=False)
    assert "already" in one_line_error(proc, 11)
    assert (mnt / "sub/hello.txt").read_text() == "hello\n"

    # Busy: a file open there keeps it mounted, with a one-line reason.
    with open(mnt / "top.bin", "rb") as busy:
        proc = node.run("umount", mnt, check=False)
        assert "busy" in one_line_error(proc, 11)
        assert os.path.ismount(mnt)
        assert busy.read(10) == (src / "top.bin").read_bytes()[:10]

    out = node.run("umount", mnt)
    assert out.stdout.strip() == f"unmounted {mnt}"
    assert not os.path.ismount(mnt)
    assert not pid_alive(pids[0])
    assert mount_pids(node.home) == []
    assert os.listdir(mnt) == []
    proc = node.run("umount", mnt, check=False)
    assert "not mounted" in one_line_error(proc, 4)


@needs_fuse
@pytest.mark.timeout(60)
def test_mount_foreground_stops_on_sigterm(node: Node, tmp_path: Path) -> None:
    _small_dataset(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([*DLFS, "mount", "--foreground", "small", str(mnt)], env=dlfs_env(node.home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no output from dlfs mount --foreground within 30 s"
        line = proc.stdout.readline()
        assert line.startswith(f"mounted small@1 at {mnt}"), (line, proc.stderr.read() if proc.poll() else "")
        assert os.path.ismount(mnt)
        assert sorted(os.listdir(mnt)) == ["sub", "top.bin"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not os.path.ismount(mnt)
        assert mount_pids(node.home) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@needs_fuse
@pytest.mark.timeout(60)
def test_a_mount_made_from_a_threaded_process_serves_the_command_as_given(node: Node, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`dlfs mount` forks its mount process; from a process with other threads (a fork would copy the
    locks they hold) it runs `dlfs mount --foreground` with the command line as given instead: the same
    mount, its options kept."""
    _small_dataset(node, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    monkeypatch.setenv("DLFS_HOME", str(node.home))

    def no_fork() -> int:
        raise AssertionError("a process with other threads forked")

    monkeypatch.setattr(os, "fork", no_fork)
    try:
        assert main(["mount", "small", str(mnt), "--cache-size", "96M"]) == 0
    finally:
        stop.set()
        other.join()
    try:
        [pid] = mount_pids(node.home)
        assert Path(f"/proc/{pid}/comm").read_text() == "dlfs-mount\n"
        assert [m["cache_size"] for m in json.loads(node.run("mounts", "--json").stdout)["mounts"]] == [96 << 20]
        assert sorted(os.listdir(mnt)) == ["sub", "top.bin"]
    finally:
        node.run("umount", mnt)


@pytest.mark.timeout(60)
def test_a_port_that_another_process_holds_is_one_line_naming_it(tmp_path: Path) -> None:
    run_dlfs(tmp_path, "keygen", tmp_path / "cluster.key")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        (tmp_path / "cluster.toml").write_text(
            'replicas = 1\nkey_file = "cluster.key"\n[[node]]\nname = "n1"\naddress = "127.0.0.1"\n'
            f"meta_port = {port + 1 if port < 65535 else port - 1}\ndata_port = {port}\n")
        proc = run_dlfs(tmp_path / "home", "node", "--cluster", tmp_path / "cluster.toml", "--name", "n1", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dlfs: error: the data daemon cannot listen on 127.0.0.1:{port}: Address already in use (another process "
        "holds that port: stop it, or give this node another port)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])  # SIGHUP: it died, logging nothing
def test_node_stops_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    home = tmp_path / "home"
    proc, log = start_node_process(home)
    try:
        wait_for_node(home, proc, log)
        # A second node on the same state directory refuses to start, and leaves the first alone.
        second = run_dlfs(home, "node", check=False, timeout=20)
        assert str(home) in one_line_error(second, 2)  # usage: that state directory is taken
        assert run_dlfs(home, "status").returncode == 0
    finally:
        rc = stop_node(proc, sig, timeout=10)  # a bounded wait: a node that hangs on the signal fails here
    assert rc == 0, log.read_text()
    assert not (home / "run" / "node.json").exists()
    proc2 = run_dlfs(home, "status", check=False)
    one_line_error(proc2, 3)


@pytest.mark.timeout(60)
def test_a_command_no_metadata_daemon_answers_says_so_in_one_line(node: Node, tmp_path: Path) -> None:
    """The one node's daemons frozen: `dlfs datasets` and `dlfs ingest` exit 3 with one line, not a
    warning per metadata daemon and then the same words again as the error; `dlfs status` says the node
    is down within its own bound."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a\n")
    proc = node.proc.pid
    os.kill(proc, signal.SIGSTOP)
    try:
        for args in (("datasets",), ("ingest", str(tmp_path / "src"), "--name", "never")):
            out = node.run(*args, check=False, timeout=40)
            assert out.returncode == 3, out
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("dlfs: error: the meta daemon at ") \
                and "did not finish the handshake" in lines[0], out.stderr
        # `dlfs status` says the node is down once it has waited its own bound (it waited 10 s handshakes).
        t0 = time.monotonic()
        status = node.run("status", check=False, timeout=40)
        assert time.monotonic() - t0 < 9 and status.returncode == 3, status
        assert "node local: DOWN (no answer within 5 s: stopped, overloaded or cut off)" in status.stdout, status
        assert one_line_error(status, 3) == ("dlfs: error: node local is not reachable: no answer within 5 s: "
                                             "stopped, overloaded or cut off")
    finally:
        os.kill(proc, signal.SIGCONT)
    assert node.run("status").returncode == 0  # running again, it answers
