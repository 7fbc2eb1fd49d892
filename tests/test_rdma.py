"""The RDMA transport: what runs everywhere (the set-up exchange, queue pair attributes, the
transport choice and its reasons, registered memory, chunk registrations, failover to TCP), and
the whole read path over a real verbs device, which skips where there is none (as here: the
kernel is built without InfiniBand)."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import random
import re
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import trio
from conftest import Node, needs_fuse, run_dlfs
from test_services import make_chunk, make_index, node_with_clients, put_chunk, running_node

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster, NodeSpec, load_cluster, parse_cluster_file
from dlfs.data.store import ChunkStore
from dlfs.errors import DlfsError, NotFound, ProtocolError, RdmaFailure, TransportUnavailable, UsageError
from dlfs.format.index import Index
from dlfs.mount.cache import ChunkCache
from dlfs.transport import verbs
from dlfs.transport.verbs import Memlock, PortInfo, VerbsReport, choose_transport, gid_bytes, gid_text
from dlfs.wire.messages import QpEndpoint, RemoteRegion, decode, reply
from dlfs.wire.protocol import Msg, pack_meta, unpack_meta

REPORT = verbs.probe()
needs_rdma = pytest.mark.skipif(not REPORT.active_ports(), reason=REPORT.error or "no active RDMA port")

ROCE = PortInfo("mlx5_0", 1, "Active", True, "Ethernet", 5, 0, 3, bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1]))
IB = PortInfo("mlx5_1", 1, "Active", True, "InfiniBand", 4, 17, 0, bytes.fromhex("fe80" + "00" * 6 + "0002c90300a1b2c3"))
UNLIMITED = Memlock(None, None, False)
GIB = 1 << 30


@asynccontextmanager
async def running_cluster_client(home: Path) -> AsyncIterator[ClusterClient]:
    """A ClusterClient for the embedded node running under `home`, in a nursery of its own."""
    async with trio.open_nursery() as nursery:
        yield ClusterClient(load_cluster(None, home), nursery)
        nursery.cancel_scope.cancel()


def test_pyverbs_imports() -> None:
    """`make install` promises pyverbs (Debian's python3-pyverbs through the venv's system
    site-packages): the RDMA transport is built on these modules."""
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.mr
    import pyverbs.qp
    import pyverbs.wr

    assert REPORT.pyverbs_error is None
    for module, names in ((pyverbs.device, ["Context", "get_device_list"]), (pyverbs.cq, ["CQ", "CompChannel"]),
                          (pyverbs.qp, ["QP", "QPAttr", "QPInitAttr", "QPCap"]), (pyverbs.mr, ["MR"]),
                          (pyverbs.wr, ["SendWR", "SGE"])):
        for name in names:
            assert hasattr(module, name), (module.__name__, name)


# --- the set-up exchange ------------------------------------------------------------------------
def test_endpoint_round_trip_through_a_frame() -> None:
    ep = QpEndpoint(qpn=0xABCDE, psn=0x123456, lid=0, gid=ROCE.gid, mtu=5, rd_atomic=16)
    assert decode(QpEndpoint, unpack_meta(pack_meta(ep.to_meta())), "endpoint") == ep
    region = RemoteRegion(bytes(range(16)), addr=0x7F00_1234_5000, rkey=0xDEADBEEF, length=8 << 20)
    assert decode(RemoteRegion, unpack_meta(pack_meta(region.to_meta())), "region") == region


@pytest.mark.parametrize("change, words", [
    ({"qpn": 1 << 24}, "Expected `int` <= 16777215 - at `$.qpn`"),
    ({"psn": -1}, "Expected `int` >= 0 - at `$.psn`"),
    ({"lid": True}, "Expected `int`, got `bool` - at `$.lid`"),
    ({"gid": b"short"}, "Expected `bytes` of length >= 16 - at `$.gid`"),
    ({"gid": "fe80::1"}, "Expected `bytes`, got `str` - at `$.gid`"),
    ({"mtu": 9}, "Expected `int` <= 5 - at `$.mtu`"),
    ({"rd_atomic": 0}, "Expected `int` >= 1 - at `$.rd_atomic`"),
    ({"qpn": None}, "Expected `int`, got `null` - at `$.qpn`"),
])
def test_malformed_endpoint_is_a_protocol_error(change: dict, words: str) -> None:
    meta = QpEndpoint(5, 6, 7, bytes(16), 3, 4).to_meta() | change
    with pytest.raises(ProtocolError, match=re.escape(f"malformed RDMA_CONNECT reply from n1: {words}")):
        reply(QpEndpoint, meta, Msg.RDMA_CONNECT, "n1")


def test_malformed_region_is_a_protocol_error() -> None:
    good = RemoteRegion(bytes(16), 4096, 7, 100).to_meta()
    for bad, where in (({"id": b"x"}, "id"), ({"rkey": 1 << 32}, "rkey"), ({"addr": -5}, "addr"),
                       ({"length": "8M"}, "length")):
        with pytest.raises(ProtocolError, match=re.escape(f"- at `$.{where}`")):
            decode(RemoteRegion, good | bad, "RDMA_REGION reply from n1")


def test_gid_text_round_trip() -> None:
    from pyverbs.addr import GID

    for raw in (ROCE.gid, IB.gid, bytes(16)):
        text = gid_text(raw)
        assert GID(text).gid == text  # the form pyverbs reads and prints
        assert gid_bytes(text) == raw
    with pytest.raises(ValueError):
        gid_bytes("fe80:0000")


# --- queue pair attributes: built and read back through pyverbs, no device needed -----------------
def test_rtr_attributes_on_roce_route_by_gid() -> None:
    import pyverbs.enums as e

    from dlfs.transport.rdma import HOP_LIMIT, MIN_RNR_TIMER, rtr_attr

    remote = QpEndpoint(qpn=0x1234, psn=0xBEEF, lid=0, gid=bytes.fromhex("00" * 10 + "ffff0a000002"), mtu=3,
                        rd_atomic=8)
    attr = rtr_attr(ROCE, remote, responder_depth=16)
    assert attr.qp_state == e.IBV_QPS_RTR
    assert attr.dest_qp_num == 0x1234 and attr.rq_psn == 0xBEEF
    assert attr.path_mtu == 3  # the smaller of the two ports' MTUs
    assert attr.max_dest_rd_atomic == 16 and attr.min_rnr_timer == MIN_RNR_TIMER
    ah = attr.ah_attr
    assert ah.is_global == 1 and ah.port_num == 1
    assert ah.sgid_index == ROCE.gid_index and ah.hop_limit == HOP_LIMIT
    assert gid_bytes(str(ah.dgid)) == remote.gid


def test_rtr_attributes_on_infiniband_route_by_lid() -> None:
    from dlfs.transport.rdma import rtr_attr

    remote = QpEndpoint(qpn=77, psn=1, lid=42, gid=bytes(16), mtu=5, rd_atomic=4)
    attr = rtr_attr(IB, remote, responder_depth=4)
    assert attr.ah_attr.is_global == 0 and attr.ah_attr.dlid == 42
    assert attr.path_mtu == IB.mtu
    # A peer without a LID is reached through its GID even on InfiniBand.
    attr = rtr_attr(IB, msgspec.structs.replace(remote, lid=0, gid=IB.gid), responder_depth=4)
    assert attr.ah_attr.is_global == 1 and gid_bytes(str(attr.ah_attr.dgid)) == IB.gid


def test_init_rts_and_create_attributes() -> None:
    import pyverbs.enums as e

    from dlfs.transport.rdma import ACK_TIMEOUT, RETRY_CNT, RNR_RETRY, init_attr, qp_init_attr, rts_attr

    init = init_attr(ROCE, e.IBV_ACCESS_REMOTE_READ)
    assert init.qp_state == e.IBV_QPS_INIT and init.qp_access_flags == e.IBV_ACCESS_REMOTE_READ
    assert init.port_num == 1 and init.pkey_index == 0
    rts = rts_attr(ROCE, psn=0xABC, initiator_depth=8)
    assert rts.qp_state == e.IBV_QPS_RTS and rts.sq_psn == 0xABC and rts.max_rd_atomic == 8
    assert (rts.timeout, rts.retry_cnt, rts.rnr_retry) == (ACK_TIMEOUT, RETRY_CNT, RNR_RETRY)
    create = qp_init_attr(None, 128)
    assert create.qp_type == e.IBV_QPT_RC and create.sq_sig_all == 0
    assert create.max_send_wr == 128 and create.max_send_sge == 1


def test_read_chain_builds_signaled_rdma_reads() -> None:
    import itertools

    import pyverbs.enums as e

    from dlfs.transport.rdma import read_chain

    pieces = [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 4096)]
    wrs = read_chain(pieces, 0x10000, 0x11, 0x7F0000000000, 0x22, itertools.count(40))
    try:
        assert [w.wr_id for w in wrs] == [42, 41, 40]  # ids given back to front; posted front first
        for w in wrs:
            assert w.opcode == e.IBV_WR_RDMA_READ and w.num_sge == 1
            assert w.send_flags == e.IBV_SEND_SIGNALED
    finally:
        for w in wrs:
            w.close()


# --- the transport choice -----------------------------------------------------------------------
def test_auto_falls_back_to_tcp_here_with_the_reason() -> None:
    choice = choose_transport("auto", GIB, "the mount's cache")
    if REPORT.active_ports():
        pytest.skip("this machine has an active RDMA port")
    assert choice.name == "tcp" and choice.port is None
    assert choice.reason.startswith("auto: ")
    assert REPORT.error and REPORT.error in choice.reason
    if not Path("/sys/class/infiniband").exists():
        assert "/sys/class/infiniband does not exist" in choice.reason


def test_auto_without_a_verbs_device_does_not_import_pyverbs() -> None:
    # Every node, mount and ingest picks a transport: where the kernel has no verbs device, auto says so
    # from /sys alone (pyverbs costs 30 ms to import), with the same reason as the full probe.
    if Path("/sys/class/infiniband").exists():
        pytest.skip("this machine has RDMA devices")
    code = ("import sys; from dlfs.transport.verbs import choose_transport; c = choose_transport('auto', 1, 'x'); "
            "print(c.name, 'pyverbs' in sys.modules); print(c.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["tcp False", choose_transport("auto", GIB, "x").reason]
    assert REPORT.pyverbs_path is not None  # the full probe (dlfs doctor's) still imports it


def test_rdma_where_impossible_is_a_one_line_usage_error() -> None:
    if REPORT.active_ports():
        pytest.skip("this machine has an active RDMA port")
    with pytest.raises(TransportUnavailable) as info:
        choose_transport("rdma", GIB, "the mount's cache")
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2
    assert "\n" not in str(info.value) and str(info.value).startswith("transport = rdma, but no RDMA device")
    assert choose_transport("tcp", GIB, "x").reason == "transport = tcp"
    with pytest.raises(UsageError, match="use auto, tcp or rdma"):
        choose_transport("infiniband", GIB, "x")


def test_choice_follows_pyverbs_ports_and_memlock() -> None:
    active = VerbsReport(ports=[ROCE])
    chosen = choose_transport("auto", GIB, "the mount's cache", report=active, limits=UNLIMITED)
    assert chosen.name == "rdma" and chosen.port == ROCE and "mlx5_0 port 1 is active" in chosen.reason

    low = Memlock(8 << 20, 8 << 20, ipc_lock=False)
    fallback = choose_transport("auto", GIB, "the mount's cache", report=active, limits=low)
    assert fallback.name == "tcp"
    assert "RLIMIT_MEMLOCK is 8.4 MB" in fallback.reason and "the mount's cache registers" in fallback.reason
    assert "LimitMEMLOCK=infinity" in fallback.reason
    with pytest.raises(TransportUnavailable, match="RLIMIT_MEMLOCK"):
        choose_transport("rdma", GIB, "the mount's cache", report=active, limits=low)
    # CAP_IPC_LOCK lifts the limit for memory registration.
    assert choose_transport("auto", GIB, "x", report=active, limits=dataclasses.replace(low, ipc_lock=True)).name == "rdma"

    down = VerbsReport(ports=[dataclasses.replace(ROCE, state="Down", active=False)])
    why = choose_transport("auto", GIB, "x", report=down, limits=UNLIMITED).reason
    assert why == "auto: no active RDMA port (mlx5_0 port 1: Down)"
    no_pyverbs = VerbsReport(pyverbs_error="ModuleNotFoundError: No module named 'pyverbs'", ports=[ROCE])
    assert "pyverbs does not import" in choose_transport("auto", GIB, "x", report=no_pyverbs, limits=UNLIMITED).reason
    # A port asked for by number must be the active one.
    assert choose_transport("auto", GIB, "x", port=2, report=active, limits=UNLIMITED).name == "tcp"


def test_memlock_reads_the_real_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limits = verbs.memlock()
    assert limits.soft == (None if soft == resource.RLIM_INFINITY else soft)
    assert limits.hard == (None if hard == resource.RLIM_INFINITY else hard)
    assert limits.allows(0)
    assert Memlock(1 << 20, None, False).describe() == "1.0 MB (hard unlimited)"
    assert not Memlock(1 << 20, None, False).allows(2 << 20)


def test_cluster_file_transport_setting(tmp_path: Path) -> None:
    from dlfs.wire.auth import write_key

    write_key(tmp_path / "k")
    base = 'key_file = "k"\n[[node]]\nname = "a"\naddress = "127.0.0.1"\n'
    (tmp_path / "c.toml").write_text('transport = "rdma"\nrdma_device = "mlx5_0"\nrdma_port = 2\n' + base)
    cluster = parse_cluster_file(tmp_path / "c.toml")
    assert (cluster.transport, cluster.rdma_device, cluster.rdma_port) == ("rdma", "mlx5_0", 2)
    (tmp_path / "c.toml").write_text(base)
    assert parse_cluster_file(tmp_path / "c.toml").transport == "auto"
    for bad, words in (('transport = "ib"', "transport = 'ib' (use auto, tcp or rdma)"),
                       ("rdma_port = 0", "rdma_port = 0 (use a port number from 1 to 255)"),
                       ("rdma_device = 3", 'rdma_device = 3 (use a device name such as "mlx5_0")')):
        (tmp_path / "c.toml").write_text(bad + "\n" + base)
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_cluster_file(tmp_path / "c.toml")


async def test_rdma_that_fails_to_start_falls_back_or_fails_clearly(tmp_path: Path) -> None:
    """Chosen but unusable (here: the device cannot be opened, by real pyverbs): auto goes on over
    TCP with the reason, rdma is the one-line error."""
    from dlfs.client.transport import chunk_transport
    from dlfs.node import _open_responder
    from dlfs.transport.verbs import TransportChoice

    ghost = dataclasses.replace(ROCE, device="dlfs_no_such_device")
    if ghost.device in REPORT.devices:
        pytest.skip("a device has that name")
    auto = TransportChoice("rdma", "auto: pretended", ghost, "auto")
    async with running_node(tmp_path) as (spec, key):
        cluster = Cluster([spec], key, 1, "test", local=spec.name)
        async with trio.open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            async with chunk_transport(client, auto, 64 << 20) as used:
                assert used.name == "tcp" and client.rdma is None
                assert used.reason.startswith("auto: RDMA on dlfs_no_such_device port 1 failed to start: ")
                assert (await client.call(spec, "data", Msg.PING))[0]["node"] == "local"
            with pytest.raises(TransportUnavailable, match="transport = rdma, but dlfs_no_such_device port 1 cannot be used"):
                async with chunk_transport(client, dataclasses.replace(auto, setting="rdma"), 64 << 20):
                    pass
            nursery.cancel_scope.cancel()
    store = ChunkStore(tmp_path / "store")
    responder, choice = _open_responder(auto, store)
    assert responder is None and choice.name == "tcp" and "failed to start" in choice.reason
    with pytest.raises(TransportUnavailable):
        _open_responder(dataclasses.replace(auto, setting="rdma"), store)
    store.close()


# --- registered memory --------------------------------------------------------------------------
class _Registration:
    """Stands in for an MR where there is no device: the arena's own logic is what is tested."""

    def __init__(self, addr: int, length: int) -> None:
        self.addr, self.length, self.lkey, self.rkey = addr, length, 0x51, 0x52
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_arena_blocks_are_reused_once_nothing_refers_to_them() -> None:
    from dlfs.transport import rdma

    made: list[_Registration] = []

    def register(addr: int, length: int) -> _Registration:
        made.append(_Registration(addr, length))
        return made[-1]

    arena = rdma.Arena(register, limit=rdma.SEGMENT)
    first = arena.alloc(3 << 20)
    assert first is not None and len(made) == 1 and made[0].length == rdma.SEGMENT
    view = first.view()
    assert len(view) == 3 << 20 and first.lkey == 0x51
    # The block is the memory at its address: an RDMA READ landing there is what the view shows.
    ctypes.memmove(first.addr, b"chunk bytes", 11)
    assert bytes(view[:11]) == b"chunk bytes"
    piece = view[6:11]  # what the cache keeps: a slice
    del first, view
    gc.collect()
    assert bytes(piece) == b"bytes" and arena.in_use >= 3 << 20  # the slice keeps the block
    del piece
    gc.collect()
    assert arena.in_use == 0
    # Filling the arena: then alloc says no (the caller reads over TCP) rather than growing past its limit.
    blocks = [arena.alloc(32 << 20) for _ in range(8)]
    assert all(b is not None for b in blocks) and arena.alloc(32 << 20) is None
    assert arena.registered == rdma.SEGMENT and len(made) == 1
    blocks.pop()
    gc.collect()
    again = arena.alloc(32 << 20)
    assert again is not None
    arena.close()
    assert made[0].closed


