"""Service tests: a real one-node cluster (both daemons) in-process on localhost, over real sockets."""

from __future__ import annotations

import io
import logging
import os
import random
import socket
import stat
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
import xxhash

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster, NodeSpec, ensure_home_key
from dlfs.data.service import DataService
from dlfs.data.store import ChunkStore
from dlfs.errors import AuthError, Conflict, CorruptData, DlfsError, NotFound, ProtocolError, Unreachable
from dlfs.format.chunk import ChunkWriter, Record, decode_record
from dlfs.format.index import IndexWriter
from dlfs.meta.engine_sqlite import EmbeddedEngine
from dlfs.meta.service import ABORT_RETRY, MetaService
from dlfs.meta.store import MetaStore
from dlfs.node import NodeOptions, run_node
from dlfs.transport.base import Address
from dlfs.wire import auth
from dlfs.wire.auth import server_handshake
from dlfs.wire.messages import Empty, request, to_meta
from dlfs.wire.protocol import MAGIC, MAX_DATA, Frame, FrameStream, Msg
from dlfs.wire.rpc import Connection, Reply, Route, Service, connect, serve


@asynccontextmanager
async def running_node(home: Path) -> AsyncIterator[tuple[NodeSpec, bytes]]:
    """Both daemons of a one-node cluster on ephemeral localhost ports, stopped on exit."""
    async with trio.open_nursery() as n:
        spec = await n.start(run_node, NodeOptions(home=home))
        yield spec, ensure_home_key(home)
        n.cancel_scope.cancel()


@asynccontextmanager
async def node_with_clients(home: Path) -> AsyncIterator[tuple[Connection, Connection]]:
    """A running node and a connection to each of its daemons: (meta, data)."""
    async with (running_node(home) as (spec, key), connect(spec.meta, key, "meta") as mconn,
                connect(spec.data, key, "data") as dconn):
        yield mconn, dconn


async def call_handler(svc: Service, msg: Msg, meta: dict, data: bytes = b"") -> dict:
    """A service's handler called directly, its request decoded into its schema first as the server does."""
    route = svc.handlers[msg]
    out, _ = await route.handler(request(route.kind, meta, msg), bytearray(data))
    return to_meta(out)


def make_chunk(seed: int, records: int = 4, size: int = 20_000) -> tuple[bytes, bytes, list[Record], list[bytes]]:
    """A real chunk: (id, bytes, records, raw payloads)."""
    rng = random.Random(seed)
    w = ChunkWriter(1 << 20)
    payloads = [rng.randbytes(size) if i % 2 else bytes([i]) * size for i in range(records)]
    recs = [w.add(p, compress=True) for p in payloads]
    cid, view = w.finish()
    return cid, bytes(view), recs, payloads


def make_index(chunks: list[tuple[bytes, bytes, list[Record]]]) -> bytes:
    """Index bytes for a root directory holding one file per record of the given chunks."""
    n_files = sum(len(recs) for _, _, recs in chunks)
    w = IndexWriter(1 + n_files, 1 << 20, created_ns=1)
    entries = []
    ino = 2
    for c, (cid, data, recs) in enumerate(chunks):
        first = w.extents_count()
        for rec in recs:
            ext = w.add_extent(c, rec)
            w.set_inode(ino, stat.S_IFREG | 0o644, 0, 0, 1, rec.raw_len, 0, ext, 1, 1)
            entries.append((f"f{ino}".encode(), ino))
            ino += 1
        w.add_chunk(cid, len(data), first, len(recs))
    ref, count = w.add_dirents(entries)
    w.set_inode(1, stat.S_IFDIR | 0o755, 0, 0, 2, 0, 0, ref, count, 1)
    out = io.BytesIO()
    w.write(out)
    return out.getvalue()


async def put_chunk(data_conn: Connection, cid: bytes, data: bytes) -> bool:
    meta, _ = await data_conn.call(Msg.PUT_CHUNK, {"id": cid}, data)
    return bool(meta["stored"])


async def list_chunks(data_conn: Connection) -> list[bytes]:
    meta, raw = await data_conn.call(Msg.LIST_CHUNKS)
    ids = [bytes(raw[i : i + 16]) for i in range(0, len(raw), 16)]
    assert meta["count"] == len(ids)
    return ids


async def ingest(meta_conn: Connection, name: str, index: bytes, pins: list[bytes]) -> dict:
    """Begin, pin, upload the index in two pieces, commit; returns the commit's answer."""
    session = await begin(meta_conn, name, pins)
    return await commit(meta_conn, session, index)


async def begin(meta_conn: Connection, name: str, pins: list[bytes]) -> str:
    meta, _ = await meta_conn.call(Msg.BEGIN_INGEST, {"name": name})
    session = meta["session"]
    await meta_conn.call(Msg.PIN_CHUNKS, {"session": session, "ids": pins})
    return session


async def commit(meta_conn: Connection, session: str, index: bytes) -> dict:
    half = len(index) // 2
    await meta_conn.call(Msg.PUT_INDEX, {"session": session, "offset": 0}, index[:half])
    await meta_conn.call(Msg.PUT_INDEX, {"session": session, "offset": half}, index[half:])
    meta, _ = await meta_conn.call(
        Msg.COMMIT, {"session": session, "size": len(index), "checksum": xxhash.xxh3_64_intdigest(index)}
    )
    return meta


async def datasets(meta_conn: Connection) -> list[tuple[str, int]]:
    meta, _ = await meta_conn.call(Msg.LIST_DATASETS)
    return [(d["name"], d["version"]) for d in meta["datasets"]]


