"""The metadata engine: where the cluster's catalog is decided, behind one protocol (JuiceFS's meta engines).

The metadata daemon (dlfs/meta/service.py) answers requests; an engine decides what they change in
cluster state. What the daemon asks of it, all of it async:

    datasets / dataset     the live versions, the same from every node; one of them, its index here
    open_ingest, pin,      an ingest session's record and its pins (chunks no collection may free);
    close_ingest           closing returns the pins it published beyond this daemon, for its abort to free
    commit                 a staged index becomes its name's next version: the number is taken in one
                           transaction, the index file put in place, or nothing changes
    remove                 versions tombstoned (numbers never reused), and the mounts still holding them
    collection             one garbage collection: holds the engine's gc lock, decides the live chunks
                           at one moment (live versions, removed ones still mounted, open ingests' pins);
                           `swept()` records a complete sweep; `compact` keeps the engine's history short
    restore_index          a damaged index file here replaced by a peer's copy, where peers hold one
    run                    background work for as long as the daemon runs (following the catalog, node
                           liveness deciding the one collector, publishing pins, compaction)

Two engines implement it:

    dlfs/meta/engine_sqlite.py  EmbeddedEngine: the one-node default. The SQLite catalog under the state
                                directory (dlfs/meta/store.py, catalog.py) decides everything; nothing
                                runs in the background, no peer holds an index, a version is held by no
                                mount lease.
    dlfs/meta/engine_etcd.py    EtcdEngine: a cluster. etcd decides (dlfs/control/plane.py: versions
                                allocated in a transaction, mount leases, the gc lock, pins published by
                                dlfs/control/pins.py); the SQLite store is this daemon's copy, kept in
                                step by the follower (dlfs/meta/follow.py), so a daemon cut off from etcd
                                still serves the versions it knows.

Both keep this daemon's index files and ingest sessions in the same MetaStore (`store`), and both
hand out the same `gc_lock`: on one daemon, a commit and a collection exclude each other, each
checking against a catalog the other cannot change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from dlfs.format.index import Index
from dlfs.meta.store import MetaStore
from dlfs.wire.messages import MountHolder, VersionInfo


class Collection(Protocol):
    """One garbage collection in progress (see MetaEngine.collection)."""

    live: set[bytes]  # every chunk something needs, decided when the collection began

    async def swept(self) -> None:
        """Every data node was swept of what `live` leaves out: record what that finished."""


class MetaEngine(Protocol):
    store: MetaStore  # this daemon's index files, catalog copy and ingest sessions
    gc_lock: trio.Lock  # this daemon's commits and collections exclude each other

    async def datasets(self) -> list[VersionInfo]:
        """Every live version, by name then number."""
        ...

    async def dataset(self, name: str, version: int | None) -> VersionInfo:
        """One live version (the newest where `version` is None), its index present here; NotFound naming
        the versions there are."""
        ...

    async def open_ingest(self, sid: str, name: str) -> None:
        """Record an ingest session this daemon opened (already in `store`)."""
        ...

    async def pin(self, sid: str, ids: list[bytes]) -> None:
        """Add chunks to an open session's pins once no collection is deciding what is live."""
        ...

    async def close_ingest(self, sid: str) -> set[bytes]:
        """Drop a session's record; returns the pins it had published beyond this daemon's memory."""
        ...

    async def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        """Publish a session's staged, checked index as its name's next version (the session ends)."""
        ...

    async def remove(self, name: str, version: int | None) -> tuple[list[VersionInfo], list[MountHolder]]:
        """Tombstone the live versions (all, or one) of `name`; returns them and the mounts holding any."""
        ...

    def collection(self) -> AbstractAsyncContextManager[Collection]:
        """Entered with `gc_lock` held: hold the engine's own gc lock where it has one (etcd's; Conflict
        naming the holder if another node has it) and decide the live chunks; released on exit."""
        ...

    async def compact(self) -> None:
        """Keep the engine's history short after a collection; logs, never raises."""
        ...

    async def restore_index(self, info: VersionInfo) -> bool:
        """Replace this daemon's index file of `info` by a peer's good copy: True once done, False where
        no peer can hold one; DlfsError if none could send it."""
        ...

    async def run(self, collect: Callable[[], Awaitable[object]]) -> None:
        """The engine's background work, for as long as the daemon runs; `collect` is a collection the
        engine starts when removed versions become free (their last mount ended)."""
        ...
