"""Ingest against a real node: versions, the datasets table, removal and garbage collection, source
errors (unreadable, vanished, changed files) that publish nothing, an interrupted ingest that
resumes, special files, bad arguments, and big files packed as records of at most 4 MiB with
block sums."""

from __future__ import annotations

import errno
import filecmp
import os
import queue
import random
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import xxhash
from conftest import DLFS, Node, dlfs_env, needs_fuse, one_line_error, run_dlfs, wait_for
from damage import inode_of

import dlfs.direct
import dlfs.ingest.run
import dlfs.ingest.source
from dlfs.client.cluster import ClusterClient
from dlfs.config import load_cluster
from dlfs.errors import CorruptData, SourceError, Unreachable
from dlfs.format.chunk import (
    BLOCK_SIZE,
    BLOCK_SUMS_MIN,
    FLAG_BLOCK_SUMS,
    FLAG_LZ4,
    MAX_RECORD_BYTES,
    Record,
    block_range,
    decode_record,
    verify_blocks,
    verify_chunk,
)
from dlfs.format.index import Index, IndexWriter
from dlfs.ingest.pack import Packed, Packer
from dlfs.ingest.run import build_index, ingest
from dlfs.ingest.source import LocalTree
from dlfs.ingest.walk import Selection, Tree
from dlfs.tasks import open_nursery
from dlfs.wire.protocol import Msg