@pytest.mark.timeout(20)
async def test_ping_both_daemons(tmp_path: Path) -> None:
    async with running_node(tmp_path) as (spec, key):
        async with connect(spec.data, key, "data") as data, connect(spec.meta, key, "meta") as meta:
            assert data.node == meta.node == "local"
            assert (await data.call(Msg.PING))[0] == {"node": "local"}
            assert (await meta.call(Msg.PING))[0] == {"node": "local"}
            status, _ = await data.call(Msg.STATUS)
            assert status["chunks"] == 0 and status["root"] == str(tmp_path / "data")
        # The node published where it listens, for the CLI on this machine.
        assert (tmp_path / "run" / "node.json").is_file()


@pytest.mark.timeout(20)
async def test_put_chunk_then_read_ranges(tmp_path: Path) -> None:
    cid, data, recs, payloads = make_chunk(1)
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        assert await put_chunk(conn, cid, data) is True
        assert await put_chunk(conn, cid, data) is False  # already stored
        on_disk = tmp_path / "data" / "chunks" / cid.hex()[:2] / cid.hex()
        assert on_disk.read_bytes() == data
        for rec, payload in zip(recs, payloads):
            _, got = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": rec.offset, "length": rec.stored_len})
            assert bytes(got) == data[rec.offset : rec.offset + rec.stored_len]
            assert bytes(decode_record(got, rec, "test")) == payload
        # A range past the end comes back short (the reader's checksums catch it).
        _, tail = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": len(data) - 10, "length": 100})
        assert bytes(tail) == data[-10:]
        status, _ = await conn.call(Msg.STATUS)
        assert (status["chunks"], status["bytes"]) == (1, len(data))


@pytest.mark.timeout(20)
async def test_put_chunk_refuses_bad_bytes(tmp_path: Path) -> None:
    cid, data, _, _ = make_chunk(2)
    other_cid, _, _, _ = make_chunk(3)
    flipped = bytearray(data)
    flipped[-5] ^= 1
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        with pytest.raises(CorruptData, match="does not match its id"):
            await put_chunk(conn, other_cid, data)
        # Damage is named where it lies: the last record's bytes.
        with pytest.raises(CorruptData, match=f"chunk {cid.hex()}: record 3: checksum mismatch"):
            await put_chunk(conn, cid, bytes(flipped))
        with pytest.raises(ProtocolError, match=r"bad PUT_CHUNK request: Expected `bytes` of length >= 16 - at `\$.id`"):
            await put_chunk(conn, b"short", data)
        assert await list_chunks(conn) == []
        assert os.listdir(tmp_path / "data" / "tmp") == []
        with pytest.raises(NotFound):
            await conn.call(Msg.READ_RANGE, {"id": other_cid, "offset": 0, "length": 10})
        # The connection still works after refused requests.
        assert await put_chunk(conn, cid, data) is True


@pytest.mark.timeout(20)
async def test_has_list_delete_chunks(tmp_path: Path) -> None:
    chunks = [make_chunk(10 + i, records=2, size=3000) for i in range(3)]
    ids = [c[0] for c in chunks]
    unknown = b"\x42" * 16
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        meta, _ = await conn.call(Msg.HAS_CHUNKS, {"ids": ids + [unknown]})
        assert sorted(meta["missing"]) == sorted(ids + [unknown])
        for cid, data, _, _ in chunks:
            await put_chunk(conn, cid, data)
        meta, _ = await conn.call(Msg.HAS_CHUNKS, {"ids": ids + [unknown]})
        assert meta["missing"] == [unknown]
        assert await list_chunks(conn) == sorted(ids)
        meta, _ = await conn.call(Msg.DELETE_CHUNKS, {"ids": [ids[1], unknown]})
        assert meta["deleted"] == 1
        assert await list_chunks(conn) == sorted([ids[0], ids[2]])
        meta, _ = await conn.call(Msg.HAS_CHUNKS, {"ids": ids})
        assert meta["missing"] == [ids[1]]
        with pytest.raises(NotFound, match=f"chunk {ids[1].hex()} is not on this node"):
            await conn.call(Msg.READ_RANGE, {"id": ids[1], "offset": 0, "length": 10})
        meta, _ = await conn.call(Msg.VERIFY_CHUNKS, {"ids": ids})
        assert meta["bad"] == {ids[1].hex(): "missing"}
        status, _ = await conn.call(Msg.STATUS)
        assert (status["chunks"], status["bytes"]) == (2, len(chunks[0][1]) + len(chunks[2][1]))


@pytest.mark.timeout(20)
async def test_read_range_of_unknown_chunk(tmp_path: Path) -> None:
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        with pytest.raises(NotFound, match="is not on this node"):
            await conn.call(Msg.READ_RANGE, {"id": b"\x01" * 16, "offset": 0, "length": 100})
        with pytest.raises(ProtocolError, match="bad READ_RANGE request: Object missing required field `offset`"):
            await conn.call(Msg.READ_RANGE, {"id": b"\x01" * 16})  # no offset or length
        assert (await conn.call(Msg.PING))[0]["node"] == "local"


@pytest.mark.timeout(20)
async def test_pipelined_reads_on_one_connection(tmp_path: Path) -> None:
    cid, data, _, _ = make_chunk(4, records=8, size=50_000)
    rng = random.Random(5)
    ranges = [(rng.randrange(len(data) - 1), rng.randrange(1, 60_000)) for _ in range(50)]
    results: dict[int, bytes] = {}
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        await put_chunk(conn, cid, data)

        async def read(i: int, off: int, length: int) -> None:
            _, got = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": off, "length": length})
            results[i] = bytes(got)

        async with trio.open_nursery() as n:
            for i, (off, length) in enumerate(ranges):
                n.start_soon(read, i, off, length)
    assert len(results) == 50
    for i, (off, length) in enumerate(ranges):
        assert results[i] == data[off : off + length], f"call {i} got another call's bytes"


