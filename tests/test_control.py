"""The control plane against a real etcd member: allocation, removal against mount leases, pins
against the gc lock, leases, and etcd being down (one line naming the endpoints)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from conftest import trio_wait_for
from etcdlab import EtcdCluster, etcd_available, free_ports, local_etcd

from dlfs.config import EtcdConfig, parse_cluster_file
from dlfs.control.etcd import EtcdUnavailable
from dlfs.control.pins import PinPublisher
from dlfs.control.plane import ControlPlane, Lease
from dlfs.errors import Conflict, NotFound, UsageError
from dlfs.meta.catalog import VersionInfo

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = local_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def control(etcd: EtcdCluster, request: pytest.FixtureRequest) -> ControlPlane:
    # A prefix per test: tests share the member but never each other's keys.
    return ControlPlane(EtcdConfig(tuple(etcd.endpoints), prefix=f"/t/{request.node.name}/", lease_ttl=2))


def info(name: str) -> VersionInfo:
    return VersionInfo(name, 0, 100, 2**64 - 5, 3, 300, 1, 1 << 20, time.time())


async def session(control: ControlPlane, sid: str) -> int:
    lease = await control.etcd.grant(30)
    await control.open_ingest(sid, "ds", "n1", lease)
    return lease


async def test_concurrent_commits_of_one_name_get_distinct_numbers(control: ControlPlane) -> None:
    got: list[int] = []

    async def commit(i: int) -> None:
        await session(control, f"s{i}")
        got.append((await control.allocate(info("ds"), f"n{i}", f"s{i}")).version)

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(commit, i)
    assert sorted(got) == list(range(1, 9))
    recs, _ = await control.versions("ds")
    assert [r.info.version for r in recs] == list(range(1, 9))
    assert recs[0].info.index_sum == 2**64 - 5  # u64 checksums survive JSON
    assert await control.ingests() == []  # each commit closed its session in the same transaction
    await control.aclose()


async def test_an_allocation_tried_again_finds_its_own_version(control: ControlPlane) -> None:
    """An allocation applied by etcd whose reply was lost is tried again (on another member): it finds
    the version its session recorded, and takes no second number."""
    await session(control, "s1")
    first = await control.allocate(info("ds"), "n1", "s1")
    again = await control.allocate(info("ds"), "n1", "s1")
    assert again.version == first.version == 1
    recs, _ = await control.versions("ds")
    assert [r.info.version for r in recs] == [1]
    await control.aclose()


async def test_a_commit_whose_session_lost_its_lease_is_refused(control: ControlPlane) -> None:
    lease = await session(control, "s1")
    await control.etcd.revoke(lease)
    with pytest.raises(Conflict, match="lost its lease"):
        await control.allocate(info("ds"), "n1", "s1")
    with pytest.raises(Conflict, match="run the ingest again"):
        await control.clear_to_pin("s1")
    await control.aclose()


async def test_removal_reports_mounts_and_refuses_new_ones(control: ControlPlane) -> None:
    await session(control, "s1")
    v = await control.allocate(info("ds"), "n1", "s1")
    lease = await control.hold_mount(v, "n3", "/mnt/ds")
    gone, mounts = await control.remove("ds", None)
    assert [g.version for g in gone] == [1] and gone[0].removed
    assert [(m.node, m.mountpoint, m.lease) for m in mounts] == [("n3", "/mnt/ds", lease)]
    with pytest.raises(NotFound, match="ds@1 was removed"):
        await control.hold_mount(v, "n4", "/mnt/other")
    with pytest.raises(NotFound, match="no dataset named 'ds'"):
        await control.remove("ds", None)
    # The number stays taken: the next commit of the name is 2.
    await session(control, "s2")
    assert (await control.allocate(info("ds"), "n1", "s2")).version == 2
    snap = await control.snapshot()
    assert [(m.name, m.version) for m in snap.mounts] == [("ds", 1)]
    await control.etcd.revoke(lease)
    assert (await control.snapshot()).mounts == []
    await control.aclose()


async def test_pins_wait_for_a_collection_and_it_sees_them(control: ControlPlane,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's pins reach etcd only when a collection takes the gc lock (one key per session), and a
    pin asked for during the collection waits for it to end."""
    await session(control, "s1")
    held: dict[str, set[bytes]] = {"s1": set()}
    board = PinPublisher(control, "n1", lambda: held)
    lease = await control.etcd.grant(30)
    pinned_at = 0.0
    pinned = trio.Event()
    refusals = 0  # the times etcd told a pin a collection runs (the real answer, counted)
    clear_to_pin = control.clear_to_pin

    async def counted_clear_to_pin(sid: str) -> bool:
        nonlocal refusals
        clear = await clear_to_pin(sid)
        refusals += not clear
        return clear

    monkeypatch.setattr(control, "clear_to_pin", counted_clear_to_pin)
    async with trio.open_nursery() as n:
        n.start_soon(board.run)
        await board.pin("s1", [b"a" * 16, b"b" * 16], held["s1"])
        assert (await control.snapshot()).pins == set()  # nothing written per chunk
        async with control.gc_lock("n1", lease):
            assert (await control.snapshot()).pins == {b"a" * 16, b"b" * 16}  # published for this collection
            with pytest.raises(Conflict, match="already running on n1"):
                async with control.gc_lock("n2", lease):
                    pass

            async def pin_late() -> None:
                nonlocal pinned_at
                await board.pin("s1", [b"c" * 16], held["s1"])
                pinned_at = trio.current_time()
                pinned.set()

            n.start_soon(pin_late)
            # Until the late pin has asked twice and been told to wait both times.
            await trio_wait_for(lambda: refusals >= 2, 10, "the late pin to be refused during the collection")
            assert held["s1"] == {b"a" * 16, b"b" * 16} and not pinned.is_set()  # the late pin waits
            released_at = trio.current_time()
        with trio.fail_after(10):
            await pinned.wait()  # taken once the collection ended
        async with control.gc_lock("n1", lease):  # the next collection sees the late pin
            assert (await control.snapshot()).pins == {b"a" * 16, b"b" * 16, b"c" * 16}
        n.cancel_scope.cancel()
    assert pinned_at >= released_at
    kvs, _ = await control.etcd.range(f"{control.p}pins/", prefix=True)
    assert [kv.key for kv in kvs] == [control.pins_key("s1")]  # one key for the session
    assert await control.close_ingest("s1") == {b"a" * 16, b"b" * 16, b"c" * 16}  # for its abort to free
    assert (await control.snapshot()).pins == set()
    await control.aclose()


