"""An ingest that fails cleans up after itself: a full data disk gives its space back before the
command returns (and a source error its chunks, in a cluster too), a killed ingest's session expires
(the test shortens its TTL) while a slow live one is kept alive, and a full local disk while the
index is written is one line and exit 7."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import DLFS, dlfs_env, one_line_error, run_dlfs, running_cluster, running_node, wait_for
from test_ingest import chunk_files, dataset_rows, make_files

import dlfs.ingest.run
import dlfs.ingest.source
from dlfs.client.cluster import ClusterClient
from dlfs.config import load_cluster, parse_cluster_file
from dlfs.data.store import chunk_path
from dlfs.errors import SourceError
from dlfs.ingest.walk import Selection, Tree, walk
from dlfs.meta.sessions import TTL_ENV
from dlfs.wire.protocol import Msg

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
        assert "data daemon disk is full at" in one_line_error(proc, 7)
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
        wait_for(lambda: chunk_files(node.home) or proc.poll() is not None, 60, "the ingest to store a chunk",
                 every=0.003)
        assert proc.poll() is None, "the ingest finished before a chunk was seen: make the tree bigger"
        proc.kill()
        proc.wait(timeout=10)
        assert chunk_files(node.home)

        # A live ingest that stalls for longer than the TTL (a slow walk) keeps its session alive.
        keepalives: list[str] = []  # each keepalive of the session the daemon took ("ok") or not
        call_meta = ClusterClient.call_meta

        async def counted_call_meta(self: ClusterClient, msg: Msg, meta: dict[str, Any] | None = None,
                                    *args: Any, **kwargs: Any) -> Any:
            try:
                reply = await call_meta(self, msg, meta, *args, **kwargs)
            except Exception as exc:
                if msg == Msg.PIN_CHUNKS and meta and meta["ids"] == []:
                    keepalives.append(repr(exc))
                raise
            if msg == Msg.PIN_CHUNKS and meta and meta["ids"] == []:
                keepalives.append("ok")
            return reply

        def slow_walk(src: str, select: Selection | None = None) -> Tree:
            # The walk stalls until the session has been kept past its TTL (a keepalive every TTL/4: six
            # span 1.5 TTLs), the killed ingest's last request further back still.
            wait_for(lambda: len(keepalives) >= 6, 60, "six keepalives of the slow ingest's session")
            return walk(src, select)

        monkeypatch.setattr(ClusterClient, "call_meta", counted_call_meta)
        monkeypatch.setattr(dlfs.ingest.source, "walk", slow_walk)
        report = trio.run(dlfs.ingest.run.ingest, load_cluster(None, node.home), str(slow_src), "slow", 1 << 20)
        assert [r["name"] for r in dataset_rows(node)] == ["slow"]
        assert len(keepalives) >= 6 and set(keepalives) == {"ok"}, keepalives

        # The killed ingest stopped asking over 1.5 TTLs ago: its session is gone, its chunks are not pinned.
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
        assert "disk is full" in one_line_error(proc, 7)
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
        stored: list[list[bool]] = []  # per chunk stored before the failure: on each node's disk then?
        store_chunk = dlfs.ingest.run._store_chunk

        async def counted_store_chunk(client: ClusterClient, session: str, p: Any, *args: Any) -> None:
            await store_chunk(client, session, p, *args)
            stored.append([chunk_path(n.home / "data" / "chunks", p.cid).exists() for n in nodes])

        async def run() -> None:
            with pytest.raises(SourceError, match="Permission denied"):
                await dlfs.ingest.run.ingest(cluster, str(tmp_path / "src"), "broken", 64 << 10)

        monkeypatch.setattr(dlfs.ingest.run, "_store_chunk", counted_store_chunk)
        monkeypatch.setattr(os, "open", open_)
        trio.run(run)
        monkeypatch.undo()
        assert stored and all(on == [True, True] for on in stored), stored  # both replicas, then freed
        assert [chunk_files(n.home) for n in nodes] == [[], []]
        assert nodes[0].run("status").stdout.count("ingests in progress 0") == 2
