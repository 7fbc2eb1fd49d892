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

from dlfs.config import NodeSpec
from dlfs.control.etcd import EtcdUnavailable
from dlfs.control.plane import ControlPlane, Lease, VersionRecord, mounts_phrase
from dlfs.errors import Conflict, NotFound, Unreachable
from dlfs.meta.follow import CatalogFollower
from dlfs.meta.store import MetaStore, VersionInfo
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Reply, Service, reserve_reply

log = logging.getLogger(__name__)
MAX_INDEX_PIECE = 16 << 20


class ChunkLedger(Protocol):
    """What the metadata daemon asks of the data daemons (the cluster client provides it)."""

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]: ...

    async def sweep(self, live: set[bytes]) -> tuple[int, list[str]]: ...


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
        self._pin_seq = 0
        # Commit and collection exclude each other: a commit checks its chunks exist and a
        # collection decides what is dead, each against a catalog the other cannot change.
        self.gc_lock = trio.Lock()
        self.handlers.update({
            Msg.STATUS: self.status,
            Msg.LIST_DATASETS: self.list_datasets,
            Msg.GET_DATASET: self.get_dataset,
            Msg.READ_INDEX: self.read_index,
            Msg.BEGIN_INGEST: self.begin_ingest,
            Msg.PIN_CHUNKS: self.pin_chunks,
            Msg.PUT_INDEX: self.put_index,
            Msg.COMMIT: self.commit,
            Msg.ABORT_INGEST: self.abort_ingest,
            Msg.REMOVE: self.remove,
            Msg.COLLECT: self.collect,
        })

    def _lease_id(self) -> int:
        """The node's lease, for what must die with this daemon (ingest sessions, the gc lock)."""
        assert self.control is not None
        if self.lease is None or not self.lease.id:
            why = self.lease.lost if self.lease is not None and self.lease.lost else "not taken yet"
            raise Unreachable(f"node {self.node} holds no lease in etcd ({self.control.etcd.describe()}): {why}")
        return self.lease.id

    async def status(self, meta: dict[str, Any], data: bytearray) -> Reply:
        live = self.store.datasets()
        return {"node": self.node, "datasets": len({v.name for v in live}),
                "versions": len(live), "ingests": len(self.store.sessions)}, b""

    async def list_datasets(self, meta: dict[str, Any], data: bytearray) -> Reply:
        if self.control is not None:  # the cluster's list, the same from every node
            recs, _ = await self.control.versions()
            return {"datasets": [r.info.to_wire() for r in recs if not r.info.removed]}, b""
        return {"datasets": [v.to_wire() for v in self.store.datasets()]}, b""

    async def get_dataset(self, meta: dict[str, Any], data: bytearray) -> Reply:
        name, raw = str(meta["name"]), meta.get("version")
        version = int(raw) if raw is not None else None
        if self.control is None:
            return self.store.get(name, version).to_wire(), b""
        try:
            recs, _ = await self.control.versions(name)
        except EtcdUnavailable as exc:
            # A version this daemon knows is still served (a mount of it takes its lease later);
            # one it does not know cannot be vouched for.
            try:
                return self.store.get(name, version).to_wire(), b""
            except NotFound:
                raise EtcdUnavailable(f"{exc}; this metadata daemon does not know {name}"
                                      f"{'@' + str(version) if version else ''}") from None
        rec = _pick(recs, name, version)
        assert self.follower is not None
        await self.follower.ensure(rec)  # a version committed elsewhere a moment ago: its index, now
        return rec.info.to_wire(), b""

    async def read_index(self, meta: dict[str, Any], data: bytearray) -> Reply:
        length = min(int(meta["length"]), MAX_INDEX_PIECE)
        await reserve_reply(length)  # the piece is read into memory and held until it is sent
        piece = await trio.to_thread.run_sync(
            self.store.read_index, str(meta["name"]), int(meta["version"]), int(meta["offset"]), length
        )
        return {}, piece

    async def begin_ingest(self, meta: dict[str, Any], data: bytearray) -> Reply:
        sid = self.store.begin(str(meta["name"]))
        if self.control is not None:
            while self.store.expired:  # their pins in etcd go with them
                await self.control.close_ingest(self.store.expired.pop())
            try:
                await self.control.open_ingest(sid, str(meta["name"]), self.node, self._lease_id())
            except BaseException:
                self.store.abort(sid)
                raise
        log.info("ingest of %s began (session %s)", meta["name"], sid)
        return {"session": sid}, b""

    async def pin_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        # Not during a collection: it computed the live set already and would delete a chunk
        # pinned now, after this reply told the ingest the chunk was safe.
        ids = [bytes(c) for c in meta["ids"]]
        if self.control is not None:  # in etcd, where every collection looks (a cluster-wide lock)
            s = self.store.session(str(meta["session"]))
            self._pin_seq += 1
            await self.control.pin(str(meta["session"]), self._pin_seq, ids, self._lease_id())
            s.pins.update(ids)
            return {}, b""
        async with self.gc_lock:
            s = self.store.session(str(meta["session"]))
            s.pins.update(ids)
        return {}, b""

    async def put_index(self, meta: dict[str, Any], data: bytearray) -> Reply:
        await trio.to_thread.run_sync(self.store.put_index, str(meta["session"]), int(meta["offset"]), data)
        return {}, b""

    async def commit(self, meta: dict[str, Any], data: bytearray) -> Reply:
        sid, size, checksum = str(meta["session"]), int(meta["size"]), int(meta["checksum"])
        s, index = await trio.to_thread.run_sync(self.store.staged_chunks, sid, size, checksum)
        try:
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
        return info.to_wire(), b""

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

    async def abort_ingest(self, meta: dict[str, Any], data: bytearray) -> Reply:
        sid = str(meta["session"])
        self.store.abort(sid)
        if self.control is not None:
            await self.control.close_ingest(sid)
        return {}, b""

    async def remove(self, meta: dict[str, Any], data: bytearray) -> Reply:
        name, raw = str(meta["name"]), meta.get("version")
        version = int(raw) if raw is not None else None
        if self.control is not None:
            return await self._remove_in_cluster(name, version)
        gone = self.store.remove(name, version)
        for v in gone:
            log.info("removed dataset %s version %d", v.name, v.version)
        freed, deferred = await self._collect()
        return {"removed": [v.to_wire() for v in gone], "freed_chunks": freed, "gc_deferred": deferred}, b""

    async def _remove_in_cluster(self, name: str, version: int | None) -> Reply:
        """Hidden from new mounts at once; the chunks go now if nothing mounts it, else when the last
        mount's lease ends (the collector frees them then)."""
        assert self.control is not None and self.follower is not None
        gone, mounts = await self.control.remove(name, version)
        for v in gone:
            log.info("removed dataset %s version %d%s", v.name, v.version,
                     f" ({mounts_phrase(mounts)} still hold it)" if mounts else "")
            await trio.to_thread.run_sync(self.store.tombstone, v)
        out = {"removed": [v.to_wire() for v in gone], "freed_chunks": 0, "gc_deferred": "",
               "mounts": [{"node": m.node, "mountpoint": m.mountpoint, "version": m.version} for m in mounts]}
        if mounts:
            out["gc_deferred"] = f"chunks are freed when the {mounts_phrase(mounts)} end"
            return out, b""
        try:
            out["freed_chunks"], out["gc_deferred"] = await self._collect()
        except Conflict as exc:  # another node is collecting: it or the collector frees them
            out["gc_deferred"] = str(exc)
        return out, b""

    async def collect(self, meta: dict[str, Any], data: bytearray) -> Reply:
        freed, deferred = await self._collect()
        return {"freed_chunks": freed, "gc_deferred": deferred}, b""

    async def collect_pending(self) -> None:
        """The collector's job: free removed versions that no mount holds any more."""
        assert self.control is not None
        snap = await self.control.snapshot()
        held = {(m.name, m.version) for m in snap.mounts}
        if any(r.info.removed and not r.freed and (r.info.name, r.info.version) not in held for r in snap.versions):
            freed, deferred = await self._collect()
            log.info("collected removed versions no mount holds: %d chunks freed%s", freed,
                     f" ({deferred})" if deferred else "")

    async def _collect(self) -> tuple[int, str]:
        """Delete the chunks nothing needs. Embedded: this daemon's catalog and sessions decide. In a
        cluster: one snapshot of etcd decides (live versions, removed ones still mounted, every open
        ingest's pins), under the cluster's gc lock, which keeps new pins out until the sweep ends."""
        if self.control is None:
            async with self.gc_lock:
                live = await trio.to_thread.run_sync(self.store.live_chunks)
                freed, skipped = await self.ledger.sweep(live)
            return freed, _skipped(skipped)
        assert self.follower is not None
        async with self.gc_lock, self.control.gc_lock(self.node, self._lease_id()):
            snap = await self.control.snapshot()
            held = {(m.name, m.version) for m in snap.mounts}
            needed = [r for r in snap.versions if not r.freed and (not r.info.removed or (r.info.name, r.info.version) in held)]
            live = set(snap.pins)
            for rec in needed:
                await self.follower.ensure(rec)  # a version this daemon never fetched: its chunk list
                live |= await trio.to_thread.run_sync(self.store.chunks_of, rec.info.name, rec.info.version)
            freed, skipped = await self.ledger.sweep(live)
            done = [r for r in snap.versions if r.info.removed and not r.freed and (r.info.name, r.info.version) not in held]
            if not skipped and done:
                await self.control.mark_freed(done)
                for r in done:
                    await trio.to_thread.run_sync(self.store.drop_index, r.info.name, r.info.version)
                    log.info("freed the chunks of removed %s", r.label)
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
