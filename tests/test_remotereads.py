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
from test_services import put_chunk, running_node

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster
from dlfs.data.store import chunk_path
from dlfs.format.chunk import ChunkWriter
from dlfs.format.index import Index, IndexWriter
from dlfs.mount.remotereads import RemoteReads
from dlfs.native import native
from dlfs.wire.messages import ReadRange
from dlfs.wire.protocol import HEADER, MAGIC, REQUEST, RESPONSE, VERSION, Msg
from dlfs.wire.rpc import CALL_TIMEOUT, IDLE_TIMEOUT, connect

pytestmark = pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
REG, DIR = 0o100640, 0o040755


def test_the_threads_frames_are_the_protocols() -> None:
    w = native.WIRE
    assert (w["magic"], w["version"], w["header"], w["request"], w["response"], w["read_range"]) == (
        MAGIC, VERSION, HEADER.size, REQUEST, RESPONSE, Msg.READ_RANGE)
    assert w["idle_s"] < IDLE_TIMEOUT / 2  # a connection is retired before the daemon could close it under a fetch
    assert w["wait_ms"] / 1000 < CALL_TIMEOUT


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


async def test_a_record_of_another_machine_is_fetched_checked_and_answered_by_the_thread(tmp_path: Path) -> None:
    rng = random.Random(8)
    small = [rng.randbytes(100_000), rng.randbytes(60_000), rng.randbytes(3_000)]
    c = ChunkWriter(1 << 20)
    recs = [c.add(b, compress=False) for b in small]
    cid, data = c.finish()
    ghost = bytes(range(16))  # a chunk no daemon has
    ix = _index(tmp_path / "r.idx", [cid, ghost], [len(data), len(data)], recs)
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as nursery:
        async with connect(spec.data, key, "data") as conn:
            assert await put_chunk(conn, cid, bytes(data))
        client = ClusterClient(Cluster([spec], key, 1, "test"), nursery)
        remote = RemoteReads(client, [cid, ghost], fetchers=2)

        async def read(ino: int, size: int = 256 << 10) -> tuple[str, bytes, dict[str, int]]:
            kind, raw, counts = await trio.to_thread.run_sync(
                lambda: native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(0, size))))
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
            kind, _, counts = await read(5)
            assert kind == "forward" and counts["remote_failures"] == 1
            s = native.remote_node_stats(1)
            assert (s["open"], s["lost"], s["failures"], s["reads"]) == (1, 0, 1, 6), s  # the damaged one was fetched
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
