"""The data daemon's request handlers: chunk writes, range reads, presence, deletion."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from dlfs.data.store import ChunkStore, boot_id, check_id
from dlfs.errors import CorruptData, TransportUnavailable
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.protocol import MAX_DATA, Msg
from dlfs.wire.rpc import Reply, Service

if TYPE_CHECKING:
    from dlfs.data.rdma import RdmaResponder

log = logging.getLogger(__name__)


class DataService(Service):
    name = "data"

    def __init__(self, store: ChunkStore, key: bytes, node: str, rdma: RdmaResponder | None = None,
                 transport_reason: str = "", memory: MemoryBudget | None = None) -> None:
        super().__init__(key, node, memory)
        self.store = store
        self.rdma = rdma  # None: chunks are served over TCP only
        self.transport_reason = transport_reason
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
            Msg.RDMA_CONNECT: self.rdma_connect,
            Msg.RDMA_REGION: self.rdma_region,
        })

    async def status(self, meta: dict[str, Any], data: bytearray) -> Reply:
        free, total = self.store.disk()
        return {"node": self.node, "chunks": self.store.count, "bytes": self.store.bytes,
                "disk_free": free, "disk_total": total, "reads": self.reads,
                "bytes_served": self.bytes_served, "root": str(self.store.root),
                "chunk_dir": str(self.store.chunk_dir), "boot_id": boot_id(),
                "transport": "rdma" if self.rdma else "tcp", "transport_reason": self.transport_reason}, b""

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
        # Sent with sendfile: the bytes go from the page cache to the socket, never through here,
        # so unlike an index piece the reply holds none of the node's memory budget.
        out = await trio.to_thread.run_sync(
            self.store.open_range, cid, int(meta["offset"]), length, limiter=self.io
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
        if self.rdma is not None:
            for cid in ids:  # readers must not get a mapping of a deleted file
                self.rdma.registry.invalidate(cid)
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

    def _responder(self) -> RdmaResponder:
        if self.rdma is None:
            raise TransportUnavailable(f"node {self.node} does not serve RDMA ({self.transport_reason or 'transport tcp'})")
        return self.rdma

    async def rdma_connect(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return await self._responder().connect(meta, data)

    async def rdma_region(self, meta: dict[str, Any], data: bytearray) -> Reply:
        return await self._responder().regions(meta, data)
