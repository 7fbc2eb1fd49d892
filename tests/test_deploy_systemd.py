"""deploy/systemd: the units pass `systemd-analyze verify`, their commands are valid dlfs
invocations, and run as systemd runs them (environment, notify socket, stop) they serve a mount."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, _free_ports, force_unmount, needs_fuse, notify_socket, run_dlfs

from dlfs.cli import build_parser, cmd_mount, cmd_node, cmd_umount

UNITS = REPO / "deploy" / "systemd"
INSTALLED = "/usr/local/bin/dlfs"
Unit = dict[str, list[tuple[str, str]]]


def read_unit(path: Path) -> Unit:
    """Sections of a unit file, each a list of (key, value) in order (keys may repeat)."""
    unit: Unit = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            unit.setdefault(section, [])
            continue
        key, sep, value = line.partition("=")
        assert section and sep, f"{path.name}: bad line {raw!r}"
        unit[section].append((key.strip(), value.strip()))
    return unit


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def unit_env(unit: Unit, instance: str, files: dict[str, Path]) -> dict[str, str]:
    """The environment systemd gives the unit's commands: Environment= first, then each
    EnvironmentFile= (a file's settings win), read from `files` in place of their /etc paths."""
    env: dict[str, str] = {}
    for value in values(unit, "Service", "Environment"):
        key, _, val = value.replace("%i", instance).partition("=")
        env[key] = val
    for value in values(unit, "Service", "EnvironmentFile"):
        optional, name = value.startswith("-"), value.lstrip("-").replace("%i", instance)
        if name in files and files[name].exists():
            env.update(read_env_file(files[name]))
        else:
            assert optional, f"EnvironmentFile={value} is required but not given"
    return env


def command(line: str, env: dict[str, str], instance: str) -> tuple[bool, list[str]]:
    """(failure ignored, argv) of an Exec line, expanded as systemd does: %i, ${VAR} within a word,
    and $VAR as a word of its own split at whitespace (gone when empty)."""
    ignore = line.startswith("-")
    words = shlex.split(line.lstrip("-").replace("%i", instance))
    argv: list[str] = []
    for word in words:
        whole = re.fullmatch(r"\$([A-Za-z_]\w*)", word)
        if whole:
            argv += env.get(whole.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_]\w*)\}", lambda m: env.get(m.group(1), ""), word))
    return ignore, argv


def unit_umask(unit: Unit) -> int:
    """The umask systemd runs the unit's commands with (UMask=, default 0022)."""
    return int((values(unit, "Service", "UMask") or ["0022"])[-1], 8)


def dlfs_args(argv: list[str]) -> object:
    """Parse a unit's dlfs command line with the real parser (SystemExit if it is not valid)."""
    assert argv[0] == INSTALLED, argv
    return build_parser().parse_args(argv[1:])


