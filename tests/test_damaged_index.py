"""Maintenance with one version's index damaged: verify, repair, gc and rm still do everything else,
and say what they could not; a catalog SQLite cannot read is rebuilt from the index files.

Damage is done on disk, as a failing disk would do it: a flipped byte in an index file, an index
file gone, a truncated catalog.db, a catalog row recorded by a dlfs that kept no chunk lists.
"""

from __future__ import annotations

import filecmp
import random
import re
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import Node, needs_fuse, running_cluster, running_node

from dlfs.format.index import file_checksum
from dlfs.meta.catalog import Catalog, VersionInfo
from dlfs.meta.store import MetaStore


def make_tree(root: Path, seed: int) -> Path:
    """About 300 KB in a few files: some 5 chunks of 64 KiB, none shared with another seed's."""
    rng = random.Random(seed)
    for i in range(6):
        (root / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 2}" / f"f{i}.bin").write_bytes(rng.randbytes(rng.choice([3_000, 40_000, 90_000])))
    return root


def chunk_files(node: Node) -> set[str]:
    return {p.name for p in (node.home / "data" / "chunks").glob("*/*")}


def ingest(node: Node, tmp_path: Path, name: str, seed: int) -> tuple[Path, set[str]]:
    """Ingest a fresh tree as `name`: (its source, the chunks it added)."""
    before = chunk_files(node)
    src = make_tree(tmp_path / f"src-{name}-{seed}", seed)
    node.ingest(src, name, "--chunk-size", "64K")
    added = chunk_files(node) - before
    assert added, f"ingest of {name} stored no new chunk"
    return src, added


def index_file(node: Node, label: str) -> Path:
    name, _, version = label.partition("@")
    return node.home / "meta" / "index" / name / f"{version}.idx"


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def one_line(proc: object) -> str:
    stderr = proc.stderr  # type: ignore[attr-defined]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlfs: error: "), stderr
    return lines[0]


