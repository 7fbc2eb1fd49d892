"""The mount's chunk cache: verified, decoded records in memory, fetched by ranges of a chunk.

Memory is one arena of fixed-size slabs (a read-ahead window, and the slack of reading it page-
aligned), mapped once: a fetch is received straight into a free slab and its records are views into
it, so no buffer is allocated or copied per fetch, and slabs freed are reused most-recent first (this
VM's first touch of fresh memory costs 1-2 s per GB). Records bigger than a slab get memory of their own.

Shared: the arena is a memfd that dlfs.direct clients and the mount's native serving threads read
(native/shm.h), and every record that sits whole in a slab is published there, so they pin and read it
with no Python at all. A slab is reused only once nothing holds a pin on it: one that is still pinned
when its records are dropped waits, retired, until its pins are released (or its clients are gone).

What a record is kept for: the FUSE mount runs in no_open mode, so the kernel keeps the pages of
every file it has read; once all of a record's bytes have gone to the kernel (counted in native/shm.c
by whoever sent them: a serving thread or the Python handlers) the record is *consumed* and dropped
here, and a slab whose records are all consumed is free again. The cache therefore holds read-ahead
that has not been used yet, not a second copy of the page cache.

One fetch pipeline (_from_sources): this machine's chunk files first (a window straight from the disk
into its slab), then the node's disk cache where the mount has one (dlfs/mount/diskcache.py), then
each replica over TCP or RDMA (into the slab too); checks, failover and the counts of what each node
gave live there, and what a replica gave that passed is handed to the disk cache's writer. Each chunk is cut into fixed windows of up to a slab; a miss
that is part of a stream (see read) fetches what of its window is not here yet (one request, one
slab) and queues the rest of the chunk, and of the file, for background prefetch workers; a random
read fetches what it asks: a small record alone, or the 4 KiB blocks of a big one.

Scan resistant (CoorDL's no-thrash idea): blocks stay resident until used; once the resident part
is full, misses fetch just their own record (no read-ahead, no prefetch) into a small LRU scratch
area, so an epoch over a dataset larger than the cache costs one fetch per missed file while the
resident part keeps hitting. Concurrent misses of one window share one fetch. A replica that is
down, slow (the fetch is hedged to the next) or whose bytes fail their checksum is passed over for
the next one, and a read that no replica answers waits for one up to a bound (dlfs/client/replicas.py).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import math
import mmap
import os
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from dlfs.cgroup import MemoryLimit, memory_limit
from dlfs.client.cluster import ClusterClient
from dlfs.client.replicas import Fetched, ReplicaReader
from dlfs.counters import LatencyHistogram
from dlfs.errors import CorruptData, DlfsError
from dlfs.format.chunk import BLOCK_SIZE, FLAG_BLOCK_SUMS, FLAG_LZ4, block_range, decode_record, verify_blocks
from dlfs.format.index import Extent, Index
from dlfs.mount.diskcache import SOURCE as DISK_CACHE
from dlfs.mount.diskcache import DiskCache
from dlfs.mount.localchunks import DIRECT_ALIGN, THREAD_BYTES, LocalChunks, ticket
from dlfs.native import native

log = logging.getLogger(__name__)
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
PREFETCH_WORKERS = 4  # windows fetched ahead at once: enough to keep a disk (or a node) busy
NO_SLAB = -1
DIRECT_CLIENTS = 256  # rows of the shared pin table: processes attached through dlfs.direct at once
ENGINE_ROW = DIRECT_CLIENTS  # the row the mount's own serving threads pin through
PREFAULT_AHEAD = 16  # fresh slabs faulted in by a thread ahead of their first use
STREAMS = 4096  # records whose last read is remembered, to tell sequential reads from random ones
SEQUENTIAL_AFTER = 2  # reads continuing the one before, after which a stream fetches whole records
# READs bigger than this are the kernel's read-ahead, so part of a sequential read, in whatever order
# they arrive (several are in flight at once); smaller ones are an application's random reads. The
# serving threads draw the same line (native/answer.h).
RANDOM_READ_MAX = getattr(native, "RANDOM_READ_MAX", 64 << 10)
# Windows kept ahead of a file read in order: from the first, doubled whenever a read that reaches
# Python finds its window still in flight (the reader outran them), up to the most (a slab each).
STREAM_WINDOWS, STREAM_WINDOWS_MAX = 8, 16
# Read-ahead for the FUSE path lands in at most this much of the arena (slabs reused once consumed):
# an epoch over a bigger dataset touches this much fresh memory once per mount, not the dataset's size.
# Measured (dlfs bench --only cold): at 256 MiB the second cold epoch of 0.44 GB of small files ran at
# 0.72-0.78x local disk, at 1 GiB 0.82-1.02x.
READAHEAD_MAX = 1 << 30
# Records held outside the arena at most (decompressed ones, records bigger than a slab, those fetched
# while every slab is pinned): beside the arena, this bounds what the cache holds.
OWN_MEMORY = 8 << 20
MIN_AUTO_CACHE = 64 << 20  # the smallest default cache: a few windows and the scratch area


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
    needs; the memfd's pages are not reclaimable, which is why it must fit the real limit."""
    limit = limit or memory_limit()
    return max(MIN_AUTO_CACHE, limit.effective // 4)


def window_size(index: Index, readahead: int) -> int:
    """Bytes of a chunk fetched per miss at most (a slab's worth). No fetch spans chunks: a window
    bigger than the dataset's chunks would be memory never used."""
    return max(min(readahead, index.totals.chunk_size or readahead), 64 << 10)


def chunk_windows(index: Index, ci: int, window: int) -> list[int]:
    """The first extent of each window of chunk `ci`, then its extents' end: records packed from the
    chunk's start, each window at most `window` bytes (or one record). The mount fetches these, and
    `dlfs warmup` the same ones, so that what it leaves on disk is what the mount asks for."""
    chunk = index.chunk(ci)
    starts, base = [], -1
    for i in range(chunk.first_extent, chunk.first_extent + chunk.n_extents):
        rec = index.extent(i).record
        if base < 0 or rec.offset + rec.stored_len - base > window:
            starts.append(i)
            base = rec.offset
    starts.append(chunk.first_extent + chunk.n_extents)
    return starts


@dataclass(slots=True)
class Block:
    """One fetched range: its memory (a slab, or its own) and the records in it not yet consumed."""

    slab: int
    nbytes: int
    resident: bool
    own: int  # bytes of its memory outside the arena (decompressed records, or all of it without a slab)
    live: set[int] = field(default_factory=set)


class ChunkCache:
    def __init__(self, index: Index, client: ClusterClient, capacity: int = 2 << 30,
                 readahead: int = 4 << 20, prefetch: bool = True, retry_timeout: float = 0.0) -> None:
        self.index = index
        self.client = client
        # Replicas are raced (hedged) and, for a read that needs its bytes, waited for up to
        # retry_timeout while none answers (a restart); read-ahead gives up after one round.
        self.replicas = ReplicaReader(client, retry_timeout)
        # A slab holds a window and the slack of reading it page-aligned (O_DIRECT from local disk).
        self.window = window_size(index, readahead)
        self.slab_size = self.window + DIRECT_ALIGN * 2
        nslabs = max(capacity // self.slab_size, 4)
        self.capacity = nslabs * self.slab_size
        # A memfd, lazily touched: a large cache costs address space, not memory, until used; the
        # same pages are mapped by dlfs.direct clients.
        arena_fd = os.memfd_create("dlfs-cache", os.MFD_CLOEXEC)
        os.ftruncate(arena_fd, self.capacity)
        self.arena = mmap.mmap(arena_fd, self.capacity)
        self.arena_fd: int | None = arena_fd
        self._mem = memoryview(self.arena)
        self.shared: Any = None  # native.SharedCache: what dlfs.direct clients see
        self.ctl_fd: int | None = None
        self._ctl: mmap.mmap | None = None
        if native is not None:
            size = native.shared_size(self.slab_size, nslabs, index.totals.extents, DIRECT_CLIENTS + 1)
            self.ctl_fd = os.memfd_create("dlfs-cache-control", os.MFD_CLOEXEC)
            os.ftruncate(self.ctl_fd, size)
            self._ctl = mmap.mmap(self.ctl_fd, size)
            self.shared = native.SharedCache(self._ctl, self.arena, create=True, slab_size=self.slab_size,
                                             nslabs=nslabs, n_extents=index.totals.extents,
                                             n_rows=DIRECT_CLIENTS + 1)
        self._free = list(range(nslabs - 1, -1, -1))  # a stack: the most recently freed slab is reused first
        self._retired: list[int] = []  # slabs whose records are gone but that a client still pins
        self._punched: set[int] = set()  # free slabs whose pages went back to the kernel
        self._scan = False  # whether the serving threads are in scan mode (see _readahead_room)
        self.given_back = 0  # bytes of free slabs returned to the kernel so far
        # Fresh slabs are taken in ascending order (the free stack's bottom); those below _fresh
        # have been faulted in, by prefault_worker or by use.
        self._nslabs, self._fresh, self._taken_high = nslabs, 0, -1
        self._want_fresh = trio.Event()
        self._records: dict[int, tuple[bytes | memoryview, int]] = {}  # extent -> (raw bytes, block)
        self._served: dict[int, int] = {}  # extent -> bytes of it sent to the kernel so far
        self._blocks: dict[int, Block] = {}
        self._resident: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._scratch: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._scratch_cap = self.capacity // 8
        self._resident_cap = self.capacity - self._scratch_cap
        # dlfs.direct clients keep reading what they fetched (nothing consumes it): they may use all of
        # the resident part; the kernel's read-ahead only what is in flight ahead of its readers.
        self._readahead_cap = min(self._resident_cap, max(READAHEAD_MAX, 4 * self.slab_size))
        self._resident_size = self._scratch_size = self._inflight_size = self._own_size = 0
        self._next_block = 0
        self._inflight: dict[int, trio.Event] = {}
        self._prefetch = prefetch
        self.local: LocalChunks | None = None  # this machine's chunk files, read in place when set
        self.disk: DiskCache | None = None  # the node's disk cache, read after `local`, filled from replicas
        # Which records the kernel was sent whole, as of the current *generation*: read-ahead passes
        # them over (the kernel keeps its pages) until the kernel asks again for one it was sent, which
        # shows it drops pages (memory pressure, a dataset bigger than memory): that starts a new
        # generation, in which no earlier note holds, so every cold epoch reads ahead as the first did.
        self._sent = array("H", bytes(2 * max(index.totals.extents, 1)))
        self._generation = 1
        self.generations = 1
        # Windows (their first extent) waiting for a prefetch worker, with their tickets: read-ahead
        # reaches the disk in the order it was queued (the workers are scheduled in any order).
        self._queued: dict[int, int] = {}
        self._streams: OrderedDict[int, tuple[int, int]] = OrderedDict()  # ext -> (end of last read, run)
        # Windows read ahead of a file read in order (their first extent) -> (the file's first extent,
        # its extents' end): the consumption of one of their records moves the stream on.
        self._streaming: dict[int, tuple[int, int]] = {}
        self._depth: OrderedDict[int, int] = OrderedDict()  # a streamed file's first extent -> windows ahead
        self._windows: dict[int, list[int]] = {}  # chunk -> first extent of each of its windows, then its end
        self._queue_send, self._queue_recv = trio.open_memory_channel[int](math.inf)
        self.stream_waits = 0  # reads that found their window still being fetched: the stream then deepens
        self.hits = self.misses = self.fetches = self.fetched_bytes = self.evictions = 0
        self.prefetched_bytes = self.consumed = 0
        self.block_reads = 0  # random reads served from just the blocks they asked for
        self.retired_pinned = 0  # slabs a dlfs.direct client still pinned when their records were dropped
        self.fetched_by_node: dict[str, int] = {}  # bytes
        self.fetches_by_node: dict[str, int] = {}
        self.fetch_seconds = LatencyHistogram()

    @property
    def failovers(self) -> int:
        """Fetches that moved on to another replica after one failed."""
        return self.replicas.failovers

    @property
    def corrupt(self) -> int:
        """Replicas' bytes that failed their check."""
        return self.replicas.corrupt

    def close(self) -> None:
        """Let go of the memfds (the mappings go with the last reference to them)."""
        for fd in (self.arena_fd, self.ctl_fd):
            if fd is not None:
                os.close(fd)
        self.arena_fd = self.ctl_fd = None

    # --- room and memory ---

    def _room(self, more: int, direct: bool = False) -> bool:
        """Whether `more` bytes of read-ahead may join the resident part (for a dlfs.direct client: all
        of it; for the kernel's reads: READAHEAD_MAX of it)."""
        cap = self._resident_cap if direct else self._readahead_cap
        return self._resident_size + self._inflight_size + more <= cap

    def _make_room(self) -> bool:
        """Drop the oldest resident blocks until a window fits: for a dlfs.direct miss. Its clients read
        records without consuming them, so the resident part fills with what they have read; its new
        windows would otherwise go to the small scratch area and be dropped before their records are
        asked for (a chunk-local epoch fetched a third of its windows twice)."""
        while self._resident and not self._room(self.slab_size, direct=True):
            self._drop(next(iter(self._resident)), evicted=True)
        return self._room(self.slab_size, direct=True)

    def _readahead_room(self) -> bool:
        """Whether a miss may read ahead, and so whether the serving threads are in scan mode (read
        whole small records of this machine's chunks themselves: every miss would be fetched alone).
        Scan mode ends once half the resident part is free again, not at the first slab's room: read
        ahead in drips, each window would mostly bring records the threads had already read."""
        if self._scan:
            room = self._resident_size + self._inflight_size <= self._readahead_cap // 2
        else:
            room = self._room(self.slab_size)
        if room == self._scan:
            self._scan = not room
            if native is not None and self.shared is not None:
                native.set_scan(self._scan)
        return room

    def _take_slab(self) -> int:
        """A free slab, evicting scratch blocks (then the oldest resident ones) if none is free;
        NO_SLAB if every slab is being fetched into."""
        if not self._free and self._retired:
            self._reclaim_retired()
        while not self._free:
            victim = next((b for order in (self._scratch, self._resident) for b in order
                           if self._blocks[b].slab != NO_SLAB), None)
            if victim is None:
                return NO_SLAB
            self._drop(victim, evicted=True)
        slab = self._free.pop()
        self._punched.discard(slab)
        if slab > self._taken_high:
            self._taken_high = slab
            if self._fresh - slab <= PREFAULT_AHEAD // 2:
                self._want_fresh.set()
        return slab

    def _drop(self, bid: int, evicted: bool = False) -> None:
        b = self._blocks.pop(bid)
        for ext in b.live:
            self._records.pop(ext, None)
            self._served.pop(ext, None)
            self._unpublish(ext)
        if evicted:
            self.evictions += len(b.live)
        if b.resident:
            del self._resident[bid]
            self._resident_size -= b.nbytes
        else:
            del self._scratch[bid]
            self._scratch_size -= b.nbytes
        self._own_size -= b.own
        if b.slab != NO_SLAB:
            self._release_slab(b.slab)

    def _release_slab(self, slab: int) -> None:
        """A slab whose records are all dropped: free now, or once no client pins it."""
        if self.shared is None or self.shared.retire(slab):
            self._free.append(slab)
        else:
            self._retired.append(slab)
            self.retired_pinned += 1

    def _reclaim_retired(self) -> None:
        assert self.shared is not None
        still: list[int] = []
        for slab in self._retired:
            (self._free if self.shared.pinned(slab) == 0 else still).append(slab)
        self._retired = still

    def trim(self) -> int:
        """Return the pages of every free slab to the kernel (no record is in one, no client pins one);
        bytes given back. The memfd's pages are reclaimable no other way (there may be no swap), and a
        slab taken again is faulted in afresh."""
        if self._retired:
            self._reclaim_retired()
        n = 0
        touched = max(self._fresh, self._taken_high + 1)  # slabs above were never faulted in
        for slab in self._free:
            if slab < touched and slab not in self._punched:
                self.arena.madvise(mmap.MADV_REMOVE, slab * self.slab_size, self.slab_size)
                self._punched.add(slab)
                n += self.slab_size
        self.given_back += n
        return n

    def shed(self, nbytes: int) -> int:
        """Drop read-ahead not yet read, least useful first (scratch, then the oldest resident blocks),
        until `nbytes` of it are gone, then trim(): for memory pressure. Bytes given back."""
        dropped = 0
        for order in (self._scratch, self._resident):
            while order and dropped < nbytes:
                b = self._blocks[next(iter(order))]
                dropped += b.nbytes
                self._drop(next(iter(order)), evicted=True)
        return self.trim()

    def _unpublish(self, ext: int) -> None:
        if self.shared is not None:
            self.shared.unpublish(ext)

    def _add_block(self, slab: int, nbytes: int, records: dict[int, bytes | memoryview],
                   offsets: dict[int, int], direct: bool = False) -> None:
        """Keep fetched records as one block; `offsets` are those lying whole in the slab (published)."""
        bid = self._next_block
        self._next_block += 1
        resident = self._resident_size + nbytes <= (self._resident_cap if direct else self._readahead_cap)
        own = nbytes - (self.slab_size if slab != NO_SLAB else 0)
        self._blocks[bid] = Block(slab, nbytes, resident, own, set(records))
        self._own_size += own
        for ext, raw in records.items():
            self._records[ext] = (raw, bid)
        if self.shared is not None:
            for ext in records:  # publishing counts the record afresh too
                if ext in offsets:
                    self.shared.publish(ext, slab, offsets[ext])
                else:
                    self.shared.reset_served(ext)
        if resident:
            self._resident[bid] = None
            self._resident_size += nbytes
        else:
            self._scratch[bid] = None
            self._scratch_size += nbytes
            while self._scratch_size > self._scratch_cap and len(self._scratch) > 1:
                self._drop(next(iter(self._scratch)), evicted=True)
        while self._own_size > OWN_MEMORY:  # least recently used first, this block last
            victim = next((b for order in (self._scratch, self._resident) for b in order
                           if b != bid and self._blocks[b].own), bid)
            self._drop(victim, evicted=True)
            if victim == bid:
                break

    # --- reads ---

    def __contains__(self, ext: int) -> bool:
        """Whether extent `ext` is here now (a read of it would not fetch)."""
        return ext in self._records

    def where(self, ext: int) -> tuple[int, int] | None:
        """(slab, offset) of extent `ext` if it lies whole in a slab of the shared arena now."""
        return self.shared.where(ext) if self.shared is not None else None

    async def read(self, ext: int, lo: int, hi: int, first: int, end: int,
                   size: int = 0) -> bytes | bytearray | memoryview:
        """Bytes [lo, hi) of extent `ext`'s record for a read of the file made of extents [first, end),
        fetched as its access pattern asks, as the kernel's own read-ahead does: a READ of more than
        RANDOM_READ_MAX (`size`: the kernel's read-ahead), reading the file from its start, or a third
        read in a row continuing the one before (across records too), is sequential: the record's
        window is fetched and the file's next windows kept in flight ahead of it; a small file (one
        record) brings its window and queues the rest of its chunk for the prefetch workers (an epoch
        reads its neighbours too, in whatever order: read-ahead's bound decides how far that goes); any
        other read inside a record with block sums fetches just the 4 KiB blocks it covers, of a small
        record of a big file (its tail) the record alone."""
        sequential = self._stream(ext, lo, hi, first) or size > RANDOM_READ_MAX
        small_file = end - first == 1
        if sequential:
            return (await self.record(ext, (first, end), chunk=small_file))[lo:hi]
        if ext in self._records or ext in self._inflight:
            return (await self.record(ext))[lo:hi]
        if self.index.extent(ext).record.flags & FLAG_BLOCK_SUMS:
            return await self._fetch_blocks(ext, lo, hi)
        # A small piece of a big file (its tail record) read at random: the record alone.
        return (await self.record(ext, ahead=small_file, chunk=small_file))[lo:hi]

    def _stream(self, ext: int, lo: int, hi: int, first: int) -> bool:
        """Note a read of [lo, hi) of extent `ext` (of a file starting at extent `first`); True if it
        belongs to a sequential stream."""
        last = self._streams.pop(ext, None)
        if last is not None and last[0] == lo:
            run = last[1] + 1
        elif lo == 0 and ext > first:  # the stream may go on from the file's previous record
            prev = self._streams.get(ext - 1)
            run = prev[1] + 1 if prev is not None and prev[0] == self.index.extent(ext - 1).record.raw_len else 0
        else:
            run = 0
        self._streams[ext] = (hi, run)
        if len(self._streams) > STREAMS:
            self._streams.popitem(last=False)
        return (lo == 0 and ext == first) or run >= SEQUENTIAL_AFTER

    async def record(self, ext: int, stream: tuple[int, int] | None = None, ahead: bool = True,
                     direct: bool = False, chunk: bool = False) -> bytes | bytearray | memoryview:
        """The raw bytes of extent `ext`, verified; CorruptData if no replica has good bytes. Whatever
        the source (this machine's chunk files, a data daemon), the record lands in the cache and stays
        until the kernel (or a dlfs.direct client) has it. With `ahead`, a miss fetches the record's
        window while read-ahead has room (else the record alone); given `stream` (the first extent and
        the extents' end of a file read in order), the file's next windows are kept in flight too; with
        `chunk`, the rest of its chunk is queued for the prefetch workers. Read-ahead passes over the
        records the kernel was sent whole only until the kernel asks again for one (see _sent): then it
        has dropped pages, and a second cold epoch reads ahead as the first did. For a `direct` client
        the window comes even when read-ahead has no room (into the part kept for such clients): it
        reads the records again, and a slab per record would fill the cache."""
        if stream is not None:
            self._stream_ahead(ext, *stream)
        waited = False
        while True:
            hit = self._records.get(ext)
            if hit is not None:
                if hit[1] in self._scratch:
                    self._scratch.move_to_end(hit[1])
                self.hits += 1
                if waited and stream is not None:
                    self._deepen(stream[0])
                return hit[0]
            pending = self._inflight.get(ext)
            if pending is None:
                break
            waited = True
            await pending.wait()  # someone is fetching it; look again when they are done
        self.misses += 1
        if self._sent[ext] == self._generation:
            self._new_generation()
        room = self._readahead_room()
        if not room and direct:
            room = self._make_room()
        window = (ahead and room) or direct
        if chunk and ahead and room:
            self._queue_chunk(ext)
        data = await self._fetch(self._run(ext, sent=not direct) if window else [ext], ext, direct)
        assert data is not None
        return data

    def _count_fetch(self, node: str, nbytes: int) -> None:
        self.fetches += 1
        self.fetched_bytes += nbytes
        self.fetches_by_node[node] = self.fetches_by_node.get(node, 0) + 1
        self.fetched_by_node[node] = self.fetched_by_node.get(node, 0) + nbytes

    def consume(self, ext: int, nbytes: int) -> None:
        """`nbytes` of extent `ext` went to the kernel, which keeps them: once all have, drop it."""
        hit = self._records.get(ext)
        if hit is None:
            return
        if self.shared is not None:
            # One count per record, shared with the serving threads' (native/shm.h).
            if self.shared.served(ext, nbytes, len(hit[0])):
                self._consumed(ext)
            return
        served = self._served.get(ext, 0) + nbytes
        if served < len(hit[0]):
            self._served[ext] = served
            return
        self._served.pop(ext, None)
        self._consumed(ext)

    def _consumed(self, ext: int) -> None:
        """The kernel has every byte of extent `ext`: drop it, and its block once that holds no other."""
        hit = self._records.pop(ext, None)
        if hit is None:
            return
        self._unpublish(ext)
        self._sent[ext] = self._generation
        self.consumed += 1
        if self._streaming:
            stream = self._streaming.pop(self.window_of(ext)[0], None)
            if stream is not None:  # a streamed window is being read: keep the stream ahead of it
                self._stream_ahead(ext, *stream)
        b = self._blocks[hit[1]]
        b.live.discard(ext)
        if not b.live:
            self._drop(hit[1])

    async def unpark_stale(self, every: float = 1.0) -> None:
        """Run for the mount's life: let the engine pass on READs parked too long (each fetch's end
        wakes the parked READs anyway; this bounds the wait of any that a lost wake-up would strand)."""
        if native is None or self.shared is None:
            return
        while True:
            await trio.sleep(every)
            native.wake_parked()

    async def drain_consumed(self) -> None:
        """Run for the mount's life: drop the records the serving threads sent whole to the kernel."""
        if self.shared is None:
            return
        while True:
            await trio.lowlevel.wait_readable(self.shared.consumed_fd)
            for ext in self.shared.take_consumed():
                self._consumed(ext)
            self._readahead_room()

    def _new_generation(self) -> None:
        """The kernel asked again for a record it was sent whole: it drops pages, so no note of what
        it was sent holds any more."""
        self._generation += 1
        self.generations += 1
        if self._generation > 0xFFFF:
            self._sent = array("H", bytes(len(self._sent) * 2))
            self._generation = 1

    def _here(self, i: int, sent: bool = True) -> bool:
        """Whether extent i needs no fetch: cached, being fetched, or (with `sent`) sent whole to the
        kernel in this generation (see _sent)."""
        return (sent and self._sent[i] == self._generation) or i in self._records or i in self._inflight

    def window_of(self, ext: int) -> tuple[int, int]:
        """[first, end) extents of the window of ext's chunk that holds it. A chunk's windows are
        fixed, packed from its start to at most a slab each: whatever order the misses come in,
        each window is fetched once into one slab (runs from each miss would overlap and fill
        many slabs a little each)."""
        ci = self.index.extent(ext).chunk
        starts = self._windows.get(ci)
        if starts is None:
            starts = self._windows[ci] = chunk_windows(self.index, ci, self.window)
        k = bisect.bisect_right(starts, ext) - 1
        return starts[k], starts[k + 1]

    def _run(self, ext: int, sent: bool = True) -> list[int]:
        """`ext` and the other extents of its window that are not here (one range covers them); with
        `sent=False` those the kernel was sent too (a dlfs.direct client reads them again)."""
        lo, hi = self.window_of(ext)
        return [i for i in range(lo, hi) if i == ext or not self._here(i, sent)]

    async def _from_sources(self, cid: bytes, ranges: list[tuple[int, int]], into: memoryview | None,
                            check: Callable[[Sequence[Buffer], str], Awaitable[T]], urgent: bool = True,
                            order: int | None = None, keep: bool = True) -> T:
        """Ranges (offset, length) of chunk `cid` from the first source whose bytes pass `check`: this
        machine's chunk files first, then the disk cache, then each replica (CorruptData from `check`
        moves on to the next; so does a replica that is down). The first range lands in `into` where the
        source can put it there. What a replica sent is counted as fetched from it (good or not), what
        this machine's chunk files or the disk cache gave once it is good; good bytes from a replica go
        to the disk cache (`keep`), behind the read. The replicas are raced and, for an `urgent` read,
        waited for through a restart (ReplicaReader). CorruptData or Unreachable if no source has good
        bytes."""
        if self.local is not None:
            pieces = await self.local.read_ranges(cid, ranges, into, urgent, order)
            if pieces is not None:
                local: list[Buffer] = list(pieces)
                try:
                    out = await check(local, self.local.node)
                except CorruptData as exc:
                    self.local.fallbacks += 1  # counted there: a node's fetches are what it served well
                    self.local.failed(cid)  # its replicas from now on, until repair replaces the file
                    log.warning("%s; reading it from the replicas", exc)
                else:
                    self._count_fetch(self.local.node, sum(len(p) for p in local))
                    return out
        if self.disk is not None:
            held = await self.disk.read(cid, ranges, into, urgent, order)
            if held is not None:
                try:
                    out = await check(held, DISK_CACHE)
                except CorruptData as exc:
                    self.disk.drop(cid)
                    log.warning("%s; dropped from the disk cache, reading it from the replicas", exc)
                else:
                    self._count_fetch(DISK_CACHE, sum(len(p) for p in held))
                    return out
        out, got = await self.replicas.read(cid, ranges, into, check, self._fetched, retry=urgent)
        if self.disk is not None and keep:  # copied now: the slab is reused once its records are read
            self.disk.put(cid, ranges, got)
        return out

    def _fetched(self, f: Fetched) -> None:
        """A replica's bytes arrived (checked next): counted as fetched from it, good or not."""
        self.fetch_seconds.observe(f.seconds)
        self._count_fetch(f.node, sum(len(p) for p in f.got))

    async def _fetch(self, run: list[int], need: int | None, direct: bool = False,
                     order: int | None = None) -> bytes | memoryview | None:
        """Fetch the records of `run` (ascending, in one window of a chunk) as one range into one slab; returns
        `need`'s bytes (CorruptData/Unreachable if no replica has them), None for a prefetch (`order`: its
        ticket, taken when it was queued)."""
        extents = [self.index.extent(i) for i in run]
        chunk = self.index.chunk(extents[0].chunk)
        base = extents[0].record.offset
        length = extents[-1].record.offset + extents[-1].record.stored_len - base
        slab = self._take_slab() if length <= self.window else NO_SLAB
        if slab == NO_SLAB and length <= self.window:  # every slab pinned or being filled: no read-ahead
            if need is None:
                return None
            run, extents = [need], [self.index.extent(need)]
            base, length = extents[0].record.offset, extents[0].record.stored_len
        into = self._mem[slab * self.slab_size : (slab + 1) * self.slab_size] if slab != NO_SLAB else None
        done = trio.Event()
        for i in run:
            self._inflight[i] = done
        self._inflight_size += length
        if self.shared is not None:  # the serving threads park READs of these until they land
            self.shared.set_pending(run, True)
        slab_kept = False

        async def keep(got: Sequence[Buffer], node: str) -> bytes | memoryview | None:
            nonlocal slab_kept
            data = got[0]
            # RDMA may land elsewhere (its own registered memory): then the slab holds nothing; a direct
            # read of the local disk may start the bytes a little into the slab.
            in_slab = slab != NO_SLAB and isinstance(data, memoryview) and data.obj is self.arena
            at = _address(data) - _address(into) if isinstance(data, memoryview) and in_slab and into else 0
            raw = await self._keep(run, extents, chunk.id, base, data, node, need, slab if in_slab else NO_SLAB, at,
                                   direct)
            slab_kept = in_slab
            if need is None:
                self.prefetched_bytes += len(data)
            return raw

        try:
            return await self._from_sources(chunk.id, [(base, length)], into, keep, urgent=need is not None,
                                            order=order)
        finally:
            self._inflight_size -= length
            for i in run:
                self._inflight.pop(i, None)
            done.set()
            if not slab_kept and slab != NO_SLAB:
                self._free.append(slab)
            if self.shared is not None:
                # Published (or failed) first, then no longer pending, then the parked READs looked at.
                self.shared.set_pending(run, False)
                if native is not None:
                    native.wake_parked()

    async def _fetch_blocks(self, ext: int, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of extent `ext`'s record, reading only the 4 KiB blocks that hold them and
        their sums (a random read inside a big record); kept nowhere: the kernel keeps what it is sent."""
        e = self.index.extent(ext)
        cid = self.index.chunk(e.chunk).id
        rng = block_range(e.record, lo, hi - lo)
        start = lo - rng.first * BLOCK_SIZE

        async def check(got: Sequence[Buffer], node: str) -> memoryview:
            where = f"chunk {cid.hex()} (from {node}) record at offset {e.record.offset}"
            verify_blocks(got[0], got[1], rng, where)
            return memoryview(got[0])[start : start + hi - lo]

        self.misses += 1
        self.block_reads += 1
        # Not kept on disk: random blocks of big files are rarely read twice, and would each be an entry.
        return await self._from_sources(cid, [(rng.data_offset, rng.data_len), (rng.sums_offset, rng.sums_len)],
                                        None, check, keep=False)

    async def _keep(self, run: list[int], extents: list[Extent], cid: bytes, base: int,
                    data: bytes | bytearray | memoryview, node: str, need: int | None,
                    slab: int, at: int = 0, direct: bool = False) -> bytes | memoryview | None:
        """Verify the fetched records and keep them as one block (its bytes `at` bytes into `slab`);
        returns `need`'s, or raises CorruptData if it is bad (keeping nothing: the next replica's copy
        replaces them all)."""
        # xxh3 runs at ~30 GB/s here: a window's checksums cost less on the event loop than a hop to a
        # thread and back (0.3-1.5 ms measured on 2 cores); lz4 of a big range goes off the loop.
        if len(data) >= THREAD_BYTES and any(e.record.flags & FLAG_LZ4 for e in extents):
            kept, in_slab, nbytes = await trio.to_thread.run_sync(
                self._verify, run, extents, cid, base, data, node, need, slab, at)
        else:
            kept, in_slab, nbytes = self._verify(run, extents, cid, base, data, node, need, slab, at)
        self._add_block(slab, nbytes, kept, in_slab, direct)
        return kept[need] if need is not None else None

    def _verify(self, run: list[int], extents: list[Extent], cid: bytes, base: int,
                data: bytes | bytearray | memoryview, node: str, need: int | None,
                slab: int, at: int = 0) -> tuple[dict[int, bytes | memoryview], dict[int, int], int]:
        """(good records, those lying whole in the slab by offset, bytes the block holds); CorruptData
        if `need`'s is bad or none is good. Touches nothing shared: it may run in a thread."""
        view = memoryview(data)
        kept: dict[int, bytes | memoryview] = {}
        in_slab: dict[int, int] = {}
        nbytes = self.slab_size if slab != NO_SLAB else len(view)
        for i, e in zip(run, extents):
            rec = e.record
            piece = view[rec.offset - base : rec.offset - base + rec.stored_len]
            try:
                raw = decode_record(piece, rec, f"chunk {cid.hex()} (from {node}) record at offset {rec.offset}")
            except CorruptData:
                if i != need:
                    continue  # read ahead only: whoever needs it will fetch and report it
                raise
            if raw is not piece:
                nbytes += len(raw)  # decompressed: its own memory
            elif slab != NO_SLAB:
                in_slab[i] = at + rec.offset - base
            kept[i] = raw
        if not kept:
            raise CorruptData(f"chunk {cid.hex()} (from {node}): no record of the range is good")
        return kept, in_slab, nbytes

    async def prefault_worker(self) -> None:
        """Run for the mount's life: keep PREFAULT_AHEAD fresh slabs faulted in ahead of use, in a
        thread (first touch of fresh memory is slow on VMs, and would stall the event loop mid-read)."""
        if native is None:
            return
        while True:
            target = min(self._nslabs, self._taken_high + 1 + PREFAULT_AHEAD)
            start = max(self._fresh, self._taken_high + 1)
            if start >= target or self._taken_high < 0:  # nothing read yet: an idle mount costs no memory
                self._fresh = max(self._fresh, target)
                self._want_fresh = trio.Event()
                await self._want_fresh.wait()
                continue
            # A slab of the range may be taken and filled while this runs: populate writes no byte.
            await trio.to_thread.run_sync(native.populate, self.arena, start * self.slab_size,
                                          (target - start) * self.slab_size)
            self._fresh = target

    # --- prefetch ---

    def _deepen(self, first: int) -> None:
        """A read of the file starting at extent `first` waited for its window: keep more ahead."""
        self.stream_waits += 1
        self._depth[first] = min(self._depth.get(first, STREAM_WINDOWS) * 2, STREAM_WINDOWS_MAX)
        self._depth.move_to_end(first)
        if len(self._depth) > STREAMS:
            self._depth.popitem(last=False)

    def _stream_ahead(self, ext: int, first: int, file_end: int) -> None:
        """The file of extents [first, file_end) is read in order, now at extent `ext`: keep its next
        windows (as many as its depth) here or queued. The serving threads answer the reads of what
        arrived without a word to Python, so it is each consumed record of a streamed window that
        moves the stream on."""
        depth = self._depth.get(first, STREAM_WINDOWS)
        nxt = self.window_of(ext)[1]
        for _ in range(depth):
            if nxt >= file_end or not self._room(self.slab_size):
                return
            self._streaming[nxt] = (first, file_end)
            if not self._here(nxt):
                self._queue_window(nxt)
            nxt = self.window_of(nxt)[1]

    def _queue_chunk(self, ext: int) -> None:
        """Queue the windows of extent `ext`'s chunk that are not here, but its own, for prefetch."""
        mine = self.window_of(ext)[0]
        chunk = self.index.chunk(self.index.extent(ext).chunk)
        start, end = chunk.first_extent, chunk.first_extent + chunk.n_extents
        while start < end:
            if start != mine and not self._here(start):
                self._queue_window(start)
            start = self.window_of(start)[1]

    def _queue_window(self, start: int) -> None:
        if self._prefetch and start not in self._queued:
            self._queued[start] = ticket()
            self._queue_send.send_nowait(start)

    async def prefetch_worker(self) -> None:
        """Run for the mount's life (PREFETCH_WORKERS of them): fetch the queued windows' records that
        are not here yet, a slab each, while read-ahead has room."""
        async for start in self._queue_recv:
            order = self._queued.pop(start, None)
            lo, hi = self.window_of(start)
            run = [i for i in range(lo, hi) if not self._here(i)]
            if not run or not self._room(self.slab_size):
                continue
            try:
                await self._fetch(run, None, order=order)
            except DlfsError as exc:
                log.debug("prefetch of extent %d's window stopped: %s", start, exc)

    def stats(self) -> dict[str, int]:
        if self._retired:
            self._reclaim_retired()  # so retired_slabs counts only those still pinned
        out = {"hits": self.hits, "misses": self.misses, "fetches": self.fetches,
               "fetched_bytes": self.fetched_bytes, "prefetched_bytes": self.prefetched_bytes,
               "block_reads": self.block_reads, "stream_waits": self.stream_waits,
               "generations": self.generations,
               "consumed": self.consumed, "evictions": self.evictions,
               "cached_bytes": self._resident_size + self._scratch_size, "corrupt": self.corrupt,
               "retired_slabs": len(self._retired), "retired_pinned": self.retired_pinned,
               "own_bytes": self._own_size, "given_back_bytes": self.given_back,
               "tcp_fallbacks": self.client.tcp_fallbacks, **self.replicas.stats()}
        if self.client.rdma is not None:
            out.update(self.client.rdma.stats())
        if self.local is not None:
            out.update(self.local.stats())
        if self.disk is not None:
            out.update(self.disk.stats())
        return out
