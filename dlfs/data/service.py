"""The data daemon's request handlers: chunk writes, range reads, presence, deletion."""

from __future__ import annotations

import logging
from typing import Any

import trio

from dlfs.data.store import ChunkStore, check_id
from dlfs.errors import CorruptData
from dlfs.wire.protocol import MAX_DATA, Msg
from dlfs.wire.rpc import Reply, Service

log = logging.getLogger(__name__)


class DataService(Service):
    name = "data"

    def __init__(self, store: ChunkStore, key: bytes, node: str) -> None:
        super().__init__(key, node)
        self.store = store
        # Disk reads and hashing run in threads; the limiter keeps them from swamping the disk.
        self.io = trio.CapacityLimiter(16)
        self.bytes_served = 0
        self.reads = 0
        self.checksum_failures = 0  # chunks that arrived or were found corrupt
        self.handlers.update({
            Msg.STATUS: self.status,
            Msg.PUT_CHUNK: self.put_chunk,
            Msg.READ_RANGE: self.read_range,
            Msg.HAS_CHUNKS: self.has_chunks,
            Msg.DELETE_CHUNKS: self.delete_chunks,
            Msg.LIST_CHUNKS: self.list_chunks,
            Msg.VERIFY_CHUNKS: self.verify_chunks,
        })

    async def status(self, meta: dict[str, Any], data: bytearray) -> Reply:
        free, total = self.store.disk()
        return {"node": self.node, "chunks": self.store.count, "bytes": self.store.bytes,
                "disk_free": free, "disk_total": total, "reads": self.reads,
                "bytes_served": self.bytes_served, "root": str(self.store.root)}, b""

    async def put_chunk(self, meta: dict[str, Any], data: bytearray) -> Reply:
        cid = check_id(meta["id"])
        try:
            stored = await trio.to_thread.run_sync(self.store.put, cid, data, limiter=self.io)
        except CorruptData as exc:
            self.checksum_failures += 1
            log.warning("refused chunk %s on node %s: %s", cid.hex(), self.node, exc)
            raise
        if stored:
            log.debug("stored chunk %s (%d bytes) on node %s", cid.hex(), len(data), self.node)
        return {"stored": stored}, b""

    async def read_range(self, meta: dict[str, Any], data: bytearray) -> Reply:
        cid = check_id(meta["id"])
        length = int(meta["length"])
        if length > MAX_DATA:  # the reply could not be sent, and pread would allocate it all first
            raise ValueError(f"length {length} is over the {MAX_DATA}-byte frame limit")
        out = await trio.to_thread.run_sync(
            self.store.read_range, cid, int(meta["offset"]), length, limiter=self.io
        )
        self.reads += 1
        self.bytes_served += len(out)
        return {}, out

    async def has_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        ids = [check_id(c) for c in meta["ids"]]
        missing = await trio.to_thread.run_sync(lambda: [c for c in ids if not self.store.has(c)])
        return {"missing": missing}, b""

    async def delete_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        ids = [check_id(c) for c in meta["ids"]]
        deleted = await trio.to_thread.run_sync(lambda: sum(self.store.delete(c) for c in ids))
        if deleted:
            log.info("deleted %d chunks on node %s", deleted, self.node)
        return {"deleted": deleted}, b""

    async def list_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        ids = await trio.to_thread.run_sync(self.store.list)
        return {"count": len(ids)}, b"".join(ids)

    async def verify_chunks(self, meta: dict[str, Any], data: bytearray) -> Reply:
        ids = [check_id(c) for c in meta["ids"]]
        bad = {}
        for cid in ids:
            why = await trio.to_thread.run_sync(self.store.verify, cid, limiter=self.io)
            if why:
                bad[cid.hex()] = why
                if why != "missing":
                    self.checksum_failures += 1
                    log.warning("chunk %s on node %s fails its check: %s", cid.hex(), self.node, why)
        return {"bad": bad}, b""