@pytest.mark.timeout(20)
async def test_ingest_commit_and_catalog(tmp_path: Path) -> None:
    cid, data, recs, _ = make_chunk(6)
    index = make_index([(cid, data, recs)])
    async with node_with_clients(tmp_path) as (mconn, dconn):
        session = await begin(mconn, "imagenet-mini", [cid])
        assert await put_chunk(dconn, cid, data)
        info = await commit(mconn, session, index)
        assert (info["name"], info["version"]) == ("imagenet-mini", 1)
        assert info["files"] == len(recs) and info["bytes"] == sum(r.raw_len for r in recs)
        assert info["chunks"] == 1 and info["index_size"] == len(index)
        assert await datasets(mconn) == [("imagenet-mini", 1)]
        got, _ = await mconn.call(Msg.GET_DATASET, {"name": "imagenet-mini"})
        assert got == info
        _, piece = await mconn.call(Msg.READ_INDEX, {"name": "imagenet-mini", "version": 1, "offset": 0,
                                                      "length": len(index) + 100})
        assert bytes(piece) == index
        # The session is spent: committing it again is refused.
        with pytest.raises(Conflict, match="unknown"):
            await commit(mconn, session, index)
        # The next ingest of the same name is version 2; version 1 stays readable.
        info2 = await ingest(mconn, "imagenet-mini", index, [cid])
        assert info2["version"] == 2
        assert await datasets(mconn) == [("imagenet-mini", 1), ("imagenet-mini", 2)]
        got, _ = await mconn.call(Msg.GET_DATASET, {"name": "imagenet-mini", "version": 1})
        assert got == info
        with pytest.raises(NotFound, match="has no version 3"):
            await mconn.call(Msg.GET_DATASET, {"name": "imagenet-mini", "version": 3})
    # The catalog outlives the daemon.
    async with running_node(tmp_path) as (spec, key), connect(spec.meta, key, "meta") as mconn:
        assert await datasets(mconn) == [("imagenet-mini", 1), ("imagenet-mini", 2)]


@pytest.mark.timeout(20)
async def test_commit_refuses_missing_or_unpinned_chunks(tmp_path: Path) -> None:
    cid, data, recs, _ = make_chunk(7)
    index = make_index([(cid, data, recs)])
    async with node_with_clients(tmp_path) as (mconn, dconn):
        session = await begin(mconn, "ds", [cid])  # pinned, but never stored
        with pytest.raises(Conflict, match=f"chunk {cid.hex()} on 0 nodes"):
            await commit(mconn, session, index)
        assert await datasets(mconn) == []
        with pytest.raises(NotFound, match="no dataset named 'ds'"):
            await mconn.call(Msg.GET_DATASET, {"name": "ds"})
        assert os.listdir(tmp_path / "meta" / "index") == []
        # Stored but never pinned: a collection could have taken it, so that is refused too.
        await put_chunk(dconn, cid, data)
        session = await begin(mconn, "ds", [])
        with pytest.raises(Conflict, match="never pinned"):
            await commit(mconn, session, index)
        # An index that is not the one the client meant.
        session = await begin(mconn, "ds", [cid])
        await mconn.call(Msg.PUT_INDEX, {"session": session, "offset": 0}, index)
        with pytest.raises(CorruptData, match="does not match the client's checksum"):
            await mconn.call(Msg.COMMIT, {"session": session, "size": len(index),
                                          "checksum": xxhash.xxh3_64_intdigest(index) ^ 1})
        with pytest.raises(CorruptData, match=f"has {len(index)} bytes, the client sent {len(index) + 1}"):
            await mconn.call(Msg.COMMIT, {"session": session, "size": len(index) + 1,
                                          "checksum": xxhash.xxh3_64_intdigest(index)})
        assert await datasets(mconn) == []
        with pytest.raises(Conflict, match="unknown"):
            await mconn.call(Msg.PIN_CHUNKS, {"session": "nope", "ids": []})
        # Dataset names become paths on the metadata daemon: nothing may climb out.
        for bad in ("../escape", "a/b", "", ".hidden", "a\n"):
            with pytest.raises(ProtocolError, match=r"bad BEGIN_INGEST request: Expected `str` matching regex .* - at `\$.name`"):
                await mconn.call(Msg.BEGIN_INGEST, {"name": bad})


@pytest.mark.timeout(20)
async def test_remove_frees_chunks_but_not_pinned_or_shared_ones(tmp_path: Path) -> None:
    shared = make_chunk(20)
    only_b = make_chunk(21)
    pinned = make_chunk(22)
    orphan = make_chunk(23)
    async with node_with_clients(tmp_path) as (mconn, dconn):
        for cid, data, _, _ in (shared, only_b, pinned, orphan):
            await put_chunk(dconn, cid, data)
        await ingest(mconn, "a", make_index([shared[:3]]), [shared[0]])
        await ingest(mconn, "b", make_index([shared[:3], only_b[:3]]), [shared[0], only_b[0]])
        # An ingest still uploading holds its chunk with a pin only.
        open_session = await begin(mconn, "c", [pinned[0]])

        meta, _ = await mconn.call(Msg.REMOVE, {"name": "a"})
        assert [(v["name"], v["version"]) for v in meta["removed"]] == [("a", 1)]
        assert meta["freed_chunks"] == 1  # the orphan; the rest are held
        assert sorted(await list_chunks(dconn)) == sorted([shared[0], only_b[0], pinned[0]])
        assert await datasets(mconn) == [("b", 1)]
        with pytest.raises(NotFound):
            await mconn.call(Msg.GET_DATASET, {"name": "a"})

        meta, _ = await mconn.call(Msg.REMOVE, {"name": "b"})
        assert meta["freed_chunks"] == 2
        assert await list_chunks(dconn) == [pinned[0]]  # pinned by the open ingest

        # The open ingest still commits with the chunk it pinned.
        info = await commit(mconn, open_session, make_index([pinned[:3]]))
        assert info["version"] == 1
        meta, _ = await mconn.call(Msg.REMOVE, {"name": "c"})
        assert meta["freed_chunks"] == 1
        assert await list_chunks(dconn) == []
        assert await datasets(mconn) == []
        with pytest.raises(NotFound):
            await mconn.call(Msg.REMOVE, {"name": "c"})