def same_tree(src: Path, mnt: Path) -> None:
    files = [p for p in src.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert filecmp.cmp(path, mnt / path.relative_to(src), shallow=False), path


def commit_one(store: MetaStore, name: str, seed: int, where: Path) -> VersionInfo:
    from test_services import make_chunk, make_index

    cid, data, recs, _ = make_chunk(seed)
    blob = make_index([(cid, data, recs)])
    sid = store.ingests.begin(name)
    store.ingests.put_index(sid, 0, blob)
    (where / "blob.idx").write_bytes(blob)
    checksum = file_checksum(where / "blob.idx")
    _, index = store.ingests.staged_chunks(sid, len(blob), checksum)
    try:
        return store.commit(sid, index, len(blob), checksum)
    finally:
        index.close()


@pytest.mark.timeout(30)
def test_an_emptied_catalog_beside_index_files_is_rebuilt_and_chunks_come_from_the_catalog(tmp_path: Path) -> None:
    root = tmp_path / "meta"
    store = MetaStore(root)
    infos = [commit_one(store, "a", 1, tmp_path), commit_one(store, "a", 2, tmp_path), commit_one(store, "b", 3, tmp_path)]
    chunks, first = store.committed_chunks(), store.chunks_of("a", 1)
    assert len(chunks) == 3 and len(first) == 1
    store.index_path("a", 1).unlink()  # the chunk list is the catalog's: no index is read
    assert store.committed_chunks() == chunks
    store.catalog.close()
    (root / "catalog.db").write_bytes(b"")  # truncated to nothing: SQLite sees an empty database

    store = MetaStore(root)  # a new commit must not take a@2's number and overwrite its file
    assert [(v.name, v.version) for v in store.datasets()] == [("a", 2), ("b", 1)]
    assert store.find("a", 2) == infos[1] and store.find("b", 1) == infos[2] and store.next_version("a") == 3
    assert store.committed_chunks() == chunks - first
    store.catalog.close()


@pytest.mark.timeout(120)
def test_verify_repair_gc_and_rm_go_on_past_a_corrupt_and_a_missing_index(node: Node, tmp_path: Path) -> None:
    _, a_chunks = ingest(node, tmp_path, "a", 1)
    _, b_chunks = ingest(node, tmp_path, "b", 2)
    _, c_chunks = ingest(node, tmp_path, "c", 3)
    flip_a_byte(index_file(node, "a@1"))
    index_file(node, "b@1").unlink()
    node.stop()  # damage found later, by a node that never saw these indexes whole
    node.start()

    verify = node.run("verify", "--all", check=False)
    assert verify.returncode == 5, verify
    assert "index of a@1 is damaged: its file fails its checksum" in verify.stdout, verify.stdout
    assert "index of b@1 is damaged: its file is missing" in verify.stdout, verify.stdout
    # The rest was verified all the same: every chunk of c.
    assert f"verified {len(c_chunks)} chunks of 1 dataset version" in verify.stdout, verify.stdout
    assert "every chunk has 1 good replica" in verify.stdout, verify.stdout
    assert "1 good replicas" not in verify.stdout, verify.stdout  # one replica, one noun
    assert "2 dataset indexes damaged (a@1, b@1) with no good copy" in one_line(verify)

    repair = node.run("repair", check=False)
    assert repair.returncode == 5, repair
    assert "index of a@1 is damaged" in repair.stdout and "index of b@1 is damaged" in repair.stdout, repair.stdout
    assert f"{len(c_chunks)} of {len(c_chunks)} chunks of 1 dataset version have 1 good replica" in repair.stdout
    assert "a@1, b@1" in one_line(repair)

    gc = node.run("gc")  # the chunk lists are in the catalog: no index is parsed
    assert gc.stdout.startswith("freed 0 chunks"), gc.stdout

    rm = node.run("rm", "c")  # another dataset: removed, exit 0, and its chunks freed
    assert f"removed c (version 1); freed {len(c_chunks)} chunks" in rm.stdout, rm
    assert not rm.stderr, rm.stderr
    assert chunk_files(node) == a_chunks | b_chunks
    node.run("rm", "a")  # the damaged ones can go too, with their chunks
    assert chunk_files(node) == b_chunks
    assert node.run("verify", "--all", check=False).returncode == 5  # b@1 is still damaged
    for log in (verify, repair, gc, rm):
        assert "Traceback" not in log.stderr and "internal error" not in log.stderr, log.stderr


@pytest.mark.timeout(120)
def test_a_version_with_unknown_chunks_holds_gc_back_in_one_line(node: Node, tmp_path: Path) -> None:
    """A version recorded before the catalog kept chunk lists, whose index is gone: nothing can be
    proven dead, so gc frees nothing and names it; rm of another dataset removes it all the same."""
    _, b_chunks = ingest(node, tmp_path, "b", 2)
    _, c_chunks = ingest(node, tmp_path, "c", 3)
    node.stop()
    db = sqlite3.connect(node.home / "meta" / "catalog.db", isolation_level=None)
    db.execute("DROP TABLE IF EXISTS chunks")  # as a dlfs that kept no chunk lists left it
    db.execute("DROP TABLE IF EXISTS chunk_sets")
    db.close()
    index_file(node, "b@1").unlink()
    node.start()
    assert "the chunks of b@1 are unknown: its index is damaged (its file is missing)" in node.node_log()

    gc = node.run("gc", check=False)
    assert gc.returncode == 5, gc
    assert "the chunks of b@1 are unknown" in one_line(gc) and "Traceback" not in gc.stderr

    rm = node.run("rm", "c")
    assert rm.stdout.startswith("removed c (version 1); freed 0 chunks"), rm.stdout
    assert "not all of its chunks are freed yet: the chunks of b@1 are unknown" in rm.stderr, rm.stderr
    assert node.run("datasets").stdout.count("\nb ") == 1 and "\nc " not in node.run("datasets").stdout

    rm = node.run("rm", "b")  # the last live version gone: everything is provably dead
    assert f"freed {len(b_chunks) + len(c_chunks)} chunks" in rm.stdout, rm.stdout
    assert chunk_files(node) == set()


@needs_fuse
@pytest.mark.timeout(120)
def test_a_truncated_catalog_is_rebuilt_from_the_index_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with running_node(home, tmp_path) as node:
        sources = {"a@1": ingest(node, tmp_path, "a", 1)[0], "b@1": ingest(node, tmp_path, "b", 2)[0],
                   "b@2": ingest(node, tmp_path, "b", 3)[0]}
        ingest(node, tmp_path, "gone", 4)
        node.run("rm", "gone")
        node.stop()
        db = home / "meta" / "catalog.db"
        before = _versions(db)
        assert [f"{v.name}@{v.version}" for v in before if not v.removed] == sorted(sources)
        with open(db, "r+b") as f:
            f.truncate(db.stat().st_size // 2)

        node.start()
        warnings = [line for line in node.node_log().splitlines() if "rebuilt from the index files" in line]
        assert len(warnings) == 1 and "versions recovered: 3" in warnings[0], node.node_log()
        assert len(list(db.parent.glob("catalog.db.damaged-*"))) == 1
        listed = node.run("datasets").stdout
        assert re.findall(r"^(\S+) +(\d+) ", listed, re.M) == [("a", "1"), ("b", "1"), ("b", "2")], listed
        for label, src in sources.items():
            mnt = node.mount(label, tmp_path / f"mnt-{label}")
            same_tree(src, mnt)
            node.umount(mnt)
        node.stop()
        after = _versions(db)
        # What commit recorded comes back whole: sizes, checksum, counts and the commit time.
        assert after == [v for v in before if not v.removed]
        node.start()
        assert "ingested a version 2" in node.ingest(sources["a@1"], "a").stdout  # numbers go on


def _versions(db: Path) -> list[VersionInfo]:
    cat = Catalog(db)
    try:
        return cat.all_versions()
    finally:
        cat.close()


@pytest.mark.timeout(120)
def test_repair_restores_a_damaged_index_from_another_metadata_daemon(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "c", n=2, replicas=2) as (n1, n2):
        ingest(n1, tmp_path, "data", 1)
        ingest(n1, tmp_path, "other", 2)
        good = {label: _followed(n2, label) for label in ("data@1", "other@1")}
        flip_a_byte(index_file(n1, "data@1"))

        verify = n1.run("verify", "--all", check=False)
        assert verify.returncode == 5, verify
        assert "index of data@1 is damaged: its file fails its checksum (on n1)" in verify.stdout, verify.stdout
        assert "every chunk has 2 good replicas" in verify.stdout, verify.stdout
        assert "`dlfs repair` restores it from another metadata daemon" in one_line(verify)
        assert n1.run("gc").returncode == 0

        repair = n1.run("repair")
        assert "restored the index of data@1 on n1 from another metadata daemon's copy" in repair.stdout, repair
        assert index_file(n1, "data@1").read_bytes() == good["data@1"]
        assert "every chunk has 2 good replicas" in n1.run("verify", "--all").stdout


def _followed(node: Node, label: str, timeout: float = 30.0) -> bytes:
    """The index file a node's follower fetched from the daemon that committed it (bounded wait)."""
    path = index_file(node, label)
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{node.name} never fetched the index of {label}"
        time.sleep(0.1)
    return path.read_bytes()


@needs_fuse
@pytest.mark.timeout(120)
def test_a_mount_gets_a_good_index_from_another_metadata_daemon_past_a_damaged_copy(tmp_path: Path) -> None:
    """This node's copy of an index damaged (a flipped byte): a mount here fetches it whole from the
    other metadata daemon and reads every file right, and says where the good copy came from. Before,
    it failed (`index of data@1 arrived corrupt`, exit 5) while n2 held a good copy."""
    with running_cluster(tmp_path / "c", n=2, replicas=2) as (n1, n2):
        src, _ = ingest(n1, tmp_path, "data", 3)
        _followed(n2, "data@1")
        flip_a_byte(index_file(n1, "data@1"))
        mnt = n1.mount("data", tmp_path / "mnt")
        try:
            same_tree(src, mnt)
        finally:
            n1.umount(mnt)
        log = n1.mount_log("data").read_text()
        assert "index of data@1: its copy fails its checksum; fetching it from each metadata daemon in turn" in log
        assert "index of data@1: a good copy from n2" in log
        n2_copy = index_file(n2, "data@1")
        flip_a_byte(n2_copy)  # now no daemon has a good copy: one line, naming each
        for cached in (n1.home / "mounts" / "index").iterdir():  # (the first mount's, good, kept here)
            cached.unlink()
        (tmp_path / "mnt2").mkdir()
        refused = n1.run("mount", "data", tmp_path / "mnt2", check=False)
        assert refused.returncode == 5, refused
        line = one_line(refused)
        assert "index of data@1: no metadata daemon sent a good copy (n1: its copy fails its checksum; n2: its " \
               "copy fails its checksum)" in line and "`dlfs repair`" in line, line
