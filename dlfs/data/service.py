"""The data daemon's request handlers: chunk writes, range reads, presence, deletion."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from dlfs.data.store import ChunkStore, boot_id
from dlfs.errors import CorruptData, ProtocolError, StorageFull, TransportUnavailable
from dlfs.native import native
from dlfs.units import human_bytes
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.messages import (
    ChunkCount,
    ChunkIds,
    ChunkRef,
    DataStatus,
    Deleted,
    Empty,
    Missing,
    QpEndpoint,
    ReadRange,
    RegionRequest,
    Staged,
    StagedChunk,
    Stored,
    Verified,
)
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Reply, Route, Service

if TYPE_CHECKING:
    from dlfs.data.rdmaserve import RdmaResponder

log = logging.getLogger(__name__)
PUT_WAIT = 120.0  # seconds a delete or HAS_CHUNKS waits for a store of the chunk in flight (a put's own timeout)
STAGE_TTL = 600.0  # seconds a staged file waits for its PUT_STAGED before it is removed (its client died)
FULL_LOG_EVERY = 60.0  # seconds between two "store is full" lines: an ingest meets a full node once per chunk


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
        # Chunks being stored now: a delete of one (a failed ingest's, whose put was in flight when it
        # gave up) waits for the store to end, else the file would land after the delete.
        self._putting: dict[bytes, int] = {}
        self._put_ended = trio.Event()
        self._staged: dict[Path, tuple[bytes, float]] = {}  # staged file -> (its chunk, when staged)
        self._full_logged: float | None = None  # when the last "store is full" line was written
        self._full_refused = 0  # chunks refused for want of room since that line
        self.handlers.update({
            Msg.STATUS: Route(Empty, self.status),
            Msg.PUT_CHUNK: Route(ChunkRef, self.put_chunk),
            Msg.STAGE_CHUNK: Route(ChunkRef, self.stage_chunk),
            Msg.PUT_STAGED: Route(StagedChunk, self.put_staged),
            Msg.READ_RANGE: Route(ReadRange, self.read_range),
            Msg.HAS_CHUNKS: Route(ChunkIds, self.has_chunks),
            Msg.DELETE_CHUNKS: Route(ChunkIds, self.delete_chunks),
            Msg.LIST_CHUNKS: Route(Empty, self.list_chunks),
            Msg.VERIFY_CHUNKS: Route(ChunkIds, self.verify_chunks),
            Msg.RDMA_CONNECT: Route(QpEndpoint, self.rdma_connect),
            Msg.RDMA_REGION: Route(RegionRequest, self.rdma_region),
            Msg.RANGE_LANE: Route(Empty, self.range_lane, handover=self._give_lane),
        })
        self.lanes = False  # READ_RANGE lanes served by the native helper's threads (start_lanes)

    def start_lanes(self) -> None:
        """Serve range lanes (Msg.RANGE_LANE: a mount's serving threads fetching records one by one)
        with native threads, where the helper is built; else such a request is refused and the
        connection stays with Python."""
        if native is None:
            return
        try:
            native.lanes_start(self.store.chunk_dir)
        except OSError as exc:  # EBUSY: another node of this process serves them (tests)
            log.log(logging.INFO if exc.errno == errno.EBUSY else logging.WARNING,
                    "node %s: range lanes are not served (%s): records are read through Python", self.node,
                    exc.strerror or exc)
            return
        self.lanes = True

    def stop_lanes(self) -> None:
        if self.lanes and native is not None:
            native.lanes_stop()
        self.lanes = False

    def lane_stats(self) -> dict[str, int]:
        """The lanes' counters (all 0 without them)."""
        if not self.lanes or native is None:
            return {}
        return dict(native.lanes_stats())

    async def range_lane(self, req: Empty, data: bytearray) -> Reply:
        if not self.lanes or native is None or not native.lanes_room():
            raise ProtocolError(f"node {self.node} has no room for another range lane" if self.lanes else
                                f"node {self.node} serves no range lanes")
        return Empty(), b""

    def _give_lane(self, fd: int) -> None:
        assert native is not None
        native.lanes_add(fd)

    async def status(self, req: Empty, data: bytearray) -> Reply:
        free, total = self.store.disk()
        lanes = self.lane_stats()
        return DataStatus(self.node, self.store.count, self.store.bytes, free, total, self.reads + lanes.get("reads", 0),
                          self.bytes_served + lanes.get("bytes", 0),
                          str(self.store.root), str(self.store.chunk_dir), boot_id(),
                          "rdma" if self.rdma else "tcp", self.transport_reason), b""

    async def put_chunk(self, req: ChunkRef, data: bytearray) -> Reply:
        stored = await self._storing(req.id, self.store.put, req.id, data)
        if stored:
            log.debug("stored chunk %s (%d bytes) on node %s", req.id.hex(), len(data), self.node)
        return Stored(stored), b""

    async def stage_chunk(self, req: ChunkRef, data: bytearray) -> Reply:
        now = trio.current_time()
        for path, (_, when) in list(self._staged.items()):
            if now - when > STAGE_TTL:
                del self._staged[path]
                path.unlink(missing_ok=True)
        try:
            path = await trio.to_thread.run_sync(self.store.stage, req.id, limiter=self.io)
        except StorageFull as exc:
            self._refused_full(exc)
            raise
        self._staged[path] = (req.id, now)
        return Staged(str(path)), b""

    async def put_staged(self, req: StagedChunk, data: bytearray) -> Reply:
        path = Path(req.path)
        if self._staged.get(path, (None,))[0] != req.id:
            raise ProtocolError(f"{req.path} is not a file node {self.node} staged for chunk {req.id.hex()}")
        del self._staged[path]
        stored = await self._storing(req.id, self.store.adopt, req.id, path, req.size)
        if stored:
            log.debug("stored staged chunk %s (%d bytes) on node %s", req.id.hex(), req.size, self.node)
        return Stored(stored), b""

    async def _storing(self, cid: bytes, put: Callable[..., bool], *args: Any) -> bool:
        """Run a store of `cid` in a thread, known to deletes while it runs; a bad chunk is counted."""
        self._putting[cid] = self._putting.get(cid, 0) + 1
        try:
            return await trio.to_thread.run_sync(put, *args, limiter=self.io)
        except CorruptData as exc:
            self.checksum_failures += 1
            log.warning("refused chunk %s on node %s: %s", cid.hex(), self.node, exc)
            raise
        except StorageFull as exc:
            self._refused_full(exc)
            raise
        finally:
            if self._putting[cid] > 1:
                self._putting[cid] -= 1
            else:
                del self._putting[cid]
            self._put_ended.set()
            self._put_ended = trio.Event()

    def _refused_full(self, exc: StorageFull) -> None:
        """Say that the store is full: one line a minute at most, with how many chunks it refused."""
        self._full_refused += 1
        now = trio.current_time()
        if self._full_logged is not None and now - self._full_logged < FULL_LOG_EVERY:
            return
        free, total = self.store.disk()
        n = self._full_refused
        log.warning("node %s: chunk store at %s is full (%s free of %s): %d chunk%s refused%s; ingest and repair "
                    "place chunks on other nodes until room is made here", self.node, self.store.root,
                    human_bytes(free), human_bytes(total), n, "" if n == 1 else "s",
                    " since the last such line" if self._full_logged is not None else "")
        log.debug("node %s: %s", self.node, exc)
        self._full_logged, self._full_refused = now, 0

    async def read_range(self, req: ReadRange, data: bytearray) -> Reply:
        # Sent with sendfile: the bytes go from the page cache to the socket, never through here,
        # so unlike an index piece the reply holds none of the node's memory budget. (Its length is
        # at most a frame's: ReadRange says so.)
        out = self.store.open_kept_range(req.id, req.offset, req.length)
        if out is None:  # its file is not open yet: that may wait for the disk
            out = await trio.to_thread.run_sync(self.store.open_range, req.id, req.offset, req.length, limiter=self.io)
        self.reads += 1
        self.bytes_served += len(out)
        return Empty(), out

    async def has_chunks(self, req: ChunkIds, data: bytearray) -> Reply:
        ids = req.ids
        # A chunk being stored is neither held nor missing yet: the answer waits for its store to end.
        # (An aborted ingest's collection asks this first, and must see a store that was in flight.)
        await self._puts_ended(ids)
        missing = await trio.to_thread.run_sync(lambda: [c for c in ids if not self.store.has(c)])
        return Missing(missing), b""

    async def _puts_ended(self, ids: list[bytes]) -> None:
        """Until no store of any of `ids` runs here (bounded: a put's own timeout)."""
        with trio.move_on_after(PUT_WAIT):
            while not self._putting.keys().isdisjoint(ids):
                await self._put_ended.wait()

    async def delete_chunks(self, req: ChunkIds, data: bytearray) -> Reply:
        ids = req.ids
        await self._puts_ended(ids)
        if self.rdma is not None:
            for cid in ids:  # readers must not get a mapping of a deleted file
                self.rdma.registry.invalidate(cid)
        deleted = await trio.to_thread.run_sync(lambda: sum(self.store.delete(c) for c in ids))
        if deleted:
            log.info("deleted %d chunks on node %s", deleted, self.node)
        return Deleted(deleted), b""

    async def list_chunks(self, req: Empty, data: bytearray) -> Reply:
        ids = await trio.to_thread.run_sync(self.store.list)
        return ChunkCount(len(ids)), b"".join(ids)

    async def verify_chunks(self, req: ChunkIds, data: bytearray) -> Reply:
        bad = {}
        for cid in req.ids:
            why = await trio.to_thread.run_sync(self.store.verify, cid, limiter=self.io)
            if why:
                bad[cid.hex()] = why
                if why != "missing":
                    self.checksum_failures += 1
                    log.warning("chunk %s on node %s fails its check: %s", cid.hex(), self.node, why)
        return Verified(bad), b""

    def _responder(self) -> RdmaResponder:
        if self.rdma is None:
            raise TransportUnavailable(f"node {self.node} does not serve RDMA ({self.transport_reason or 'transport tcp'})")
        return self.rdma

    async def rdma_connect(self, req: QpEndpoint, data: bytearray) -> Reply:
        return await self._responder().connect(req)

    async def rdma_region(self, req: RegionRequest, data: bytearray) -> Reply:
        return await self._responder().regions(req)
