"""dlfs.direct against a real node and a real FUSE mount: every file's bytes equal the source's
(direct hits, misses, compressed and multi-chunk records, symlinks), the errors open() would raise,
off-mount fallback, pins held across concurrent eviction, pins of a killed process reclaimed, and
two jobs sharing one cache."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Node, mounts_under, needs_fuse
from damage import damaged_dataset
from treegen import BIG, MANY_DIR, MANY_FILES, SPECIALS, TEXT, make_edge_tree

import dlfs.direct
from dlfs.direct import DirectReader, PlainReader
from dlfs.native import native
from dlfs.stats import read_sample

pytestmark = needs_fuse


def source_files(src: Path) -> list[bytes]:
    """Relative paths of every regular file of the source (symlinks to files too), as bytes."""
    out = []
    for dirpath, _, files in os.walk(os.fsencode(src)):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, os.fsencode(src))
            if rel in SPECIALS:
                continue
            if os.path.isfile(full):  # follows symlinks, as open() does
                out.append(rel)
    return sorted(out)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The edge tree ingested twice (plain, and lz4 with 64 KiB chunks), both mounted."""
    from conftest import force_unmount, running_node

    base = tmp_path_factory.mktemp("direct")
    src = base / "src"
    make_edge_tree(src)
    with running_node(base / "home", base) as node:
        node.ingest(src, "plain")
        node.ingest(src, "small", "--chunk-size", "64K", "--compress", "lz4")
        plain = node.mount("plain", base / "mnt-plain")
        small = node.mount("small", base / "mnt-small")
        try:
            yield src, plain, small
        finally:
            force_unmount(base)


def test_connect_finds_the_control_channel(edge: tuple[Path, Path, Path]) -> None:
    src, plain, _ = edge
    with dlfs.direct.connect(plain) as r:
        assert isinstance(r, DirectReader) and r.direct and r.label == "plain@1"
        assert os.getxattr(plain, "user.dlfs.control") == os.fsencode(r.control)
        assert "user.dlfs.control" not in os.listxattr(plain)  # a copy of the tree must not carry it
    off = dlfs.direct.connect(src)
    assert isinstance(off, PlainReader) and not off.direct and "not a dlfs mount" in off.reason


@pytest.mark.parametrize("which", ["plain", "small"])
def test_every_file_equals_the_source_twice(edge: tuple[Path, Path, Path], which: str) -> None:
    """Cold (misses fetched by the mount) then warm (pinned in place): every byte as in the source."""
    src, plain, small = edge
    mnt = plain if which == "plain" else small
    rels = source_files(src)
    with dlfs.direct.connect(mnt) as r:
        for attempt in ("cold", "warm"):
            views = r.read_many([os.path.join(os.fsencode(mnt), rel) for rel in rels])
            for rel, view in zip(rels, views):
                assert view.readonly
                assert view == open(os.path.join(os.fsencode(src), rel), "rb").read(), (attempt, rel)
            del views
        one = r.read(os.path.join(os.fsencode(mnt), BIG))
        assert one == (src / os.fsdecode(BIG)).read_bytes()
        assert r.read(os.path.join(os.fsencode(mnt), TEXT)) == (src / os.fsdecode(TEXT)).read_bytes()
        del one
        stats = r.stats()
    assert stats["direct_clients"] >= 1 and stats["fetches"] > 0


def test_warm_reads_need_no_request(edge: tuple[Path, Path, Path]) -> None:
    src, plain, _ = edge
    paths = [plain / os.fsdecode(MANY_DIR) / name for name in sorted(os.listdir(src / os.fsdecode(MANY_DIR)))]
    assert len(paths) == MANY_FILES
    with dlfs.direct.connect(plain) as r:
        assert isinstance(r, DirectReader)
        r.read_many(paths)  # now in the shared cache
        before = r.stats()["direct_requests"]
        for _ in range(3):
            views = r.read_many(paths)
            assert [bytes(v) for v in views] == [(src / os.fsdecode(MANY_DIR) / p.name).read_bytes() for p in paths]
            del views
        assert r.stats()["direct_requests"] == before + 1  # only the stats call itself


