"""The serving threads' own fetches from the data daemons (native/remote.c, dlfs/mount/remotereads.py):
scan mode's misses of chunks this machine does not hold, fetched, checked and answered in C on
connections Python opened and authenticated, against a real data daemon and against peers that break
the protocol. Everything the threads cannot do goes to Python as a plain forward."""

from __future__ import annotations

import array
import io
import random
import socket
import threading
import time
from pathlib import Path

import fusewire as fw
import msgpack
import msgspec
import pytest
import trio
from test_services import make_chunk, put_chunk, running_node

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster, NodeSpec
from dlfs.data.store import chunk_path
from dlfs.errors import NotFound, ProtocolError, Unreachable, status_of
from dlfs.format.chunk import ChunkWriter
from dlfs.format.index import Index, IndexWriter
from dlfs.mount.remotereads import IndexChunkIds, RemoteReads
from dlfs.native import native
from dlfs.transport.base import Address
from dlfs.wire.messages import ReadRange
from dlfs.wire.protocol import FRAME_STALL, HEADER, MAGIC, MAX_DATA, REQUEST, RESPONSE, VERSION, Msg
from dlfs.wire.rpc import CALL_TIMEOUT, IDLE_TIMEOUT, connect

pytestmark = pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
REG, DIR = 0o100640, 0o040755


def test_the_threads_frames_are_the_protocols() -> None:
    w = native.WIRE
    assert (w["magic"], w["version"], w["header"], w["request"], w["response"], w["read_range"]) == (
        MAGIC, VERSION, HEADER.size, REQUEST, RESPONSE, Msg.READ_RANGE)
    assert w["idle_s"] < IDLE_TIMEOUT / 2  # a connection is retired before the daemon could close it under a fetch
    assert w["wait_ms"] / 1000 < CALL_TIMEOUT
    # The daemon's range lanes: errors as Python's, the same limits and bounds.
    assert (w["not_found"], w["protocol_error"]) == (status_of(NotFound("")), status_of(ProtocolError("")))
    assert (w["max_data"], w["lane_idle_s"], w["lane_stall_ms"]) == (MAX_DATA, IDLE_TIMEOUT, FRAME_STALL * 1000)


def _index(path: Path, cids: list[bytes], sizes: list[int], recs: list) -> Index:
    """Files 2.. of one record each: recs[i] of chunk 0, and one more of chunk 1 (another id)."""
    w = IndexWriter(2 + len(recs), 1 << 20)
    for r in recs:
        w.add_extent(0, r)
    w.add_extent(1, recs[0])
    w.add_chunk(cids[0], sizes[0], 0, len(recs))
    w.add_chunk(cids[1], sizes[1], len(recs), 1)
    ref, n = w.add_dirents([(f"f{i}".encode(), 2 + i) for i in range(len(recs) + 1)])
    w.set_inode(1, DIR, 0, 0, 2, 0, 0, ref, n, 1)
    for i, r in enumerate([*recs, recs[0]]):
        w.set_inode(2 + i, REG, 0, 0, 1, r.raw_len, 0, i, 1, 1)
    buf = io.BytesIO()
    w.write(buf)
    path.write_bytes(buf.getvalue())
    return Index(path)


def _fake_peer(answer: bytes | None) -> tuple[socket.socket, list[bytes], threading.Thread]:
    """One end of a socket pair for the threads; the other reads one request and sends `answer` (None:
    nothing, ever). What it read is in the list."""
    ours, theirs = socket.socketpair()
    got: list[bytes] = []

    def run() -> None:
        head = theirs.recv(HEADER.size, socket.MSG_WAITALL)
        _, _, _, _, _, _, meta_len, _ = HEADER.unpack(head)
        got.append(head + theirs.recv(meta_len, socket.MSG_WAITALL))
        if answer is not None:
            theirs.sendall(answer)
            theirs.shutdown(socket.SHUT_WR)  # and nothing more
        try:
            theirs.recv(1)  # until the threads close their end
        except ConnectionResetError:  # closed with our answer unread
            pass
        theirs.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return ours, got, t


def four_records(seed: int) -> tuple[list[bytes], list, bytes, bytes]:
    """A chunk of four records (100 KB, 60 KB, 3 KB, and 300 KB with block sums): the files' bytes, the
    records, the chunk's id and its bytes."""
    rng = random.Random(seed)
    small = [rng.randbytes(100_000), rng.randbytes(60_000), rng.randbytes(3_000), rng.randbytes(300_000)]
    c = ChunkWriter(1 << 20)
    recs = [c.add(b, compress=False) for b in small]
    assert [r.has_block_sums for r in recs] == [False, False, False, True]  # the last: 256 KiB or more
    cid, data = c.finish()
    return small, recs, cid, bytes(data)


