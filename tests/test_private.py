"""Private at rest and on this machine (issue 15), probed by another local user: nothing of an ingested
root-only secret is readable under $DLFS_HOME, a looser home is tightened at start with one warning,
a key file others can read is refused in one line, and a mount never serves its control socket from
a directory another user made."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import DLFS, HAVE_FUSE, REPO, dlfs_env, force_unmount, needs_fuse, run_dlfs, stop_node, wait_for_node

import dlfs.direct
from dlfs.errors import KeyExposed, UsageError
from dlfs.mount.records import mount_log as mount_log_path
from dlfs.wire.auth import read_key, write_key

PROBE = "dlfs-probe"
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run commands as another user"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv"),
    pytest.mark.timeout(120),
]
TIGHTENED = "that other users could read (dlfs keeps its state private)"


def probe_ids() -> tuple[int, int]:
    """The unprivileged user the probes run as, made once (a system user with no home)."""
    try:
        pw = pwd.getpwnam(PROBE)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PROBE],
                       capture_output=True, check=False, timeout=30)  # another test may have made it meanwhile
        pw = pwd.getpwnam(PROBE)
    return pw.pw_uid, pw.pw_gid


def as_probe(*argv: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    uid, gid = probe_ids()
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *map(str, argv)],
                          capture_output=True, text=True, errors="replace", timeout=60, check=False)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the probe user can reach (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="dlfs-private-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        force_unmount(path)
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def node_made_home(home: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`dlfs node` on a home it makes itself (conftest's nodes get theirs made for them)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([*DLFS, "node"], env=dlfs_env(home), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for_node(home, proc, log)
        yield proc
    finally:
        assert stop_node(proc, signal.SIGTERM) == 0, log.read_text()


def secret_source(base: Path) -> tuple[Path, str]:
    """A root-only file (0600 in a 0700 directory) holding a secret the probe cannot read at its source."""
    secret = f"dlfs-secret-{os.urandom(12).hex()}"
    src = base / "src"
    src.mkdir(mode=0o700)
    fd = os.open(src / "secret.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (secret + "\n").encode() * 64)
    os.close(fd)
    assert as_probe("cat", src / "secret.txt").returncode != 0
    return src, secret


def loose_entries(home: Path) -> list[str]:
    """Everything under `home` (home too) with a group or other bit: what another user might reach."""
    out = [] if not stat.S_IMODE(home.stat().st_mode) & 0o077 else [str(home)]
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                out.append(f"{os.path.join(dirpath, name)} {stat.S_IMODE(st.st_mode):04o}")
    return out


def probe_finds(home: Path, secret: str) -> tuple[str, str]:
    """What the probe user gets from `grep -r` for the secret and `find -readable` over `home`."""
    grep = as_probe("grep", "-rl", secret, home)
    find = as_probe("find", home, "-readable", "-type", "f")
    return grep.stdout.strip(), find.stdout.strip()


def test_another_user_reads_nothing_of_an_ingested_secret(base: Path) -> None:
    src, secret = secret_source(base)
    home = base / "home"
    with node_made_home(home, base / "node.log") as _:
        run_dlfs(home, "ingest", src, "--name", "secret", "--compress", "none")
        mnt = base / "mnt"
        if HAVE_FUSE:  # the mount's own files too: its index cache, records, stats, log and socket
            mnt.mkdir()
            run_dlfs(home, "mount", "secret", mnt)
            assert (mnt / "secret.txt").read_text().startswith(secret)
        names = {p.name for p in home.rglob("*")}
        assert {"cluster.key", "catalog.db", "catalog.db-wal", "node.json", "node.lock", "1.idx"} <= names, names
        assert any(len(n) == 32 for n in names)  # a chunk file
        # Every directory 0700 and every file 0600, made so, not tightened afterwards.
        assert loose_entries(home) == []
        assert TIGHTENED not in (base / "node.log").read_text()
        assert probe_finds(home, secret) == ("", "")
        # Nothing inside leans on the home's own mode: opened up, it still gives nothing away.
        home.chmod(0o755)
        assert probe_finds(home, secret) == ("", "")
        # Root reads it whole: the secret is there in plain, as the probe would find it were it readable.
        found = subprocess.run(["grep", "-rl", secret, home / "data"], capture_output=True, text=True, check=False)
        assert found.stdout.strip()
        if HAVE_FUSE:
            run_dlfs(home, "umount", mnt)


def test_a_looser_home_is_tightened_at_start_with_one_warning(base: Path) -> None:
    src, secret = secret_source(base)
    home, log = base / "home", base / "node.log"
    with node_made_home(home, log):
        run_dlfs(home, "ingest", src, "--name", "secret", "--compress", "none")
    # What an older dlfs left: directories 0755, files 0644.
    files, dirs = 0, 1
    home.chmod(0o755)
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
            dirs += 1
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
            files += 1
    grep, _ = probe_finds(home, secret)
    assert "/data/chunks/" in grep, grep  # the leak the issue found: a chunk file, readable
    with node_made_home(home, log):
        lines = [line for line in log.read_text().splitlines() if TIGHTENED in line]
        assert lines == [lines[0]] and "WARNING" in lines[0], lines
        assert f"tightened {files} files and {dirs} directories under {home} {TIGHTENED}" in lines[0]
        assert loose_entries(home) == []
        assert probe_finds(home, secret) == ("", "")
        if HAVE_FUSE:  # a mount tightens at its start too, with its own one line
            home.chmod(0o750)
            mnt = base / "mnt"
            mnt.mkdir()
            run_dlfs(home, "mount", "secret", mnt)
            mount_log = mount_log_path(home, "secret", mnt).read_text()
            assert mount_log.count(TIGHTENED) == 1 and f"tightened 0 files and 1 directories under {home}" in mount_log
            assert loose_entries(home) == []
            run_dlfs(home, "umount", mnt)


def test_a_key_others_can_read_is_refused(base: Path) -> None:
    key = base / "cluster.key"
    write_key(key)
    for mode in (0o600, 0o400):
        key.chmod(mode)
        assert len(read_key(key)) == 32
    for mode in (0o644, 0o640, 0o604, 0o620):
        key.chmod(mode)
        with pytest.raises(KeyExposed) as err:
            read_key(key)
        assert str(err.value) == (f"cluster key {key} can be read or changed by other users (mode {mode:04o}): "
                                  f"run `chmod 600 {key}`")
        assert isinstance(err.value, UsageError) and err.value.path == str(key)
    # As a user meets it: the node and every command refuse it in one line, exit 2.
    key.chmod(0o644)
    cluster = base / "cluster.toml"
    cluster.write_text('key_file = "cluster.key"\n[[node]]\nname = "n1"\naddress = "127.0.0.1"\n')
    for args in (["node", "--cluster", cluster], ["--cluster", cluster, "datasets"]):
        proc = run_dlfs(base / "home", *args, check=False, timeout=30)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == f"dlfs: error: cluster key {key} can be read or changed by other users (mode 0644): " \
                              f"run `chmod 600 {key}`\n"
    # The embedded node's own key, loosened after it made it: every command refuses it (the node, at its
    # next start, tightens it with the rest of its home).
    home = base / "home"
    with node_made_home(home, base / "node.log"):
        (home / "cluster.key").chmod(0o644)
        proc = run_dlfs(home, "datasets", check=False, timeout=30)
        assert proc.returncode == 2 and "(mode 0644): run `chmod 600" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr


@needs_fuse
def test_the_control_socket_never_lives_where_another_user_made_its_directory(base: Path) -> None:
    """$DLFS_HOME too long for a socket path: the socket falls back to $TMPDIR/dlfs-<uid>. Made first by
    another user (a directory, or a symlink to theirs), the mount refuses it in one line; made by the
    mount, it is root's alone, and root's dlfs.direct attaches through it."""
    from conftest import running_node

    uid, _ = probe_ids()
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # as /tmp: anyone may make a directory there first
    home = base / ("h" * 100) / "home"
    fallback = tmp / f"dlfs-{os.getuid()}"
    src = base / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(200_000))
    env = {**dlfs_env(home), "TMPDIR": str(tmp)}

    def mount(mnt: Path) -> subprocess.CompletedProcess[str]:
        mnt.mkdir(exist_ok=True)
        return subprocess.run([*DLFS, "mount", "pics", str(mnt)], env=env, capture_output=True, text=True,
                              timeout=60, cwd=REPO, check=False)

    with running_node(home, base):
        run_dlfs(home, "ingest", src, "--name", "pics")
        mnt = base / "mnt"
        evil = tmp / "evil"
        assert as_probe("mkdir", "-m", "777", evil).returncode == 0
        for plant, why in ((["mkdir", "-m", "700", fallback], f"is owned by uid {uid}, not {os.getuid()}"),
                           (["ln", "-s", evil, fallback], f"is a symlink to {evil}")):
            assert as_probe(*plant).returncode == 0
            proc = mount(mnt)
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.startswith(f"dlfs: error: {fallback} {why}: another user could take over")
            assert proc.stderr.count("\n") == 1 and f"rm -r {fallback}" in proc.stderr, proc.stderr
            assert not os.path.ismount(mnt) and os.listdir(evil) == []
            subprocess.run(["rm", "-r", fallback], check=True)
        # A directory of ours that others can enter is refused as well.
        fallback.mkdir(mode=0o755)
        fallback.chmod(0o755)
        proc = mount(mnt)
        assert proc.returncode == 2 and "mode 0755, open to other users" in proc.stderr, proc.stderr
        fallback.rmdir()

        proc = mount(mnt)
        assert proc.returncode == 0, proc.stderr
        st = os.lstat(fallback)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        control = os.fsdecode(os.getxattr(mnt, "user.dlfs.control"))
        assert Path(control).parent == fallback and stat.S_IMODE(os.stat(control).st_mode) == 0o600
        with dlfs.direct.connect(mnt) as reader:
            assert reader.direct and reader.read(mnt / "a.bin") == (src / "a.bin").read_bytes()
        run_dlfs(home, "umount", mnt)
        assert not os.path.exists(control)
