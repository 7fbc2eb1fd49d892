"""The etcd metadata engine: a cluster's catalog, decided in etcd (dlfs/control/plane.py).

The SQLite store is this daemon's copy of the catalog, which the follower (dlfs/meta/follow.py) keeps
in step, and its index files. Versions are numbered in an etcd transaction; a mount's lease on its
version defers the freeing of a removed one; pins stay in memory until a collection asks for them
(dlfs/control/pins.py). What each method promises is in dlfs/meta/engine.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from dlfs.config import NodeSpec
from dlfs.control.etcd import EtcdUnavailable
from dlfs.control.pins import PinPublisher
from dlfs.control.plane import ControlPlane, Lease, VersionRecord
from dlfs.errors import DlfsError, NotFound, Unreachable
from dlfs.format.index import Index
from dlfs.meta.follow import CatalogFollower, PeerCaller
from dlfs.meta.store import MetaStore
from dlfs.tasks import open_nursery
from dlfs.wire.messages import MountHolder, VersionInfo

log = logging.getLogger(__name__)
COMPACT_INTERVAL = 300.0  # seconds between the collecting node's compactions of etcd's history


@dataclass
class _Collection:
    engine: EtcdEngine
    live: set[bytes]
    done: list[VersionRecord]  # removed versions no mount holds, not yet freed, as the snapshot saw them

    async def swept(self) -> None:
        if not self.done:
            return
        await self.engine.control.mark_freed(self.done)
        for r in self.done:
            await trio.to_thread.run_sync(self.engine.store.drop_index, r.info.name, r.info.version)
            log.info("freed the chunks of removed %s", r.label)


class EtcdEngine:
    def __init__(self, store: MetaStore, control: ControlPlane, lease: Lease | None, node: str,
                 peers: list[NodeSpec], caller: PeerCaller) -> None:
        self.store = store
        self.control = control
        self.lease = lease  # the node's membership lease: ingest sessions and the gc lock die with it
        self.node = node
        self.gc_lock = trio.Lock()
        self.follower = CatalogFollower(store, control, node, peers, caller)
        self.pins = PinPublisher(control, node, store.ingests.held)

    def _lease_id(self) -> int:
        """The node's lease, for what must die with this daemon (ingest sessions, the gc lock)."""
        if self.lease is None or not self.lease.id:
            why = self.lease.lost if self.lease is not None and self.lease.lost else "not taken yet"
            raise Unreachable(f"node {self.node} holds no lease in etcd ({self.control.etcd.describe()}): {why}")
        return self.lease.id

    async def datasets(self) -> list[VersionInfo]:
        recs, _ = await self.control.versions()  # the cluster's list, the same from every node
        return [r.info for r in recs if not r.info.removed]

    async def dataset(self, name: str, version: int | None) -> VersionInfo:
        try:
            recs, _ = await self.control.versions(name)
        except EtcdUnavailable as exc:
            # A version this daemon knows is still served (a mount of it takes its lease later);
            # one it does not know cannot be vouched for.
            try:
                return self.store.get(name, version)
            except NotFound:
                raise EtcdUnavailable(f"{exc}; this metadata daemon does not know {name}"
                                      f"{'@' + str(version) if version else ''}") from None
        rec = _pick(recs, name, version)
        await self.follower.ensure(rec)  # a version committed elsewhere a moment ago: its index, now
        return rec.info

    async def open_ingest(self, sid: str, name: str) -> None:
        await self.control.open_ingest(sid, name, self.node, self._lease_id())

    async def pin(self, sid: str, ids: list[bytes]) -> None:
        # Cleared against etcd's gc lock; published when a collection asks.
        await self.pins.pin(sid, ids, self.store.ingests.session(sid).pins)

    async def close_ingest(self, sid: str) -> set[bytes]:
        return await self.control.close_ingest(sid)  # also those published from an earlier daemon's memory

    async def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        """The number is taken in etcd (one transaction, which also drops the session's pins), then
        the index is put in place here; if that fails the version is removed again at once."""
        s = self.store.ingests.session(sid)
        t = index.totals
        info = VersionInfo(s.name, 0, size, checksum, t.files, t.bytes, t.chunks, t.chunk_size, time.time())
        info = await self.control.allocate(info, self.node, sid)
        try:
            await trio.to_thread.run_sync(self.store.install, sid, info, index)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self.control.remove(info.name, info.version)
            raise
        return info

    async def remove(self, name: str, version: int | None) -> tuple[list[VersionInfo], list[MountHolder]]:
        """Hidden from new mounts at once; tombstoned here with its index kept until its chunks are freed
        (now if nothing mounts it, else when the last mount's lease ends)."""
        gone, mounts = await self.control.remove(name, version)
        for v in gone:
            await trio.to_thread.run_sync(self.store.tombstone, v)
        return gone, [MountHolder(m.node, m.mountpoint, m.version) for m in mounts]

    @asynccontextmanager
    async def collection(self) -> AsyncIterator[_Collection]:
        """One snapshot of etcd decides (live versions, removed ones still mounted, every open ingest's
        pins), under the cluster's gc lock, which keeps new pins out until the sweep ends."""
        async with self.control.gc_lock(self.node, self._lease_id()):
            snap = await self.control.snapshot()
            live = set(snap.pins)
            for rec in snap.needed():
                name, version = rec.info.name, rec.info.version
                if not await trio.to_thread.run_sync(self.store.knows_chunks, name, version):
                    await self.follower.ensure(rec)  # a version this daemon never fetched: its chunk list
                live |= await trio.to_thread.run_sync(self.store.chunks_of, name, version)
            yield _Collection(self, live, snap.collectable())

    async def compact(self) -> None:
        try:  # the collecting node keeps etcd's history short (COMPACT_MARGIN revisions)
            await self.control.compact()
        except DlfsError as exc:
            log.info("could not compact etcd's history: %s", exc)

    async def restore_index(self, info: VersionInfo) -> bool:
        rec = VersionRecord(info, holder="", freed=False, mod_revision=0)  # any peer with its checksum
        async with self.follower.lock:
            await self.follower.fetch(rec, install=self.store.restore_index)
        return True

    async def run(self, collect: Callable[[], Awaitable[object]]) -> None:
        """Follow the catalog (the collector frees removed versions once no mount holds them), publish
        pins when a collection asks, and, on the collecting node, compact every COMPACT_INTERVAL."""

        async def collect_pending() -> None:
            if (await self.control.snapshot()).collectable():
                await collect()

        self.follower.collect = collect_pending
        async with open_nursery() as nursery:
            nursery.start_soon(self.follower.run, name="dlfs-catalog-follower")
            nursery.start_soon(self.pins.run, name="dlfs-pin-publisher")
            nursery.start_soon(self._compact_periodically, name="dlfs-etcd-compaction")

    async def _compact_periodically(self) -> None:
        while True:
            await trio.sleep(COMPACT_INTERVAL)
            try:
                if await self.follower.collector():
                    await self.control.compact()
            except DlfsError as exc:
                log.info("could not compact etcd's history: %s", exc)


def _pick(recs: list[VersionRecord], name: str, version: int | None) -> VersionRecord:
    live = [r for r in recs if not r.info.removed]
    if version is None:
        if not live:
            raise NotFound(f"no dataset named {name!r}")
        return live[-1]
    for r in recs:
        if r.info.version == version:
            if r.info.removed:
                raise NotFound(f"{name}@{version} was removed")
            return r
    if not live:
        raise NotFound(f"no dataset named {name!r}")
    raise NotFound(f"dataset {name!r} has no version {version} (it has {', '.join(str(r.info.version) for r in live)})")
