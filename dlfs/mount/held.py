"""What the cache holds: fetched records, the blocks (slabs, or memory of their own) they lie in, which
of them are published to the shared table, and when each is consumed.

A block stays until every record in it has been sent whole to the kernel (consumed: the kernel keeps
those pages) or it is evicted. Two parts, each bounded: the resident part, where read-ahead waits to
be read (the kernel's read-ahead may use READAHEAD_MAX of it, dlfs.direct clients all of it), and a
small LRU scratch area for misses fetched alone once read-ahead has no room (scan resistance: a
dataset bigger than the cache costs one fetch per missed file while the resident part keeps hitting).
Records held outside the arena (decompressed, bigger than a slab) are bounded by OWN_MEMORY.

Publishing a record (its slab and offset) lets the serving threads and dlfs.direct clients read it
with no Python; bytes sent to the kernel are counted once per record, by whoever sent them, in the
shared table (native/shm.h) or here when there is none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dlfs.mount.slabs import NO_SLAB, Slabs

# Read-ahead for the FUSE path lands in at most this much of the arena (slabs reused once consumed):
# an epoch over a bigger dataset touches this much fresh memory once per mount, not the dataset's size.
# Measured (dlfs bench --only cold): at 256 MiB the second cold epoch of 0.44 GB of small files ran at
# 0.72-0.78x local disk, at 1 GiB 0.82-1.02x.
READAHEAD_MAX = 1 << 30
# Records held outside the arena at most (decompressed ones, records bigger than a slab, those fetched
# while every slab is pinned): beside the arena, this bounds what the cache holds.
OWN_MEMORY = 8 << 20


@dataclass(slots=True)
class Block:
    """One fetched range: its memory (a slab, or its own) and the records in it not yet consumed."""

    slab: int
    nbytes: int
    resident: bool
    part: bool  # a part of a packed slab (records fetched alone), not the whole slab
    own: int  # bytes of its memory outside the arena (decompressed records, or all of it without a slab)
    live: set[int] = field(default_factory=set)
    n: int = 0  # records it was fetched with

    @property
    def partial(self) -> bool:
        """Some of its records consumed, some not: the mark of a window read out of order."""
        return 0 < len(self.live) < self.n

    @property
    def partly_read(self) -> int:
        """Its records consumed, where it is partial (else 0)."""
        return self.n - len(self.live) if self.partial else 0


class Held:
    def __init__(self, slabs: Slabs, shared: Any = None) -> None:
        self.slabs = slabs
        self.shared = shared  # native.CacheOwner, or None: served bytes then counted here
        self.records: dict[int, tuple[bytes | memoryview, int]] = {}  # extent -> (raw bytes, block)
        self._served: dict[int, int] = {}  # extent -> bytes of it sent to the kernel so far (no shared table)
        self._blocks: dict[int, Block] = {}
        self._resident: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._scratch: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.scratch_cap = slabs.capacity // 8
        self.resident_cap = slabs.capacity - self.scratch_cap
        # dlfs.direct clients keep reading what they fetched (nothing consumes it): they may use all of
        # the resident part; the kernel's read-ahead only what is in flight ahead of its readers.
        self.readahead_cap = min(self.resident_cap, max(READAHEAD_MAX, 4 * slabs.slab_size))
        self.resident_size = self.scratch_size = self.own_size = 0
        self._next_block = 0
        self.evictions = self.consumed = 0
        # Blocks partly consumed now, and their records consumed: a reader in order has one or two (the
        # window it is in, read through from its start), an epoch in a random order one for nearly every
        # window it has touched, most with one record read.
        self.partial = self.partial_read = 0

    def __contains__(self, ext: int) -> bool:
        return ext in self.records

    def hit(self, ext: int) -> bytes | memoryview | None:
        """Extent `ext`'s bytes if held (a scratch block is then the most recently used)."""
        hit = self.records.get(ext)
        if hit is None:
            return None
        if hit[1] in self._scratch:
            self._scratch.move_to_end(hit[1])
        return hit[0]

    def size(self, ext: int) -> int | None:
        hit = self.records.get(ext)
        return None if hit is None else len(hit[0])

    @property
    def cached_bytes(self) -> int:
        return self.resident_size + self.scratch_size

    def add(self, slab: int, own: int, records: dict[int, bytes | memoryview], offsets: dict[int, int],
            direct: bool = False, part: int = 0, published: bool = False) -> None:
        """Keep fetched records as one block (in `slab`, or NO_SLAB; `own`: its bytes outside the arena;
        `part`: the bytes of a packed slab it has, 0 for the whole slab); `offsets` are those lying whole
        in the slab, published (here, or already as they landed: `published`)."""
        bid = self._next_block
        self._next_block += 1
        nbytes = own + ((part or self.slabs.slab_size) if slab != NO_SLAB else 0)
        resident = self.resident_size + nbytes <= (self.resident_cap if direct else self.readahead_cap)
        self._blocks[bid] = Block(slab, nbytes, resident, bool(part), own, set(records), len(records))
        self.own_size += own
        for ext, raw in records.items():
            self.records[ext] = (raw, bid)
        if self.shared is not None and not published:
            for ext in records:  # publishing counts the record afresh too
                if ext in offsets:
                    self.shared.publish(ext, slab, offsets[ext])
                else:
                    self.shared.reset_served(ext)
        if resident:
            self._resident[bid] = None
            self.resident_size += nbytes
        else:
            self._scratch[bid] = None
            self.scratch_size += nbytes
            while self.scratch_size > self.scratch_cap and len(self._scratch) > 1:
                self._drop(next(iter(self._scratch)), evicted=True)
        while self.own_size > OWN_MEMORY:  # least recently used first, this block last
            victim = next((b for order in (self._scratch, self._resident) for b in order
                           if b != bid and self._blocks[b].own), bid)
            self._drop(victim, evicted=True)
            if victim == bid:
                break

    def _drop(self, bid: int, evicted: bool = False) -> None:
        b = self._blocks.pop(bid)
        self.partial -= b.partial
        self.partial_read -= b.partly_read
        for ext in b.live:
            self.records.pop(ext, None)
            self._served.pop(ext, None)
            if self.shared is not None:
                self.shared.unpublish(ext)
        if evicted:
            self.evictions += len(b.live)
        if b.resident:
            del self._resident[bid]
            self.resident_size -= b.nbytes
        else:
            del self._scratch[bid]
            self.scratch_size -= b.nbytes
        self.own_size -= b.own
        if b.slab != NO_SLAB:
            (self.slabs.release_part if b.part else self.slabs.release)(b.slab)

    def evict_for_slab(self) -> bool:
        """Drop the least useful block that holds a slab (scratch first, then the oldest resident);
        False if none does."""
        victim = next((b for order in (self._scratch, self._resident) for b in order
                       if self._blocks[b].slab != NO_SLAB), None)
        if victim is None:
            return False
        self._drop(victim, evicted=True)
        return True

    def evict_oldest_resident(self) -> bool:
        if not self._resident:
            return False
        self._drop(next(iter(self._resident)), evicted=True)
        return True

    def evict_oldest_partial(self) -> bool:
        """Drop the resident block fetched longest ago of those partly consumed; False if none is."""
        if not self.partial:  # none anywhere: no walk of every resident block (read-ahead full of unread ones)
            return False
        victim = next((bid for bid in self._resident if self._blocks[bid].partial), None)
        if victim is None:
            return False
        self._drop(victim, evicted=True)
        return True

    def shed(self, nbytes: int) -> None:
        """Drop read-ahead not yet read, least useful first, until `nbytes` of it are gone."""
        dropped = 0
        for order in (self._scratch, self._resident):
            while order and dropped < nbytes:
                bid = next(iter(order))
                dropped += self._blocks[bid].nbytes
                self._drop(bid, evicted=True)

    def served(self, ext: int, nbytes: int) -> bool:
        """`nbytes` of held extent `ext` went to the kernel: True once all of it has (then call
        consumed)."""
        size = self.size(ext)
        assert size is not None
        if self.shared is not None:  # one count per record, shared with the serving threads'
            return bool(self.shared.served(ext, nbytes, size))
        served = self._served.get(ext, 0) + nbytes
        if served < size:
            self._served[ext] = served
            return False
        self._served.pop(ext, None)
        return True

    def take_consumed(self, ext: int) -> bool:
        """The kernel has every byte of extent `ext`: drop it, and its block once that holds no other.
        False if it was not held."""
        hit = self.records.pop(ext, None)
        if hit is None:
            return False
        if self.shared is not None:
            self.shared.unpublish(ext)
        self.consumed += 1
        b = self._blocks[hit[1]]
        was, was_read = b.partial, b.partly_read
        b.live.discard(ext)
        self.partial += b.partial - was
        self.partial_read += b.partly_read - was_read
        if not b.live:
            self._drop(hit[1])
        return True
