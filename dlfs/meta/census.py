"""The metadata daemon's count of chunks short of replicas, for its metrics.

Presence only (one HAS_CHUNKS per data node, as `dlfs status` does), and at most once per
`max_age` seconds however often it is scraped: the count costs the data daemons a directory
lookup per chunk, never a read.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import trio

from dlfs.errors import DlfsError
from dlfs.meta.store import MetaStore

log = logging.getLogger(__name__)
CENSUS_TIMEOUT = 20.0


class Holders(Protocol):
    async def holders(self, ids: list[bytes]) -> tuple[dict[bytes, list[str]], list[str]]: ...


class ReplicaCensus:
    def __init__(self, store: MetaStore, holders: Holders, replicas: int, node: str, max_age: float = 60.0) -> None:
        self.store = store
        self.holders = holders
        self.replicas = replicas
        self.node = node
        self.max_age = max_age
        self.chunks = 0  # chunks of live versions
        self.under_replicated = 0  # of those, stored on fewer than R reachable data nodes
        self.replicas_missing = 0  # replicas those chunks lack, all together
        self.unreachable = 0  # data nodes that did not answer
        self.taken_at = 0.0  # wall-clock time of the last count, 0 before the first
        self._taken = -float("inf")  # trio clock of the last attempt
        self._lock = trio.Lock()

    async def refresh(self) -> None:
        """Count again if the last count is older than max_age; bounded, and never raises."""
        async with self._lock:  # concurrent scrapes wait for one count rather than each making one
            if trio.current_time() - self._taken < self.max_age:
                return
            self._taken = trio.current_time()
            try:
                with trio.fail_after(CENSUS_TIMEOUT):
                    ids = sorted(await trio.to_thread.run_sync(self.store.committed_chunks))
                    held, down = await self.holders.holders(ids)
            except (DlfsError, OSError, trio.TooSlowError) as exc:
                log.warning("node %s: replica count failed: %s", self.node, exc or "timed out")
                return
            short = [len(nodes) for nodes in held.values() if len(nodes) < self.replicas]
            self.chunks = len(ids)
            self.under_replicated = len(short)
            self.replicas_missing = sum(self.replicas - n for n in short)
            self.unreachable = len(down)
            self.taken_at = time.time()
            if short:
                log.info("node %s: %d of %d chunks have fewer than %d replicas (%d replicas missing)",
                         self.node, len(short), len(ids), self.replicas, self.replicas_missing)