@pytest.mark.timeout(20)
async def test_collect_frees_only_unneeded_chunks_and_versions_are_never_reused(tmp_path: Path) -> None:
    held, orphan = make_chunk(30), make_chunk(31)
    async with node_with_clients(tmp_path) as (mconn, dconn):
        for cid, data, _, _ in (held, orphan):
            await put_chunk(dconn, cid, data)
        await ingest(mconn, "d", make_index([held[:3]]), [held[0]])
        meta, _ = await mconn.call(Msg.COLLECT)
        assert meta == {"freed_chunks": 1, "gc_deferred": ""}
        assert await list_chunks(dconn) == [held[0]]
        await mconn.call(Msg.REMOVE, {"name": "d", "version": 1})
        # The removed version's number stays taken: d@1 never names other content later.
        await put_chunk(dconn, held[0], held[1])
        info = await ingest(mconn, "d", make_index([held[:3]]), [held[0]])
        assert info["version"] == 2


@pytest.mark.timeout(20)
async def test_wrong_key_is_refused_and_daemon_keeps_serving(tmp_path: Path) -> None:
    async with running_node(tmp_path) as (spec, key):
        wrong = bytes(b ^ 0xFF for b in key)
        for address, service in ((spec.data, "data"), (spec.meta, "meta")):
            with pytest.raises(AuthError, match="wrong cluster key"):
                async with connect(address, wrong, service):
                    pass
        async with connect(spec.data, key, "data") as conn:
            assert (await conn.call(Msg.PING))[0]["node"] == "local"
        with pytest.raises(ProtocolError, match="is a data daemon, not meta"):
            async with connect(spec.data, key, "meta"):
                pass


async def _raw_hello(address: Address) -> tuple[trio.SocketStream, Frame]:
    stream = await trio.open_tcp_stream(address.host, address.port)
    hello = await FrameStream(stream, "daemon").receive()
    return stream, hello