async def test_a_collection_waits_for_unpublished_pins_then_refuses(control: ControlPlane) -> None:
    """A session whose daemon never publishes (cut off from etcd) makes a collection fail, not free its chunks."""
    await session(control, "s1")
    lease = await control.etcd.grant(30)
    with pytest.raises(Conflict, match="1 ingest session.* on n1 did not publish their pins"):
        async with control.gc_lock("n2", lease):
            pass
    assert (await control.gc_holder())[0] == 0  # the failed collection let go of the lock
    await control.aclose()


async def test_a_lease_lives_while_kept_and_ends_when_revoked(control: ControlPlane,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async def take() -> int:
        lease = await control.etcd.grant(2)
        await control.etcd.put(control.node_key("n1"), '{"roles": ["meta"]}', lease)
        return lease

    keepalives: list[int] = []  # etcd's answer to each (the TTL left: 0 once expired)
    keepalive = control.etcd.keepalive

    async def counted_keepalive(lease_id: int) -> int:
        ttl = await keepalive(lease_id)
        keepalives.append(ttl)
        return ttl

    monkeypatch.setattr(control.etcd, "keepalive", counted_keepalive)
    lease = Lease(control, "node n1", take)
    async with trio.open_nursery() as n:
        await n.start(lease.run)
        # Past the TTL (a keepalive every TTL/3, so four span more than it): only the keepalives keep it,
        # and each renewed it to its whole TTL.
        await trio_wait_for(lambda: len(keepalives) >= 4, 20, "four keepalives of the lease")
        assert keepalives[:4] == [2, 2, 2, 2], keepalives
        assert list(await control.nodes()) == ["n1"]
        await lease.revoke()
        assert await control.nodes() == {}
        n.cancel_scope.cancel()
    await control.aclose()


async def test_etcd_down_is_one_line_naming_the_endpoints() -> None:
    down = [f"http://127.0.0.1:{p}" for p in free_ports(2)]
    control = ControlPlane(EtcdConfig(tuple(down)))
    with pytest.raises(EtcdUnavailable) as err:
        await control.versions()
    text = str(err.value)
    assert "\n" not in text and all(f"{e}: connection refused" in text for e in down), text
    await control.aclose()


def test_a_cluster_of_several_nodes_needs_etcd(tmp_path: Path) -> None:
    (tmp_path / "k").write_text("ab" * 32)
    (tmp_path / "k").chmod(0o600)  # a key others can read is refused
    nodes = '[[node]]\nname = "a"\naddress = "127.0.0.1"\n[[node]]\nname = "b"\naddress = "127.0.0.2"\n'
    path = tmp_path / "c.toml"
    path.write_text('key_file = "k"\n' + nodes)
    with pytest.raises(UsageError, match=r"has 2 nodes but no \[etcd\] section"):
        parse_cluster_file(path)
    path.write_text('key_file = "k"\n' + nodes + '[etcd]\nendpoints = ["10.0.0.1:2379"]\n')
    with pytest.raises(UsageError, match="endpoints"):
        parse_cluster_file(path)
    path.write_text('key_file = "k"\n' + nodes + '[etcd]\nendpoints = ["https://e:2379"]\ncert_file = "c.pem"\n')
    with pytest.raises(UsageError, match="cert_file and key_file go together"):
        parse_cluster_file(path)
    path.write_text('key_file = "k"\n' + nodes + '[etcd]\nendpoints = ["http://e1:2379/"]\nlease_ttl = 7\n')
    cfg = parse_cluster_file(path).etcd
    assert cfg is not None and cfg.endpoints == ("http://e1:2379",) and cfg.lease_ttl == 7 and cfg.prefix == "/dlfs/"