def make_files(root: Path, n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        rel = f"d{i % 3}/f{i:03d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(size)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def chunk_files(home: Path) -> list[Path]:
    return [p for p in (home / "data" / "chunks").rglob("*") if p.is_file()]


def dataset_rows(node: Node) -> list[dict[str, str]]:
    out = node.run("datasets").stdout
    lines = out.splitlines()
    if lines == ["no datasets (add one with `dlfs ingest SRC --name NAME`)"]:
        return []
    assert lines[0].split() == ["NAME", "VERSION", "FILES", "BYTES", "CHUNKS", "CREATED"]
    rows = []
    for line in lines[1:]:
        name, version, files, num, unit, chunks, day, minute = line.split()
        rows.append({"name": name, "version": version, "files": files, "bytes": f"{num} {unit}",
                     "chunks": chunks, "created": f"{day} {minute}"})
    return rows


async def meta_status(home: Path) -> dict[str, Any]:
    async with open_nursery() as nursery:
        client = ClusterClient(load_cluster(None, home), nursery)
        out, _ = await client.call_meta(Msg.STATUS)
        nursery.cancel_scope.cancel()
    return out


# --- versions, listing, removal ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_ingest_twice_makes_version_2(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "src", 10, 100_000)
    first = node.ingest(tmp_path / "src", "ds", "--chunk-size", "256K")
    assert first.stdout.startswith("ingested ds version 1: 10 files, 1.0 MB in ")
    stored = chunk_files(node.home)
    # 100 kB files, two to a 256 KiB chunk.
    assert len(stored) == 5
    assert "(5 sent, 0 already stored)" in first.stdout
    # The same tree again is no new version: it says so, sends nothing and frees nothing.
    same = node.ingest(tmp_path / "src", "ds", "--chunk-size", "256K")
    assert same.stdout == ("ds is unchanged: version 1 holds exactly these 10 files (1.0 MB); no new version "
                           "made (--force makes one)\n")
    assert [r["version"] for r in dataset_rows(node)] == ["1"]
    assert chunk_files(node.home) == stored
    assert node.run("status").stdout.count("ingests in progress 0") == 1  # its session was given up
    second = node.ingest(tmp_path / "src", "ds", "--chunk-size", "256K", "--force")
    assert second.stdout.startswith("ingested ds version 2: 10 files, 1.0 MB in 5 chunks")
    assert "(0 sent, 5 already stored)" in second.stdout  # same bytes, same chunks
    assert chunk_files(node.home) == stored
    rows = dataset_rows(node)
    assert [(r["name"], r["version"], r["files"], r["bytes"], r["chunks"]) for r in rows] == [
        ("ds", "1", "10", "1.0 MB", "5"), ("ds", "2", "10", "1.0 MB", "5")]
    assert (node.home / "meta/index/ds/2.idx").is_file()


@pytest.mark.timeout(60)
def test_a_change_of_metadata_alone_is_a_new_version(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "src", 4, 10_000)
    node.ingest(tmp_path / "src", "meta")
    victim = next((tmp_path / "src").rglob("*.bin"))
    os.chmod(victim, 0o600)  # the bytes stay: only the inode differs
    out = node.ingest(tmp_path / "src", "meta")
    assert out.stdout.startswith("ingested meta version 2: 4 files") and "(0 sent, " in out.stdout
    assert "unchanged: version 2" in node.ingest(tmp_path / "src", "meta").stdout


@pytest.mark.timeout(60)
def test_rm_frees_chunks(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "src", 6, 50_000)
    node.ingest(tmp_path / "src", "gone", "--chunk-size", "64K")
    node.ingest(tmp_path / "src", "gone", "--chunk-size", "128K")  # version 2, other chunks
    assert len(chunk_files(node.home)) == sum(int(r["chunks"]) for r in dataset_rows(node)) > 0  # none shared
    out = node.run("rm", "gone")
    assert out.stdout.startswith("removed gone (version 1, 2); freed ")
    assert chunk_files(node.home) == []
    assert dataset_rows(node) == []
    assert not (node.home / "meta/index/gone").exists()
    err = one_line_error(node.run("rm", "gone", check=False), 4)
    assert "gone" in err
    assert "dataset" in one_line_error(node.run("rm", "never-was", check=False), 4)


@pytest.mark.timeout(60)
def test_rm_one_version_keeps_the_other(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "a", 4, 50_000, seed=1)
    make_files(tmp_path / "b", 4, 50_000, seed=2)
    node.ingest(tmp_path / "a", "two")
    node.ingest(tmp_path / "b", "two")
    both = len(chunk_files(node.home))
    node.run("rm", "two@1")
    assert [r["version"] for r in dataset_rows(node)] == ["2"]
    assert 0 < len(chunk_files(node.home)) < both


@needs_fuse
@pytest.mark.timeout(60)
def test_rm_refuses_a_mounted_version(node: Node, tmp_path: Path) -> None:
    files = make_files(tmp_path / "src", 6, 100_000)
    node.ingest(tmp_path / "src", "busy", "--chunk-size", "64K")
    node.ingest(tmp_path / "src", "busy", "--chunk-size", "128K")
    mnt = node.mount("busy@1", tmp_path / "mnt")
    try:
        for ref in ("busy", "busy@1"):
            proc = node.run("rm", ref, check=False)
            assert "busy@1 is mounted at" in one_line_error(proc, 10)
        assert [r["version"] for r in dataset_rows(node)] == ["1", "2"]
        # Nothing was freed under the mount: every file still reads.
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data
        node.run("rm", "busy@2")  # another version is fine
    finally:
        node.umount(mnt)
    node.run("rm", "busy")
    assert dataset_rows(node) == [] and chunk_files(node.home) == []


# --- source errors: nothing is published ------------------------------------------------------
async def _expect_source_error(node: Node, src: Path, what: str) -> str:
    cluster = load_cluster(None, node.home)
    with pytest.raises(SourceError) as info:
        await ingest(cluster, str(src), "broken", 64 << 10)
    message = str(info.value)
    assert "\n" not in message
    assert what in message, message
    assert dataset_rows(node) == []
    assert (await meta_status(node.home))["ingests"] == 0  # the session was aborted
    assert chunk_files(node.home) == []  # and the chunks it had stored freed
    return message


@pytest.mark.timeout(60)
async def test_a_store_it_cannot_write_takes_chunks_over_its_socket(node: Node, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    files = make_files(tmp_path / "src", 12, 30_000)
    tried: list[str] = []

    def refuse(path: str, data: memoryview) -> None:  # as a daemon of another user's files would
        tried.append(path)
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(dlfs.ingest.run, "_write_staged", refuse)
    report = await ingest(load_cluster(None, node.home), str(tmp_path / "src"), "sent", 64 << 10)
    # Once refused, every chunk goes over the socket: only those staged in parallel before were tried.
    assert 1 <= len(tried) <= dlfs.ingest.run.UPLOADERS
    assert report.chunks_sent == len(chunk_files(node.home)) == report.info.chunks
    # The files staged for it stay empty until the daemon drops them (STAGE_TTL, or its restart).
    assert sorted(str(p) for p in (node.home / "data/tmp").iterdir()) == sorted(tried)
    assert all(os.path.getsize(p) == 0 for p in tried)
    assert report.info.files == len(files)


@pytest.mark.timeout(30)
def test_staged_writes_land_whole_aligned_or_not(tmp_path: Path) -> None:
    import mmap

    rng = random.Random(5)
    for size in (0, 100, 4096, 3 * 4096 + 77, 1 << 20):
        content = rng.randbytes(size)
        aligned = mmap.mmap(-1, max(size, 1))  # page-aligned, as the ingest's pool: O_DIRECT, then the tail
        aligned[:size] = content
        for buf in (memoryview(aligned)[:size], memoryview(bytearray(b"x" + content))[1:]):  # and one that is not
            target = tmp_path / f"staged-{size}"
            target.write_bytes(b"old bytes, longer than some chunks here" * 3)
            os.truncate(target, 0)
            dlfs.ingest.run._write_staged(str(target), buf)
            assert target.read_bytes() == content
            del buf


@pytest.mark.timeout(60)
async def test_a_damaged_staged_chunk_is_refused(node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000)
    real = dlfs.ingest.run._write_staged

    def damage(path: str, data: memoryview) -> None:
        real(path, data)
        with open(path, "r+b") as f:  # the chunk header's magic
            f.write(b"X")

    monkeypatch.setattr(dlfs.ingest.run, "_write_staged", damage)
    with pytest.raises(CorruptData, match=r"^staged chunk [0-9a-f]{32}: not a dlfs chunk \(bad magic\)$"):
        await ingest(load_cluster(None, node.home), str(tmp_path / "src"), "damaged", 64 << 10)
    assert dataset_rows(node) == [] and chunk_files(node.home) == []
    assert not list((node.home / "data/tmp").iterdir())


@pytest.mark.timeout(60)
async def test_a_chunk_being_stored_when_another_fails_is_finished_before_the_abort(
        node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One uploader is still writing its staged chunk when another's fails: its store finishes (the
    # daemon takes the file) before the session is aborted, which then frees it. Cancelled mid-way as it
    # once was, its PUT_STAGED never went and the staged file stayed in data/tmp (for STAGE_TTL).
    make_files(tmp_path / "src", 24, 30_000)
    real = dlfs.ingest.run._write_staged
    calls: list[str] = []
    broke = threading.Event()  # the packer's and uploaders' threads wait on it, not the event loop

    def slow_or_failing(path: str, data: memoryview) -> None:
        calls.append(path)
        if len(calls) == 1:  # the first: still writing when the second fails
            assert broke.wait(10)
            return real(path, data)
        broke.set()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dlfs.ingest.run, "_write_staged", slow_or_failing)
    with pytest.raises(Unreachable, match="Input/output error"):
        await ingest(load_cluster(None, node.home), str(tmp_path / "src"), "half", 64 << 10)
    assert len(calls) >= 2
    assert dataset_rows(node) == [] and chunk_files(node.home) == []
    left = sorted(p.name for p in (node.home / "data/tmp").iterdir())
    assert left == sorted(Path(p).name for p in calls[1:]), (left, calls)


@pytest.mark.timeout(60)
async def test_unreadable_file(node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000)
    victim = os.fsencode(tmp_path / "src" / "d1" / "f004.bin")
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fsencode(path) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    message = await _expect_source_error(node, tmp_path / "src", os.fsdecode(victim))
    assert "Permission denied" in message


@pytest.mark.timeout(60)
async def test_file_vanishes_after_walk(node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000)
    victim = tmp_path / "src" / "d2" / "f008.bin"
    real_walk = dlfs.ingest.source.walk

    def walk(src: str | bytes, select: Selection | None = None) -> Tree:
        tree = real_walk(src, select)
        victim.unlink()
        return tree

    monkeypatch.setattr(dlfs.ingest.source, "walk", walk)
    await _expect_source_error(node, tmp_path / "src", str(victim))


@pytest.mark.timeout(60)
async def test_file_changes_size_after_walk(node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000)
    victim = tmp_path / "src" / "d0" / "f006.bin"
    real_walk = dlfs.ingest.source.walk

    def walk(src: str | bytes, select: Selection | None = None) -> Tree:
        tree = real_walk(src, select)
        with open(victim, "ab") as f:
            f.write(b"more")
        return tree

    monkeypatch.setattr(dlfs.ingest.source, "walk", walk)
    message = await _expect_source_error(node, tmp_path / "src", str(victim))
    assert "changed" in message


@pytest.mark.timeout(60)
async def test_file_rewritten_same_size_after_walk(node: Node, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000)
    victim = tmp_path / "src" / "d1" / "f010.bin"
    real_walk = dlfs.ingest.source.walk

    def walk(src: str | bytes, select: Selection | None = None) -> Tree:
        tree = real_walk(src, select)
        st = victim.stat()
        victim.write_bytes(bytes(st.st_size))  # same size, other bytes, a later mtime
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        return tree

    monkeypatch.setattr(dlfs.ingest.source, "walk", walk)
    message = await _expect_source_error(node, tmp_path / "src", str(victim))
    assert "changed" in message


@pytest.mark.timeout(60)
async def test_cancelled_ingest_gives_its_session_up(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "src", 100, 200_000, seed=4)
    cluster = load_cluster(None, node.home)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            async def cancel_after_first_chunk() -> None:
                while not chunk_files(node.home):
                    await trio.sleep(0.003)
                scope.cancel()

            nursery.start_soon(cancel_after_first_chunk)
            await ingest(cluster, str(tmp_path / "src"), "cancelled", 1 << 20)
            raise AssertionError("the ingest finished before it was cancelled")
    assert scope.cancelled_caught
    assert chunk_files(node.home) == []  # giving the session up freed the chunks it had stored
    assert (await meta_status(node.home))["ingests"] == 0
    assert dataset_rows(node) == []


@pytest.mark.timeout(30)
def test_missing_or_bad_source(node: Node, tmp_path: Path) -> None:
    err = one_line_error(node.run("ingest", tmp_path / "nope", "--name", "x", check=False), 6)
    assert str(tmp_path / "nope") in err
    (tmp_path / "file").write_bytes(b"x")
    err = one_line_error(node.run("ingest", tmp_path / "file", "--name", "x", check=False), 6)
    assert "not a directory" in err
    assert dataset_rows(node) == []


# --- interrupted, resumed ---------------------------------------------------------------------
@needs_fuse
@pytest.mark.timeout(120)
def test_killed_ingest_resumes(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_files(src, 300, 200_000, seed=5)
    cmd = [*DLFS, "ingest", str(src), "--name", "big", "--chunk-size", "1M"]

    def interrupt(sig: int) -> subprocess.CompletedProcess[str]:
        """Start the ingest, send `sig` once it stored a chunk more than before."""
        before = len(chunk_files(node.home))
        proc = subprocess.Popen(cmd, env=dlfs_env(node.home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_for(lambda: len(chunk_files(node.home)) > before or proc.poll() is not None, 60,
                 "the ingest to store a chunk more", every=0.003)
        assert proc.poll() is None, "the ingest finished before a chunk was seen: make the tree bigger"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    # Ctrl-C: the ingest stops at once (not after packing everything) and gives its session up.
    stopped = interrupt(signal.SIGINT)
    assert (stopped.returncode, stopped.stderr) == (130, "dlfs: interrupted\n")
    assert len(chunk_files(node.home)) < 30
    assert "ingests in progress 0" in node.run("status").stdout
    # SIGTERM (a job's time limit) and SIGHUP (its terminal closed) the same; they ended the process at
    # once, and its session (and the chunks it held) stayed in progress until its TTL ran out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        stopped = interrupt(sig)
        assert (stopped.returncode, stopped.stderr) == (128 + sig, f"dlfs: interrupted by {sig.name}\n"), stopped
        assert "ingests in progress 0" in node.run("status").stdout
    # kill -9: no chance to clean up; still nothing is visible.
    killed = interrupt(signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    # A chunk the ingest had sent whole before it died is still stored by the daemon: count once settled.
    left, deadline = -1, time.monotonic() + 10
    while left != (left := len(chunk_files(node.home))) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert 0 < left < 60
    assert dataset_rows(node) == []

    again = node.ingest(src, "big", "--chunk-size", "1M")
    m = re.search(r"\((\d+) sent, (\d+) already stored\)", again.stdout)
    assert m, again.stdout
    # Every chunk the killed ingest left is one this one needs (content-named): none is sent again.
    assert int(m.group(2)) == left
    assert int(m.group(1)) + left == int(dataset_rows(node)[0]["chunks"])
    assert [r["version"] for r in dataset_rows(node)] == ["1"]
    mnt = node.mount("big", tmp_path / "mnt")
    try:
        filecmp.clear_cache()
        for rel in files:
            assert filecmp.cmp(src / rel, mnt / rel, shallow=False), rel
        assert sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*.bin")) == sorted(files)
    finally:
        node.umount(mnt)


# --- special files, arguments -----------------------------------------------------------------
@pytest.mark.timeout(30)
def test_special_files_skipped_with_warning(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "file").write_bytes(b"regular")
    os.mkfifo(src / "a fifo")
    with socket.socket(socket.AF_UNIX) as s:
        here = os.getcwd()
        os.chdir(src)
        try:
            s.bind("a socket")
        finally:
            os.chdir(here)
    out = node.ingest(src, "spec")
    assert "ingested spec version 1: 1 file," in out.stdout
    assert re.search(r"skipped .*a fifo", out.stderr), out.stderr
    assert re.search(r"skipped .*a socket", out.stderr), out.stderr


@pytest.mark.timeout(30)
def test_bad_arguments(node: Node, tmp_path: Path) -> None:
    make_files(tmp_path / "src", 1, 10)
    proc = node.run("ingest", tmp_path / "src", "--name", "bad/name", check=False)
    assert "bad/name" in one_line_error(proc, 2)
    proc = node.run("ingest", tmp_path / "src", "--name", "ok", "--chunk-size", "1X", check=False)
    assert "1X" in one_line_error(proc, 2)
    proc = node.run("ingest", tmp_path / "src", "--name", "ok", "--chunk-size", "4K", check=False)
    assert "chunk-size" in one_line_error(proc, 2)
    assert dataset_rows(node) == []


@pytest.mark.timeout(30)
def test_bad_arguments_are_reported_before_the_node_is_needed(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    proc = run_dlfs(tmp_path / "no-node", "ingest", tmp_path / "src", "--name", "bad/name", check=False)
    assert "bad/name" in one_line_error(proc, 2)
    proc = run_dlfs(tmp_path / "no-node", "ingest", tmp_path / "src", "--name", "ok", "--chunk-size", "1X",
                    check=False)
    assert "1X" in one_line_error(proc, 2)


# --- packing boundaries, empty trees, pinned versions (through a mount) -----------------------
@needs_fuse
@pytest.mark.timeout(60)
def test_chunk_boundary_sizes(mounted: Callable[..., Path], tmp_path: Path) -> None:
    # At 64 KiB chunks a record holds at most 65536 - 32 (chunk header) - 24 (record header) bytes.
    payload = (64 << 10) - 32 - 24
    sizes = [payload - 1, payload, payload + 1, 2 * payload, 2 * payload + 1, 0, 1, 300_000, 7, payload - 30,
             24, 25, (64 << 10), (256 << 10) + 1, 1 << 20]
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(11)
    for i, n in enumerate(sizes):
        (src / f"r{i:02d}-{n}").write_bytes(rng.randbytes(n))  # stored as is
        (src / f"t{i:02d}-{n}").write_bytes((b"%d compresses " % i * n)[:n])  # stored as lz4
    mnt = mounted(src, "bound", "--chunk-size", "64K", "--compress", "lz4")
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(src))
    filecmp.clear_cache()
    for p in src.iterdir():
        assert (mnt / p.name).stat().st_size == p.stat().st_size
        assert filecmp.cmp(p, mnt / p.name, shallow=False), p.name


@needs_fuse
@pytest.mark.timeout(60)
def test_empty_trees(node: Node, mounted: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert os.listdir(mounted(tmp_path / "empty", "nothing")) == []
    assert [(r["files"], r["bytes"], r["chunks"]) for r in dataset_rows(node)] == [("0", "0 B", "0")]
    # An empty source is most likely a wrong path or filter: said (it was "... in 0.0 s (0 B/s)" alone).
    again = node.ingest(tmp_path / "empty", "nothing-again")
    assert again.stdout.startswith("ingested nothing-again version 1: 0 files, 0 B in 0 chunks") and \
        "B/s" not in again.stdout, again.stdout
    assert again.stderr == f"dlfs: warning: no file to ingest in {tmp_path / 'empty'}: version 1 of nothing-again is empty\n"
    one = tmp_path / "one"
    one.mkdir()
    (one / "a").write_bytes(b"x")
    assert f"no file to ingest in {one} after --exclude: version 1 of none-taken is empty" in \
        node.ingest(one, "none-taken", "--exclude", "a").stderr
    node.ingest(one, "single")
    assert node.ingest(one, "single").stdout.startswith("single is unchanged: version 1 holds exactly this file (1 B)")
    (tmp_path / "zeros" / "d").mkdir(parents=True)
    (tmp_path / "zeros" / "a").write_bytes(b"")
    (tmp_path / "zeros" / "d" / "b").write_bytes(b"")
    mnt = mounted(tmp_path / "zeros", "zeros")
    assert sorted(os.listdir(mnt)) == ["a", "d"]
    assert (mnt / "a").read_bytes() == b"" and (mnt / "d" / "b").read_bytes() == b""


@needs_fuse
@pytest.mark.timeout(60)
def test_mount_pins_a_version(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "same").write_bytes(b"unchanged\n")
    (src / "data").write_bytes(b"version one\n")
    (src / "only-in-1").write_bytes(b"gone later\n")
    node.ingest(src, "pin")
    (src / "data").write_bytes(b"version two, longer\n")
    (src / "only-in-1").unlink()
    (src / "only-in-2").write_bytes(b"new\n")
    node.ingest(src, "pin")
    one = node.mount("pin@1", tmp_path / "mnt1")
    newest = node.mount("pin", tmp_path / "mnt2")
    try:
        assert sorted(os.listdir(one)) == ["data", "only-in-1", "same"]
        assert (one / "data").read_bytes() == b"version one\n"
        assert sorted(os.listdir(newest)) == ["data", "only-in-2", "same"]
        assert (newest / "data").read_bytes() == b"version two, longer\n"
        assert (one / "same").read_bytes() == (newest / "same").read_bytes() == b"unchanged\n"
    finally:
        node.umount(one)
        node.umount(newest)


# --- big files: records of at most MAX_RECORD_BYTES, block sums -------------------------------
MiB = 1 << 20


def _pack(src: Path, chunk_size: int, compress: bool = False) -> tuple[Index, list[bytes]]:
    """Walk and pack `src` as ingest does (no node): the index, opened, and every chunk's bytes."""
    source = LocalTree(str(src))
    tree = source.walk(None)
    writer = IndexWriter(len(tree.nodes), chunk_size)
    pool: queue.Queue[bytearray] = queue.Queue()
    pool.put(bytearray(chunk_size))
    chunks: list[bytes] = []

    def emit(p: Packed) -> None:
        chunks.append(bytes(p.data))  # the buffer is reused for the next chunk
        pool.put(p.buf)

    extents = Packer(source, tree, writer, chunk_size, compress, pool, emit).run()
    build_index(tree, extents, writer)
    with open(src.parent / "packed.idx", "wb") as f:
        writer.write(f)
    return Index(src.parent / "packed.idx"), chunks


def _records_of(idx: Index, rel: str) -> list[Record]:
    node = idx.inode(inode_of(idx, rel))
    return [idx.extent(e).record for e in range(node.ref, node.ref + node.count)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_mib", [16, 8, 5])
def test_packer_cuts_big_files_into_records(tmp_path: Path, chunk_mib: int) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(31)
    content = {"a-small": rng.randbytes(1000), "b-big": rng.randbytes(10 * MiB), "c-two": rng.randbytes(8 * MiB),
               "d-small": rng.randbytes(5000)}
    for name, data in content.items():
        (src / name).write_bytes(data)
    idx, chunks = _pack(src, chunk_mib * MiB)
    try:
        for name, data in content.items():
            recs = _records_of(idx, name)
            assert all(r.raw_len <= MAX_RECORD_BYTES for r in recs), name
            assert sum(r.raw_len for r in recs) == len(data)
            assert all(r.has_block_sums == (r.raw_len >= BLOCK_SUMS_MIN) for r in recs), name
            # Their bytes start on a 4 KiB boundary of the chunk: one block read is one page of the chunk file.
            assert all(r.offset % BLOCK_SIZE == 0 for r in recs if r.has_block_sums), name
            # Every record but a file's last holds whole 4 KiB blocks: a 4 KiB-aligned read of the file is one block.
            assert all(r.raw_len % BLOCK_SIZE == 0 for r in recs[:-1]), (name, [r.raw_len for r in recs])
        big = [r.raw_len for r in _records_of(idx, "b-big")]
        if chunk_mib == 16:  # room for it whole: 4 + 4 + 2 MiB, then 4 + 4 in the next chunk
            assert big == [4 * MiB, 4 * MiB, 2 * MiB]
            assert [r.raw_len for r in _records_of(idx, "c-two")] == [4 * MiB, 4 * MiB]
        else:  # cut where a chunk fills, and never longer than 4 MiB
            assert len(big) == 3 if chunk_mib == 8 else len(big) >= 3
        assert all(len(c) <= chunk_mib * MiB for c in chunks)
        for i, data in enumerate(chunks):  # every chunk stands on its own, sums and all
            assert verify_chunk(data, idx.chunk(i).id) == idx.chunk(i).n_extents
        # The records read back are the file, piece by piece.
        got = b""
        node = idx.inode(inode_of(idx, "b-big"))
        for e in range(node.ref, node.ref + node.count):
            ext = idx.extent(e)
            got += bytes(decode_record(chunks[ext.chunk][ext.record.offset : ext.record.offset + ext.record.stored_len],
                                       ext.record, "t"))
        assert got == content["b-big"]
    finally:
        idx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_size", [(1 << 20) + 12_345, (3 << 20) + 4095, (5 << 20) + 1, 9 << 20])
def test_packed_chunks_never_pass_their_size(tmp_path: Path, chunk_size: int) -> None:
    """Files of every size, compressible or not, packed with lz4 on: a compressed piece moves the
    padding of the records after it, and still no chunk grows past its size."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(chunk_size)
    text = b"".join(b"row %d of text that compresses\n" % i for i in range(400_000))
    content = {}
    for i in range(30):
        n = rng.choice([rng.randrange(5000), rng.randrange(BLOCK_SUMS_MIN - 10, BLOCK_SUMS_MIN + 10),
                        rng.randrange(6 * MiB)])
        content[f"f{i:02d}"] = text[:n] if rng.random() < 0.4 else rng.randbytes(n)
        (src / f"f{i:02d}").write_bytes(content[f"f{i:02d}"])
    idx, chunks = _pack(src, chunk_size, compress=True)
    try:
        assert all(len(c) <= chunk_size for c in chunks)
        for i, data in enumerate(chunks):
            assert verify_chunk(data, idx.chunk(i).id) == idx.chunk(i).n_extents
        for name, data in content.items():
            recs = _records_of(idx, name)
            assert all(r.offset % BLOCK_SIZE == 0 for r in recs if r.has_block_sums), name
            node = idx.inode(inode_of(idx, name))
            got = b""
            for e in range(node.ref, node.ref + node.count):
                ext = idx.extent(e)
                stored = chunks[ext.chunk][ext.record.offset : ext.record.offset + ext.record.stored_len]
                got += bytes(decode_record(stored, ext.record, name))
            assert got == data, name
    finally:
        idx.close()


def _chunk_bytes(node: Node, cid: bytes) -> bytes:
    return (node.home / "data" / "chunks" / cid.hex()[:2] / cid.hex()).read_bytes()


def _big_tree(src: Path) -> dict[str, bytes]:
    """A 10 MiB file, a 300 KiB one, compressible text of 1 and 6 MiB, and small files."""
    rng = random.Random(32)
    files = {"big.bin": rng.randbytes(10 * MiB), "mid.bin": rng.randbytes(300 << 10),
             "text.txt": b"".join(b"line %d of a text that compresses\n" % i for i in range(30_000))[: 1 * MiB],
             "text-big.txt": b"".join(b"row %d, a longer text\n" % i for i in range(300_000))[: 6 * MiB]}
    files.update({f"small/s{i:02d}": rng.randbytes(rng.choice([0, 1, 100, 4096, 20_000])) for i in range(20)})
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return files


@needs_fuse
@pytest.mark.timeout(120)
def test_big_files_are_records_of_4_mib_with_block_sums(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = _big_tree(src)
    node.ingest(src, "packed", "--chunk-size", "16M", "--compress", "lz4")
    node.ingest(src, "plain")  # 8 MiB chunks, nothing compressed
    for name in ("packed", "plain"):
        idx = Index(node.home / f"meta/index/{name}/1.idx")
        try:
            big = _records_of(idx, "big.bin")
            assert len(big) == 3 and all(r.raw_len <= MAX_RECORD_BYTES for r in big), big
            if name == "packed":
                assert [r.raw_len for r in big] == [4 * MiB, 4 * MiB, 2 * MiB]
            assert all(r.flags == FLAG_BLOCK_SUMS for r in big + _records_of(idx, "mid.bin"))
            for i in range(20):
                assert not any(r.has_block_sums for r in _records_of(idx, f"small/s{i:02d}"))
            texts = _records_of(idx, "text.txt") + _records_of(idx, "text-big.txt")
            assert len(texts) == 3  # 1 MiB, then 6 MiB as 4 + 2
            # Compressed records never carry sums; stored as is, these are big enough for them.
            assert all(r.flags == (FLAG_LZ4 if name == "packed" else FLAG_BLOCK_SUMS) for r in texts)
            # The sums in the stored chunks are those of the source's 4 KiB blocks.
            inode = idx.inode(inode_of(idx, "big.bin"))
            pos = 0
            for e in range(inode.ref, inode.ref + inode.count):
                ext = idx.extent(e)
                data = _chunk_bytes(node, idx.chunk(ext.chunk).id)
                assert struct.unpack_from("<H", data, 8)[0] == 3  # chunks with block sums are version 3
                rec = ext.record
                assert rec.offset % BLOCK_SIZE == 0  # its bytes start on a 4 KiB boundary of the chunk file
                piece = files["big.bin"][pos : pos + rec.raw_len]
                want = b"".join(struct.pack("<Q", xxhash.xxh3_64_intdigest(piece[i : i + 4096]))
                                for i in range(0, len(piece), 4096))
                assert data[rec.offset + rec.stored_len : rec.offset + rec.stored_len + rec.sums_len] == want
                blocks = block_range(rec, 0, rec.raw_len)
                verify_blocks(data[blocks.data_offset : blocks.data_offset + blocks.data_len],
                              data[blocks.sums_offset : blocks.sums_offset + blocks.sums_len], blocks, "t")
                pos += rec.raw_len
        finally:
            idx.close()
        assert node.run("verify", name).returncode == 0

    for name in ("packed", "plain"):
        mnt = node.mount(name, tmp_path / f"mnt-{name}")
        try:
            filecmp.clear_cache()
            for rel in files:
                assert filecmp.cmp(src / rel, mnt / rel, shallow=False), (name, rel)
            data = files["big.bin"]
            rand = random.Random(33)
            # Around the record edges, across two and three records, and at random.
            offsets = [0, 4 * MiB - 5, 4 * MiB, 4 * MiB + 3, 8 * MiB - 1, 10 * MiB - 10]
            offsets += [rand.randrange(len(data)) for _ in range(50)]
            for flag in (os.O_RDONLY, os.O_RDONLY | os.O_DIRECT):  # O_DIRECT: every pread goes to dlfs
                fd = os.open(mnt / "big.bin", flag)
                try:
                    for off in offsets:
                        n = rand.choice([1, 4096, 10_000, 5 * MiB, 9 * MiB])
                        assert os.pread(fd, n, off) == data[off : off + n], (name, flag, off, n)
                finally:
                    os.close(fd)
            with dlfs.direct.connect(mnt) as reader:  # dlfs.direct assembles the records too
                assert reader.direct
                views = reader.read_many([mnt / "big.bin", mnt / "mid.bin", mnt / "text-big.txt"])
                assert [bytes(v) for v in views] == [files["big.bin"], files["mid.bin"], files["text-big.txt"]]
                del views
        finally:
            node.umount(mnt)
