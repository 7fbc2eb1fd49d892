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
from test_remotereads import _index, four_records

from dlfs.mount.diskcache import DiskCache
from dlfs.mount.diskreads import DiskReads, tag_of
from dlfs.mount.remotereads import IndexChunkIds
from dlfs.native import native

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