def test_units_are_valid_and_run_dlfs() -> None:
    node = read_unit(UNITS / "dlfs-node.service")
    mount = read_unit(UNITS / "dlfs-mount@.service")
    assert values(node, "Service", "Restart") == ["on-failure"]
    assert values(node, "Service", "LimitMEMLOCK") == ["infinity"]
    assert values(node, "Service", "Type") == values(mount, "Service", "Type") == ["notify"]
    for unit in (node, mount):
        assert "-/etc/dlfs/dlfs.env" in values(unit, "Service", "EnvironmentFile")
        assert values(unit, "Install", "WantedBy") == ["multi-user.target"]
    assert "dlfs-node.service" in " ".join(values(mount, "Unit", "After")).split()
    # After a local etcd member where there is one, without needing one.
    assert "etcd.service" in " ".join(values(node, "Unit", "After")).split()
    assert not [v for k in ("Requires", "Requisite", "BindsTo", "Wants") for v in values(node, "Unit", k) if "etcd" in v]

    files = {"/etc/dlfs/dlfs.env": UNITS / "dlfs.env"}
    env = unit_env(node, "", files)
    assert env["DLFS_HOME"] == "/var/lib/dlfs" and env["DLFS_CLUSTER"] == "/etc/dlfs/cluster.toml"
    (start,) = values(node, "Service", "ExecStart")
    args = dlfs_args(command(start, env, "")[1])
    assert args.fn is cmd_node and args.metrics == ":9420"  # type: ignore[attr-defined]

    # The state directory holds every dataset's bytes: root's alone before dlfs starts (dlfs keeps it so).
    for unit in (node, mount):
        (state,) = values(unit, "Service", "StateDirectory")
        assert unit_env(unit, "imagenet", files)["DLFS_HOME"] == f"/var/lib/{state}"
        assert values(unit, "Service", "StateDirectoryMode") == ["0700"]
    assert unit_umask(node) == 0o077
    # Not the mount's: its ExecStartPre makes the mount point, which other users reach the files through.
    assert unit_umask(mount) & 0o055 == 0

    env = unit_env(mount, "imagenet", files)
    (start,) = values(mount, "Service", "ExecStart")
    args = dlfs_args(command(start, env, "imagenet")[1])
    assert args.fn is cmd_mount and args.foreground  # type: ignore[attr-defined]
    assert (args.dataset, args.mountpoint) == ("imagenet", "/mnt/dlfs/imagenet")  # type: ignore[attr-defined]
    (stop,) = values(mount, "Service", "ExecStop")
    args = dlfs_args(command(stop, env, "imagenet")[1])
    assert args.fn is cmd_umount and args.mountpoint == "/mnt/dlfs/imagenet"  # type: ignore[attr-defined]