async def test_a_record_of_another_machine_is_fetched_checked_and_answered_by_the_thread(tmp_path: Path) -> None:
    small, recs, cid, data = four_records(8)
    ghost = bytes(range(16))  # a chunk no daemon has
    ix = _index(tmp_path / "r.idx", [cid, ghost], [len(data), len(data)], recs)
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as nursery:
        async with connect(spec.data, key, "data") as conn:
            assert await put_chunk(conn, cid, bytes(data))
        client = ClusterClient(Cluster([spec], key, 1, "test"), nursery)
        ids = IndexChunkIds(ix)  # as a mount gives them: read from the index as asked
        assert list(ids) == [cid, ghost] and ids[1:] == [ghost] and len(ids) == 2
        remote = RemoteReads(client, ids, fetchers=2)

        async def read(ino: int, size: int = 256 << 10, ring: bool = False) -> tuple[str, bytes, dict[str, int]]:
            kind, raw, counts = await trio.to_thread.run_sync(
                lambda: native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(0, size)), ring=ring))
            return kind, fw.reply(raw).body if kind == "answered" else b"", counts

        try:
            native.set_scan(True)
            assert (await read(2))[0] == "forward"  # no route: Python's
            native.remote_route(remote.route())
            assert (await read(2))[0] == "forward"  # no connection yet: Python's, and one is wanted
            assert native.remote_node_stats(1)["wanted"] == 1 and native.remote_node_stats(0)["wanted"] == 1
            await remote.open_one(1)
            for ino, blob in ((2, small[0]), (3, small[1]), (4, small[2]), (2, small[0])):
                kind, body, counts = await read(ino)
                assert kind == "answered" and body == blob, ino
                assert (counts["remote_reads"], counts["remote_failures"], counts["record_reads"]) == (1, 0, 0)
            s = native.remote_node_stats(1)
            assert (s["open"], s["reads"], s["bytes"], s["lost"]) == (1, 4, 2 * 100_000 + 63_000, 0), s
            assert remote.lanes == 1 and native.lanes_stats()["reads"] == 4  # served by the daemon's threads
            # A record with block sums, too big for a /dev/fuse thread's own buffer: fetched into a shared
            # one the reply holds until sent; an io_uring queue fetches into the reply's own buffer, a small
            # record too.
            for ino, blob, ring in [(5, small[3], False)] * 6 + [(5, small[3], True), (3, small[1], True)]:
                kind, body, counts = await read(ino, 512 << 10, ring=ring)  # 6: each shared buffer let go
                assert kind == "answered" and body == blob and counts["remote_reads"] == 1, (ino, ring)
            assert (await read(5, 256 << 10))[0] == "forward"  # part of it: its checksum covers it all
            assert native.remote_node_stats(1)["reads"] == 12
            assert (await read(3, 4096))[0] == "forward"  # part of a record: its checksum covers it all
            # The daemon's copy damaged: the thread's check fails, Python fetches it (and says what is wrong).
            path = chunk_path(tmp_path / "home" / "data" / "chunks", cid)
            blob = bytearray(path.read_bytes())
            blob[recs[1].offset + 1234] ^= 4
            path.chmod(0o600)
            path.write_bytes(bytes(blob))
            kind, _, counts = await read(3)
            assert kind == "forward" and counts["remote_failures"] == 1 and counts["remote_reads"] == 0
            assert (await read(4))[1] == small[2]  # the damage is record 1's alone, the connection kept
            # An error answered (the daemon has no such chunk): read past, Python's, the connection kept.
            not_found = native.lanes_stats()["not_found"]
            kind, _, counts = await read(6)
            assert kind == "forward" and counts["remote_failures"] == 1
            kind, _, counts = await read(6)  # not asked again: Python's until the route is made again
            assert kind == "forward" and counts["remote_failures"] == 0
            assert native.lanes_stats()["not_found"] == not_found + 1
            s = native.remote_node_stats(1)
            assert (s["open"], s["lost"], s["failures"], s["reads"]) == (1, 0, 1, 14), s  # the damaged one was fetched
            assert (await read(2))[1] == small[0]

            # Peers that break the protocol, on node slot 2: the request they get is a valid READ_RANGE.
            native.remote_route(array.array("H", [2, 2]))
            garbage = HEADER.pack(MAGIC, VERSION, RESPONSE, Msg.READ_RANGE, 0, 99, 1, 100_000) + b"\x80"
            for answer in (garbage, b"\x00" * 7, None):
                ours, got, t = _fake_peer(answer)
                native.remote_add(2, ours.detach())
                t0 = time.monotonic()
                kind, _, counts = await read(2)
                took = time.monotonic() - t0
                assert kind == "forward" and counts["remote_failures"] == 1, answer
                s = native.remote_node_stats(2)
                assert s["open"] == 0, (answer, s)  # closed: Python opens another if it is wanted
                magic, version, kind_, msg, status, req, meta_len, data_len = HEADER.unpack(got[0][:HEADER.size])
                assert (magic, version, kind_, msg, status, data_len) == (MAGIC, VERSION, REQUEST, Msg.READ_RANGE, 0, 0)
                rr = msgspec.convert(msgpack.unpackb(got[0][HEADER.size:]), ReadRange)
                assert (rr.id, rr.offset, rr.length) == (cid, recs[0].offset, recs[0].stored_len)
                # A silent peer costs the READ the fetch's bound, no more.
                assert took < (native.WIRE["wait_ms"] / 1000 + 1.5 if answer is None else 1.0), (answer, took)
                t.join(5)
            assert native.remote_node_stats(2)["lost"] == 3
            assert native.remote_node_stats(2)["timeouts"] == 1  # the silent one's: the others answered, badly
            # The bound follows Python's hedge bound: a silent node costs a READ that, and is marked failing
            # (read last, the route moved off it) as a node a hedge beat would be.
            remote.bound = lambda: 0.3
            remote._follow_bound()
            assert native.remote_wait() == 300
            remote.specs[3] = spec  # slot 3: the node a silent peer stands for
            native.remote_route(array.array("H", [3, 3]))
            ours, _, t = _fake_peer(None)
            native.remote_add(3, ours.detach())
            t0 = time.monotonic()
            kind, _, counts = await read(2)
            took = time.monotonic() - t0
            assert kind == "forward" and 0.25 < took < 1.5, took
            assert native.remote_node_stats(0)["timeouts"] == 2 and not client.failing(spec.name)
            remote._timed_out()
            assert client.failing(spec.name) and native.remote_node_stats(3)["timeouts"] == 1
            t.join(5)
            native.remote_route(array.array("H", [0, 0]))
            assert (await read(2))[0] == "forward"  # routed to nobody: Python's
            with pytest.raises(OSError):
                native.remote_route(array.array("H", [1]))  # another size
            with pytest.raises(OSError):
                native.remote_route(array.array("H", [1, native.WIRE["nodes"] + 1]))
        finally:
            native.set_scan(False)
            native.remote_close()
            nursery.cancel_scope.cancel()
    assert native.remote_node_stats(1)["open"] == 0
    ix.close()