def test_errors_are_the_ones_open_raises(edge: tuple[Path, Path, Path]) -> None:
    src, plain, _ = edge
    with dlfs.direct.connect(plain) as r:
        with pytest.raises(FileNotFoundError):
            r.read(plain / "no such file")
        with pytest.raises(FileNotFoundError):
            r.read_many([plain / os.fsdecode(TEXT), plain / "nope" / "deeper"])
        with pytest.raises(IsADirectoryError):
            r.read(plain / "big")
        with pytest.raises(IsADirectoryError):
            r.read(plain)
        with pytest.raises(NotADirectoryError):
            r.read(plain / os.fsdecode(TEXT) / "below a file")
        # A name over 255 bytes is refused, not missing, as open() says through the kernel.
        for read in (lambda p: open(p, "rb"), r.read, r.files_under):
            for where in (plain / ("n" * 256), plain / ("n" * 256) / "x"):
                with pytest.raises(OSError) as too_long:
                    read(where)
                assert too_long.value.errno == errno.ENAMETOOLONG, (read, where)
        # A path outside the mount is read plainly, errors included.
        assert r.read(src / os.fsdecode(TEXT)) == (src / os.fsdecode(TEXT)).read_bytes()
        with pytest.raises(FileNotFoundError):
            r.read(src / "absent")
        assert r.read_many([]) == []


def test_views_are_read_only_and_release_their_pins(edge: tuple[Path, Path, Path]) -> None:
    src, plain, _ = edge
    with dlfs.direct.connect(plain) as r:
        assert isinstance(r, DirectReader)
        path = plain / os.fsdecode(TEXT)
        r.read(path).release()
        assert r._shared.row_pins(r.row) == 0
        with r.read(path) as view:
            assert r._shared.row_pins(r.row) == 1
            with pytest.raises(TypeError):
                view[0] = 0
            part = view[10:20]
        shared, row = r._shared, r.row
        assert shared.row_pins(row) == 1  # the slice still holds it
        clients = r.stats()["direct_clients"]
        r.close()  # a view is alive: its pin and the connection stay until it goes
        with pytest.raises(ValueError, match="closed"):
            r.read(path)
        assert part == (src / os.fsdecode(TEXT)).read_bytes()[10:20]
        with dlfs.direct.connect(plain) as other:
            assert other.stats()["direct_clients"] == clients + 1
            del shared, part
            deadline = time.monotonic() + 10
            while other.stats()["direct_clients"] != clients and time.monotonic() < deadline:
                time.sleep(0.02)
            assert other.stats()["direct_clients"] == clients


def test_fallback_off_mount(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"alpha")
    (tmp_path / "d").mkdir()
    r = dlfs.direct.connect(tmp_path)
    assert isinstance(r, PlainReader)
    with r.read(tmp_path / "a") as v:
        assert v.readonly and v == b"alpha"
    assert [bytes(v) for v in r.read_many([tmp_path / "a", str(tmp_path / "a")])] == [b"alpha"] * 2
    with pytest.raises(FileNotFoundError):
        r.read(tmp_path / "b")
    with pytest.raises(IsADirectoryError):
        r.read(tmp_path / "d")
    with pytest.raises(FileNotFoundError):
        dlfs.direct.connect(tmp_path / "nowhere")


# --- a cache far smaller than the dataset: eviction under pins, and a killed client ---------------
TINY = ("--cache-size", "1M", "--readahead", "64K")  # 16 slabs of 64 KiB