def test_cache_slabs_are_registered_one_at_a_time_as_reads_land_in_them() -> None:
    # RDMA READs land in the mount's shared arena (dlfs.direct maps it): each slab is registered the
    # first time a read lands there, once, and a range that is not inside one slab is not taken.
    import mmap

    from dlfs.transport import rdma

    made: list[_Registration] = []

    def register(addr: int, length: int) -> _Registration:
        made.append(_Registration(addr, length))
        return made[-1]

    slab = 1 << 20
    arena = mmap.mmap(-1, 4 * slab)
    slabs = rdma.SlabRegistry(register, arena, slab)
    view = memoryview(arena)
    base = rdma.buffer_address(view)
    assert slabs.slab_of(base + slab + 100, 1000) == 1
    assert slabs.slab_of(base + slab - 10, 20) is None  # straddles two slabs
    assert slabs.slab_of(base + 4 * slab, 1) is None and slabs.slab_of(base - 1, 1) is None
    assert slabs.lkey(2) is None
    assert slabs.add(2) == 0x51 and slabs.add(2) == 0x51
    assert [(r.addr, r.length) for r in made] == [(base + 2 * slab, slab)]
    assert rdma.buffer_address(view[2 * slab :]) == base + 2 * slab  # a slab's view is where it was registered
    slabs.close()
    assert made[0].closed and slabs.lkey(2) is None
    del view
    arena.close()


