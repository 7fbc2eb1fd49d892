"""An ingest that fails cleans up after itself: a full data disk gives its space back before the
command returns (and a source error its chunks, in a cluster too), a killed ingest's session expires
(the test shortens its TTL) while a slow live one is kept alive, and a full local disk while the
index is written is one line and exit 7."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import DLFS, dlfs_env, run_dlfs, running_cluster, running_node
from test_ingest import chunk_files, dataset_rows, make_files, one_line_error

import dlfs.ingest.run
import dlfs.ingest.source
from dlfs.config import load_cluster, parse_cluster_file
from dlfs.errors import SourceError
from dlfs.ingest.walk import Selection, Tree, walk
from dlfs.meta.store import TTL_ENV

TTL = 2.0  # the session TTL these tests give the node (seconds)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at `path` (a full disk on demand); skips where mounting is not allowed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


@pytest.mark.timeout(60)
def test_data_disk_full_frees_the_ingests_chunks(tmp_path: Path) -> None:
    home = tmp_path / "home"
    make_files(tmp_path / "src", 6, 1 << 20, seed=11)  # 6 MiB for a 3 MiB disk
    with tmpfs(home / "data", "3m"), running_node(home, tmp_path / "scratch") as node:
        before = free_bytes(home / "data")
        proc = node.run("ingest", tmp_path / "src", "--name", "big", "--chunk-size", "1M", check=False)
        assert proc.returncode == 7, proc.stderr
        assert "data daemon disk is full at" in one_line_error(proc)
        # Freed by the ingest's own abort, before it returned: no `dlfs gc`.
        assert chunk_files(home) == []
        assert free_bytes(home / "data") == before
        assert "ingests in progress 0" in node.run("status").stdout
        assert dataset_rows(node) == []


@pytest.mark.timeout(90)
def test_killed_ingest_expires_and_gc_frees_its_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TTL_ENV, str(TTL))  # the node's (started below, with this environment)
    killed_src, slow_src = tmp_path / "killed", tmp_path / "slow"
    make_files(killed_src, 100, 200_000, seed=12)
    make_files(slow_src, 3, 100_000, seed=13)
    with running_node(tmp_path / "home", tmp_path) as node:
        proc = subprocess.Popen([*DLFS, "ingest", str(killed_src), "--name", "killed", "--chunk-size", "1M"],
                                env=dlfs_env(node.home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not chunk_files(node.home):
            assert proc.poll() is None, "the ingest finished before a chunk was seen: make the tree bigger"
            assert time.monotonic() < deadline
            time.sleep(0.003)
        proc.kill()
        proc.wait(timeout=10)
        assert chunk_files(node.home)

        # A live ingest that stalls for longer than the TTL (a slow walk) keeps its session alive.
        def slow_walk(src: str, select: Selection | None = None) -> Tree:
            time.sleep(2.5 * TTL)
            return walk(src, select)

        monkeypatch.setattr(dlfs.ingest.source, "walk", slow_walk)
        report = trio.run(dlfs.ingest.run.ingest, load_cluster(None, node.home), str(slow_src), "slow", 1 << 20)
        assert [r["name"] for r in dataset_rows(node)] == ["slow"]

        # The killed ingest stopped asking over 2.5 TTLs ago: its session is gone, its chunks are not pinned.
        assert "ingests in progress 0" in node.run("status").stdout
        gc = node.run("gc")
        assert "freed 0 " not in gc.stdout, gc.stdout
        assert len(chunk_files(node.home)) == report.info.chunks


@pytest.mark.timeout(60)
def test_local_disk_full_writing_the_index(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2000):  # empty files with long names: an index of some 300 KB, no chunk data
        (src / f"{i:05d}-{'n' * 120}").touch()
    with running_node(tmp_path / "home", tmp_path / "scratch") as node:
        client = tmp_path / "client"  # the ingest's own home, where it writes the index before uploading it
        with tmpfs(client, "1m"):
            (client / "run").mkdir(mode=0o700)
            shutil.copy2(node.home / "run" / "node.json", client / "run" / "node.json")
            shutil.copy2(node.home / "cluster.key", client / "cluster.key")
            with open(client / "filler", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free_bytes(client) - (64 << 10))
            proc = run_dlfs(client, "ingest", src, "--name", "idx", check=False)
        assert proc.returncode == 7, proc.stderr
        assert "disk is full" in one_line_error(proc)
        assert "ingests in progress 0" in node.run("status").stdout
        assert dataset_rows(node) == []


@pytest.mark.timeout(90)
def test_failed_ingest_frees_its_chunks_in_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cluster (etcd): the pins come from etcd and the collection runs under the cluster's gc lock."""
    make_files(tmp_path / "src", 12, 30_000, seed=14)
    victim = os.fsencode(tmp_path / "src" / "d2" / "f011.bin")  # the last file: chunks are stored before it
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fsencode(path) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    with running_cluster(tmp_path / "c", n=2, replicas=2) as nodes:
        cluster = parse_cluster_file(tmp_path / "c" / "cluster.toml")
        stored: list[int] = []

        async def run() -> None:
            async with trio.open_nursery() as watch:
                async def count() -> None:  # the chunks stored before the failure
                    while True:
                        stored.append(sum(len(chunk_files(n.home)) for n in nodes))
                        await trio.sleep(0.005)

                watch.start_soon(count)
                with pytest.raises(SourceError, match="Permission denied"):
                    await dlfs.ingest.run.ingest(cluster, str(tmp_path / "src"), "broken", 64 << 10)
                watch.cancel_scope.cancel()

        monkeypatch.setattr(os, "open", open_)
        trio.run(run)
        monkeypatch.undo()
        assert max(stored) > 0
        assert [chunk_files(n.home) for n in nodes] == [[], []]
        assert nodes[0].run("status").stdout.count("ingests in progress 0") == 2
