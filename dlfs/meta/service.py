"""The metadata daemon's request handlers: catalog reads, index transfer, ingest commit, removal.

One set of handlers over one metadata engine (dlfs/meta/engine.py): the embedded SQLite catalog of the
one-node default, or a cluster's catalog in etcd. The handlers move index bytes, check what ingests
send and ask the data daemons (the ledger); the engine decides what that changes in cluster state.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio
from msgspec.structs import replace

from dlfs.errors import Conflict, DlfsError, Unreachable
from dlfs.format.check import check_index
from dlfs.meta.engine import MetaEngine
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
ABORT_RETRY = (2.0, 30.0)  # seconds between tries to finish an abort that was held up: first, most
ABORT_GIVE_UP = 24 * 3600.0  # an abort still failing after this is left to the next `dlfs gc`


class ChunkLedger(Protocol):
    """What the metadata daemon asks of the data daemons (the cluster client provides it)."""

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]: ...

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]: ...


class MetaService(Service):
    name = "meta"

    def __init__(self, engine: MetaEngine, key: bytes, node: str, ledger: ChunkLedger,
                 memory: MemoryBudget | None = None) -> None:
        super().__init__(key, node, memory)
        self.engine = engine
        self.store = engine.store
        self.ingests = engine.store.ingests
        self.ledger = ledger
        # Aborted sessions whose chunks are not freed yet (the engine or a data node held that up): sid -> (pins, since).
        self._aborting: dict[str, tuple[set[bytes], float]] = {}
        self._finishing: set[str] = set()  # aborted sessions a task is finishing now: no second one starts
        self._committing: set[str] = set()  # sessions whose COMMIT is running
        # Commit and collection exclude each other: a commit checks its chunks exist and a
        # collection decides what is dead, each against a catalog the other cannot change.
        self.gc_lock = engine.gc_lock
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

    async def status(self, req: Empty, data: bytearray) -> Reply:
        self.ingests.expire()  # a killed ingest is not "in progress" (its record elsewhere goes in expire_idle)
        live = self.store.datasets()
        return MetaStatus(self.node, len({v.name for v in live}), len(live), len(self.ingests.open)), b""

    async def list_datasets(self, req: Empty, data: bytearray) -> Reply:
        return DatasetList(await self.engine.datasets()), b""

    async def get_dataset(self, req: DatasetRef, data: bytearray) -> Reply:
        return await self.engine.dataset(req.name, req.version), b""

    async def read_index(self, req: IndexPiece, data: bytearray) -> Reply:
        length = min(req.length, MAX_INDEX_PIECE)
        await reserve_reply(length)  # the piece is read into memory and held until it is sent
        piece = await trio.to_thread.run_sync(self.store.read_index, req.name, req.version, req.offset, length)
        return Empty(), piece

    async def begin_ingest(self, req: BeginIngest, data: bytearray) -> Reply:
        await self._expire()
        sid = self.ingests.begin(req.name)
        try:
            await self.engine.open_ingest(sid, req.name)
        except BaseException:
            self.ingests.abort(sid)
            raise
        log.info("ingest of %s began (session %s)", req.name, sid)
        return IngestBegun(sid, self.ingests.ttl), b""

    async def _expire(self) -> None:
        """Drop the sessions of ingests that stopped asking (killed): their pins, here and in the engine, go."""
        self.ingests.expire()
        while self.ingests.expired:
            sid = self.ingests.expired.pop()
            try:
                await self.engine.close_ingest(sid)
            except DlfsError as exc:  # tried again at the next expiry; the node's lease bounds them anyway
                self.ingests.expired.append(sid)
                log.warning("could not close expired ingest session %s in the cluster's catalog: %s", sid, exc)
                return

    async def expire_idle(self) -> None:
        """Expire dead ingests' sessions on time, also where no request comes (a cluster's gc elsewhere)."""
        while True:
            await trio.sleep(max(self.ingests.ttl / 4, 0.1))
            await self._expire()

    async def pin_chunks(self, req: PinChunks, data: bytearray) -> Reply:
        # Not during a collection: it computed the live set already and would delete a chunk
        # pinned now, after this reply told the ingest the chunk was safe (the engine waits).
        if not req.ids:  # the ingest's keepalive (no collection to wait for)
            self.ingests.session(req.session)
            return Empty(), b""
        await self.engine.pin(req.session, req.ids)
        return Empty(), b""

    def _not_committing(self, sid: str) -> None:
        # A session's staged file is moved into place by its commit: nothing else may touch it meanwhile.
        if sid in self._committing:
            raise Conflict(f"ingest session {sid} is being committed")

    async def put_index(self, req: PutIndex, data: bytearray) -> Reply:
        self._not_committing(req.session)
        await trio.to_thread.run_sync(self.ingests.put_index, req.session, req.offset, data)
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
        s, index = await trio.to_thread.run_sync(self.ingests.staged_chunks, sid, size, checksum)
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
                info = await self.engine.commit(sid, index, size, checksum)
        finally:
            index.close()
        log.info("committed dataset %s version %d: %d files, %d bytes, %d chunks",
                 info.name, info.version, info.files, info.bytes, info.chunks)
        return info, b""

    async def abort_ingest(self, req: SessionRef, data: bytearray) -> Reply:
        """Give a failed ingest up and free its chunks that nothing else needs, now (no `dlfs gc`). Where
        the engine (etcd unreachable) or the gc lock holds that up, this daemon finishes it later (`upkeep`)."""
        self._not_committing(req.session)
        pins = self.ingests.abort(req.session)
        self._aborting[req.session] = (pins, trio.current_time())
        try:
            await self._finish_abort(req.session)
        except DlfsError as exc:
            log.warning("ingest session %s given up, but %s: this node frees its %d chunks when it can (retrying)",
                        req.session, exc, len(pins))
        return Empty(), b""

    async def _finish_abort(self, sid: str) -> bool:
        """Close an aborted session in the engine and free its chunks nothing else needs; raises (and keeps
        it for another try) while the engine, the gc lock or a data node holds that up. False, with nothing
        done, where it is finished already or another task is finishing it."""
        if sid not in self._aborting or sid in self._finishing:
            return False
        self._finishing.add(sid)
        try:
            pins, _ = self._aborting[sid]
            pins |= await self.engine.close_ingest(sid)
            if pins:
                freed, deferred = await self._collect(only=pins)
                log.info("ingest session %s given up: %d of its %d chunks freed%s", sid, freed, len(pins),
                         f" ({deferred})" if deferred else "")
            self._aborting.pop(sid, None)
        finally:
            self._finishing.discard(sid)
        return True

    async def upkeep(self) -> None:
        """Background work: the engine's own (following a cluster's catalog, publishing pins, compaction),
        and finishing aborts that were held up."""
        async with open_nursery() as nursery:
            nursery.start_soon(self.engine.run, self._collect_removed, name="dlfs-meta-engine")
            nursery.start_soon(self._retry_aborts, name="dlfs-abort-retry")

    async def _retry_aborts(self) -> None:
        pause = ABORT_RETRY[0]
        while True:
            await trio.sleep(pause)
            failed = False
            for sid in list(self._aborting):
                if sid not in self._aborting:
                    continue  # finished meanwhile by its ABORT_INGEST's own try
                since = self._aborting[sid][1]
                try:
                    if await self._finish_abort(sid):
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

    async def remove(self, req: DatasetRef, data: bytearray) -> Reply:
        """Hidden from new mounts at once; the chunks go now if nothing mounts it, else when the last
        mount's lease ends (the engine's collector frees them then)."""
        gone, mounts = await self.engine.remove(req.name, req.version)
        for v in gone:
            log.info("removed dataset %s version %d%s", v.name, v.version,
                     f" ({mounts_phrase(mounts)} still hold it)" if mounts else "")
        out = Removed(gone, mounts=mounts)
        if mounts:
            return replace(out, gc_deferred=f"chunks are freed when the {mounts_phrase(mounts)} end"), b""
        try:
            freed, deferred = await self._collect()
        except DlfsError as exc:  # removed all the same: the reply says so, and why nothing was freed
            log.warning("removed %s, but garbage collection failed: %s", req.name, exc)
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
            if why and req.restore:
                try:
                    if await self.engine.restore_index(info):
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

    async def _collect_removed(self) -> None:
        """The engine's collector: free removed versions that no mount holds any more."""
        freed, deferred = await self._collect()
        log.info("collected removed versions no mount holds: %d chunks freed%s", freed,
                 f" ({deferred})" if deferred else "")

    async def _collect(self, only: set[bytes] | None = None) -> tuple[int, str]:
        """Delete the chunks nothing needs (of `only`, where given: an aborted ingest's), as the engine
        decides them under its gc lock, which keeps new pins out until the sweep ends."""
        await self._expire()  # a dead ingest's pins keep nothing
        async with self.gc_lock, self.engine.collection() as collection:
            freed, skipped = await self.ledger.sweep(collection.live, only)
            if not skipped and only is None:
                await collection.swept()
        await self.engine.compact()
        return freed, _skipped(skipped)


def _skipped(nodes: list[str]) -> str:
    if not nodes:
        return ""
    why = f"data node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} unreachable; their chunks are freed later"
    log.warning("garbage collection incomplete: %s", why)
    return why


def mounts_phrase(mounts: list[MountHolder]) -> str:
    nodes = sorted({m.node for m in mounts})
    return f"{len(mounts)} mount{'s' if len(mounts) != 1 else ''} on {', '.join(nodes)}"