def test_block_sizes_come_from_a_small_set() -> None:
    from dlfs.transport.rdma import block_size

    sizes = {block_size(n) for n in range(1, 64 << 20, 4099)}
    assert len(sizes) < 120
    for n in (1, 4096, 4097, 1 << 20, (1 << 20) + 1, 123_456_789):
        assert n <= block_size(n) <= max(4096, n + n // 8)


def _store_with_chunks(root: Path, n: int) -> tuple[ChunkStore, list[tuple[bytes, bytes]]]:
    store = ChunkStore(root)
    chunks = []
    for seed in range(n):
        cid, data, _, _ = make_chunk(seed, records=2, size=30_000)
        store.put(cid, data)
        chunks.append((cid, data))
    return store, chunks


async def test_chunk_registry_maps_files_and_keeps_to_its_budget(tmp_path: Path) -> None:
    """The data daemon's registrations over real chunk files (mapped read-only, by address); only
    the memory registration itself is stood in for."""
    from dlfs.data.rdmaserve import ChunkRegistry

    store, chunks = _store_with_chunks(tmp_path, 3)
    size = len(chunks[0][1])
    made: list[_Registration] = []

    def register(addr: int, length: int) -> _Registration:
        made.append(_Registration(addr, length))
        return made[-1]

    registry = ChunkRegistry(store, register, budget=2 * size + 100)
    (a, a_bytes), (b, b_bytes), (c, _) = chunks
    ra = await registry.acquire(a)
    region = ra.region()
    assert region.length == len(a_bytes) and region.rkey == 0x52
    # What a remote READ at region.addr reads: the chunk file's bytes.
    assert ctypes.string_at(region.addr, region.length) == a_bytes
    rb = await registry.acquire(b)
    assert ctypes.string_at(rb.region().addr, 64) == b_bytes[:64]
    assert registry.pinned == len(a_bytes) + len(b_bytes)
    # Both held: no room for a third, and the refusal is an error the client answers with TCP.
    with pytest.raises(DlfsError, match="budget"):
        await registry.acquire(c)
    assert registry.pinned == len(a_bytes) + len(b_bytes)
    # Released, a registration stays for the next reader until its room is needed.
    registry.release(ra)
    assert not made[0].closed
    assert (await registry.acquire(a)) is ra
    registry.release(ra)
    rc = await registry.acquire(c)
    assert made[0].closed and registry.pinned == len(b_bytes) + rc.length
    # A deleted chunk: held, its mapping lives until released, but new readers do not get it.
    registry.invalidate(b)
    assert not made[1].closed
    store.delete(b)
    with pytest.raises(NotFound):
        await registry.acquire(b)
    registry.release(rb)
    assert made[1].closed
    with pytest.raises(NotFound):
        await registry.acquire(bytes(16))
    registry.close()
    assert all(m.closed for m in made) and registry.pinned == 0
    store.close()


# --- a data daemon without RDMA, and failover ---------------------------------------------------
async def test_daemon_without_rdma_refuses_set_up_clearly(tmp_path: Path) -> None:
    async with node_with_clients(tmp_path) as (_, data):
        status, _ = await data.call(Msg.STATUS)
        if status["transport"] == "rdma":
            pytest.skip("this machine's node serves RDMA")
        assert status["transport"] == "tcp" and status["transport_reason"].startswith("auto: ")
        ep = QpEndpoint(1, 2, 0, bytes(16), 5, 16)
        with pytest.raises(UsageError, match="node local does not serve RDMA"):
            await data.call(Msg.RDMA_CONNECT, ep.to_meta())
        with pytest.raises(UsageError, match="does not serve RDMA"):
            await data.call(Msg.RDMA_REGION, {"ids": [bytes(16)]})
        # The connection is fine afterwards.
        assert (await data.call(Msg.PING))[0] == {"node": "local"}


async def test_per_connection_state_ends_with_its_connection() -> None:
    """What the data daemon's RDMA handlers rely on: each connection has its own Peer, and its
    clean-ups run when that connection ends (its queue pair and registrations go with it)."""
    from dlfs.transport.base import Address
    from dlfs.wire.rpc import Reply, Route, Service, connect, current_peer, serve

    closed: list[str] = []

    class Who(msgspec.Struct):
        who: str

    class Holder(Service):
        name = "data"

        def __init__(self) -> None:
            super().__init__(b"k" * 32, "n1")
            self.handlers[Msg.RDMA_CONNECT] = Route(Who, self.hold)

        async def hold(self, req: Who, data: bytearray) -> Reply:
            peer = current_peer()
            peer.state["n"] = peer.state.get("n", 0) + 1
            if peer.state["n"] == 1:
                peer.on_close(lambda: closed.append(req.who))
            return {"n": peer.state["n"]}, b""

    async with trio.open_nursery() as nursery:
        [address] = await nursery.start(serve, Holder(), Address("127.0.0.1", 0))
        async with connect(address, b"k" * 32, "data") as a:
            async with connect(address, b"k" * 32, "data") as b:
                assert (await a.call(Msg.RDMA_CONNECT, {"who": "a"}))[0]["n"] == 1
                assert (await a.call(Msg.RDMA_CONNECT, {"who": "a"}))[0]["n"] == 2
                assert (await b.call(Msg.RDMA_CONNECT, {"who": "b"}))[0]["n"] == 1
            with trio.fail_after(5):
                while closed != ["b"]:
                    await trio.sleep(0.01)
        with trio.fail_after(5):
            while closed != ["b", "a"]:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


class ErrorStateRdma:
    """A test double of the RDMA path whose queue pair is in the error state: every read fails as
    a flushed work request does. The client must not let that reach the reader."""

    name = "rdma"

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, int, int]] = []

    async def read_range(self, spec: NodeSpec, cid: bytes, offset: int, length: int,
                         timeout: float, into: memoryview | None = None) -> memoryview:
        self.calls.append((spec.name, cid, offset, length))
        await trio.lowlevel.checkpoint()
        raise RdmaFailure(f"RDMA READ from {spec.name} failed: work request completed with status "
                          "WR flush error (vendor error 0x0); queue pair Error")

    def stats(self) -> dict[str, int]:
        return {"rdma_reads": 0}