def make_churn_tree(root: Path, n: int = 400, seed: int = 7) -> dict[str, bytes]:
    """Files of 1-40 KB whose bytes name them (a view of the wrong file can never pass for the right one)."""
    rng = random.Random(seed)
    want = {}
    for i in range(n):
        rel = f"d{i % 7}/f{i:04d}.bin"
        tag = rel.encode().ljust(32, b"#")
        data = (tag + rng.randbytes(rng.randint(1000, 40_000)))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        want[rel] = data
    return want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Node, Path, dict[str, bytes]]:
    from conftest import force_unmount, running_node

    base = tmp_path_factory.mktemp("tiny")
    src = base / "src"
    want = make_churn_tree(src)
    with running_node(base / "home", base) as node:
        node.ingest(src, "churn", "--chunk-size", "64K")
        # The node's own chunk files are read in place too: that path must honour pins as well.
        mnt = node.mount("churn", base / "mnt", *TINY)
        try:
            yield node, mnt, want
        finally:
            force_unmount(base)


def _churn(mnt: str, want: dict[str, bytes], seed: int, rounds: int, out: mp.Queue) -> None:
    """Read random batches, hold some views a while, check every view when made and when let go."""
    rng = random.Random(seed)
    names = sorted(want)
    bad: list[str] = []
    held: list[tuple[str, memoryview]] = []
    r = dlfs.direct.connect(mnt)
    reads = 0
    for _ in range(rounds):
        batch = rng.sample(names, 12)
        for rel, view in zip(batch, r.read_many([os.path.join(mnt, rel) for rel in batch])):
            reads += 1
            if view != want[rel]:
                bad.append(f"{rel} when read")
            if rng.random() < 0.3:
                held.append((rel, view))
        while len(held) > 40:
            rel, view = held.pop(rng.randrange(len(held)))
            if view != want[rel]:
                bad.append(f"{rel} when released")
            view.release()
    for rel, view in held:
        if view != want[rel]:
            bad.append(f"{rel} at the end")
    out.put((reads, bad))


def test_pins_hold_under_concurrent_eviction(tiny: tuple[Node, Path, dict[str, bytes]]) -> None:
    """Three processes churn a 1 MiB cache over 8 MB of files while holding views: every view shows
    its own file's bytes from creation to release, though slabs are evicted and reused throughout."""
    _, mnt, want = tiny
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_churn, args=(str(mnt), want, seed, 150, out)) for seed in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert all(not bad for _, bad in results), [bad[:5] for _, bad in results]
    assert sum(n for n, _ in results) == 3 * 150 * 12
    with dlfs.direct.connect(mnt) as r:
        stats = r.stats()
    assert stats["evictions"] > 100, stats  # the cache really was churned
    assert stats["retired_pinned"] > 0, stats  # and slabs were dropped while a client pinned them
    assert stats["direct_reclaimed_pins"] == 0  # every process let go of its pins itself


KILLED = textwrap.dedent("""
    import os, sys, time
    import dlfs.direct
    mnt = sys.argv[1]
    r = dlfs.direct.connect(mnt)
    names = sorted(os.path.join(d, f) for d in os.listdir(mnt) for f in os.listdir(os.path.join(mnt, d)))
    views = r.read_many([os.path.join(mnt, n) for n in names[:60]])
    print(r._shared.row_pins(r.row), flush=True)
    time.sleep(600)
""")


def test_pins_of_a_killed_process_are_reclaimed(tiny: tuple[Node, Path, dict[str, bytes]]) -> None:
    node, mnt, want = tiny
    with dlfs.direct.connect(mnt) as watcher:
        before = watcher.stats()
        proc = subprocess.Popen([sys.executable, "-c", KILLED, str(mnt)], stdout=subprocess.PIPE, text=True,
                                env=node.env)
        try:
            held = int(proc.stdout.readline())
            # Each pinned slab holds a few of its files; with all 16 pinned the rest came as copies.
            assert 0 < held <= 60
            assert watcher.stats()["direct_clients"] == before["direct_clients"] + 1
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while watcher.stats()["direct_clients"] != before["direct_clients"] and time.monotonic() < deadline:
            time.sleep(0.02)
        after = watcher.stats()
        assert after["direct_clients"] == before["direct_clients"]
        assert after["direct_reclaimed_pins"] == before["direct_reclaimed_pins"] + held
        # Its slabs are usable again: churning the whole dataset twice leaves none waiting on pins.
        names = sorted(want)
        for _ in range(2):
            for i in range(0, len(names), 50):
                views = watcher.read_many([mnt / n for n in names[i : i + 50]])
                assert [bytes(v) for v in views] == [want[n] for n in names[i : i + 50]]
                del views
        assert watcher.stats()["retired_slabs"] == 0


