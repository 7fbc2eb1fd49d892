"""The cache's memory: one arena of fixed-size slabs in a shared file, mapped once, shared with the
mount's serving threads and dlfs.direct clients (native/shm.h).

The file is on 2 MiB pages where the mount can have them (native/hugearena.c: an unnamed file of a
private tmpfs; else a memfd, which gets them where the admin allows shared memory huge pages): a
window read from the disk with O_DIRECT is then one request of a few segments, not four of 254.

A slab holds one read-ahead window and the slack of reading it page-aligned (O_DIRECT). Freed slabs
are reused most-recent first, so a stream keeps reusing the few slabs it has in flight (this VM's
first touch of fresh memory costs 1-2 s per GB); fresh ones are faulted in ahead of use by a thread.
A slab that a client still pins when its records are dropped waits, retired, until its pins are
released. Records fetched alone (a random order's misses: ~110 KB each) share slabs: each takes a
part of the slab being packed (page-aligned, for O_DIRECT), and a slab packed so is free again once
its last part is dropped; a slab each would hold a 256 MiB cache of 4 MiB slabs to 60 such records.
Free slabs' pages go back to the kernel on demand (trim): shared memory is reclaimable no other way
when there is no swap. Which slab holds what is the cache's business, not this module's.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from typing import Any

import trio

from dlfs.native import native

log = logging.getLogger(__name__)
NO_SLAB = -1
# Fresh slabs faulted in by a thread ahead of their first use. Each is cleared memory the mount pays for
# once (1-2 s of CPU per GB on this VM): 16 ahead left a fresh mount's small-file epoch 143-181 MB of
# cache touched against 105-118 MB at 4, and its big-file pass at 1 reader 881 MB/s and 0.54 s of mount
# CPU against 940 MB/s and 0.47 s (6 alternated rounds; 2 readers alike).
PREFAULT_AHEAD = 4
PART_ALIGN = 4096  # where parts of a packed slab start: a page (O_DIRECT lands page-aligned)
MIN_SLABS = 4  # a cache smaller than this many slabs is made this big: a window read, a few ahead


def arena_file(size: int, huge: bool = True) -> tuple[int, bool]:
    """A shared file of `size` bytes for the arena, and whether it is on huge pages for certain: a
    private huge tmpfs's (root may mount one, where `huge`), else a memfd."""
    if native is not None and huge:
        try:
            fd = native.huge_arena(tempfile.gettempdir(), size)
            log.info("the cache is on 2 MiB pages (a private tmpfs)")
            return fd, True
        except OSError as exc:
            log.info("%s; the cache is a memfd", exc)
    fd = os.memfd_create("dlfs-cache", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, False


class Slabs:
    """The arena and which of its slabs are free, retired or given back. One owner: the chunk cache."""

    def __init__(self, capacity: int, slab_size: int, huge: bool = True) -> None:
        self.slab_size = slab_size
        self.nslabs = max(capacity // slab_size, MIN_SLABS)
        self.capacity = self.nslabs * slab_size
        # Lazily touched: a large cache costs address space, not memory, until used; the same pages
        # are mapped by dlfs.direct clients.
        self.fd: int | None
        self.fd, self.huge = arena_file(self.capacity, huge)
        self.arena = mmap.mmap(self.fd, self.capacity)
        if huge and not self.huge and hasattr(mmap, "MADV_HUGEPAGE"):
            self.arena.madvise(mmap.MADV_HUGEPAGE)  # heeded where shmem_enabled says "advise"
        self.mem = memoryview(self.arena)
        self.pins: Any = None  # the shared table, which counts clients' pins per slab (set once it exists)
        self._free = list(range(self.nslabs - 1, -1, -1))  # a stack: the most recently freed is reused first
        self._retired: list[int] = []  # slabs whose records are gone but that a client still pins
        self._punched: set[int] = set()  # free slabs whose pages went back to the kernel
        self.given_back = 0  # bytes of free slabs returned to the kernel so far
        self.retired_pinned = 0  # slabs a client still pinned when their records were dropped
        # Fresh slabs are taken in ascending order (the free stack's bottom); those below `fresh` have
        # been faulted in, by prefault_worker or by use.
        self.fresh, self._taken_high = 0, -1
        self._populated = 0  # slabs below this were faulted in by prefault_worker
        self._want_fresh = trio.Event()
        self._packing, self._pack_at = NO_SLAB, 0  # the slab parts are taken from now, and its next free byte
        self._parts: dict[int, int] = {}  # packed slab -> parts of it not yet dropped

    def view(self, slab: int, at: int = 0, nbytes: int = 0) -> memoryview:
        """Slab `slab`, or `nbytes` of it from `at` (a part)."""
        start = slab * self.slab_size + at
        return self.mem[start : start + (nbytes or self.slab_size - at)]

    @property
    def touched(self) -> int:
        """Bytes of the arena faulted in so far (taken, or faulted in ahead of use): the fresh memory the
        cache has cost, whatever is free again since."""
        return max(self._populated, self._taken_high + 1) * self.slab_size

    def has_free(self) -> bool:
        if not self._free and self._retired:
            self.reclaim_retired()
        return bool(self._free)

    def take(self) -> int:
        """A free slab (has_free() must be true): one used before where there is one, retired ones
        included."""
        if self._retired and self._free[-1] > self._taken_high:
            # A serving thread's pin outlives its record's drop by microseconds: without this, each slab
            # retired so waited for the free list to empty while fresh memory was touched in its place.
            self.reclaim_retired()
        slab = self._free.pop()
        self._punched.discard(slab)
        if slab > self._taken_high:
            self._taken_high = slab
            if self.fresh - slab <= PREFAULT_AHEAD // 2:
                self._want_fresh.set()
        return slab

    def give(self, slab: int) -> None:
        """A slab taken but never filled: free again at once (nothing can pin it)."""
        self._free.append(slab)

    def release(self, slab: int) -> None:
        """A slab whose records are all dropped: free now, or once no client pins it."""
        if self.pins is None or self.pins.retire(slab):
            self._free.append(slab)
        else:
            self._retired.append(slab)
            self.retired_pinned += 1

    def take_part(self, nbytes: int) -> tuple[int, int, int] | None:
        """(slab, offset, size) of a part of at least `nbytes` in the slab being packed, or None where it
        has no room left (then start_packing a free slab)."""
        need = -(-nbytes // PART_ALIGN) * PART_ALIGN
        if self._packing == NO_SLAB or self._pack_at + need > self.slab_size:
            return None
        at, self._pack_at = self._pack_at, self._pack_at + need
        self._parts[self._packing] += 1
        return self._packing, at, need

    def start_packing(self, slab: int) -> None:
        """Pack parts into `slab` (taken, free) from now on; the slab packed before is released once its
        parts are (now, if none is left). Its offsets only grow: a part dropped is never written again
        while the slab is packed, so a client's pin on it holds."""
        self.stop_packing()
        self._packing, self._pack_at = slab, 0
        self._parts[slab] = 0

    def stop_packing(self) -> bool:
        """Pack no more into the slab being packed; True if that released it (no part of it was left:
        free, or retired while a client pins it)."""
        old, self._packing = self._packing, NO_SLAB
        if old == NO_SLAB or self._parts[old]:
            return False
        del self._parts[old]
        self.release(old)
        return True

    def release_part(self, slab: int) -> None:
        """A part of packed `slab` dropped (or never filled): the slab is released with its last part,
        unless parts are still taken from it."""
        self._parts[slab] -= 1
        if not self._parts[slab] and slab != self._packing:
            del self._parts[slab]
            self.release(slab)

    def reclaim_retired(self) -> None:
        still: list[int] = []
        for slab in self._retired:
            (self._free if self.pins.pinned(slab) == 0 else still).append(slab)
        self._retired = still

    @property
    def retired(self) -> int:
        """Retired slabs still pinned."""
        if self._retired:
            self.reclaim_retired()
        return len(self._retired)

    def trim(self) -> int:
        """Return the pages of every free slab to the kernel (no record is in one, no client pins one);
        bytes given back. A slab taken again is faulted in afresh."""
        if self._retired:
            self.reclaim_retired()
        n = 0
        touched = max(self.fresh, self._taken_high + 1)  # slabs above were never faulted in
        for slab in self._free:
            if slab < touched and slab not in self._punched:
                self.arena.madvise(mmap.MADV_REMOVE, slab * self.slab_size, self.slab_size)
                self._punched.add(slab)
                n += self.slab_size
        self.given_back += n
        return n

    async def prefault_worker(self) -> None:
        """Run for the mount's life: keep PREFAULT_AHEAD fresh slabs faulted in ahead of use, in a
        thread (first touch of fresh memory is slow on VMs, and would stall the event loop mid-read)."""
        if native is None:
            return
        while True:
            target = min(self.nslabs, self._taken_high + 1 + PREFAULT_AHEAD)
            start = max(self.fresh, self._taken_high + 1)
            if start >= target or self._taken_high < 0:  # nothing read yet: an idle mount costs no memory
                self.fresh = max(self.fresh, target)
                self._want_fresh = trio.Event()
                await self._want_fresh.wait()
                continue
            # A slab of the range may be taken and filled while this runs: populate writes no byte.
            await trio.to_thread.run_sync(native.populate, self.arena, start * self.slab_size,
                                          (target - start) * self.slab_size)
            self.fresh = self._populated = target

    def close(self) -> None:
        """Let go of the file (the mapping goes with the last reference to it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