async def _closed_by_peer(stream: trio.SocketStream, within: float) -> bool:
    """True if the daemon closes the connection (EOF, or a reset for the bytes it left unread)."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


@pytest.mark.timeout(20)
async def test_garbage_closes_only_that_connection(tmp_path: Path) -> None:
    async with running_node(tmp_path) as (spec, key):
        async with connect(spec.data, key, "data") as good:
            stream, hello = await _raw_hello(spec.data)
            assert hello.msg == Msg.HELLO and hello.meta["service"] == "data"
            garbage = bytearray(random.Random(9).randbytes(64))
            assert int.from_bytes(garbage[:2], "little") != MAGIC
            await stream.send_all(bytes(garbage))
            assert await _closed_by_peer(stream, 5), "the daemon kept a connection that sent garbage"
            await stream.aclose()
            # Garbage after a good handshake closes that connection too, and only that one.
            async with connect(spec.data, key, "data") as victim:
                await victim.fs.stream.send_all(bytes(garbage))
                with trio.fail_after(5):
                    await victim.done.wait()
                with pytest.raises(Unreachable):
                    await victim.call(Msg.PING)
            assert (await good.call(Msg.PING))[0]["node"] == "local"
        async with connect(spec.data, key, "data") as fresh:
            assert (await fresh.call(Msg.PING))[0]["node"] == "local"


@pytest.mark.timeout(20)
async def test_silent_peer_is_dropped_after_the_handshake_timeout(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.5)
    async with running_node(tmp_path) as (spec, key):
        start = trio.current_time()
        stream, hello = await _raw_hello(spec.meta)
        assert hello.meta["service"] == "meta"
        assert await _closed_by_peer(stream, 5), "the daemon kept a silent connection"
        assert trio.current_time() - start >= 0.4
        await stream.aclose()
        # A silent peer that never even reads its HELLO is dropped too.
        raw = await trio.open_tcp_stream(spec.data.host, spec.data.port)
        await trio.sleep(1)
        assert await _closed_by_peer(raw, 5)
        await raw.aclose()
        async with connect(spec.meta, key, "meta") as conn:
            assert (await conn.call(Msg.PING))[0]["node"] == "local"


@pytest.mark.timeout(20)
async def test_unknown_message_gets_an_error_and_connection_stays_usable(tmp_path: Path) -> None:
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        with pytest.raises(ProtocolError, match="does not handle message 999"):
            await conn.call(999, {"x": 1})  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="does not handle message 26"):
            await conn.call(Msg.COMMIT)  # a metadata message sent to the data daemon
        assert conn.closed is None
        assert (await conn.call(Msg.PING))[0]["node"] == "local"


@pytest.mark.timeout(20)
async def test_cluster_client_fails_over_to_a_live_replica(tmp_path: Path) -> None:
    cid, data, recs, payloads = make_chunk(30)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    async with running_node(tmp_path) as (spec, key):
        dead = NodeSpec("dead", Address("127.0.0.1", dead_port), Address("127.0.0.1", dead_port))
        live = NodeSpec("live", spec.meta, spec.data)
        cluster = Cluster([dead, live], key, 2, "test", local="dead")
        async with trio.open_nursery() as n:
            client = ClusterClient(cluster, n)
            # The order the chunk cache tries replicas in: this machine's first, last once it failed.
            assert [s.name for s in client.replicas(cid)] == ["dead", "live"]
            with pytest.raises(Unreachable):
                await client.read_from(dead, cid, 0, 10)
            assert [s.name for s in client.replicas(cid)] == ["live", "dead"]
            with pytest.raises(NotFound):
                await client.read_from(live, cid, 0, 10)  # not stored anywhere yet
            await client.call(live, "data", Msg.PUT_CHUNK, {"id": cid}, data)
            rec = recs[1]
            got = await client.read_from(client.replicas(cid)[0], cid, rec.offset, rec.stored_len)
            assert bytes(decode_record(got, rec, "t")) == payloads[1]
            held, down = await client.holders([cid])
            assert held == {cid: ["live"]} and down == ["dead"]
            assert await client.under_replicated([cid]) == {cid: ["live"]}
            n.cancel_scope.cancel()


@pytest.mark.timeout(30)
async def test_catalog_reads_hedge_past_a_silent_metadata_daemon(tmp_path: Path) -> None:
    """A metadata daemon that takes connections and says nothing (frozen, SIGSTOPped) is asked first: a
    catalog read asks the next one too after META_HEDGE and takes its answer, an error answered included,
    and the silent node is read last from then on."""
    from dlfs.client.cluster import META_HEDGE

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nobody ever answers on them
    try:
        async with running_node(tmp_path) as (spec, key), trio.open_nursery() as n:
            frozen = NodeSpec("a-frozen", Address("127.0.0.1", silent.getsockname()[1]), spec.data)
            live = NodeSpec("b-live", spec.meta, spec.data)
            client = ClusterClient(Cluster([frozen, live], key, 1, "test"), n)
            assert [x.name for x in client.meta_nodes()] == ["a-frozen", "b-live"]
            t0 = trio.current_time()
            with pytest.raises(NotFound):  # b-live's answer, after the hedge's wait
                await client.call_meta(Msg.GET_DATASET, {"name": "nothing"})
            took = trio.current_time() - t0
            assert META_HEDGE <= took < META_HEDGE + 3.0, took  # not the 10 s connect bound
            assert client.failing("a-frozen") and [x.name for x in client.meta_nodes()] == ["b-live", "a-frozen"]
            out, _ = await client.call_meta(Msg.LIST_DATASETS)
            assert out["datasets"] == []
            n.cancel_scope.cancel()
    finally:
        silent.close()


@pytest.mark.timeout(60)
async def test_an_index_cache_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    """A mount (or warmup) whose home has no room for the version's index: StorageFull naming the place and
    the size (the mount's log had a traceback, and the command "mount process exited (1)"), nothing left."""
    from test_ingest_cleanup import tmpfs

    from dlfs.client.indexes import fetch_index
    from dlfs.errors import StorageFull
    from dlfs.ingest.run import ingest

    src = tmp_path / "src"
    src.mkdir()
    for i in range(600):
        (src / f"f{i:04d}").write_bytes(b"x" * 100)
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as n:
        cluster = Cluster([spec], key, 1, "test", local=spec.name)
        info = (await ingest(cluster, str(src), "full")).info
        assert info.index_size > 32 << 10
        client = ClusterClient(cluster, n)
        with tmpfs(tmp_path / "tiny", "16k") as tiny:
            with pytest.raises(StorageFull, match=r"^no room for the index of full@1 \(.*\) in .*tiny/home/mounts/index: "
                                                  r"No space left on device; free some space there"):
                await fetch_index(client, info, tiny / "home")
            assert not any((tiny / "home" / "mounts" / "index").iterdir())  # its piece removed
        assert (await fetch_index(client, info, tmp_path / "home2")).stat().st_size == info.index_size
        n.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_chunk_reads_take_the_data_daemons_connections_in_turn(tmp_path: Path) -> None:
    """A client's chunk reads alternate over READ_LANES connections to a data daemon (one reply's
    turnaround no longer idles the link); other calls keep to the first. Every read gets its own bytes."""
    from dlfs.client.cluster import READ_LANES

    assert READ_LANES == 2
    cid, data, recs, payloads = make_chunk(31, records=8, size=50_000)
    async with running_node(tmp_path) as (spec, key):
        async with trio.open_nursery() as n:
            client = ClusterClient(Cluster([spec], key, 1, "test", local=spec.name), n)
            await client.call(spec, "data", Msg.PUT_CHUNK, {"id": cid}, data)
            got: dict[int, bytes] = {}

            async def read(i: int) -> None:
                rec = recs[i % len(recs)]
                got[i] = bytes(decode_record(await client.read_from(spec, cid, rec.offset, rec.stored_len), rec, "t"))

            async with trio.open_nursery() as readers:
                for i in range(16):
                    readers.start_soon(read, i)
            assert got == {i: payloads[i % len(recs)] for i in range(16)}
            lanes = {k[2]: c for k, c in client._conns.items() if k[:2] == (spec.name, "data")}
            assert sorted(lanes) == [0, 1]
            assert lanes[0] is not lanes[1] and lanes[0].fs.peer == lanes[1].fs.peer  # two sockets, one daemon
            assert (await client.call(spec, "data", Msg.PING))[0]["node"] == spec.name
            assert len([k for k in client._conns if k[:2] == (spec.name, "data")]) == 2
            n.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_concurrent_puts_of_one_chunk_store_it_once(tmp_path: Path) -> None:
    cid, data, _, _ = make_chunk(40, records=8, size=100_000)
    stored: list[bool] = []
    async with running_node(tmp_path) as (spec, key):

        async def put_one() -> None:
            async with connect(spec.data, key, "data") as conn:
                stored.append(await put_chunk(conn, cid, data))

        async with trio.open_nursery() as n:
            for _ in range(6):
                n.start_soon(put_one)
        assert sorted(stored) == [False] * 5 + [True]  # the ingest's "sent" count relies on it
        async with connect(spec.data, key, "data") as conn:
            status, _ = await conn.call(Msg.STATUS)
            assert (status["chunks"], status["bytes"]) == (1, len(data))
            assert await list_chunks(conn) == [cid]
        assert os.listdir(tmp_path / "data" / "tmp") == []


def test_a_range_of_a_chunk_whose_file_is_kept_open_needs_no_thread(tmp_path: Path) -> None:
    """open_kept_range serves a chunk whose file the store keeps open (nothing there may wait for the
    disk, so the daemon's event loop calls it); any other, not yet opened, evicted or replaced, is
    None, left to open_range in a thread."""
    store = ChunkStore(tmp_path, open_files=2)
    chunks = []
    for i in range(3):
        w = ChunkWriter(1 << 16)
        w.add(bytes([i + 1]) * 50_000, compress=False)
        cid, view = w.finish()
        assert store.put(cid, bytes(view))
        chunks.append((cid, bytes(view)))

    def read(r: object) -> bytes:
        assert r is not None
        try:
            return os.pread(r.fd, r.length, r.offset)  # type: ignore[attr-defined]
        finally:
            r.close()  # type: ignore[attr-defined]

    (a, da), (b, db), (c, dc) = chunks
    assert store.open_kept_range(a, 10, 100) is None  # never opened
    assert read(store.open_range(a, 10, 100)) == da[10:110]
    assert read(store.open_kept_range(a, 20, 1 << 20)) == da[20:]  # kept now; shorter at the end, as open_range
    store.open_range(b, 0, 1).close()
    store.open_range(c, 0, 1).close()  # two kept at most: a is closed
    assert store.open_kept_range(a, 0, 10) is None
    assert read(store.open_kept_range(c, 5, 10)) == dc[5:15]
    # A file replaced under its kept descriptor is not read from the old inode, here or in open_range.
    path = store.path(c)
    os.unlink(path)
    path.write_bytes(dc)
    assert store.open_kept_range(c, 5, 10) is None
    assert read(store.open_range(c, 5, 10)) == dc[5:15]
    os.unlink(store.path(b))
    with pytest.raises(NotFound):
        store.open_kept_range(b, 0, 10)
    with pytest.raises(ValueError):
        store.open_kept_range(c, -1, 10)
    store.close()


async def test_read_range_opens_only_a_chunk_file_not_kept_in_a_thread(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from dlfs.wire.messages import ReadRange

    store = ChunkStore(tmp_path)
    w = ChunkWriter(1 << 16)
    w.add(b"x" * 30_000, compress=False)
    cid, view = w.finish()
    assert store.put(cid, bytes(view))
    service = DataService(store, bytes(32), "n1")
    opened_in_threads = 0
    run_sync = trio.to_thread.run_sync

    async def counting(fn, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal opened_in_threads
        opened_in_threads += fn == store.open_range
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)
    for i in range(3):
        _, out = await service.read_range(ReadRange(cid, 100 * i, 100), bytearray())
        assert os.pread(out.fd, out.length, out.offset) == bytes(view)[100 * i:100 * i + 100]
        out.close()
    assert opened_in_threads == 1  # the first: the file was not open yet
    store.close()


@pytest.mark.timeout(20)
def test_chunk_store_reads_stay_right_under_descriptor_eviction(tmp_path: Path) -> None:
    """Many threads reading more chunks than the store keeps open: every read returns its own chunk's bytes."""
    store = ChunkStore(tmp_path, open_files=2)
    chunks = []
    for i in range(8):
        w = ChunkWriter(1 << 16)
        w.add(bytes([i]) * 60_000, compress=False)
        cid, view = w.finish()
        assert store.put(cid, bytes(view))
        chunks.append((cid, bytes(view)))
    wrong: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(4000):
                cid, data = rng.choice(chunks)
                off = rng.randrange(100, 50_000)
                r = store.open_range(cid, off, 100)
                try:
                    got = os.pread(r.fd, r.length, r.offset)
                finally:
                    r.close()
                if got != data[off : off + 100]:
                    wrong.append(f"chunk {cid.hex()}: another chunk's bytes")
        except (OSError, DlfsError) as exc:
            wrong.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert wrong == []


@pytest.mark.timeout(20)
async def test_read_range_over_the_frame_limit_is_refused(tmp_path: Path) -> None:
    cid, data, _, _ = make_chunk(41)
    async with running_node(tmp_path) as (spec, key), connect(spec.data, key, "data") as conn:
        await put_chunk(conn, cid, data)
        for length in (MAX_DATA + 1, 1 << 40):
            with pytest.raises(ProtocolError, match=rf"bad READ_RANGE request: Expected `int` <= {MAX_DATA} - at `\$.length`"):
                await conn.call(Msg.READ_RANGE, {"id": cid, "offset": 0, "length": length})
        with pytest.raises(ProtocolError, match=r"bad READ_RANGE request: Expected `int` >= 0 - at `\$.offset`"):
            await conn.call(Msg.READ_RANGE, {"id": cid, "offset": -1, "length": 10})
        _, got = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": 0, "length": len(data)})
        assert bytes(got) == data


class MemoryLedger:
    """An in-memory stand-in for the data daemons whose collection can be held halfway."""

    def __init__(self, stored: set[bytes]) -> None:
        self.stored = stored
        self.sweeping = trio.Event()
        self.release = trio.Event()

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]:
        return {c: [] for c in ids if c not in self.stored}

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]:
        self.sweeping.set()
        await self.release.wait()
        dead = (self.stored if only is None else self.stored & only) - live
        self.stored -= dead
        return len(dead), []