def _epoch(mnt: str, names: list[str], seed: int, out: mp.Queue) -> None:
    order = list(names)
    random.Random(seed).shuffle(order)
    r = dlfs.direct.connect(mnt)
    n = 0
    for i in range(0, len(order), 32):
        n += sum(len(v) for v in r.read_many([os.path.join(mnt, p) for p in order[i : i + 32]]))
    out.put(n)


def test_two_jobs_share_one_cache(tiny: tuple[Node, Path, dict[str, bytes]], tmp_path: Path) -> None:
    """Two processes reading whole epochs at once, in different orders, on a fresh mount: each chunk
    is fetched about once, not once per job."""
    node, _, want = tiny
    mnt = node.mount("churn", tmp_path / "shared", "--cache-size", "256M")
    try:
        ctx = mp.get_context("fork")
        out: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_epoch, args=(str(mnt), sorted(want), seed, out)) for seed in (1, 2)]
        for p in procs:
            p.start()
        got = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        total = sum(len(d) for d in want.values())
        assert got == [total, total]
        with dlfs.direct.connect(mnt) as r:
            fetched = r.stats()["fetched_bytes"]
        assert total <= fetched <= 1.1 * total, (fetched, total)
        # The mount's statistics (`dlfs stats`) show the same.
        deadline = time.monotonic() + 5
        while (sample := read_sample(node.home, mnt))["fetched_bytes"] != fetched and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sample["fetched_bytes"] == fetched and sample["direct_pinned"] + sample["direct_inline"] > 0
    finally:
        node.umount(mnt)


def test_a_forked_child_attaches_anew(edge: tuple[Path, Path, Path]) -> None:
    """A reader made before fork() works in the child, on a row of its own (DataLoader workers)."""
    src, mnt, _ = edge
    names = [f"{os.fsdecode(MANY_DIR)}/{n}" for n in sorted(os.listdir(src / os.fsdecode(MANY_DIR)))[:20]]
    want = {n: (src / n).read_bytes() for n in names}
    with dlfs.direct.connect(mnt) as r:
        assert isinstance(r, DirectReader)
        parent_views = r.read_many([mnt / n for n in names])
        parent_row = r.row
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: says what it saw down the pipe
            try:
                views = r.read_many([mnt / n for n in names])
                ok = [bytes(v) for v in views] == [want[n] for n in names]
                pinned = sum(isinstance(v.obj, native.Pin) for v in views)
                os.write(wfd, f"{ok} {r.row} {pinned} {r._shared.row_pins(r.row)}".encode())
                del views
            finally:
                os._exit(0)
        os.close(wfd)
        seen = os.read(rfd, 200).decode().split()
        os.close(rfd)
        os.waitpid(pid, 0)
        ok, row, pinned, pins = seen[0] == "True", *map(int, seen[1:])
        assert ok and row != parent_row and pinned > 0 and pins == pinned, seen
        # The child's exit released only its own pins: the parent's views are intact and still pinned.
        assert [bytes(v) for v in parent_views] == [want[n] for n in names]
        assert r._shared.row_pins(r.row) > 0
        del parent_views
        assert r._shared.row_pins(r.row) == 0


def test_a_full_pin_table_falls_back_to_the_mount(edge: tuple[Path, Path, Path]) -> None:
    """256 processes' worth of readers attached: the next one reads through the kernel instead."""
    src, plain, _ = edge
    readers = []
    try:
        while True:
            r = dlfs.direct.connect(plain)
            if not r.direct:
                break
            readers.append(r)
            assert len(readers) <= 256
        assert len(readers) == 256 and "256 dlfs.direct processes" in r.reason
        assert r.read(plain / os.fsdecode(TEXT)) == (src / os.fsdecode(TEXT)).read_bytes()
    finally:
        for r in readers:
            r.close()
    deadline = time.monotonic() + 10
    while not (again := dlfs.direct.connect(plain)).direct and time.monotonic() < deadline:
        time.sleep(0.05)
    assert again.direct  # rows are given back as their connections end


