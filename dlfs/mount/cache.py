"""The mount's chunk cache: verified, decoded records in memory, fetched by windows of a chunk, kept
until the kernel (or a dlfs.direct client) has them. It owns what is in memory and in flight, and
composes three parts that each own their own state:

  - slabs.py: the arena of fixed-size slabs (a shared file: a private huge tmpfs's, else a memfd), free/retired/given back, prefaulting;
  - planner.py: what to fetch (windows, streams, how far ahead, what the kernel was sent), no I/O;
  - fetcher.py: where bytes come from (local chunk files, the disk cache, replicas) and their checks.

The rest of the mount reaches each part directly (cache.fetcher.local, cache.slabs.arena,
cache.held.evictions, cache.planner.window_of): one owner, one name for each piece of state.

Published: every record that sits whole in a slab is published in the shared table (native/shm.h), so
the mount's serving threads and dlfs.direct clients pin and read it with no Python at all; the serving
threads park READs of records being fetched (set_pending) and answer them once published.

What a record is kept for: the FUSE mount runs in no_open mode, so the kernel keeps the pages of every
file it has read; once all of a record's bytes have gone to the kernel (counted in native/shm.c by
whoever sent them: a serving thread or the Python handlers) the record is *consumed* and dropped here,
and a slab whose records are all consumed is free again. The cache therefore holds read-ahead that has
not been used yet, not a second copy of the page cache.

A miss that is part of a stream fetches what of its window is not here yet (one request, one slab) and
queues the file's next windows (and a small file's chunk) for background prefetch workers; a random
read fetches what it asks: a small record alone, or the 4 KiB blocks of a big one.

Scan resistant (CoorDL's no-thrash idea): blocks stay resident until used; once read-ahead's part is
full, misses fetch just their own record (no read-ahead, no prefetch; a part of a shared slab each)
into a small LRU scratch area, so an epoch over a dataset larger than the cache costs one fetch per
missed file while the resident part keeps hitting. Concurrent misses of one window share one fetch.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import mmap
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import trio

from dlfs.cgroup import MemoryLimit, memory_limit
from dlfs.client.cluster import ClusterClient
from dlfs.errors import CorruptData, DlfsError
from dlfs.format.chunk import FLAG_BLOCK_SUMS, FLAG_LZ4
from dlfs.format.index import Extent, Index
from dlfs.mount.diskcache import SOURCE as DISK_CACHE
from dlfs.mount.fetcher import Buffer, Fetcher, verify_window
from dlfs.mount.held import Held
from dlfs.mount.localchunks import DIRECT_ALIGN, LAND_MAX, THREAD_BYTES, ticket
from dlfs.mount.planner import STREAM_WINDOWS_MAX, Planner, window_reach, window_size
from dlfs.mount.slabs import NO_SLAB, Slabs
from dlfs.native import native
from dlfs.units import human_bytes

log = logging.getLogger(__name__)
PREFETCH_WORKERS = 4  # windows fetched ahead at once: enough to keep a disk (or a node) busy
# Read-ahead reaches the disk (or a node) in the order its readers will want it: a window k windows
# ahead of its reader is wanted k window-reads from now, at about this rate (a reader copying from the
# page cache here). Queued first come first served, one reader's burst of windows at a file's start
# held the other's next window back, whose READ then reached Python and fetched it itself. The rest
# of a small file's chunk (whatever order an epoch reads it in) is wanted after any stream's windows.
READER_RATE = 1 << 30
DIRECT_CLIENTS = 256  # rows of the shared pin table: processes attached through dlfs.direct at once
ENGINE_ROW = DIRECT_CLIENTS  # the row the mount's own serving threads pin through
MIN_AUTO_CACHE = 64 << 20  # the smallest default cache: a few windows and the scratch area
# The mount's own memory beside its cache and index (the interpreter, the serving threads' buffers): its
# bound is cache + MOUNT_SLACK + index (`dlfs bench --only memory` holds it to that). An OOM-killed mount
# of a 48 MiB group peaked at 22 MB anonymous, 9 MB file and 8-26 MB shared.
MOUNT_SLACK = 64 << 20
# Windows partly read at once past this (or a quarter of read-ahead's), most with one record read: a
# random order. DataLoader workers reading in order have one or two each, read through from their starts
# (at 32, a random epoch's latch came later: 99-150 us of mount CPU a file in the cold bench's first
# epoch against 80-98). Where the serving engine says how many processes read (the READs it sent to
# Python), two per reader, but no fewer than LATCH_MIN: each window before the latch is 8 MiB read and
# fresh memory touched for one file (the cold bench's first epoch, 2 readers at random, latched past 4
# against 16: 55-67 against 105-126 MB of cache touched, 74-86 against 78-96 us of mount CPU a file, the
# same files/s within this VM's noise; 16 readers in order latched past 4, wrongly: 0.66x against 0.86x).
LATCH_WINDOWS = 16
LATCH_MIN = 4
DIRECT_RECENT = 8  # chunks of the latest dlfs.direct misses (whether the reads are chunk-local)
PACKED_MIN = 4  # fetches of at most a slab / this (with their page-aligned slack) share slabs (slabs.py)


def _address(buf: memoryview) -> int:
    """Where a writable view's first byte is in memory (to tell where in its slab a fetch landed)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # its export would pin the buffer


