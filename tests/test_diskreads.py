"""The serving threads' reads of the node's disk cache (native/diskcache.c, dlfs/mount/diskreads.py): in
scan mode a whole record of a chunk this machine does not hold is read from the disk cache's file of that
chunk, checked and answered in C, wherever the file has it; a hole (a record never kept), a damaged copy,
an evicted file or a name not told yet goes to Python as a plain forward. Without a mount: requests are
answered one by one in this process, against a real disk cache directory."""

from __future__ import annotations

import time
from pathlib import Path

import fusewire as fw
import pytest
import trio
from test_remotereads import _index, four_records
from test_services import put_chunk, running_node

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster
from dlfs.mount.diskcache import DiskCache
from dlfs.mount.diskreads import DiskReads, tag_of
from dlfs.mount.remotereads import IndexChunkIds, RemoteReads
from dlfs.native import native
from dlfs.wire.rpc import connect

pytestmark = pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")


def test_a_disk_cache_files_name_gives_its_tag() -> None:
    assert tag_of("00281e70feef3a3c2bbadfc50e858903.7c94d185") == 0x7C94D185
    assert tag_of("ab.00000001") == 1


def test_records_the_disk_cache_holds_are_read_checked_and_answered_by_the_thread(tmp_path: Path) -> None:
    small, recs, cid, data = four_records(3)
    other = bytes(range(16))  # a chunk the disk cache never has
    ix = _index(tmp_path / "r.idx", [cid, other], [len(data), len(data)], recs)
    disk = DiskCache(tmp_path / "dc")
    reads = DiskReads(disk, IndexChunkIds(ix))

    def read(ino: int, size: int = 256 << 10, ring: bool = False) -> tuple[str, bytes, dict[str, int]]:
        kind, raw, counts = native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(0, size)), ring=ring)
        return kind, fw.reply(raw).body if kind == "answered" else b"", counts

    def keep(*which: int) -> None:
        """Records `which` of the chunk written to the disk cache (as the mount keeps what it fetched)."""
        disk.store(cid, [(recs[k].offset, (recs[k].stored_len + recs[k].sums_len)) for k in which],
                   [memoryview(data)[recs[k].offset : recs[k].offset + (recs[k].stored_len + recs[k].sums_len)] for k in which])

    try:
        native.set_scan(True)
        assert reads.refresh() == 0
        assert read(2)[0] == "forward"  # nothing held: Python's
        keep(0, 1, 3)  # told at once (the writer's own news)
        assert native.engine_stats()["disk_cache_reads"] == 0
        for ino, blob in ((2, small[0]), (3, small[1]), (2, small[0])):
            kind, body, counts = read(ino)
            assert kind == "answered" and body == blob, ino
            assert (counts["disk_cache_reads"], counts["record_reads"], counts["remote_reads"]) == (1, 0, 0)
        kind, _, counts = read(4)  # record 2 never kept: a hole there, not read
        assert kind == "forward" and counts["record_failures"] == 0
        # A record with block sums, too big for a /dev/fuse thread's own buffer: into a shared one the
        # reply holds until sent (six times: each let go); an io_uring queue's into the reply's own buffer.
        for ring in [False] * 6 + [True]:
            kind, body, counts = read(5, 512 << 10, ring=ring)
            assert kind == "answered" and body == small[3] and counts["disk_cache_reads"] == 1, ring
        assert read(3, 4096)[0] == "forward"  # part of a record: its checksum covers it all
        assert read(6)[0] == "forward"  # a chunk the disk cache does not have
        assert native.dcache_used() == [0] and native.dcache_used() == []  # once each: noted as recently used
        # The copy damaged on disk: the thread's check fails and Python reads it (then drops the copy).
        (name,) = disk.files().values()
        path = disk.chunk_dir / name[:2] / name
        blob = bytearray(path.read_bytes())
        blob[recs[1].offset + 99] ^= 1
        path.write_bytes(bytes(blob))
        kind, _, counts = read(3)
        assert kind == "forward" and counts["record_failures"] == 1
        assert read(2)[1] == small[0]  # the rest of the file is as good as ever
        # Evicted (by another process: no news of it) and kept again under a new name. A file the threads
        # hold open still reads (its bytes are checked all the same) until its path is looked at again, a
        # second later; the old name is gone then, and nothing is read until a refresh tells the new one.
        other_process = DiskCache(tmp_path / "dc")
        other_process._evict(1 << 30)
        time.sleep(native.LOCAL_RECHECK_S + 0.1)
        assert read(2)[0] == "forward"
        other_process.store(cid, [(recs[0].offset, recs[0].stored_len)], [memoryview(data)[recs[0].offset:][: recs[0].stored_len]])
        assert read(2)[0] == "forward"
        assert reads.refresh() == 1
        assert read(2)[1] == small[0]
        assert read(3)[0] == "forward"  # not kept under the new name
        # Evicted by this process: told at once.
        disk._evict(1 << 30)
        kind, _, counts = read(2)
        assert kind == "forward" and counts["record_failures"] == 0
        assert reads.refresh() == 0
        with pytest.raises(OSError):
            native.dcache_set(2, 1)  # no such chunk in the version
        keep(0)
        assert read(2)[1] == small[0]
        native.dcache_close()  # (the engine's stop does it)
        with pytest.raises(OSError):
            native.dcache_set(0, 1)  # closed: nothing to tell
        assert read(2)[0] == "forward"  # and nothing read from it
    finally:
        native.set_scan(False)
        native.dcache_close()
        disk.close()
        ix.close()