async def _committed_dataset(tmp_path: Path, meta_conn, data_conn, n_chunks: int = 3) -> tuple[Index, list[bytes]]:
    from test_services import ingest

    chunks = []
    payloads: list[bytes] = []
    for seed in range(n_chunks):
        cid, data, recs, raw = make_chunk(100 + seed, records=5, size=40_000)
        await put_chunk(data_conn, cid, data)
        chunks.append((cid, data, recs))
        payloads += raw
    index_bytes = make_index(chunks)
    await ingest(meta_conn, "ds", index_bytes, [c for c, _, _ in chunks])
    path = tmp_path / "ds.idx"
    path.write_bytes(index_bytes)
    return Index(path), payloads


async def test_rdma_path_in_error_state_fails_over_to_tcp(tmp_path: Path) -> None:
    async with node_with_clients(tmp_path / "node") as (meta_conn, data_conn):
        index, payloads = await _committed_dataset(tmp_path, meta_conn, data_conn)
        async with running_cluster_client(tmp_path / "node") as client:
            rdma = ErrorStateRdma()
            client.rdma = rdma
            cache = ChunkCache(index, client, capacity=64 << 20, readahead=1 << 20)
            order = list(range(len(payloads)))
            random.Random(5).shuffle(order)
            for ext in order:
                assert bytes(await cache.record(ext)) == payloads[ext]
            # Every fetch tried RDMA first, and every one was served over TCP instead.
            assert rdma.calls and cache.fetcher.fetches == len(rdma.calls) == client.tcp_fallbacks
            assert cache.stats()["tcp_fallbacks"] == client.tcp_fallbacks
            assert not client.health  # an RDMA failure does not make the node suspect
        index.close()