async def test_a_learned_route_is_made_chunk_by_chunk_and_forgotten_when_the_nodes_health_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the whole route would cost too many ranks (a big cluster, a big dataset), it is learned: a chunk's
    # entry is made when Python first fetches one of its records alone, and every entry is forgotten (to be
    # learned again in the new order) when a node starts or stops failing.
    small, recs, cid, data = four_records(5)
    ix = _index(tmp_path / "r.idx", [cid, bytes(range(16))], [len(data), len(data)], recs)
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as nursery:
        async with connect(spec.data, key, "data") as conn:
            assert await put_chunk(conn, cid, data)
        client = ClusterClient(Cluster([spec], key, 1, "test"), nursery)
        assert not RemoteReads(client, IndexChunkIds(ix), fetchers=2).learned  # 2 ranks: made whole
        monkeypatch.setattr("dlfs.mount.remotereads.ROUTE_WORK_MAX", 1)
        remote = RemoteReads(client, IndexChunkIds(ix), fetchers=2)
        assert remote.learned

        async def read(ino: int) -> tuple[str, bytes, dict[str, int]]:
            kind, raw, counts = await trio.to_thread.run_sync(
                lambda: native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(0, 256 << 10))))
            return kind, fw.reply(raw).body if kind == "answered" else b"", counts

        try:
            native.set_scan(True)
            remote.learn(0)  # before the route exists: nothing to make yet
            await remote._reroute()
            await remote.open_one(1)
            assert (await read(2))[0] == "forward"  # chunk 0 not learned: Python's
            remote.learn(0)
            for ino, blob in ((2, small[0]), (3, small[1])):  # its other records: the threads'
                kind, body, counts = await read(ino)
                assert kind == "answered" and body == blob and counts["remote_reads"] == 1, ino
            assert (await read(6))[0] == "forward"  # chunk 1: not learned
            client._failed(spec)  # health changed: forgotten
            await remote._reroute()
            assert (await read(2))[0] == "forward"
            client._answered(spec.name)
            await remote._reroute()
            remote.learn(0)
            assert (await read(2))[1] == small[0]
        finally:
            native.set_scan(False)
            native.remote_close()
            nursery.cancel_scope.cancel()
    ix.close()