def test_corrupt_and_truncated_chunks_raise_eio(node: Node, tmp_path: Path) -> None:
    """A flipped byte and a truncated chunk file (one replica: nowhere else to read them): those files
    raise OSError(EIO) naming the path, every other file reads right, and the mount stays up."""
    d = damaged_dataset(node, tmp_path, "bad")
    src, broken, flipped = d.src, d.broken, d.flipped
    where = d.files

    mnt = node.mount("bad", tmp_path / "mnt")
    with dlfs.direct.connect(mnt) as r:
        for rel in sorted(broken):
            with pytest.raises(OSError) as info:
                r.read(mnt / rel)
            assert info.value.errno == errno.EIO and info.value.filename == str(mnt / rel)
        good = sorted(set(where) - broken)
        with pytest.raises(OSError) as info:
            r.read_many([mnt / good[0], mnt / flipped, mnt / good[1]])
        assert info.value.errno == errno.EIO and info.value.filename == str(mnt / flipped)
        assert [bytes(v) for v in r.read_many([mnt / g for g in good])] == [(src / g).read_bytes() for g in good]
        assert r.stats()["corrupt"] >= 1
    assert len(os.listdir(mnt / "c")) == 60  # the mount still answers
    node.umount(mnt)


def test_populate_faults_in_a_range_and_checks_it() -> None:
    import mmap

    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20)
        native.populate(m, 4096, 8192)
        assert os.fstat(fd).st_blocks * 512 >= 8192  # the memfd now holds those pages
        m[4096:4100] = b"abcd"  # still ordinary, writable memory
        with pytest.raises(ValueError):
            native.populate(m, 100, 4096)  # not page-aligned
        with pytest.raises(ValueError):
            native.populate(m, 0, 2 << 20)  # past the end
        with pytest.raises(TypeError):
            native.populate(b"read-only", 0, 1)
        m.close()
    finally:
        os.close(fd)