async def test_rdma_path_unreachable_marks_the_node_suspect(tmp_path: Path) -> None:
    class Unreachable:
        name = "rdma"

        async def read_range(self, spec: NodeSpec, cid: bytes, offset: int, length: int, timeout: float,
                             into: memoryview | None = None) -> bytes:
            from dlfs.errors import Unreachable as Gone

            raise Gone(f"cannot reach the data daemon of {spec.name}")

        def stats(self) -> dict[str, int]:
            return {}

    async with running_node(tmp_path) as (spec, key):
        cluster = Cluster([spec], key, 1, "test", local=spec.name)
        async with trio.open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            client.rdma = Unreachable()
            from dlfs.errors import Unreachable as Gone

            with pytest.raises(Gone):
                await client.read_from(spec, bytes(16), 0, 10)
            assert client.failing(spec.name)
            nursery.cancel_scope.cancel()


async def test_completions_in_error_break_the_link_and_fail_its_read() -> None:
    """The link's completion bookkeeping with pyverbs' own work completions (no device needed)."""
    import pyverbs.enums as e
    from pyverbs.cq import WC

    from dlfs.client.rdmareads import Link, _Read
    from dlfs.transport.rdma import Block

    class Conn:
        closed = None

    link = Link(None, "n1", Conn(), None, None)  # type: ignore[arg-type]
    block = Block(0, 0, bytearray(16), 16)
    ok, bad = _Read(block, b"a" * 16, 2), _Read(block, b"b" * 16, 2)
    for wr_id, read in ((1, ok), (2, ok), (3, bad), (4, bad)):
        link.reads[wr_id] = read
    link.busy[ok.cid] = link.busy[bad.cid] = 1  # as Link.read counts them
    await link.slots.acquire()  # as posting does, one slot per work request
    await link.slots.acquire()
    await link.slots.acquire()
    await link.slots.acquire()
    link.completed(WC(wr_id=1, status=e.IBV_WC_SUCCESS))
    assert not ok.done.is_set()
    link.completed(WC(wr_id=2, status=e.IBV_WC_SUCCESS))
    assert ok.done.is_set() and ok.error is None and link.usable()
    link.completed(WC(wr_id=3, status=e.IBV_WC_REM_ACCESS_ERR))
    link.completed(WC(wr_id=4, status=e.IBV_WC_WR_FLUSH_ERR))
    assert bad.done.is_set() and "remote access error" in (bad.error or "")
    assert not link.usable() and "remote access error" in (link.broken or "")
    assert link.slots.value == 128 and not link.reads and not link.busy
    link.completed(WC(wr_id=99, status=e.IBV_WC_SUCCESS))  # unknown (its link was torn down): ignored