def test_readme_etcd_settings() -> None:
    """README.md's /etc/default/etcd: every setting is one etcd reads, the member is in its own
    initial cluster, and the cluster file's [etcd] section beside it names its client URL."""
    text = (UNITS / "README.md").read_text()
    env_file = re.search(r"cat > /etc/default/etcd <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert env_file
    env = dict(line.split("=", 1) for line in env_file.group(1).splitlines())
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert len(members) == 3 and members[env["ETCD_NAME"]] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] in env["ETCD_LISTEN_CLIENT_URLS"].split(",")
    assert env["ETCD_DATA_DIR"] != "/var/lib/etcd/default"  # the package's own first start made that one
    toml_block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert toml_block
    endpoints = tomllib.loads(toml_block.group(1))["etcd"]["endpoints"]
    assert len(endpoints) == len(members) and env["ETCD_ADVERTISE_CLIENT_URLS"] in endpoints
    etcd = shutil.which("etcd")
    if etcd:
        known = set(re.findall(r"^\s+--([a-z0-9-]+)", subprocess.run([etcd, "--help"], capture_output=True, text=True,
                                                                    timeout=30).stdout, re.M))
        flags = {k.removeprefix("ETCD_").lower().replace("_", "-") for k in env}
        assert flags <= known, flags - known


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that every command exists: point the units at this checkout's dlfs.
    dlfs = Path(sys.executable).with_name("dlfs")
    assert dlfs.exists(), "dlfs is not installed next to this python (make install)"
    for name in ("dlfs-node.service", "dlfs-mount@.service"):
        (tmp_path / name).write_text((UNITS / name).read_text().replace(INSTALLED, str(dlfs)))
    proc = subprocess.run([analyze, "verify", str(tmp_path / "dlfs-node.service"),
                           str(tmp_path / "dlfs-mount@imagenet.service")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), proc.stderr


def _notify_socket() -> tuple[socket.socket, str]:
    s, name = notify_socket()
    s.settimeout(30)
    return s, name


def _ready(sock: socket.socket) -> str:
    message = sock.recv(4096).decode()
    assert message.startswith("READY=1\nSTATUS="), message
    return message.split("STATUS=", 1)[1]


@needs_fuse
@pytest.mark.timeout(120)
def test_units_run_as_systemd_runs_them(tmp_path: Path) -> None:
    """Node and mount started with the units' environment and commands, readiness over the
    notify socket, the mount stopped by ExecStop and the node by KillSignal."""
    dlfs = str(Path(sys.executable).with_name("dlfs"))
    home, mnt = tmp_path / "home", tmp_path / "mnt" / "pics"
    (port,) = _free_ports(1)
    (tmp_path / "dlfs.env").write_text(f"DLFS_HOME={home}\nDLFS_NODE_ARGS=--metrics 127.0.0.1:{port}\n")
    (tmp_path / "mount.env").write_text(f"DLFS_MOUNTPOINT={mnt}\nDLFS_MOUNT_ARGS=--cache-size 64M\n")
    files = {"/etc/dlfs/dlfs.env": tmp_path / "dlfs.env", "/etc/dlfs/mount-pics.env": tmp_path / "mount.env"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("DLFS_")}
    base["PYTHONPATH"] = str(REPO)

    def argv(line: str, env: dict[str, str], instance: str) -> tuple[bool, list[str]]:
        ignore, words = command(line, env, instance)
        return ignore, [dlfs if w == INSTALLED else w for w in words]

    node_unit = read_unit(UNITS / "dlfs-node.service")
    node_env = {**base, **unit_env(node_unit, "", files)}
    node_sock, node_env["NOTIFY_SOCKET"] = _notify_socket()
    _, start = argv(values(node_unit, "Service", "ExecStart")[0], node_env, "")
    node_log, mount_log = tmp_path / "node.log", tmp_path / "mount.log"
    with open(node_log, "wb") as log:
        node = subprocess.Popen(start, env=node_env, stdout=subprocess.DEVNULL, stderr=log, umask=unit_umask(node_unit))
    mount_proc = None
    try:
        assert _ready(node_sock) == "node local serving"
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.bin").write_bytes(os.urandom(100_000))
        run_dlfs(home, "ingest", src, "--name", "pics")

        unit = read_unit(UNITS / "dlfs-mount@.service")
        env = {**base, **unit_env(unit, "pics", files)}
        sock, env["NOTIFY_SOCKET"] = _notify_socket()
        for line in values(unit, "Service", "ExecStartPre"):
            ignore, cmd = argv(line, env, "pics")
            assert subprocess.run(cmd, env=env, timeout=30, umask=unit_umask(unit)).returncode == 0 or ignore
        # The mount point and the folder made for it: other users reach the files through them.
        assert [stat.S_IMODE(p.stat().st_mode) for p in (mnt.parent, mnt)] == [0o755, 0o755]
        _, start = argv(values(unit, "Service", "ExecStart")[0], env, "pics")
        with open(mount_log, "wb") as log:
            mount_proc = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL, stderr=log, umask=unit_umask(unit))
        assert _ready(sock) == f"mounted pics@1 at {mnt} (1 file, 100.0 kB)"
        assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
        loose = [p for p in [home, *home.rglob("*")] if not p.is_symlink() and p.stat().st_mode & 0o077]
        assert loose == [], loose  # the node's and the mount's state alike

        _, stop = argv(values(unit, "Service", "ExecStop")[0], env, "pics")
        stopped = subprocess.run(stop, env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert mount_proc.wait(timeout=30) == 0, mount_log.read_text()
        assert not os.path.ismount(mnt)
        for line in values(unit, "Service", "ExecStopPost"):
            ignore, cmd = argv(line, env, "pics")
            assert ignore  # after a clean unmount there is nothing left to clear, and that is fine
            subprocess.run(cmd, env=env, capture_output=True, timeout=30)
    finally:
        if mount_proc is not None and mount_proc.poll() is None:
            mount_proc.kill()
        force_unmount(tmp_path)
        node.send_signal(signal.Signals[values(node_unit, "Service", "KillSignal")[0]])
        rc = node.wait(timeout=30)
    assert rc == 0, node_log.read_text()
    assert "[dataset=pics@1]: pics@1: unmounted from" in mount_log.read_text()
