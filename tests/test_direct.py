"""dlfs.direct against a real node and a real FUSE mount: every file's bytes equal the source's
(direct hits, misses, compressed and multi-chunk records, symlinks), the errors open() would raise,
off-mount fallback, pins held across concurrent eviction, pins of a killed process reclaimed, and
two jobs sharing one cache."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Node, needs_fuse
from treegen import BIG, MANY_DIR, MANY_FILES, SPECIALS, TEXT, make_edge_tree

import dlfs.direct
from dlfs.direct import DirectReader, PlainReader

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