# --- the whole read path over a real device (skips without one) ---------------------------------
def _big_chunk() -> tuple[bytes, bytes]:
    """A 4.5 MB chunk of three incompressible records."""
    from dlfs.format.chunk import ChunkWriter

    rng = random.Random(7)
    w = ChunkWriter(8 << 20)
    for _ in range(3):
        w.add(rng.randbytes(1_500_000), compress=False)
    cid, view = w.finish()
    return cid, bytes(view)


def test_big_chunk_helper() -> None:
    cid, data = _big_chunk()
    assert len(data) > 4_500_000 and len(cid) == 16


def _rdma_cluster(spec: NodeSpec, key: bytes) -> Cluster:
    return Cluster([spec], key, 1, "test", local=spec.name, transport="rdma")


@needs_rdma
async def test_read_path_over_rdma_every_byte_and_a_queue_pair_error(tmp_path: Path) -> None:
    from dlfs.client.rdmareads import BACKOFF_MIN
    from dlfs.client.transport import choose_for, chunk_transport
    from dlfs.node import NodeOptions, run_node
    from dlfs.transport.rdma import break_qp
    from dlfs.wire.rpc import connect

    home = tmp_path / "node"
    async with trio.open_nursery() as nursery:
        spec = await nursery.start(run_node, NodeOptions(home=home, transport="rdma"))
        from dlfs.config import ensure_home_key

        key = ensure_home_key(home)
        async with connect(spec.meta, key, "meta") as meta_conn, connect(spec.data, key, "data") as data_conn:
            assert (await data_conn.call(Msg.STATUS))[0]["transport"] == "rdma"
            index, payloads = await _committed_dataset(tmp_path, meta_conn, data_conn, n_chunks=4)
            big_id, big = _big_chunk()  # several work requests per read
            await put_chunk(data_conn, big_id, big)
        cluster = _rdma_cluster(spec, key)
        arena = 64 << 20
        async with trio.open_nursery() as client_nursery:
            client = ClusterClient(cluster, client_nursery)
            async with chunk_transport(client, choose_for(cluster, arena, "test"), arena) as choice:
                assert choice.name == "rdma" and client.rdma is not None
                cache = ChunkCache(index, client, capacity=32 << 20, readahead=256 << 10)
                client.rdma.attach_arena(cache.slabs.arena, cache.slab_size)
                for ext in random.Random(1).sample(range(len(payloads)), len(payloads)):
                    assert bytes(await cache.record(ext)) == payloads[ext]
                # The READs landed in the shared arena's slabs, where dlfs.direct clients map them.
                assert all(cache.where(ext) is not None for ext in range(len(payloads)))
                rng = random.Random(2)
                for _ in range(50):
                    off = rng.randrange(len(big))
                    length = rng.randrange(1, 3 << 20)
                    got = await client.read_from(spec, big_id, off, length)
                    assert bytes(got) == big[off : off + length]  # shorter at the chunk's end, as TCP
                stats = client.rdma.stats()
                assert stats["rdma_reads"] >= 50 and client.tcp_fallbacks == 0
                # A queue pair in the error state: the read still returns the right bytes (TCP) ...
                link = client.rdma.links[spec.name]  # type: ignore[attr-defined]
                break_qp(link.qp)
                assert bytes(await client.read_from(spec, big_id, 10, 2 << 20)) == big[10 : 10 + (2 << 20)]
                assert client.tcp_fallbacks == 1 and client.rdma.stats()["rdma_failures"] == 1
                # ... and once its back-off has passed, RDMA connects again and serves.
                await trio.sleep(BACKOFF_MIN + 0.2)
                before = client.rdma.stats()["rdma_reads"]
                assert bytes(await client.read_from(spec, big_id, 0, len(big))) == big
                assert client.rdma.stats()["rdma_reads"] == before + 1 and client.tcp_fallbacks == 1
                assert client.rdma.links[spec.name] is not link  # type: ignore[attr-defined]
            client_nursery.cancel_scope.cancel()
        index.close()
        nursery.cancel_scope.cancel()