def auto_cache_size(limit: MemoryLimit | None = None) -> int:
    """The default cache bound: a quarter of the memory this process may use (its memory cgroup's
    limit where that is below physical memory: a pod, a Slurm job), at least 64 MiB. It bounds
    read-ahead not yet read (what was read is the page cache's), so it is only used as far as that
    needs; the arena's pages (shared memory) are not reclaimable, which is why it must fit the real limit."""
    limit = limit or memory_limit()
    return max(MIN_AUTO_CACHE, limit.effective // 4)


def slab_size(window: int) -> int:
    """Bytes of one slab for windows of `window`: a window with its last record's block sums, and the
    slack of reading it page-aligned (O_DIRECT from local disk), in whole pages."""
    return -(-window_reach(window) // DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN * 2


class ChunkCache:
    def __init__(self, index: Index, client: ClusterClient, capacity: int = 2 << 30,
                 readahead: int = 4 << 20, prefetch: bool = True, retry_timeout: float = 0.0,
                 huge_pages: bool = True) -> None:
        self.index = index
        self.client = client
        self.window = window_size(index, readahead)
        self.reach = window_reach(self.window)  # a window's bytes at most, its last record's block sums included
        # On 2 MiB pages where `huge_pages` (the mount says no where memory is limited: see lifecycle.py).
        self.slabs = Slabs(capacity, slab_size(self.window), huge=huge_pages)
        self.slab_size, self.capacity = self.slabs.slab_size, self.slabs.capacity
        self.planner = Planner(index, self.window)
        self.fetcher = Fetcher(index, client, retry_timeout)
        self.shared: Any = None  # native.CacheOwner: the mount's half of what dlfs.direct clients see
        self.ctl_fd: int | None = None
        self._ctl: mmap.mmap | None = None
        if native is not None:
            size = native.shared_size(self.slab_size, self.slabs.nslabs, index.totals.extents, DIRECT_CLIENTS + 1)
            self.ctl_fd = os.memfd_create("dlfs-cache-control", os.MFD_CLOEXEC)
            os.ftruncate(self.ctl_fd, size)
            self._ctl = mmap.mmap(self.ctl_fd, size)
            self.shared = native.CacheOwner(self._ctl, self.slabs.arena, slab_size=self.slab_size,
                                            nslabs=self.slabs.nslabs, n_extents=index.totals.extents,
                                            n_rows=DIRECT_CLIENTS + 1)
            self.slabs.pins = self.shared
        self.held = Held(self.slabs, self.shared)
        self._scan = False  # whether the serving threads are in scan mode (see _readahead_room)
        # Whether the serving threads fetch scan mode's records of other machines' chunks themselves
        # (remotereads.py): then a dataset bigger than read-ahead keeps to scan mode through a daemon too.
        self.threads_fetch = False
        # Then read-ahead's windows of other machines' chunks are fetched on their connections and landed in C
        # too (_land_remote), not received by the event loop.
        self.landed_remote = 0  # windows so
        # Told the chunk of each record Python fetches alone (remotereads.RemoteReads.learn: a learned route).
        self.on_alone: Callable[[int], None] | None = None
        # Whether they read the records the disk cache holds from its files (diskreads.py): its fetches
        # are then in place as this machine's chunk files' are.
        self.threads_read_disk = False
        # Scan mode stays once read-ahead's windows are read in a random order (held.partial: many windows
        # partly read), whatever the dataset's size: each window then brings one record read now and the
        # rest over the whole epoch, so read-ahead holds the dataset in memory nobody can reclaim beside
        # the kernel's own copy, touching fresh memory for all of it (the cold bench's first epoch of 0.9
        # GB: 0.43-0.53x local disk at 259-351 us of mount CPU a file; scan mode from the start: 0.73-0.82x
        # at 84-88 us). The serving threads' own reads give more, each file's started at its LOOKUP (in a
        # 1 GiB group: 0.85-1.13x local disk at 82-94 us a file and a 156-162 MiB peak, against
        # 0.87-0.92x, 90-95 us and 282 MiB by window). Streams of big files still read ahead (_stream_ahead).
        # Only where the threads can read the files themselves (_reads_in_place).
        self.scan_latched = False
        self._latch_partial = max(2, min(LATCH_WINDOWS, self.held.readahead_cap // self.slab_size // 4))
        # Distinct processes behind the latest misses (0: unknown); the mount sets native.miss_readers.
        self.readers: Callable[[], int] = lambda: 0
        # A dataset bigger than read-ahead's bound also latches when read-ahead fills.
        self._bigger = index.totals.bytes > self.held.readahead_cap
        self._inflight: dict[int, trio.Event] = {}  # extent -> its fetch's end (one fetch for concurrent misses)
        self._inflight_size = 0
        self._early: set[int] = set()  # landed in C and sent whole to the kernel before _land kept them
        self._wake_asked = trio.Event()  # a window a READ waited for landed: wake the parked ones after its reply
        self._prefetch = prefetch
        # Windows (their first extent) waiting for a prefetch worker, with their tickets (when each is
        # wanted: READER_RATE) and whether they were queued as the rest of a small file's chunk, taken
        # earliest first; a window queued again for sooner gets a second entry in the heap, and the first
        # is passed over.
        self._queued: dict[int, tuple[int, bool]] = {}
        self._queue: list[tuple[int, int]] = []  # (ticket, window) heap
        self._queue_ready = trio.Semaphore(0)  # one per entry in the heap
        self._window_ns = self.slab_size * 1_000_000_000 // READER_RATE
        self.hits = self.misses = self.prefetched_bytes = 0
        self.block_reads = 0  # random reads served from just the blocks they asked for
        self.hinted = 0  # streams the serving threads started (see _hinted)
        self._direct_chunks: deque[int] = deque(maxlen=DIRECT_RECENT)  # chunks of the latest direct misses

    def close(self) -> None:
        """Let go of the memfds (the mappings go with the last reference to them)."""
        self.slabs.close()
        if self.ctl_fd is not None:
            os.close(self.ctl_fd)
            self.ctl_fd = None

    # --- room and memory ---

    def _present(self, i: int) -> bool:
        """Whether extent i is here or being fetched (the planner's view of this cache)."""
        return i in self.held or i in self._inflight

    def _room(self, more: int, direct: bool = False) -> bool:
        """Whether `more` bytes of read-ahead may join the resident part (for a dlfs.direct client: all
        of it; for the kernel's reads: READAHEAD_MAX of it)."""
        cap = self.held.resident_cap if direct else self.held.readahead_cap
        return self.held.resident_size + self._inflight_size + more <= cap

    def _room_for_window(self) -> bool:
        """Room for a stream's next window; where read-ahead is full, partly read windows give way, the
        one fetched longest ago first. In a random order of big files those are files' last windows,
        kept for the first records of the file after each in its chunk, which that order reads much
        later if at all this epoch: they filled read-ahead, and streams stopped reading ahead."""
        while not self._room(self.slab_size):
            if not self.held.evict_oldest_partial():
                return False
        return True

    def _make_room(self) -> bool:
        """Drop the oldest resident blocks until a window fits: for a dlfs.direct miss. Its clients read
        records without consuming them, so the resident part fills with what they have read; its new
        windows would otherwise go to the small scratch area and be dropped before their records are
        asked for (a chunk-local epoch fetched a third of its windows twice)."""
        while not self._room(self.slab_size, direct=True) and self.held.evict_oldest_resident():
            pass
        return self._room(self.slab_size, direct=True)

    def _direct_window(self, ext: int, room: bool) -> bool:
        """Whether a dlfs.direct miss of extent `ext` brings its window (`room`: whether read-ahead has
        room). For a dataset the part kept for such clients holds, while either has room, or where the
        reads are chunk-local (a recent miss was in its chunk, or the recent misses were in a few chunks:
        the ChunkLocalSampler's order), dropping the oldest windows for it. For a bigger one only where
        they are chunk-local: in a random order its window's other records would be dropped before they
        were asked for (a 4 MiB read per 110 KB file: 28x the bytes served, at 0.10x local disk), and a
        record alone takes a part of a slab, not a slab."""
        chunk = self.index.extent(ext).chunk
        # A random order over many chunks repeats one in 8 misses now and then (1 in 14 over 110 chunks,
        # a 4 MiB window each time), but seldom twice.
        seen = set(self._direct_chunks)
        near = len(seen) <= DIRECT_RECENT // 2 or (chunk in seen and len(seen) <= DIRECT_RECENT - 2)
        self._direct_chunks.append(chunk)
        if self.index.totals.bytes > self.held.resident_cap:
            return near and (self._room(self.slab_size, direct=True) or self._make_room())
        return room or self._room(self.slab_size, direct=True) or (near and self._make_room())

    def _readahead_room(self) -> bool:
        """Whether a miss may read ahead, and so whether the serving threads are in scan mode (read
        whole small records of this machine's chunks themselves: every miss would be fetched alone).
        Scan mode ends once half the resident part is free again, not at the first slab's room: read
        ahead in drips, each window would mostly bring records the threads had already read. Once the
        windows are read in a random order it does not end (scan_latched)."""
        if self.scan_latched:
            room = False
        elif self._scan:
            room = self.held.resident_size + self._inflight_size <= self.held.readahead_cap // 2
        else:
            room = self._room(self.slab_size)
            # Under 1.5 records read a partly read window: a random order (about 1.05 when it latches);
            # readers in order have read 2 or more of theirs from their second file on.
            shuffled = self.held.partial > self.latch_at() and 2 * self.held.partial_read < 3 * self.held.partial
            # Through a daemon, a random order alone keeps the windows (a dataset that fits is read from
            # the cache the next epoch); one bigger than read-ahead is scan mode's once the threads fetch.
            # Latching a random order there too (tried 2026-12-06, the threads fetching): on loopback the
            # first epoch ran 4,454-4,805 files/s against 2,641-3,417 by window, the second 4,347-4,935
            # against 6,146-6,964; across a 10 Gbit netns link 0.87-0.96 s against 0.80 s an epoch (and
            # 1.19-1.79 s against 0.96-1.44 s with a disk cache to fill), at 1 Gbit 2.6 s against 2.8 s.
            full, in_place = self._bigger and not room, self._reads_in_place()
            if (shuffled and in_place) or (full and (in_place or self.threads_fetch)):
                room, self.scan_latched = False, True
                readers = self.readers()
                why = (f"{self.held.partial} windows are partly read, {self.held.partial_read} records of them"
                       + (f", by {readers} reader{'s' * (readers > 1)}" if readers else "")
                       + " (a random order)" if shuffled and in_place else
                       f"read-ahead is full and the dataset ({human_bytes(self.index.totals.bytes)}) is bigger "
                       f"than its bound ({human_bytes(self.held.readahead_cap)})")
                log.info("%s: from now on small files are read one by one, each from its lookup on, not by window",
                         why)
        if room == self._scan:
            self._scan = not room
            if native is not None and self.shared is not None:
                native.set_scan(self._scan)
        return room

    def latch_at(self) -> int:
        """Windows partly read at once past which a random order latches scan mode: two per reader (one in
        order has one or two), at least LATCH_MIN; _latch_partial where the readers are not known."""
        readers = self.readers() if self.held.partial > LATCH_MIN else 0  # (only asked once it matters)
        return min(self._latch_partial, max(LATCH_MIN, 2 * readers)) if readers else self._latch_partial

    def _reads_in_place(self) -> bool:
        """Whether most of the latest fetches read this machine's chunk files (or the disk cache's, where
        the threads read it), which the serving threads can read themselves in scan mode. Where they came
        from replicas, each of scan mode's misses is a fetch of its own through Python, and windows are
        worth their memory (the cold bench's small files through the data daemon, --no-short-circuit,
        before the threads fetched: 1,233-1,624 files/s latched against 2,724-2,867 by window in the first
        epoch, 1,445-1,498 against 5,709-5,772 in the second; see _readahead_room for since)."""
        # The latest fetches, not all: the epoch that filled the disk cache came from replicas, the next from it.
        on_disk = {self.fetcher.local.node if self.fetcher.local is not None else None,
                   DISK_CACHE if self.threads_read_disk else None} - {None}
        recent = self.fetcher.recent
        return bool(on_disk) and 2 * sum(src in on_disk for src in recent) >= len(recent)

    def _take_slab(self) -> int:
        """A free slab, evicting scratch blocks (then the oldest resident ones) if none is free;
        NO_SLAB if every slab is being fetched into."""
        while not self.slabs.has_free():
            if not self.held.evict_for_slab() and not self.slabs.stop_packing():
                return NO_SLAB
        return self.slabs.take()

    def _packed(self, length: int) -> bool:
        """Whether a fetch of `length` bytes takes a part of a packed slab (with the slack of reading it
        page-aligned), not a slab of its own."""
        return (length + 2 * DIRECT_ALIGN) * PACKED_MIN <= self.slab_size

    def _take_room(self, length: int) -> tuple[int, int, int]:
        """Where a fetch of `length` bytes lands, with the slack of reading it page-aligned: (slab, offset
        in it, size of its part of the slab, or 0 for all of it). A small fetch (a record alone) takes a
        part of the slab being packed, a window a slab of its own; NO_SLAB if none can be had."""
        if not self._packed(length):
            return self._take_slab(), 0, 0
        need = length + 2 * DIRECT_ALIGN
        part = self.slabs.take_part(need)
        if part is None:
            slab = self._take_slab()
            if slab == NO_SLAB:
                return NO_SLAB, 0, 0
            self.slabs.start_packing(slab)
            part = self.slabs.take_part(need)
            assert part is not None
        return part

    def trim(self) -> int:
        """Return the pages of every free slab to the kernel; bytes given back."""
        return self.slabs.trim()

    def shed(self, nbytes: int) -> int:
        """Drop read-ahead not yet read, least useful first (scratch, then the oldest resident blocks),
        until `nbytes` of it are gone, then trim(): for memory pressure. Bytes given back."""
        self.held.shed(nbytes)
        self.slabs.stop_packing()  # its free end would otherwise stay, all but empty, until the next part
        return self.trim()

    # --- reads ---

    def __contains__(self, ext: int) -> bool:
        """Whether extent `ext` is here now (a read of it would not fetch)."""
        return ext in self.held

    def where(self, ext: int) -> tuple[int, int] | None:
        """(slab, offset) of extent `ext` if it lies whole in a slab of the shared arena now."""
        return self.shared.where(ext) if self.shared is not None else None

    async def read(self, ext: int, lo: int, hi: int, first: int, end: int,
                   size: int = 0) -> bytes | bytearray | memoryview:
        """Bytes [lo, hi) of extent `ext`'s record for a read of the file made of extents [first, end),
        fetched as its access pattern asks (planner.py): a sequential read brings the record's window
        and keeps the file's next windows in flight ahead of it; a small file (one record) brings its window and queues
        the rest of its chunk for the prefetch workers (an epoch reads its neighbours too, in whatever
        order: read-ahead's bound decides how far that goes); any other read inside a record with block
        sums fetches just the 4 KiB blocks it covers, of a small record of a big file (its tail) the
        record alone."""
        sequential = self.planner.sequential(ext, lo, hi, first, size)
        small_file = end - first == 1
        if sequential:
            return (await self.record(ext, (first, end), chunk=small_file))[lo:hi]
        if self._present(ext):
            return (await self.record(ext))[lo:hi]
        if self.index.extent(ext).record.flags & FLAG_BLOCK_SUMS:
            self.misses += 1
            self.block_reads += 1
            return await self.fetcher.blocks(ext, lo, hi)
        # A small piece of a big file (its tail record) read at random: the record alone.
        return (await self.record(ext, ahead=small_file, chunk=small_file))[lo:hi]

    async def record(self, ext: int, stream: tuple[int, int] | None = None, ahead: bool = True,
                     direct: bool = False, chunk: bool = False) -> bytes | bytearray | memoryview:
        """The raw bytes of extent `ext`, verified; CorruptData if no replica has good bytes. Whatever
        the source, the record lands in the cache and stays until the kernel (or a dlfs.direct client)
        has it. With `ahead`, a miss fetches the record's window while read-ahead has room (else the
        record alone); given `stream` (the first extent and the extents' end of a file read in order),
        the file's next windows are kept in flight too; with `chunk`, the rest of its chunk is queued
        for the prefetch workers. For a `direct` client the window comes even when read-ahead has no
        room (into the part kept for such clients): it reads the records again, and a slab per record
        would fill the cache."""
        if stream is not None:
            self._stream_ahead(ext, *stream)
        waited = False
        while True:
            hit = self.held.hit(ext)
            if hit is not None:
                self.hits += 1
                if waited and stream is not None:
                    self.planner.deepen(stream[0])
                return hit
            pending = self._inflight.get(ext)
            if pending is None:
                break
            waited = True
            await pending.wait()  # someone is fetching it; look again when they are done
        self.misses += 1
        if self.planner.asked_again(ext) and stream is not None:
            # A new generation: the file's next windows, passed over above as sent to the kernel, are wanted again.
            self._stream_ahead(ext, *stream)
        room = self._readahead_room()
        if direct:
            room = self._direct_window(ext, room)
        window = (ahead or direct) and room
        if chunk and ahead and room:
            for start in self.planner.rest_of_chunk(ext, self._present):
                self._queue_window(start, of_chunk=True)
        run = self.planner.run(ext, self._present, sent=not direct) if window else [ext]
        if not window and self.on_alone is not None:
            self.on_alone(self.index.extent(ext).chunk)
        data = await self._fetch(run, ext, direct)
        assert data is not None
        return data

    async def fetch_alone(self, exts: Sequence[int]) -> None:
        """A batch of dlfs.direct reads: those of `exts` that miss and would be read alone (no window:
        see _direct_window) are read from this machine's chunk files together, in one trip to its disk
        thread, each into a part of a shared slab, checked and kept; record() then finds them here. A
        miss whose window comes, or that cannot be read here (not here, short, corrupt), is left to
        record(), which fetches it as usual (its replicas, its errors)."""
        local = self.fetcher.local
        if local is None:
            return
        room = self._readahead_room()
        todo: list[tuple[int, Extent, bytes, int, int, int]] = []  # extent, its entry, chunk, slab, offset, part
        for ext in dict.fromkeys(exts):
            if self._present(ext):
                continue
            e = self.index.extent(ext)
            if not self._packed(e.record.stored_len) or self._direct_window(ext, room):
                continue
            slab, at, part = self._take_room(e.record.stored_len)
            if slab == NO_SLAB:
                break
            todo.append((ext, e, self.index.chunk(e.chunk).id, slab, at, part))
        if not todo:
            return
        run = [t[0] for t in todo]
        length = sum(t[1].record.stored_len for t in todo)
        done = self._claim(run, length)
        kept: set[int] = set()
        try:
            try:
                got = await local.read_records([(cid, e.record.offset, e.record.stored_len, self.slabs.view(slab, at, part))
                                                for _, e, cid, slab, at, part in todo])
            except (OSError, DlfsError) as exc:  # record() reads each as usual, and says what fails
                log.debug("a batch of %d records read alone stopped: %s", len(todo), exc)
                return
            for (ext, e, cid, slab, _, part), data in zip(todo, got):
                if data is None:
                    continue
                try:
                    await self._keep([ext], [e], cid, e.record.offset, data, local.node, ext, slab,
                                     _address(data) - _address(self.slabs.view(slab)), True, part)
                except CorruptData as exc:
                    local.failed_check(cid, exc)
                    continue
                kept.add(ext)
                self.misses += 1
                self.planner.asked_again(ext)
                self.fetcher.count_local(len(data))
        finally:
            for ext, _, _, slab, _, _ in todo:
                if ext not in kept:
                    self.slabs.release_part(slab)
            self._unclaim(run, length, done)

    def consume(self, ext: int, nbytes: int) -> None:
        """`nbytes` of extent `ext` went to the kernel, which keeps them: once all have, drop it."""
        if ext not in self.held:
            return
        if self.held.served(ext, nbytes):
            self._consumed(ext)

    def answered(self, ino: int) -> None:
        """A READ of inode `ino` is answered here (or failed): the READs of that file that the serving
        threads parked behind it (native/answer.c's start_wait) look again, after its reply."""
        if native is not None and self.shared is not None and native.read_answered(ino):
            self._wake_asked.set()

    def _consumed(self, ext: int) -> None:
        """The kernel has every byte of extent `ext`: drop it (its slab is free once it holds no other
        record), and move on the stream whose window it was in."""
        if not self.held.take_consumed(ext):
            if ext in self._inflight:  # published as it landed (_land), not kept here yet: _land drops it
                self._early.add(ext)
            return
        stream = self.planner.sent(ext)
        if stream is not None:  # a streamed window is being read: keep the stream ahead of it
            self._stream_ahead(ext, *stream)

    def _hinted(self, ino: int, ext: int) -> None:
        """The serving threads answered a read-ahead READ of inode `ino` from here, and its next record,
        extent `ext`, is neither here nor coming: the file is read in order, so its stream starts now (its
        first records came in a neighbour's window, and no READ of it reached Python)."""
        node = self.index.inode(ino)
        if node.ref < ext < node.ref + node.count:
            self.hinted += 1
            self._stream_ahead(ext - 1, node.ref, node.ref + node.count)

    async def unpark_stale(self, every: float = 1.0) -> None:
        """Run for the mount's life: wake the READs parked for a window that a READ in Python waited for,
        once that READ is answered (it is the reader's next bytes; the parked ones come after it in the
        file, and answering them first held its reply up by a copy each); and every `every` seconds
        in any case, so that the engine passes on READs parked too long (a lost wake-up strands none)."""
        if native is None or self.shared is None:
            return
        while True:
            with trio.move_on_after(every):
                await self._wake_asked.wait()
            self._wake_asked = trio.Event()
            native.wake_parked()

    async def drain_consumed(self) -> None:
        """Run for the mount's life: drop the records the serving threads sent whole to the kernel."""
        if self.shared is None:
            return
        while True:
            await trio.lowlevel.wait_readable(self.shared.consumed_fd)
            for ext in self.shared.take_consumed():
                self._consumed(ext)
            for ino, ext in self.shared.take_hints():
                self._hinted(ino, ext)
            self._readahead_room()

    # --- fetching a window ---

    def _claim(self, run: list[int], length: int) -> trio.Event:
        """Mark `run` (`length` bytes) as being fetched: reads of it wait for the event, and the serving
        threads park READs of it until it lands."""
        done = trio.Event()
        for i in run:
            self._inflight[i] = done
        self._inflight_size += length
        if self.shared is not None:
            self.shared.set_pending(run, True)
        return done

    def _unclaim(self, run: list[int], length: int, done: trio.Event, urgent: bool = False) -> None:
        self._inflight_size -= length
        for i in run:
            self._inflight.pop(i, None)
            self._early.discard(i)
        done.set()
        if self.shared is not None:
            # Published (or failed) first, then no longer pending, then the parked READs looked at: at once
            # for read-ahead, after the reply for a READ that waited here (`urgent`; unpark_stale).
            self.shared.set_pending(run, False)
            if native is not None:
                if urgent:
                    self._wake_asked.set()
                else:
                    native.wake_parked()

    async def _fetch(self, run: list[int], need: int | None, direct: bool = False,
                     order: int | None = None) -> bytes | memoryview | None:
        """Fetch the records of `run` (ascending, in one window of a chunk) as one range into one slab;
        returns `need`'s bytes (CorruptData/Unreachable if no replica has them), None for a prefetch
        (`order`: its ticket, taken when it was queued)."""
        extents = [self.index.extent(i) for i in run]
        chunk = self.index.chunk(extents[0].chunk)
        base, length, least = self.planner.span(run)
        slab, at_part, part = self._take_room(length) if length <= self.reach else (NO_SLAB, 0, 0)
        if slab == NO_SLAB and length <= self.reach:  # every slab pinned or being filled: no read-ahead
            if need is None:
                return None
            run, extents = [need], [self.index.extent(need)]
            base, length, least = self.planner.span(run)
        into = self.slabs.view(slab, at_part, part) if slab != NO_SLAB else None
        done = self._claim(run, length)
        slab_kept = False

        async def keep(got: Sequence[Buffer], node: str) -> bytes | memoryview | None:
            nonlocal slab_kept
            data = got[0]
            # RDMA may land elsewhere (its own registered memory): then the slab holds nothing; a direct
            # read of the local disk may start the bytes a little into the slab.
            in_slab = slab != NO_SLAB and isinstance(data, memoryview) and data.obj is self.slabs.arena
            at = _address(data) - _address(into) + at_part if isinstance(data, memoryview) and in_slab and into else 0
            raw = await self._keep(run, extents, chunk.id, base, data, node, need, slab if in_slab else NO_SLAB,
                                   at, direct, part)
            slab_kept = in_slab
            if need is None:
                self.prefetched_bytes += len(data)
            return raw

        try:
            if into is not None and self._lands_in_c(extents):
                landed = await self._land(run, extents, chunk.id, base, length, slab, at_part, len(into), part, need,
                                          direct, order)
                if landed is not None:
                    slab_kept = True
                    return landed[0]
            if into is not None and self._lands_remote(extents, chunk.id, base, length, least):
                landed = await self._land_remote(run, extents, extents[0].chunk, chunk.id, base, length, slab,
                                                 at_part, part, need, direct)
                if landed is not None:
                    slab_kept = True
                    return landed[0]
            return await self.fetcher.ranges(chunk.id, [(base, length)], into, keep,
                                             urgent=need is not None, order=order, least=least)
        finally:
            if not slab_kept and slab != NO_SLAB:
                (self.slabs.release_part if part else self.slabs.give)(slab)
            self._unclaim(run, length, done, urgent=need is not None)

    def _landable(self, extents: list[Extent]) -> bool:
        """Whether a window of these records may land in C at all: a shared cache, every record uncompressed
        (its stored bytes are its bytes) and few enough."""
        return (self.shared is not None and len(extents) <= LAND_MAX
                and all(not e.record.flags & FLAG_LZ4 and e.record.raw_len == e.record.stored_len for e in extents))

    def _lands_in_c(self, extents: list[Extent]) -> bool:
        """Whether a window of these records may land in C read from this machine's chunk file (LocalChunks.land)."""
        return self.fetcher.local is not None and self._landable(extents)

    async def _land(self, run: list[int], extents: list[Extent], cid: bytes, base: int, length: int, slab: int,
                    at: int, room: int, part: int, need: int | None, direct: bool,
                    order: int | None) -> tuple[bytes | memoryview | None] | None:
        """The window read from this machine's chunk file into `slab` (at `at`, `room` bytes), checked,
        published and its parked READs answered in C as it lands (LocalChunks.land), then kept here as
        _keep keeps a window: (`need`'s bytes,), or None if it did not land so (the usual path then)."""
        local = self.fetcher.local
        assert local is not None
        start = await local.land(cid, base, length, self.shared, slab, at, room,
                                 [(i, e.record.offset, e.record.stored_len, e.record.checksum)
                                  for i, e in zip(run, extents)], urgent=need is not None, order=order)
        if start is None:
            return None
        self.fetcher.count_local(length)
        return self._keep_landed(run, extents, base, length, slab, start, part, need, direct)

    def _keep_landed(self, run: list[int], extents: list[Extent], base: int, length: int, slab: int, start: int,
                     part: int, need: int | None, direct: bool) -> tuple[bytes | memoryview | None]:
        """A window landed in C, published there (chunk bytes from `base` at `start` of `slab`), kept here as
        _keep keeps one: (`need`'s bytes,)."""
        offsets = {i: start + e.record.offset - base for i, e in zip(run, extents)}
        kept: dict[int, bytes | memoryview] = {i: self.slabs.view(slab, o, e.record.stored_len)
                                                for (i, o), e in zip(offsets.items(), extents)}
        self.held.add(slab, 0, kept, offsets, direct, part, published=True)
        if need is None:
            self.prefetched_bytes += length
        for i in run:  # sent whole to the kernel between its landing and now: dropped now
            if i in self._early:
                self._early.discard(i)
                self._consumed(i)
        return (kept[need] if need is not None else None,)

    def _lands_remote(self, extents: list[Extent], cid: bytes, base: int, length: int, least: int) -> bool:
        """Whether a window of these records may be fetched and landed in C (_land_remote): the serving
        threads fetch from the data daemons, it may land in C at all, the chunk's file is not on this machine,
        and the disk cache (read before the replicas) does not hold the window."""
        if not self.threads_fetch or not self._landable(extents):
            return False
        if self.fetcher.local is not None and self.fetcher.local.here(cid):
            return False  # its file here did not land it (a failed check): the usual path says so, then fails over
        disk = self.fetcher.disk
        return disk is None or not disk.holds(cid, [(base, length)], least)

    async def _land_remote(self, run: list[int], extents: list[Extent], ci: int, cid: bytes, base: int, length: int,
                           slab: int, at: int, part: int, need: int | None,
                           direct: bool) -> tuple[bytes | memoryview | None] | None:
        """The window fetched from the data daemon the serving threads' route names for its chunk, on one of
        their connections (native/remote.h), straight into `slab` at `at`, checked, published and its parked
        READs answered in C as it lands, by a thread: the event loop receives none of its bytes. Then kept here
        as _land keeps one: (`need`'s bytes,), or None where it was not fetched so or a record failed its check
        (the usual path then fetches it, from another replica if need be, and says what went wrong)."""
        assert self.shared is not None
        recs = [(i, at + e.record.offset - base, e.record.stored_len, e.record.checksum) for i, e in zip(run, extents)]
        bad = await trio.to_thread.run_sync(self.shared.land_remote, ci, cid, base, length, slab, at, recs)
        if bad is None or bad >= 0:
            return None
        if self.fetcher.disk is not None:  # copied now, as a replica's window is: the slab is reused once read
            self.fetcher.disk.put(cid, [(base, length)], [self.slabs.view(slab, at, length)])
        self.landed_remote += 1
        return self._keep_landed(run, extents, base, length, slab, at, part, need, direct)

    async def _keep(self, run: list[int], extents: list[Extent], cid: bytes, base: int,
                    data: bytes | bytearray | memoryview, node: str, need: int | None,
                    slab: int, at: int = 0, direct: bool = False, part: int = 0) -> bytes | memoryview | None:
        """Verify the fetched records and keep them as one block (its bytes `at` bytes into `slab`, of
        which it has `part` bytes or, with 0, all);
        returns `need`'s, or raises CorruptData if it is bad (keeping nothing: the next replica's copy
        replaces them all)."""
        # xxh3 runs at ~30 GB/s here: a window's checksums cost less on the event loop than a hop to a
        # thread and back (0.3-1.5 ms measured on 2 cores); lz4 of a big range goes off the loop.
        args = (run, extents, cid, base, data, node, need, slab != NO_SLAB, at)
        if len(data) >= THREAD_BYTES and any(e.record.flags & FLAG_LZ4 for e in extents):
            kept, offsets, own = await trio.to_thread.run_sync(verify_window, *args)
        else:
            kept, offsets, own = verify_window(*args)
        self.held.add(slab, own, kept, offsets, direct, part if slab != NO_SLAB else 0)
        return kept[need] if need is not None else None

    # --- read-ahead ---

    async def prefault_worker(self) -> None:
        await self.slabs.prefault_worker()

    def _stream_ahead(self, ext: int, first: int, file_end: int) -> None:
        """The file of extents [first, file_end) is read in order, now at extent `ext`: keep its next
        windows here or queued. The serving threads answer the reads of what arrived without a word to
        Python, so it is each consumed record of a streamed window that moves the stream on."""
        for start, k in self.planner.ahead(ext, first, file_end, self._present, self._room_for_window):
            self._queue_window(start, windows_ahead=k)

    def _queue_window(self, start: int, of_chunk: bool = False, windows_ahead: int = STREAM_WINDOWS_MAX) -> None:
        """Queue the window starting at extent `start` for the prefetch workers, wanted once its reader has
        read `windows_ahead` windows (`of_chunk`: the rest of a small file's chunk, which scan mode's
        latch cancels; a stream's windows it does not)."""
        if not self._prefetch:
            return
        order = ticket(windows_ahead * self._window_ns)
        queued = self._queued.get(start)
        if queued is not None and queued[0] <= order:
            return
        self._queued[start] = (order, of_chunk and (queued is None or queued[1]))
        heapq.heappush(self._queue, (order, start))
        self._queue_ready.release()

    async def prefetch_worker(self) -> None:
        """Run for the mount's life (PREFETCH_WORKERS of them): fetch the queued windows' records that
        are not here yet, a slab each, while read-ahead has room, the earliest wanted first."""
        while True:
            await self._queue_ready.acquire()
            order, start = heapq.heappop(self._queue)
            queued = self._queued.get(start)
            if queued is None or queued[0] != order:
                continue  # queued again for sooner: that entry is the one
            del self._queued[start]
            of_chunk = queued[1]
            lo, hi = self.planner.window_of(start)
            run = [i for i in range(lo, hi) if self.planner.needed(i, self._present)]
            if not run or not self._room(self.slab_size) or (of_chunk and self.scan_latched):
                continue
            try:
                await self._fetch(run, None, order=order)
            except DlfsError as exc:
                log.debug("prefetch of extent %d's window stopped: %s", start, exc)

    def stats(self) -> dict[str, int]:
        out = {"hits": self.hits, "misses": self.misses, "stream_waits": self.planner.stream_waits,
               "block_reads": self.block_reads, "generations": self.planner.generations, "hinted": self.hinted,
               "prefetched_bytes": self.prefetched_bytes, "consumed": self.held.consumed,
               "evictions": self.held.evictions, "cached_bytes": self.held.cached_bytes,
               "retired_slabs": self.slabs.retired, "retired_pinned": self.slabs.retired_pinned,
               "own_bytes": self.held.own_size, "given_back_bytes": self.slabs.given_back,
               "landed_remote": self.landed_remote,
               **self.fetcher.stats()}
        return out