async def test_a_range_lane_answers_as_the_daemons_python_does(tmp_path: Path) -> None:
    # A connection given over with RANGE_LANE is answered by the daemon's native threads: the daemon's own
    # client decodes every reply (pipelined, in order), errors included; a bad body is an error reply and
    # the lane goes on; any other message closes the lane. A daemon without lanes refuses, and the
    # connection stays its Python's.
    cid, data, _, _ = make_chunk(9, records=13, size=20_000)  # half its records compressed: 121 KB
    async with running_node(tmp_path / "home") as (spec, key):
        async with connect(spec.data, key, "data") as conn:
            assert await put_chunk(conn, cid, data)
        before = native.lanes_stats()
        async with connect(spec.data, key, "data") as lane:
            await lane.call(Msg.RANGE_LANE)
            wanted = [(0, 1000), (5, 100_000), (60_000, 9_000), (len(data) - 10, 4096), (len(data) + 5, 10), (0, 0)]
            got: dict[int, bytes] = {}

            async def one(i: int, off: int, n: int) -> None:
                _, got[i] = await lane.call(Msg.READ_RANGE, {"id": cid, "offset": off, "length": n})

            async with trio.open_nursery() as n:  # in flight together on the one lane
                for i, (off, length) in enumerate(wanted):
                    n.start_soon(one, i, off, length)
            assert [bytes(got[i]) for i in range(len(wanted))] == [data[o : o + k] for o, k in wanted]
            with pytest.raises(NotFound, match=r"chunk 0{32} is not on this node"):
                await lane.call(Msg.READ_RANGE, {"id": bytes(16), "offset": 0, "length": 10})
            with pytest.raises(ProtocolError, match="bad READ_RANGE request"):
                await lane.call(Msg.READ_RANGE, {"id": cid, "offset": 0})
            _, again = await lane.call(Msg.READ_RANGE, {"id": cid, "offset": 3, "length": 3})
            assert bytes(again) == data[3:6]
            s = native.lanes_stats()
            assert s["open"] == 1 and s["reads"] - before["reads"] == len(wanted) + 1, s
            assert s["not_found"] - before["not_found"] == 1
            with pytest.raises(Unreachable):  # not a READ_RANGE: the lane is closed
                await lane.call(Msg.PING, timeout=5)
        assert wait_until(lambda: native.lanes_stats()["open"] == 0)
        assert native.lanes_stats()["closed_bad"] - before["closed_bad"] == 1
        async with connect(spec.data, key, "data") as conn:  # what they served counts in the daemon's status
            status, _ = await conn.call(Msg.STATUS)
            assert status["reads"] >= len(wanted) + 1 and status["bytes_served"] >= sum(map(len, got.values())) + 3
        native.lanes_stop()  # as a daemon without them: refused, the connection stays a plain one
        try:
            async with connect(spec.data, key, "data") as conn:
                with pytest.raises(ProtocolError, match="no room for another range lane"):
                    await conn.call(Msg.RANGE_LANE)
                _, plain = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": 7, "length": 5})
                assert bytes(plain) == data[7:12]
        finally:
            native.lanes_start(tmp_path / "home" / "data" / "chunks")  # the node stops them at its end


def wait_until(cond: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


async def test_the_route_names_each_chunks_first_replica_and_follows_the_nodes_health() -> None:
    # Each chunk is fetched from the first node of the client's order for it (its rendezvous rank), and a
    # node that fails goes last until it answers again: the route is made again when that changes.
    specs = [NodeSpec(f"n{i}", Address("127.0.0.1", 1000 + i), Address("127.0.0.1", 2000 + i)) for i in range(3)]
    ids = [bytes([i]) * 16 for i in range(40)]
    async with trio.open_nursery() as nursery:
        client = ClusterClient(Cluster(specs, b"k" * 32, 2, "test"), nursery)
        remote = RemoteReads(client, ids, fetchers=4)
        assert remote.per_node == 4 and remote.slot == {"n0": 1, "n1": 2, "n2": 3}
        first = remote.route()
        assert list(first) == [remote.slot[client.replicas(c)[0].name] for c in ids]
        assert {1, 2, 3} <= set(first)  # spread over the nodes
        seen = client.health_changes
        client._failed(specs[0])
        assert client.health_changes == seen + 1
        after = remote.route()
        assert 1 not in set(after)  # n0 failing: every chunk from another
        assert all(a == b for a, b in zip(first, after) if b != 1 and a != 1)  # the others' chunks stay put
        client._answered("n0")
        assert list(remote.route()) == list(first) and client.health_changes == seen + 2
        # A mount that reads n1's chunk files in place never asks n1's daemon for them: the next replica.
        in_place = RemoteReads(client, ids, fetchers=4, in_place="n1")
        assert list(in_place.route()) == [
            remote.slot[next(s.name for s in client.replicas(c) if s.name != "n1")] for c in ids]
        assert 2 not in set(in_place.route()) and set(in_place.route()) == {1, 3}
        nursery.cancel_scope.cancel()