# --- connect() from anywhere inside a mount, and why it falls back --------------------------------
def probe_connect(path: Path, env: dict[str, str] | None = None,
                  user: tuple[int, int] | None = None) -> tuple[str, str]:
    """connect(path) in a fresh process (another environment, another user): 'direct root reason'
    and what it logged."""
    code = ("import sys, dlfs.direct; r = dlfs.direct.connect(sys.argv[1]); "
            "print(r.direct, r.root, r.reason, sep='\\n')")
    argv = [sys.executable, "-c", code, str(path)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def test_connect_from_a_subdirectory_or_a_file(edge: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Any path inside the mount finds its root; reads are zero-copy and, warm, need no request."""
    src, plain, _ = edge
    deep = plain / os.fsdecode(MANY_DIR)
    files = [deep / n for n in sorted(os.listdir(src / os.fsdecode(MANY_DIR)))[:30]]
    (tmp_path / "link").symlink_to(deep)  # a symlink into the mount, from outside it
    for where in (deep, files[0], plain / os.fsdecode(TEXT), tmp_path / "link"):
        with dlfs.direct.connect(where) as r:
            assert isinstance(r, DirectReader) and r.root == str(plain) and r.reason is None, where
            r.read_many(files)
            before = r.stats()["direct_requests"]
            views = r.read_many(files)
            assert [bytes(v) for v in views] == [(src / os.fsdecode(MANY_DIR) / f.name).read_bytes() for f in files]
            assert all(isinstance(v.obj, native.Pin) for v in views)  # views of the shared cache itself
            del views
            assert r.stats()["direct_requests"] == before + 1  # the stats call alone
            assert r.files_under(deep)[0][:2] == [f.name for f in files[:2]]


def test_connect_off_dlfs_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    caplog.set_level("INFO", logger="dlfs.direct")
    for where in (tmp_path, tmp_path / "d", tmp_path / "d" / "f"):
        r = dlfs.direct.connect(where)
        assert isinstance(r, PlainReader) and not r.direct
        assert r.reason.startswith(f"not a dlfs mount: {where} is on ") and r.reason in caplog.text
        assert r.read(tmp_path / "d" / "f") == b"x"
    assert {rec.levelname for rec in caplog.records} == {"INFO"}  # off dlfs is no cause for a warning


def test_without_the_c_helper_it_says_so(edge: tuple[Path, Path, Path]) -> None:
    _, plain, _ = edge
    out, err = probe_connect(plain / "text", env={"DLFS_NO_NATIVE": "1"})
    direct, root, reason = out.splitlines()
    assert (direct, root) == ("False", str(plain))
    assert reason == "dlfs's C helper is not loaded in this process (DLFS_NO_NATIVE is set)"
    assert reason in err  # a warning, on stderr where logging is not set up


def test_a_mount_without_a_shared_cache_says_so(tiny: tuple[Node, Path, dict[str, bytes]], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, want = tiny
    monkeypatch.setenv("DLFS_NO_NATIVE", "1")  # the mount process runs without the C helper
    mnt = node.mount("churn", tmp_path / "mnt-no-native")
    monkeypatch.delenv("DLFS_NO_NATIVE")
    try:
        rel = sorted(want)[0]
        r = dlfs.direct.connect(mnt / rel)
        assert isinstance(r, PlainReader) and r.root == str(mnt)
        assert r.reason == (f"the dlfs mount dlfs:churn@1 at {mnt} has no control socket: it runs without "
                            "dlfs's C helper, so it has no shared cache")
        assert r.read(mnt / rel) == want[rel]
    finally:
        node.umount(mnt)


@pytest.fixture
def reachable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory other users can reach (pytest's are root's alone); binds made in it are undone."""
    path = Path(tempfile.mkdtemp(prefix="dlfs-direct-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for mnt in mounts_under(path):
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False, timeout=30)
        shutil.rmtree(path, ignore_errors=True)


def bind(source: Path, target: Path) -> Path:
    target.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True, timeout=30)
    return target


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to bind-mount")
def test_bind_mounts_of_a_mount(edge: tuple[Path, Path, Path], reachable: Path,
                                caplog: pytest.LogCaptureFixture) -> None:
    """A bind of the whole mount (pods sharing one mount) reads direct; a bind of a directory inside
    it cannot reach the root's control socket, and says so."""
    src, plain, _ = edge
    whole = bind(plain, reachable / "whole")
    with dlfs.direct.connect(whole / "text") as r:
        assert r.direct and r.root == str(whole)
        assert r.read(whole / os.fsdecode(TEXT)) == (src / os.fsdecode(TEXT)).read_bytes()
    part = bind(plain / "text", reachable / "part")
    r = dlfs.direct.connect(part)
    assert not r.direct and r.reason == (f"{part} is a bind mount of a directory inside the dlfs mount "
                                         "dlfs:plain@1: dlfs.direct attaches through the root of a mount "
                                         "(bind-mount the whole mount)")
    assert [rec.levelname for rec in caplog.records if rec.name == "dlfs.direct"] == ["WARNING"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_user_is_told_whose_mount_it_is(edge: tuple[Path, Path, Path], reachable: Path) -> None:
    """The control socket is the mount owner's: another user reads through the kernel, told why."""
    from test_private import probe_ids

    _, plain, _ = edge
    whole = bind(plain, reachable / "whole")  # the mount's own directory is under root's private tmp
    out, err = probe_connect(whole / "text", user=probe_ids())
    direct, root, reason = out.splitlines()
    assert (direct, root) == ("False", str(whole))
    assert reason.startswith("cannot attach to the mount's control socket ")
    assert reason.endswith(": Permission denied (the mount is uid 0's: only that user and root may attach to it)")
    assert reason in err