@pytest.mark.timeout(20)
async def test_chunk_pinned_during_a_collection_is_not_collected(tmp_path: Path) -> None:
    """An ingest pins a chunk that is already stored while a REMOVE's collection runs; its commit must succeed."""
    old = make_chunk(50)
    reused = make_chunk(51)  # stored, held by nothing: the new ingest will reuse it
    ledger = MemoryLedger({old[0], reused[0]})
    svc = MetaService(EmbeddedEngine(MetaStore(tmp_path / "meta")), b"k" * 32, "n", ledger)

    async def call(msg: Msg, meta: dict, data: bytes = b"") -> dict:
        return await call_handler(svc, msg, meta, data)

    async def ingest_with(name: str, chunk: tuple, checked: trio.Event | None = None) -> dict:
        sid = (await call(Msg.BEGIN_INGEST, {"name": name}))["session"]
        await call(Msg.PIN_CHUNKS, {"session": sid, "ids": [chunk[0]]})
        # Like the ingest: a chunk already stored is not sent again.
        if chunk[0] not in ledger.stored:
            ledger.stored.add(chunk[0])
        if checked is not None:
            checked.set()
        index = make_index([chunk[:3]])
        await call(Msg.PUT_INDEX, {"session": sid, "offset": 0}, index)
        return await call(Msg.COMMIT, {"session": sid, "size": len(index), "checksum": xxhash.xxh3_64_intdigest(index)})

    ledger.release.set()
    await ingest_with("old", old)
    ledger.release = trio.Event()
    result: dict[str, object] = {}

    async def new_ingest(checked: trio.Event) -> None:
        try:
            result["info"] = await ingest_with("new", reused, checked)
        except Conflict as exc:
            result["error"] = exc

    async with trio.open_nursery() as n:
        n.start_soon(call, Msg.REMOVE, {"name": "old"})
        await ledger.sweeping.wait()
        checked = trio.Event()
        n.start_soon(new_ingest, checked)
        with trio.move_on_after(0.5):
            await checked.wait()  # the ingest got as far as it could while the collection ran
        ledger.release.set()
    assert "error" not in result, result.get("error")
    assert result["info"]["version"] == 1  # type: ignore[index]
    assert reused[0] in ledger.stored and old[0] not in ledger.stored


