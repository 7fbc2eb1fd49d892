"""The metadata daemon's request handlers: catalog reads, index transfer, ingest commit, removal.

Two kinds of catalog behind one set of handlers: the embedded one-node default decides everything in
its SQLite catalog; a cluster (`control` set) decides in etcd (dlfs/control/plane.py) and keeps the
SQLite catalog as its local copy, which the follower (dlfs/meta/follow.py) keeps in step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import trio
from msgspec.structs import replace

from dlfs.config import NodeSpec
from dlfs.control.etcd import EtcdUnavailable
from dlfs.control.pins import PinPublisher
from dlfs.control.plane import ControlPlane, Lease, VersionRecord, mounts_phrase
from dlfs.errors import Conflict, DlfsError, NotFound, Unreachable
from dlfs.format.check import check_index
from dlfs.meta.follow import CatalogFollower
from dlfs.meta.store import MetaStore, VersionInfo
from dlfs.tasks import open_nursery
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.messages import (
    BeginIngest,
    Collected,
    Commit,
    DatasetList,
    DatasetRef,
    Empty,
    IndexCheck,
    IndexesChecked,
    IndexPiece,
    IngestBegun,
    MetaStatus,
    MountHolder,
    PinChunks,
    PutIndex,
    Removed,
    SessionRef,
)
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Reply, Route, Service, reserve_reply

log = logging.getLogger(__name__)
MAX_INDEX_PIECE = 16 << 20
ABORT_RETRY = (2.0, 30.0)  # seconds between tries to finish an abort that etcd held up: first, most
ABORT_GIVE_UP = 24 * 3600.0  # an abort still failing after this is left to the next `dlfs gc`
COMPACT_INTERVAL = 300.0  # seconds between the collecting node's compactions of etcd's history


class ChunkLedger(Protocol):
    """What the metadata daemon asks of the data daemons (the cluster client provides it)."""

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]: ...

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]: ...


class MetaService(Service):
    name = "meta"

    def __init__(self, store: MetaStore, key: bytes, node: str, ledger: ChunkLedger,
                 peers: list[NodeSpec] | None = None, memory: MemoryBudget | None = None,
                 control: ControlPlane | None = None, lease: Lease | None = None) -> None:
        super().__init__(key, node, memory)
        self.store = store
        self.ledger = ledger
        self.control = control
        self.lease = lease  # the node's membership lease: ingest sessions and the gc lock die with it
        self.follower = CatalogFollower(store, control, node, peers or [], ledger) if control else None  # type: ignore[arg-type]
        if self.follower is not None:
            self.follower.collect = self.collect_pending
        self.pins = PinPublisher(control, node, self._open_pins) if control else None
        # Aborted sessions whose etcd record or chunks are not freed yet (etcd was down): sid -> (pins, since).
        self._aborting: dict[str, tuple[set[bytes], float]] = {}
        self._committing: set[str] = set()  # sessions whose COMMIT is running
        # Commit and collection exclude each other: a commit checks its chunks exist and a
        # collection decides what is dead, each against a catalog the other cannot change.
        self.gc_lock = trio.Lock()
        self.handlers.update({
            Msg.STATUS: Route(Empty, self.status),
            Msg.LIST_DATASETS: Route(Empty, self.list_datasets),
            Msg.GET_DATASET: Route(DatasetRef, self.get_dataset),
            Msg.READ_INDEX: Route(IndexPiece, self.read_index),
            Msg.BEGIN_INGEST: Route(BeginIngest, self.begin_ingest),
            Msg.PIN_CHUNKS: Route(PinChunks, self.pin_chunks),
            Msg.PUT_INDEX: Route(PutIndex, self.put_index),
            Msg.COMMIT: Route(Commit, self.commit),
            Msg.ABORT_INGEST: Route(SessionRef, self.abort_ingest),
            Msg.REMOVE: Route(DatasetRef, self.remove),
            Msg.COLLECT: Route(Empty, self.collect),
            Msg.CHECK_INDEXES: Route(IndexCheck, self.check_indexes),
        })

    def _lease_id(self) -> int:
        """The node's lease, for what must die with this daemon (ingest sessions, the gc lock)."""
        assert self.control is not None
        if self.lease is None or not self.lease.id:
            why = self.lease.lost if self.lease is not None and self.lease.lost else "not taken yet"
            raise Unreachable(f"node {self.node} holds no lease in etcd ({self.control.etcd.describe()}): {why}")
        return self.lease.id

    async def status(self, req: Empty, data: bytearray) -> Reply:
        self.store.expire_sessions()  # a killed ingest is not "in progress" (etcd's record goes in expire_idle)
        live = self.store.datasets()
        return MetaStatus(self.node, len({v.name for v in live}), len(live), len(self.store.sessions)), b""

    async def list_datasets(self, req: Empty, data: bytearray) -> Reply:
        if self.control is not None:  # the cluster's list, the same from every node
            recs, _ = await self.control.versions()
            return DatasetList([r.info for r in recs if not r.info.removed]), b""
        return DatasetList(self.store.datasets()), b""

    async def get_dataset(self, req: DatasetRef, data: bytearray) -> Reply:
        name, version = req.name, req.version
        if self.control is None:
            return self.store.get(name, version), b""
        try:
            recs, _ = await self.control.versions(name)
        except EtcdUnavailable as exc:
            # A version this daemon knows is still served (a mount of it takes its lease later);
            # one it does not know cannot be vouched for.
            try:
                return self.store.get(name, version), b""
            except NotFound:
                raise EtcdUnavailable(f"{exc}; this metadata daemon does not know {name}"
                                      f"{'@' + str(version) if version else ''}") from None
        rec = _pick(recs, name, version)
        assert self.follower is not None
        await self.follower.ensure(rec)  # a version committed elsewhere a moment ago: its index, now
        return rec.info, b""

    async def read_index(self, req: IndexPiece, data: bytearray) -> Reply:
        length = min(req.length, MAX_INDEX_PIECE)
        await reserve_reply(length)  # the piece is read into memory and held until it is sent
        piece = await trio.to_thread.run_sync(self.store.read_index, req.name, req.version, req.offset, length)
        return Empty(), piece

    async def begin_ingest(self, req: BeginIngest, data: bytearray) -> Reply:
        await self._expire()
        sid = self.store.begin(req.name)
        if self.control is not None:
            try:
                await self.control.open_ingest(sid, req.name, self.node, self._lease_id())
            except BaseException:
                self.store.abort(sid)
                raise
        log.info("ingest of %s began (session %s)", req.name, sid)
        return IngestBegun(sid, self.store.session_ttl), b""

    async def _expire(self) -> None:
        """Drop the sessions of ingests that stopped asking (killed): their pins, here and in etcd, go."""
        self.store.expire_sessions()
        control = self.control
        if control is None:
            self.store.expired.clear()
        while control is not None and self.store.expired:
            sid = self.store.expired.pop()
            try:
                await control.close_ingest(sid)
            except DlfsError as exc:  # tried again at the next expiry; the node's lease bounds them anyway
                self.store.expired.append(sid)
                log.warning("could not close expired ingest session %s in etcd: %s", sid, exc)
                return

    async def expire_idle(self) -> None:
        """Expire dead ingests' sessions on time, also where no request comes (a cluster's gc elsewhere)."""
        while True:
            await trio.sleep(max(self.store.session_ttl / 4, 0.1))
            await self._expire()

    async def pin_chunks(self, req: PinChunks, data: bytearray) -> Reply:
        # Not during a collection: it computed the live set already and would delete a chunk
        # pinned now, after this reply told the ingest the chunk was safe.
        ids = req.ids
        if not ids:  # the ingest's keepalive (no collection to wait for)
            self.store.session(req.session)
            return Empty(), b""
        if self.pins is not None:  # cleared against etcd's gc lock; published when a collection asks
            s = self.store.session(req.session)
            await self.pins.pin(req.session, ids, s.pins)
            return Empty(), b""
        async with self.gc_lock:
            s = self.store.session(req.session)
            s.pins.update(ids)
        return Empty(), b""

    def _not_committing(self, sid: str) -> None:
        # A session's staged file is moved into place by its commit: nothing else may touch it meanwhile.
        if sid in self._committing:
            raise Conflict(f"ingest session {sid} is being committed")

    async def put_index(self, req: PutIndex, data: bytearray) -> Reply:
        self._not_committing(req.session)
        await trio.to_thread.run_sync(self.store.put_index, req.session, req.offset, data)
        return Empty(), b""

    async def commit(self, req: Commit, data: bytearray) -> Reply:
        self._not_committing(req.session)
        self._committing.add(req.session)
        try:
            return await self._commit(req)
        finally:
            self._committing.discard(req.session)

    async def _commit(self, req: Commit) -> Reply:
        sid, size, checksum = req.session, req.size, req.checksum
        s, index = await trio.to_thread.run_sync(self.store.staged_chunks, sid, size, checksum)
        try:
            # Every reader trusts a committed index's references: refuse one that is not sane inside.
            await trio.to_thread.run_sync(check_index, index)
            ids = index.chunk_ids()
            if not set(ids) <= s.pins:
                raise Conflict(f"ingest of {s.name} commits chunks it never pinned")
            async with self.gc_lock:
                short = await self.ledger.under_replicated(ids)
                if short:
                    cid, nodes = next(iter(short.items()))
                    raise Conflict(
                        f"ingest of {s.name}: {len(short)} chunks have fewer than the cluster's replicas "
                        f"(e.g. chunk {cid.hex()} on {len(nodes)} nodes); run the ingest again"
                    )
                if self.control is None:
                    info = await trio.to_thread.run_sync(self.store.commit, sid, index, size, checksum)
                else:
                    info = await self._commit_in_cluster(sid, index, size, checksum)
        finally:
            index.close()
        log.info("committed dataset %s version %d: %d files, %d bytes, %d chunks",
                 info.name, info.version, info.files, info.bytes, info.chunks)
        return info, b""

    async def _commit_in_cluster(self, sid: str, index: Any, size: int, checksum: int) -> VersionInfo:
        """The number is taken in etcd (one transaction, which also drops the session's pins), then
        the index is put in place here; if that fails the version is removed again at once."""
        assert self.control is not None
        s = self.store.session(sid)
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

    async def abort_ingest(self, req: SessionRef, data: bytearray) -> Reply:
        """Give a failed ingest up and free its chunks that nothing else needs, now (no `dlfs gc`). In a
        cluster with etcd unreachable, this daemon finishes it when etcd answers again (`upkeep`)."""
        self._not_committing(req.session)
        pins = self.store.abort(req.session)
        if self.control is None:
            if pins:
                try:
                    freed, deferred = await self._collect(only=pins)
                    log.info("ingest session %s given up: %d of its %d chunks freed%s", req.session, freed,
                             len(pins), f" ({deferred})" if deferred else "")
                except DlfsError as exc:
                    log.warning("ingest session %s given up; its chunks are freed later: %s", req.session, exc)
            return Empty(), b""
        self._aborting[req.session] = (pins, trio.current_time())
        try:
            await self._finish_abort(req.session)
        except DlfsError as exc:
            log.warning("ingest session %s given up, but %s: this node frees its %d chunks when it can (retrying)",
                        req.session, exc, len(pins))
        return Empty(), b""

    async def _finish_abort(self, sid: str) -> None:
        """Close an aborted session in etcd and free its chunks nothing else needs; raises (and keeps it
        for another try) while etcd, the gc lock or a data node holds that up."""
        assert self.control is not None
        pins, _ = self._aborting[sid]
        pins |= await self.control.close_ingest(sid)  # also those published from an earlier daemon's memory
        if pins:
            freed, deferred = await self._collect(only=pins)
            log.info("ingest session %s given up: %d of its %d chunks freed%s", sid, freed, len(pins),
                     f" ({deferred})" if deferred else "")
        self._aborting.pop(sid, None)

    def _open_pins(self) -> dict[str, set[bytes]]:
        """What this daemon's sessions hold, for a collection (an aborting session holds nothing)."""
        return {sid: s.pins for sid, s in self.store.sessions.items()}

    async def upkeep(self) -> None:
        """A cluster's background work: publish pins when a collection asks, finish aborts that etcd
        held up, and, on the collecting node, compact etcd's history every COMPACT_INTERVAL."""
        assert self.pins is not None
        async with open_nursery() as nursery:
            nursery.start_soon(self.pins.run, name="dlfs-pin-publisher")
            nursery.start_soon(self._retry_aborts, name="dlfs-abort-retry")
            nursery.start_soon(self._compact_periodically, name="dlfs-etcd-compaction")

    async def _retry_aborts(self) -> None:
        pause = ABORT_RETRY[0]
        while True:
            await trio.sleep(pause)
            failed = False
            for sid in list(self._aborting):
                pins, since = self._aborting[sid]
                try:
                    await self._finish_abort(sid)
                    log.warning("ingest session %s: its abort is finished", sid)
                except (Conflict, Unreachable) as exc:  # etcd down (ControlUnavailable), the gc lock held
                    failed = True
                    if trio.current_time() - since > ABORT_GIVE_UP:
                        log.warning("ingest session %s: abort given up after %.0f h (%s); the next `dlfs gc` frees "
                                    "its chunks", sid, ABORT_GIVE_UP / 3600, exc)
                        self._aborting.pop(sid, None)
                except DlfsError as exc:  # e.g. a damaged index stops every collection: `dlfs verify` names it
                    log.warning("ingest session %s: abort not finished (%s); the next `dlfs gc` frees its chunks",
                                sid, exc)
                    self._aborting.pop(sid, None)
            pause = min(pause * 2, ABORT_RETRY[1]) if failed else ABORT_RETRY[0]

    async def _compact_periodically(self) -> None:
        assert self.control is not None and self.follower is not None
        while True:
            await trio.sleep(COMPACT_INTERVAL)
            try:
                if await self.follower.collector():
                    await self.control.compact()
            except DlfsError as exc:
                log.info("could not compact etcd's history: %s", exc)

    async def remove(self, req: DatasetRef, data: bytearray) -> Reply:
        if self.control is not None:
            return await self._remove_in_cluster(req.name, req.version)
        gone = self.store.remove(req.name, req.version)
        for v in gone:
            log.info("removed dataset %s version %d", v.name, v.version)
        try:
            freed, deferred = await self._collect()
        except DlfsError as exc:  # removed all the same: the reply says so, and why nothing was freed
            log.warning("removed %s, but garbage collection failed: %s", req.name, exc)
            return Removed(gone, 0, str(exc)), b""
        return Removed(gone, freed, deferred), b""

    async def _remove_in_cluster(self, name: str, version: int | None) -> Reply:
        """Hidden from new mounts at once; the chunks go now if nothing mounts it, else when the last
        mount's lease ends (the collector frees them then)."""
        assert self.control is not None and self.follower is not None
        gone, mounts = await self.control.remove(name, version)
        for v in gone:
            log.info("removed dataset %s version %d%s", v.name, v.version,
                     f" ({mounts_phrase(mounts)} still hold it)" if mounts else "")
            await trio.to_thread.run_sync(self.store.tombstone, v)
        out = Removed(gone, mounts=[MountHolder(m.node, m.mountpoint, m.version) for m in mounts])
        if mounts:
            return replace(out, gc_deferred=f"chunks are freed when the {mounts_phrase(mounts)} end"), b""
        try:
            freed, deferred = await self._collect()
        except DlfsError as exc:  # another node collecting (Conflict), a damaged index: freed later
            return replace(out, gc_deferred=str(exc)), b""
        return replace(out, freed_chunks=freed, gc_deferred=deferred), b""

    async def check_indexes(self, req: IndexCheck, data: bytearray) -> Reply:
        """verify and repair: each live version's index file here checked against its commit; with
        `restore`, a damaged or missing one replaced by a good copy from a peer (found by checksum)."""
        damaged: dict[str, str] = {}
        restored: list[str] = []
        for ref in req.versions:
            info = self.store.find(ref.name, ref.version or 0)
            if info is None or info.removed:
                continue  # not here (yet), or removed since the caller listed it: nothing to check
            label = f"{info.name}@{info.version}"
            why = await trio.to_thread.run_sync(self.store.check_index, info)
            if why and req.restore and self.follower is not None:
                try:
                    rec = VersionRecord(info, holder="", freed=False, mod_revision=0)  # any peer with its checksum
                    async with self.follower.lock:
                        await self.follower.fetch(rec, install=self.store.restore_index)
                    log.warning("index of %s was damaged here (%s): restored from a peer's copy", label, why)
                    restored.append(label)
                    continue
                except DlfsError as exc:
                    why = f"{why}; {exc}"
            if why:
                damaged[label] = why
        return IndexesChecked(damaged, restored), b""

    async def collect(self, req: Empty, data: bytearray) -> Reply:
        freed, deferred = await self._collect()
        return Collected(freed, deferred), b""

    async def collect_pending(self) -> None:
        """The collector's job: free removed versions that no mount holds any more."""
        assert self.control is not None
        if (await self.control.snapshot()).collectable():
            freed, deferred = await self._collect()
            log.info("collected removed versions no mount holds: %d chunks freed%s", freed,
                     f" ({deferred})" if deferred else "")

    async def _collect(self, only: set[bytes] | None = None) -> tuple[int, str]:
        """Delete the chunks nothing needs (of `only`, where given: an aborted ingest's). Embedded: this
        daemon's catalog and sessions decide. In a cluster: one snapshot of etcd decides (live versions,
        removed ones still mounted, every open ingest's pins), under the cluster's gc lock, which keeps
        new pins out until the sweep ends."""
        await self._expire()  # a dead ingest's pins keep nothing
        if self.control is None:
            async with self.gc_lock:
                live = await trio.to_thread.run_sync(self.store.live_chunks)
                freed, skipped = await self.ledger.sweep(live, only)
            return freed, _skipped(skipped)
        assert self.follower is not None
        async with self.gc_lock, self.control.gc_lock(self.node, self._lease_id()):
            snap = await self.control.snapshot()
            live = set(snap.pins)
            for rec in snap.needed():
                name, version = rec.info.name, rec.info.version
                if not await trio.to_thread.run_sync(self.store.knows_chunks, name, version):
                    await self.follower.ensure(rec)  # a version this daemon never fetched: its chunk list
                live |= await trio.to_thread.run_sync(self.store.chunks_of, name, version)
            freed, skipped = await self.ledger.sweep(live, only)
            done = snap.collectable()
            if not skipped and done and only is None:
                await self.control.mark_freed(done)
                for r in done:
                    await trio.to_thread.run_sync(self.store.drop_index, r.info.name, r.info.version)
                    log.info("freed the chunks of removed %s", r.label)
        try:  # the collecting node keeps etcd's history short (COMPACT_MARGIN revisions)
            await self.control.compact()
        except DlfsError as exc:
            log.info("could not compact etcd's history: %s", exc)
        return freed, _skipped(skipped)


def _skipped(nodes: list[str]) -> str:
    if not nodes:
        return ""
    why = f"data node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} unreachable; their chunks are freed later"
    log.warning("garbage collection incomplete: %s", why)
    return why


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
