"""The serving threads' reads of the node's disk cache (native/diskcache.h): in scan mode a whole record
of a chunk this machine does not hold is read by the thread that got its READ from the disk cache's file
of that chunk, where the file has it, as this machine's own chunk files are read; no word to Python. What
the threads fetch from the data daemons themselves (remotereads.py) is offered back, and a thread of its
own here writes it to the disk cache, so the first epoch fills it as Python's fetches would.

Python keeps the catalogue (diskcache.py) and tells the threads which file holds each chunk of the
mounted version: at once for what this process writes, evicts or drops, and from the catalogue every
REFRESH_EVERY seconds for what other mounts and `dlfs warmup` change. A stale name costs nothing but a
fallback: the threads never read a hole, and check every record (xxh3), so a file evicted meanwhile, or
one whose bytes are bad, sends the READ to Python, which reads the record again (from the replicas where
the copy here is bad). Which chunks the threads read is noted in the catalogue, for its eviction order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import trio

from dlfs.mount.diskcache import DiskCache
from dlfs.native import native

log = logging.getLogger(__name__)
REFRESH_EVERY = 5.0  # seconds between two reads of the catalogue (and notes of what the threads read)
KEEP_WAIT_MS = 250  # the keeper's longest wait for records the threads fetched (it ends with the engine)
KEEP_CLOSE_TIMEOUT = 5.0  # seconds a mount's end waits for the keeper to hand over what it took


def tag_of(name: str) -> int:
    """The suffix of a disk cache file's name ("<chunk id>.<8 hex digits>"), as the threads open it."""
    return int(name.rsplit(".", 1)[1], 16)


class DiskReads:
    """Owner of what the serving threads know of the disk cache, for one mount."""

    def __init__(self, disk: DiskCache, chunk_ids: Sequence[bytes]) -> None:
        assert native is not None
        self.disk = disk
        self.chunk_ids = chunk_ids
        self._number: dict[bytes, int] | None = None  # chunk id -> its number in the version (made in a thread)
        self._told: dict[int, int] = {}  # chunk number -> the tag the threads have (absent: 0)
        self._lock = threading.Lock()  # the writer thread's news and a refresh's, one at a time
        self._keeper: threading.Thread | None = None  # takes what the threads fetched (start_keeping)
        native.dcache_open(disk.chunk_dir, len(chunk_ids))

    def _tell(self, cid: bytes, name: str | None) -> None:
        """Chunk `cid`'s file is `name` now (None: it has none). From the writer thread or the loop."""
        if self._number is None or (ci := self._number.get(cid)) is None:
            return
        tag = tag_of(name) if name is not None else 0
        assert native is not None
        with self._lock:
            try:
                native.dcache_set(ci, tag)  # (closed with the engine: then nothing reads it anyway)
            except OSError:
                return
            if tag:
                self._told[ci] = tag
            else:
                self._told.pop(ci, None)

    def refresh(self) -> int:
        """Tell the threads every file the catalogue lists now (blocking: a thread's); chunks told."""
        if self._number is None:
            self._number = {cid: i for i, cid in enumerate(self.chunk_ids)}
            self.disk.on_file = self._tell
        assert native is not None
        with self._lock:  # (news meanwhile wait: the catalogue read here is no older than they are)
            held = {ci: tag_of(name) for cid, name in self.disk.files().items()
                    if (ci := self._number.get(cid)) is not None}
            for ci in [ci for ci in self._told if ci not in held]:
                native.dcache_set(ci, 0)
                del self._told[ci]
            for ci, tag in held.items():
                if self._told.get(ci) != tag:
                    native.dcache_set(ci, tag)
                    self._told[ci] = tag
        return len(held)

    def forget_all(self) -> None:
        """Tell the threads to read none of the cache's files any more."""
        assert native is not None
        with self._lock:
            try:
                for ci in self._told:
                    native.dcache_set(ci, 0)
            except OSError:
                return  # (closed with the engine: nothing reads it anyway)
            self._told.clear()

    def start_keeping(self) -> None:
        """The serving threads fetch from the data daemons too (remotereads.py): what they fetch is offered
        here and written to the disk cache by a thread of its own, as Python's own fetches are."""
        assert native is not None
        native.dcache_keep()
        self._keeper = threading.Thread(target=self._keep_fetched, name="dlfs-disk-cache-keeper", daemon=True)
        self._keeper.start()

    def close(self) -> None:
        """Keep no more; what the threads fetched before is written (given to the disk cache's writer)."""
        if self._keeper is not None:
            assert native is not None
            native.dcache_keep_end()
            self._keeper.join(KEEP_CLOSE_TIMEOUT)
            self._keeper = None

    def _keep_fetched(self) -> None:
        assert native is not None
        dropped = 0
        while (got := native.dcache_take(KEEP_WAIT_MS)) is not None:  # None: ended, all handed over
            for ci, offset, data in got:
                self.disk.put_record(self.chunk_ids[ci], offset, data)
            now = native.dcache_keep_stats()["dropped"]  # offered while every slot was full
            self.disk.dropped += now - dropped
            dropped = now

    async def keep(self) -> None:
        """Refresh from the catalogue, and note what the threads read, until the mount ends (the first
        refresh is the mount's own, before it serves)."""
        assert native is not None
        while native.engine_running():
            await trio.sleep(REFRESH_EVERY)
            if self.disk.broken:  # damaged under this mount (diskcache.py said so once): nothing more read
                self.forget_all()
                continue
            try:
                told = await trio.to_thread.run_sync(self.refresh)
            except Exception as exc:  # a busy or broken catalogue: the threads keep what they were told
                if not self.disk.note_damage(exc):
                    log.warning("disk cache %s: %s; the serving threads keep reading what they knew of it",
                                self.disk.root, exc)
            else:
                log.debug("disk cache %s: the serving threads may read %d chunk files", self.disk.root, told)
            used = native.dcache_used()
            if used:
                self.disk.note_used(self.chunk_ids[ci] for ci in used)
