"""Giving memory back: the mount's cache returns what it can to the kernel when its memory cgroup runs
short, or when the mount has been idle a while.

The cache's pages (shared memory) cannot be reclaimed by the kernel (no swap, often), so under a limit an OOM
kill is the kernel's only remedy unless the mount lets go first. The watch reads the limiting group's
unreclaimable memory (anonymous + shared) once a second: over HIGH_WATER of the limit, the cache drops
read-ahead not yet read (scratch first, then the oldest) until it is back under LOW_WATER, and returns
its free slabs' pages; an idle mount returns its free slabs' pages too.
"""

from __future__ import annotations

import logging

import trio

from dlfs.cgroup import MemoryLimit
from dlfs.mount.cache import ChunkCache
from dlfs.units import human_bytes

log = logging.getLogger(__name__)
INTERVAL = 1.0  # seconds between looks at the group's memory
HIGH_WATER = 0.90  # of the limit, unreclaimable: shed read-ahead from here
LOW_WATER = 0.80  # ... down to here
IDLE_TRIM = 30.0  # seconds without a fetch, after which free slabs go back to the kernel


async def watch_memory(cache: ChunkCache, limit: MemoryLimit) -> None:
    """Run for the mount's life."""
    idle_since, fetches, pressed = trio.current_time(), cache.fetcher.fetches, False
    while True:
        await trio.sleep(INTERVAL)
        used = limit.unreclaimable() if limit.limited else None
        if used is not None and used > HIGH_WATER * limit.effective:
            freed = cache.shed(int(used - LOW_WATER * limit.effective))
            if not pressed:
                log.warning("memory cgroup %s: %s of %s cannot be reclaimed; the cache gave back %s",
                            limit.group, human_bytes(used), human_bytes(limit.effective), human_bytes(freed))
            pressed = True
            continue
        pressed = False
        if cache.fetcher.fetches != fetches:
            idle_since, fetches = trio.current_time(), cache.fetcher.fetches
        elif trio.current_time() - idle_since > IDLE_TRIM and (freed := cache.trim()):
            log.info("idle for %.0f s: returned %s of free cache slabs to the kernel", IDLE_TRIM, human_bytes(freed))