async def test_what_the_threads_fetch_is_kept_in_the_disk_cache(tmp_path: Path) -> None:
    # A compute node whose serving threads fetch scan mode's records from the data daemons: each record they
    # fetch is offered back (copied into one of DLFS_KEEP_SLOTS buffers: none free, it is not kept, and
    # counted), taken by a thread of the mount's and written to the disk cache, whose file the threads
    # then read it from.
    small, recs, cid, data = four_records(6)
    ix = _index(tmp_path / "r.idx", [cid, bytes(range(16))], [len(data), len(data)], recs)
    disk = DiskCache(tmp_path / "dc")
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as nursery:
        async with connect(spec.data, key, "data") as conn:
            assert await put_chunk(conn, cid, data)
        client = ClusterClient(Cluster([spec], key, 1, "test"), nursery)
        remote = RemoteReads(client, IndexChunkIds(ix), fetchers=2)
        reads = DiskReads(disk, IndexChunkIds(ix))

        async def read(ino: int, size: int = 256 << 10) -> tuple[str, bytes, dict[str, int]]:
            kind, raw, counts = await trio.to_thread.run_sync(
                lambda: native.answer(ix.sections(), fw.request(fw.READ, ino, fw.read_in(0, size))))
            return kind, fw.reply(raw).body if kind == "answered" else b"", counts

        try:
            native.set_scan(True)
            reads.refresh()
            native.remote_route(remote.route())
            await remote.open_one(1)
            kind, body, counts = await read(2)  # not kept yet: nothing is offered, nothing taken
            assert kind == "answered" and body == small[0] and counts["remote_reads"] == 1
            assert native.dcache_take(0) == []
            native.dcache_keep()
            for _ in range(native.KEEP_SLOTS + 1):  # one more than there are slots, none taken
                assert (await read(3))[2]["remote_reads"] == 1
            got = native.dcache_take(0)
            assert len(got) == native.KEEP_SLOTS and native.dcache_keep_stats()["dropped"] == 1
            assert all((ci, off, bytes(b)) == (0, recs[1].offset, small[1]) for ci, off, b in got)
            assert native.dcache_take(10) == []  # (waited 10 ms: nothing more came)
            reads.start_keeping()  # the mount's keeper: taken and written as they come
            assert (await read(2))[2]["remote_reads"] == 1
            for _ in range(100):
                if disk.files():
                    break
                await trio.sleep(0.05)
            kind, body, counts = await read(2)  # now from the disk cache's file
            assert kind == "answered" and body == small[0] and counts["disk_cache_reads"] == 1
            assert counts["remote_reads"] == 0
            # A record with block sums (256 KiB or more) is too big for a slot: left to Python, which keeps it.
            kind, _, counts = await read(5, 512 << 10)
            assert kind == "forward" and counts["remote_reads"] == counts["remote_failures"] == 0
        finally:
            native.set_scan(False)
            native.remote_close()
            native.dcache_close()  # the keeper's wait ends: its thread too
            nursery.cancel_scope.cancel()
    disk.close()
    ix.close()