@pytest.mark.timeout(20)
async def test_an_abort_still_sweeping_is_not_finished_again_by_the_retry_loop(
        tmp_path: Path, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    """The loop that retries held-up aborts wakes while an ABORT_INGEST's own try is still sweeping: it
    leaves that session to it (one sweep, one line), and has nothing left to do once it is finished."""
    chunk = make_chunk(60)
    ledger = MemoryLedger({chunk[0]})
    svc = MetaService(EmbeddedEngine(MetaStore(tmp_path / "meta")), b"k" * 32, "n", ledger)
    sweeps: list[set[bytes] | None] = []
    sweep = ledger.sweep

    async def counted(live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]:
        sweeps.append(only)
        return await sweep(live, only)

    ledger.sweep = counted  # type: ignore[method-assign]
    sid = (await call_handler(svc, Msg.BEGIN_INGEST, {"name": "x"}))["session"]
    await call_handler(svc, Msg.PIN_CHUNKS, {"session": sid, "ids": [chunk[0]]})
    caplog.set_level(logging.INFO, logger="dlfs.meta.service")
    async with trio.open_nursery() as n:
        n.start_soon(svc._retry_aborts)
        n.start_soon(call_handler, svc, Msg.ABORT_INGEST, {"session": sid})
        await ledger.sweeping.wait()
        await trio.sleep(3 * ABORT_RETRY[0])  # the loop wakes (the clock jumps) while the sweep is held
        ledger.release.set()
        await trio.sleep(3 * ABORT_RETRY[0])  # and again once the abort is finished
        n.cancel_scope.cancel()
    assert sweeps == [{chunk[0]}] and chunk[0] not in ledger.stored
    said = [r.getMessage() for r in caplog.records]
    assert [line for line in said if "given up" in line or "abort is finished" in line] == [
        f"ingest session {sid} given up: 1 of its 1 chunks freed"]


@pytest.mark.timeout(20)
async def test_a_chunk_being_stored_is_answered_for_once_its_store_ends(tmp_path: Path) -> None:
    """An aborted ingest's collection asks HAS_CHUNKS, then deletes what is held: a store of one of its
    chunks still in flight is waited for, so the chunk is deleted rather than landing after it."""
    cid, blob, _, _ = make_chunk(70)
    store = ChunkStore(tmp_path / "data")
    entered, release = threading.Event(), threading.Event()
    put = store.put

    def held_put(c: bytes, d: bytes | bytearray | memoryview) -> bool:
        entered.set()
        release.wait(10)
        return put(c, d)

    store.put = held_put  # type: ignore[method-assign]
    svc = DataService(store, b"k" * 32, "n")
    answers: dict[str, dict] = {}

    async def has() -> None:
        answers["has"] = await call_handler(svc, Msg.HAS_CHUNKS, {"ids": [cid]})

    async with trio.open_nursery() as n:
        n.start_soon(call_handler, svc, Msg.PUT_CHUNK, {"id": cid}, blob)
        await trio.to_thread.run_sync(entered.wait, 10)
        n.start_soon(has)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == {}  # not "missing" while the store runs
        release.set()
    assert answers["has"]["missing"] == []
    assert (await call_handler(svc, Msg.DELETE_CHUNKS, {"ids": [cid]}))["deleted"] == 1
    assert (await call_handler(svc, Msg.HAS_CHUNKS, {"ids": [cid]}))["missing"] == [cid]


class Sleep(msgspec.Struct):
    sleep: float


class Echo(msgspec.Struct):
    n: int


class ToyService(Service):
    """A service with handlers that misbehave on purpose: slow, buggy, or given bad arguments."""

    name = "toy"

    def __init__(self, key: bytes) -> None:
        super().__init__(key, "toy-node")
        self.handlers.update({Msg.STATUS: Route(Sleep, self.slow), Msg.VERIFY_CHUNKS: Route(Empty, self.buggy),
                              Msg.HAS_CHUNKS: Route(Echo, self.echo)})

    async def slow(self, req: Sleep, data: bytearray) -> Reply:
        await trio.sleep(req.sleep)
        return {"slept": req.sleep}, b""

    async def buggy(self, req: Empty, data: bytearray) -> Reply:
        raise RuntimeError("a bug")

    async def echo(self, req: Echo, data: bytearray) -> Reply:
        return {"n": req.n}, bytes(data)


@asynccontextmanager
async def toy_server(key: bytes) -> AsyncIterator[Address]:
    async with trio.open_nursery() as n:
        bound = await n.start(serve, ToyService(key), Address("127.0.0.1", 0))
        yield bound[0]
        n.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_rpc_timeouts_and_handler_failures(tmp_path: Path) -> None:
    key = b"t" * 32
    async with toy_server(key) as address:
        assert address.port != 0
        async with connect(address, key, "toy") as conn:
            with pytest.raises(Unreachable, match="did not answer STATUS within 0.2 s"):
                await conn.call(Msg.STATUS, {"sleep": 1.0}, timeout=0.2)
            with pytest.raises(DlfsError, match="internal error in VERIFY_CHUNKS: a bug"):
                await conn.call(Msg.VERIFY_CHUNKS)
            with pytest.raises(ProtocolError, match="bad HAS_CHUNKS request: Object missing required field `n`"):
                await conn.call(Msg.HAS_CHUNKS)
            # The late answer to the timed-out call is dropped; other calls still match their answers.
            async with trio.open_nursery() as n:
                for i in range(20):
                    n.start_soon(_echo, conn, i)
            await trio.sleep(1.0)
            assert (await conn.call(Msg.STATUS, {"sleep": 0}))[0] == {"slept": 0}
            assert conn.closed is None


async def _echo(conn: Connection, i: int) -> None:
    meta, data = await conn.call(Msg.HAS_CHUNKS, {"n": i}, bytes([i]) * (i * 1000))
    assert meta == {"n": i} and bytes(data) == bytes([i]) * (i * 1000)


@pytest.mark.timeout(20)
async def test_connect_failures_are_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    with pytest.raises(Unreachable, match=f"cannot reach the data daemon at 127.0.0.1:{dead_port}"):
        async with connect(Address("127.0.0.1", dead_port), b"k" * 32, "data"):
            pass

    async def mute(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as n:
        listeners = await n.start(partial(trio.serve_tcp, mute, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(Unreachable, match="did not finish the handshake"):
            async with connect(Address("127.0.0.1", port), b"k" * 32, "data"):
                pass
        n.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_daemon_going_away_fails_calls_fast(tmp_path: Path) -> None:
    key = b"t" * 32
    async with trio.open_nursery() as outer:
        server = trio.CancelScope()

        async def run_server(task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
            with server:
                async with toy_server(key) as address:
                    task_status.started(address)
                    await trio.sleep_forever()

        address = await outer.start(run_server)
        async with connect(address, key, "toy") as conn:
            errors: list[BaseException] = []

            async def waiting_call() -> None:
                try:
                    await conn.call(Msg.STATUS, {"sleep": 30})
                except Unreachable as exc:
                    errors.append(exc)

            async with trio.open_nursery() as n:
                n.start_soon(waiting_call)
                await trio.sleep(0.2)
                server.cancel()  # the daemon stops with a call in flight
            assert len(errors) == 1 and "lost connection" in str(errors[0])
            with trio.fail_after(1):
                with pytest.raises(Unreachable):
                    await conn.call(Msg.STATUS, {"sleep": 0})


@pytest.mark.timeout(20)
async def test_send_interrupted_by_a_timeout_closes_the_connection() -> None:
    """A frame cut off halfway leaves the stream unusable: later calls must fail at once, not hang."""
    key = b"t" * 32

    async def stalled(stream: trio.SocketStream) -> None:
        fs = FrameStream(stream, "client")
        await server_handshake(fs, key, "toy", "stalled")
        await trio.sleep_forever()  # never reads another byte

    async with trio.open_nursery() as n:
        listeners = await n.start(partial(trio.serve_tcp, stalled, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with connect(Address("127.0.0.1", port), key, "toy") as conn:
            with pytest.raises(Unreachable, match="did not answer PUT_CHUNK within 0.5 s"):
                await conn.call(Msg.PUT_CHUNK, {"id": b"x" * 16}, b"\0" * (64 << 20), timeout=0.5)
            start = trio.current_time()
            with pytest.raises(Unreachable):
                await conn.call(Msg.PING, timeout=5)
            assert trio.current_time() - start < 1
            with trio.fail_after(1):
                await conn.done.wait()
        n.cancel_scope.cancel()


@pytest.mark.timeout(10)
def test_damaged_catalog_is_one_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "meta"
    root.mkdir()
    catalog = root / "catalog.json"
    for text in ('{"format": 1, "datasets": {"a": [{"name": "a"', '{"format": 1}', '[1, 2]',
                 '{"format": 1, "datasets": {"a": [{"name": "a", "bogus": 1}]}}'):
        catalog.write_text(text)
        with pytest.raises(CorruptData, match=f"catalog {catalog} "):
            MetaStore(root)