# --- the --transport option -----------------------------------------------------------------------
def test_transport_option_on_the_commands_that_move_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    from dlfs.cli import main

    for name in ("node", "mount", "ingest", "verify", "repair", "bench", "doctor"):
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        assert "--transport {auto,tcp,rdma}" in capsys.readouterr().out, name
    with pytest.raises(SystemExit) as info:
        main(["node", "--transport", "infiniband"])
    assert info.value.code == 2 and "invalid choice: 'infiniband'" in capsys.readouterr().err


@needs_fuse
@pytest.mark.timeout(90)
def test_transport_rdma_where_there_is_none_fails_in_one_line(node: Node, tmp_path: Path) -> None:
    if REPORT.active_ports():
        pytest.skip("this machine has an active RDMA port")
    from conftest import one_line_error

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    want = "dlfs: error: transport = rdma, but no RDMA device"
    for args in (["ingest", src, "--name", "x", "--transport", "rdma"], ["verify", "--all", "--transport=rdma"]):
        proc = node.run(*args, check=False)
        assert one_line_error(proc, 2).startswith(want), proc.stderr
    node.ingest(src, "x")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = node.run("mount", "x", mnt, "--transport", "rdma", check=False)
    assert one_line_error(proc, 2).startswith(want), proc.stderr
    assert not os.path.ismount(mnt)
    proc = run_dlfs(tmp_path / "other", "node", "--transport", "rdma", check=False, timeout=30)
    assert one_line_error(proc, 2).startswith(want), proc.stderr
    # auto: TCP, and both the node and the mount say why.
    assert "data daemon: chunks served over TCP (auto: no RDMA device" in node.node_log()
    node.mount("x", mnt)
    assert (mnt / "a.bin").read_bytes() == b"a" * 1000
    node.umount(mnt)
    assert "mount of x: chunks travel over TCP (auto: no RDMA device" in node.mount_log("x").read_text()
