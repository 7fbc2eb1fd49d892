"""The embedded metadata engine: the one-node default, decided in this daemon's SQLite catalog.

Every change is decided in the request that makes it (dlfs/meta/engine.py says what each promises):
the catalog takes a version number in the transaction that records it, a collection's live set is the
catalog's versions and this daemon's sessions' pins, and nothing runs in the background. No peer
holds an index and no mount takes a lease, so those parts of the protocol are answered here plainly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from dlfs.format.index import Index
from dlfs.meta.store import MetaStore
from dlfs.wire.messages import MountHolder, VersionInfo


@dataclass
class _Collection:
    live: set[bytes]

    async def swept(self) -> None:
        """Nothing to record: a removal already dropped its versions' chunk sets."""


class EmbeddedEngine:
    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self.gc_lock = trio.Lock()  # also keeps pins out while a collection decides what is live

    async def datasets(self) -> list[VersionInfo]:
        return self.store.datasets()

    async def dataset(self, name: str, version: int | None) -> VersionInfo:
        return self.store.get(name, version)

    async def open_ingest(self, sid: str, name: str) -> None:
        """The session in the store is its whole record."""

    async def pin(self, sid: str, ids: list[bytes]) -> None:
        # Not during a collection: it computed the live set already and would delete a chunk pinned now.
        async with self.gc_lock:
            self.store.ingests.session(sid).pins.update(ids)

    async def close_ingest(self, sid: str) -> set[bytes]:
        return set()  # pins live only in the session the store dropped

    async def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        return await trio.to_thread.run_sync(self.store.commit, sid, index, size, checksum)

    async def remove(self, name: str, version: int | None) -> tuple[list[VersionInfo], list[MountHolder]]:
        return self.store.remove(name, version), []  # no mount holds a version: its index goes at once

    @asynccontextmanager
    async def collection(self) -> AsyncIterator[_Collection]:
        # The caller holds gc_lock: the catalog and the sessions' pins cannot change under it.
        yield _Collection(await trio.to_thread.run_sync(self.store.live_chunks))

    async def compact(self) -> None:
        """SQLite keeps no history to compact."""

    async def restore_index(self, info: VersionInfo) -> bool:
        return False  # one node: no peer holds a copy

    async def run(self, collect: Callable[[], Awaitable[object]]) -> None:
        """Nothing in the background: a removal collects at once (no mount lease can defer it)."""
