"""The metadata daemon's catalog in SQLite: versions taken in one transaction from any thread, an older
catalog.json imported, damage as one clear error."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import DLFS, REPO, dlfs_env, needs_fuse, wait_for_node
from msgspec.structs import replace
from test_services import make_chunk, make_index

from dlfs.errors import CorruptData, DlfsError
from dlfs.format.index import Index, file_checksum
from dlfs.meta.catalog import Catalog, VersionInfo
from dlfs.meta.store import MetaStore

V = VersionInfo("a", 0, 100, (1 << 64) - 5, 3, 300, 1, 1 << 20, 1.5)


def test_versions_taken_from_many_threads_at_once_are_all_distinct(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.db")
    got: list[int] = []
    lock = threading.Lock()

    def commit() -> None:
        for _ in range(25):
            v = cat.add(V).version
            with lock:
                got.append(v)

    threads = [threading.Thread(target=commit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 201))
    assert [v.version for v in cat.versions("a")] == list(range(1, 201))
    assert cat.find("a", 7) == replace(V, version=7)  # the u64 checksum comes back whole
    cat.close()


def test_a_failed_publish_records_nothing(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.db")
    cat.add(V)

    def fail(number: int) -> None:
        assert number == 2
        raise DlfsError("disk said no")

    with pytest.raises(DlfsError, match="disk said no"):
        cat.add(V, fail)
    assert [v.version for v in cat.versions("a")] == [1] and cat.next_version("a") == 2
    assert cat.insert(replace(V, version=1)) is False  # a peer's copy of a number taken here: kept as is
    cat.tombstone("a", {1}, 9.0)
    assert cat.find("a", 1).removed == 9.0  # type: ignore[union-attr]
    assert cat.next_version("a") == 2  # never reused
    cat.close()


def test_an_older_catalog_json_is_imported_once(tmp_path: Path) -> None:
    root = tmp_path / "meta"
    root.mkdir()
    old = [replace(V, version=1), replace(V, version=2, removed=4.0), replace(V, name="b", version=1)]
    doc = {"format": 1, "datasets": {"a": [v.to_wire() for v in old[:2]], "b": [old[2].to_wire()]}}
    (root / "catalog.json").write_text(json.dumps(doc))
    store = MetaStore(root)
    assert store.all_versions() == old
    assert [v.version for v in store.datasets()] == [1, 1] and store.next_version("a") == 3
    assert not (root / "catalog.json").exists() and (root / "catalog.json.imported").exists()
    store.catalog.close()
    assert MetaStore(root).all_versions() == old  # from the database now


def test_a_damaged_catalog_is_one_clear_error(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    db.write_bytes(b"this is not a database, but it is long enough to look like a header" * 100)
    with pytest.raises(CorruptData, match=f"catalog {db} is not a dlfs catalog"):
        Catalog(db)


def test_commits_of_one_name_from_worker_threads_get_distinct_versions(tmp_path: Path) -> None:
    # The metadata daemon commits in worker threads: through the old JSON file two commits of one name
    # could both take max + 1 and write one fixed catalog.tmp.
    store = MetaStore(tmp_path / "meta")
    cid, data, recs, _ = make_chunk(3)
    blob = make_index([(cid, data, recs)])
    sessions = []
    for _ in range(6):
        sid = store.ingests.begin("ds")
        store.ingests.put_index(sid, 0, blob)
        sessions.append(sid)
    checksum = file_checksum_of(blob, tmp_path)
    infos, errors = [], []

    def commit(sid: str) -> None:
        try:
            _, index = store.ingests.staged_chunks(sid, len(blob), checksum)
            infos.append(store.commit(sid, index, len(blob), checksum))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=commit, args=(sid,)) for sid in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(i.version for i in infos) == [1, 2, 3, 4, 5, 6]
    for i in infos:
        assert store.index_path("ds", i.version).read_bytes() == blob
        Index(store.index_path("ds", i.version)).close()


def file_checksum_of(blob: bytes, where: Path) -> int:
    p = where / "blob.idx"
    p.write_bytes(blob)
    return file_checksum(p)


@needs_fuse
@pytest.mark.timeout(120)
def test_the_one_node_default_needs_no_etcd(tmp_path: Path) -> None:
    """No etcd on the PATH (only fusermount3 is): node, ingest, mount, read, rm all work."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fusermount = shutil.which("fusermount3")
    assert fusermount
    (bin_dir / "fusermount3").symlink_to(fusermount)
    env = {**dlfs_env(tmp_path / "home"), "PATH": str(bin_dir)}
    node = subprocess.Popen([*DLFS, "node"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_node(tmp_path / "home", node, Path("/dev/null"))

        def dlfs(*args: str | Path) -> str:
            proc = subprocess.run([*DLFS, *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True,
                                  timeout=60)
            assert proc.returncode == 0, f"dlfs {args}: {proc.stdout}{proc.stderr}"
            return proc.stdout

        src = tmp_path / "src"
        src.mkdir()
        (src / "a.bin").write_bytes(b"dlfs" * 10_000)
        assert "ingested laptop version 1" in dlfs("ingest", src, "--name", "laptop")
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        dlfs("mount", "laptop", mnt)
        try:
            assert (mnt / "a.bin").read_bytes() == b"dlfs" * 10_000
        finally:
            dlfs("umount", mnt)
        assert "removed laptop" in dlfs("rm", "laptop")
        assert (tmp_path / "home" / "meta" / "catalog.db").exists()
    finally:
        node.terminate()
        out = node.communicate(timeout=20)[0].decode(errors="replace")
    assert "etcd" not in out, out


def test_collections_of_one_datasets_versions_at_once_and_a_commit_beside_them(tmp_path: Path) -> None:
    """Two versions' collections ending at once (the follower's and the etcd engine's threads) both
    found their dataset's directory empty and both removed it: FileNotFoundError took the daemon's task
    down (seen in CI). And a commit's rename must not find its directory removed under it."""
    store = MetaStore(tmp_path / "meta")
    errors: list[BaseException] = []
    for round_ in range(300):
        store.index_path("x", 1).parent.mkdir(exist_ok=True)
        for v in (1, 2):
            store.index_path("x", v).write_bytes(b"i")
        staged = tmp_path / "staged"
        staged.write_bytes(b"i")
        gate = threading.Barrier(3)

        def run(fn: Any, *args: Any, gate: threading.Barrier = gate) -> None:
            gate.wait()
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the test reports whatever the race raised
                errors.append(exc)

        work = [threading.Thread(target=run, args=(store.drop_index, "x", v)) for v in (1, 2)]
        work.append(threading.Thread(target=run, args=(store._put_in_place, staged, "x", 3, 0.0, "commit")))
        for t in work:
            t.start()
        for t in work:
            t.join()
        assert not errors, (round_, errors)
        assert store.index_path("x", 3).read_bytes() == b"i"  # the commit's file survived the collections
        store.drop_index("x", 3)
        assert not (store.index_dir / "x").exists()
