"""The metadata daemon's request handlers: catalog reads, index transfer, ingest commit, removal."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from dlfs.errors import Conflict
from dlfs.meta.store import MetaStore
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Reply, Service

log = logging.getLogger(__name__)
MAX_INDEX_PIECE = 16 << 20


class ChunkLedger(Protocol):
    """What the metadata daemon asks of the data daemons (the cluster client provides it)."""

    async def missing_replicas(self, ids: list[bytes]) -> list[tuple[bytes, str]]: ...

    async def sweep(self, live: set[bytes]) -> int: ...


class MetaService(Service):
    name = "meta"

    def __init__(self, store: MetaStore, key: bytes, node: str, ledger: ChunkLedger) -> None:
        super().__init__(key, node)
        self.store = store
        self.ledger = ledger
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
        })

    async def status(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return {"node": self.node, "datasets": len(self.store.catalog),
                "versions": len(self.store.datasets()), "ingests": len(self.store.sessions)}, b""

    async def list_datasets(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return {"datasets": [v.to_wire() for v in self.store.datasets()]}, b""

    async def get_dataset(self, meta: dict[str, Any], data: bytearray) -> Reply:
        version = meta.get("version")
        return self.store.get(str(meta["name"]), int(version) if version is not None else None).to_wire(), b""

    async def read_index(self, meta: dict[str, Any], data: bytearray) -> Reply:
        length = min(int(meta["length"]), MAX_INDEX_PIECE)
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
                missing = await self.ledger.missing_replicas(ids)
                if missing:
                    cid, node = missing[0]
                    raise Conflict(
                        f"ingest of {s.name}: {len(missing)} chunk replicas are not stored "
                        f"(e.g. chunk {cid.hex()} on {node}); run the ingest again"
                    )
                info = await trio.to_thread.run_sync(self.store.commit, sid, index, size, checksum)
        finally:
            index.close()
        log.info("committed dataset %s version %d: %d files, %d bytes, %d chunks",
                 info.name, info.version, info.files, info.bytes, info.chunks)
        return info.to_wire(), b""

    async def abort_ingest(self, meta: dict[str, Any], data: bytearray) -> Reply:
        self.store.abort(str(meta["session"]))
        return {}, b""

    async def remove(self, meta: dict[str, Any], data: bytearray) -> Reply:
        version = meta.get("version")
        async with self.gc_lock:
            gone = self.store.remove(str(meta["name"]), int(version) if version is not None else None)
            live = await trio.to_thread.run_sync(self.store.live_chunks)
            freed = await self.ledger.sweep(live)
        for v in gone:
            log.info("removed dataset %s version %d", v.name, v.version)
        return {"removed": [v.to_wire() for v in gone], "freed_chunks": freed}, b""
