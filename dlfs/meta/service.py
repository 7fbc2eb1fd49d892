"""The metadata daemon's request handlers: catalog reads, index transfer, ingest commit, removal."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from dlfs.config import NodeSpec
from dlfs.errors import Conflict
from dlfs.meta.store import MetaStore
from dlfs.meta.sync import CatalogSync
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Reply, Service, reserve_reply

log = logging.getLogger(__name__)
MAX_INDEX_PIECE = 16 << 20


class ChunkLedger(Protocol):
    """What the metadata daemon asks of the data daemons (the cluster client provides it)."""

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]: ...

    async def sweep(self, live: set[bytes]) -> int: ...


class MetaService(Service):
    name = "meta"

    def __init__(self, store: MetaStore, key: bytes, node: str, ledger: ChunkLedger,
                 peers: list[NodeSpec] | None = None, memory: MemoryBudget | None = None) -> None:
        super().__init__(key, node, memory)
        self.store = store
        self.ledger = ledger
        self.sync = CatalogSync(store, node, peers or [], ledger if peers else None)  # type: ignore[arg-type]
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
            Msg.CATALOG: self.catalog,
            Msg.NOTIFY: self.notify,
            Msg.PINS: self.pins,
            Msg.COLLECT: self.collect,
        })

    async def status(self, meta: dict[str, Any], data: bytearray) -> Reply:
        live = self.store.datasets()
        return {"node": self.node, "datasets": len({v.name for v in live}),
                "versions": len(live), "ingests": len(self.store.sessions)}, b""

    async def catalog(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return {"versions": [v.to_wire() for v in self.store.all_versions()]}, b""

    async def notify(self, meta: dict[str, Any], data: bytearray) -> Reply:
        self.sync.wake.set()
        return {}, b""

    async def pins(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return {"ids": sorted(self.store.pins())}, b""

    async def list_datasets(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return {"datasets": [v.to_wire() for v in self.store.datasets()]}, b""

    async def get_dataset(self, meta: dict[str, Any], data: bytearray) -> Reply:
        version = meta.get("version")
        return self.store.get(str(meta["name"]), int(version) if version is not None else None).to_wire(), b""

    async def read_index(self, meta: dict[str, Any], data: bytearray) -> Reply:
        length = min(int(meta["length"]), MAX_INDEX_PIECE)
        await reserve_reply(length)  # the piece is read into memory and held until it is sent
        piece = await trio.to_thread.run_sync(
            self.store.read_index, str(meta["name"]), int(meta["version"]), int(meta["offset"]), length
        )
        return {}, piece

    async def begin_ingest(self, meta: dict[str, Any], data: bytearray) -> Reply:
        sid = self.store.begin(str(meta["name"]))
        log.info("ingest of %s began (session %s)", meta["name"], sid)
        return {"session": sid}, b""

    async def pin_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        # Not during a collection: it computed the live set already and would delete a chunk
        # pinned now, after this reply told the ingest the chunk was safe.
        async with self.gc_lock:
            s = self.store.session(str(meta["session"]))
            s.pins.update(bytes(c) for c in meta["ids"])
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
                # Learn the peers' versions first, so the number chosen here is new cluster-wide.
                await self.sync.pull_all()
                info = await trio.to_thread.run_sync(self.store.commit, sid, index, size, checksum)
        finally:
            index.close()
        log.info("committed dataset %s version %d: %d files, %d bytes, %d chunks",
                 info.name, info.version, info.files, info.bytes, info.chunks)
        await self.sync.notify()
        return info.to_wire(), b""

    async def abort_ingest(self, meta: dict[str, Any], data: bytearray) -> Reply:
        self.store.abort(str(meta["session"]))
        return {}, b""

    async def remove(self, meta: dict[str, Any], data: bytearray) -> Reply:
        version = meta.get("version")
        async with self.gc_lock:
            await self.sync.pull_all()
            gone = self.store.remove(str(meta["name"]), int(version) if version is not None else None)
            for v in gone:
                log.info("removed dataset %s version %d", v.name, v.version)
            await self.sync.notify()
            freed, deferred = await self._collect()
        return {"removed": [v.to_wire() for v in gone], "freed_chunks": freed, "gc_deferred": deferred}, b""

    async def collect(self, meta: dict[str, Any], data: bytearray) -> Reply:
        async with self.gc_lock:
            freed, deferred = await self._collect()
        return {"freed_chunks": freed, "gc_deferred": deferred}, b""

    async def _collect(self) -> tuple[int, str]:
        """Delete the chunks nothing needs; deferred (with the reason) unless every peer answers,
        since a peer's commit or pin that this daemon has not seen would make live chunks look dead."""
        missed = await self.sync.pull_all()
        peer_pins = await self.sync.peer_pins() if not missed else None
        if missed or peer_pins is None:
            why = f"metadata daemon {', '.join(missed) or 'peer'} unreachable"
            log.warning("garbage collection deferred: %s", why)
            return 0, why
        live = await trio.to_thread.run_sync(self.store.live_chunks)
        return await self.ledger.sweep(live | peer_pins), ""
