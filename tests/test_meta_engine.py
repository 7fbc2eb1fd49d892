"""The metadata engine's contract (dlfs/meta/engine.py), the same tests against both engines through the
protocol: the embedded SQLite engine, and the etcd engine against a real etcd member (a key prefix per
test). Ingest sessions are staged in the engine's store, as the metadata daemon stages them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
from etcdlab import EtcdCluster, etcd_available, local_etcd
from test_services import make_chunk, make_index

from dlfs.config import EtcdConfig
from dlfs.control.plane import ControlPlane, Lease
from dlfs.errors import Conflict, DlfsError, NotFound
from dlfs.format.index import file_checksum
from dlfs.meta.engine import MetaEngine
from dlfs.meta.engine_etcd import EtcdEngine
from dlfs.meta.engine_sqlite import EmbeddedEngine
from dlfs.meta.store import MetaStore

pytestmark = pytest.mark.timeout(60)
NODE = "n1"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster | None]:
    if etcd_available() is not None:
        yield None
        return
    cluster = local_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster
    finally:
        cluster.stop()


async def _join(control: ControlPlane) -> int:
    lease = await control.etcd.grant(control.cfg.lease_ttl)
    await control.etcd.put(control.node_key(NODE), '{"roles": ["meta"]}', lease)
    return lease


@pytest.fixture(params=["sqlite", "etcd"])
async def engine(request: pytest.FixtureRequest, etcd: EtcdCluster | None, tmp_path: Path) -> AsyncIterator[MetaEngine]:
    store = MetaStore(tmp_path / "meta")
    if request.param == "sqlite":
        yield EmbeddedEngine(store)
        store.catalog.close()
        return
    if etcd is None:
        pytest.skip(str(etcd_available()))
    control = ControlPlane(EtcdConfig(tuple(etcd.endpoints), prefix=f"/t/{request.node.name}/", lease_ttl=2))
    lease = Lease(control, f"node {NODE}", partial(_join, control))
    # No peers: every version this daemon serves is one it committed (the follower never fetches).
    e = EtcdEngine(store, control, lease, NODE, [], None)  # type: ignore[arg-type]

    async def collect() -> None:  # the tests run each collection themselves
        pass

    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        nursery.start_soon(e.run, collect)
        yield e
        await lease.revoke()
        nursery.cancel_scope.cancel()
    await control.aclose()
    store.catalog.close()


def chunk(seed: int) -> tuple[bytes, bytes]:
    """An index naming one real chunk of its own: (its bytes, the chunk's id)."""
    cid, data, recs, _ = make_chunk(seed)
    return make_index([(cid, data, recs)]), cid


async def stage(engine: MetaEngine, name: str, blob: bytes, cid: bytes) -> str:
    """An open, recorded session of `name` with `blob` staged and its chunk pinned."""
    sid = engine.store.ingests.begin(name)
    await engine.open_ingest(sid, name)
    engine.store.ingests.put_index(sid, 0, blob)
    await engine.pin(sid, [cid])
    return sid


async def commit(engine: MetaEngine, name: str, seed: int) -> tuple[int, bytes, bytes]:
    """A version of `name` committed as the metadata daemon commits it: (its number, index, chunk id)."""
    blob, cid = chunk(seed)
    sid = await stage(engine, name, blob, cid)
    checksum = file_checksum(engine.store.ingests.session(sid).path)
    _, index = engine.store.ingests.staged_chunks(sid, len(blob), checksum)
    try:
        async with engine.gc_lock:
            info = await engine.commit(sid, index, len(blob), checksum)
    finally:
        index.close()
    return info.version, blob, cid


async def live_chunks(engine: MetaEngine) -> set[bytes]:
    async with engine.gc_lock, engine.collection() as c:
        return set(c.live)


async def test_commits_number_versions_and_publish_their_index(engine: MetaEngine) -> None:
    v1, blob1, _ = await commit(engine, "ds", 1)
    v2, blob2, _ = await commit(engine, "ds", 2)
    assert (v1, v2) == (1, 2)
    assert [(v.name, v.version) for v in await engine.datasets()] == [("ds", 1), ("ds", 2)]
    newest = await engine.dataset("ds", None)
    assert (newest.version, newest.index_size) == (2, len(blob2))
    assert (await engine.dataset("ds", 1)).index_size == len(blob1)
    assert engine.store.index_path("ds", 1).read_bytes() == blob1
    assert engine.store.index_path("ds", 2).read_bytes() == blob2
    assert engine.store.ingests.open == {}  # each commit ended its session


async def test_concurrent_commits_of_one_name_get_distinct_numbers(engine: MetaEngine) -> None:
    got: list[int] = []

    async def one(seed: int) -> None:
        got.append((await commit(engine, "ds", seed))[0])

    async with trio.open_nursery() as n:
        for seed in range(5):
            n.start_soon(one, seed)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert [v.version for v in await engine.datasets()] == [1, 2, 3, 4, 5]


async def test_unknown_names_and_versions_are_one_line_not_found(engine: MetaEngine) -> None:
    with pytest.raises(NotFound, match="no dataset named 'nope'"):
        await engine.dataset("nope", None)
    await commit(engine, "ds", 1)
    await commit(engine, "ds", 2)
    with pytest.raises(NotFound, match=r"dataset 'ds' has no version 7 \(it has 1, 2\)"):
        await engine.dataset("ds", 7)
    with pytest.raises(NotFound, match="no dataset named 'nope'"):
        await engine.remove("nope", None)


async def test_a_removal_hides_the_version_and_its_number_is_never_reused(engine: MetaEngine) -> None:
    await commit(engine, "ds", 1)
    await commit(engine, "ds", 2)
    gone, mounts = await engine.remove("ds", 2)
    assert [(g.name, g.version) for g in gone] == [("ds", 2)] and gone[0].removed > 0
    assert mounts == []  # nothing mounts it
    assert [v.version for v in await engine.datasets()] == [1]
    assert (await engine.dataset("ds", None)).version == 1
    with pytest.raises(NotFound):
        await engine.dataset("ds", 2)
    assert (await commit(engine, "ds", 3))[0] == 3
    gone, _ = await engine.remove("ds", None)  # every live version of the name
    assert sorted(g.version for g in gone) == [1, 3]
    assert await engine.datasets() == []


async def test_a_collection_keeps_live_versions_and_pins_and_frees_removed_ones(engine: MetaEngine) -> None:
    _, _, kept = await commit(engine, "keep", 1)
    _, _, dropped = await commit(engine, "drop", 2)
    blob, pinned = chunk(3)
    sid = await stage(engine, "open", blob, pinned)
    assert await live_chunks(engine) == {kept, dropped, pinned}
    await engine.remove("drop", None)
    async with engine.gc_lock, engine.collection() as c:
        assert c.live == {kept, pinned}
        await c.swept()
    await engine.compact()
    assert not engine.store.has_index("drop", 1)  # its chunks are freed: its index is needed nowhere
    assert engine.store.has_index("keep", 1)
    # An aborted session's pins are freed by its abort: what the store held and what the engine returns.
    held = engine.store.ingests.abort(sid) | await engine.close_ingest(sid)
    assert held == {pinned}
    assert await live_chunks(engine) == {kept}


async def test_a_pin_waits_for_a_collection_in_progress(engine: MetaEngine) -> None:
    blob, first = chunk(1)
    sid = await stage(engine, "ds", blob, first)
    late = chunk(2)[1]
    done = trio.Event()

    async def pin_late() -> None:
        await engine.pin(sid, [late])
        done.set()

    async with trio.open_nursery() as n:
        async with engine.gc_lock, engine.collection() as c:
            assert c.live == {first}
            n.start_soon(pin_late)
            with trio.move_on_after(1.0):  # a pin that did not wait ends well within this
                await done.wait()
            assert not done.is_set() and late not in engine.store.ingests.session(sid).pins
        with trio.fail_after(30):
            await done.wait()
    assert engine.store.ingests.session(sid).pins == {first, late}
    assert await live_chunks(engine) == {first, late}


async def test_a_session_the_store_dropped_cannot_pin_or_commit(engine: MetaEngine) -> None:
    blob, cid = chunk(1)
    sid = await stage(engine, "ds", blob, cid)
    engine.store.ingests.abort(sid)
    await engine.close_ingest(sid)
    with pytest.raises(Conflict, match=f"ingest session {sid} is "):
        await engine.pin(sid, [cid])
    assert await engine.datasets() == []


async def test_a_damaged_index_is_restored_only_from_a_peer(engine: MetaEngine) -> None:
    await commit(engine, "ds", 1)
    info = await engine.dataset("ds", 1)
    path = engine.store.index_path("ds", 1)
    path.write_bytes(b"x" * info.index_size)
    assert engine.store.check_index(info) == "its file fails its checksum"
    try:
        restored = await engine.restore_index(info)
    except DlfsError as exc:  # etcd: no peer could send it
        assert "could send the index of ds@1" in str(exc)
        restored = False
    assert restored is False  # neither engine has a peer here
    assert engine.store.check_index(info) == "its file fails its checksum"
