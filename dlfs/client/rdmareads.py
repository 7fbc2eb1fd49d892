"""The client's RDMA path: one-sided RDMA READs of chunk ranges from data daemons, straight into
registered memory that the chunk cache then keeps as its block (no copy here, no CPU there).

Per data node, one link: an RC queue pair with its own completion queue, connected over the node's
authenticated data connection (RDMA_CONNECT), and the chunk regions it has asked for (RDMA_REGION).
A read becomes work requests of at most PIECE bytes, posted as one chain; a link keeps several in
flight. Whatever goes wrong on a link (a work request completing in error, the queue pair in the
error state, no completion in time, a daemon without RDMA) raises RdmaFailure: the cluster client
then reads that range over TCP, and the node's RDMA waits out a back-off before it is tried again.
"""

from __future__ import annotations

import itertools
import logging
import mmap
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pyverbs.enums as e
import trio
from pyverbs.cq import WC, cqe_status_to_str
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP
from pyverbs.wr import SendWR

from dlfs.config import NodeSpec
from dlfs.errors import DlfsError, NotFound, RdmaFailure, Unreachable, UsageError, error_from_status
from dlfs.tasks import open_nursery
from dlfs.transport.rdma import (
    SEGMENT,
    Arena,
    Block,
    CompletionQueue,
    RdmaDevice,
    SlabRegistry,
    break_qp,
    buffer_address,
    connect_qp,
    local_write_registrar,
    new_psn,
    qp_init_attr,
    qp_state,
    read_chain,
)
from dlfs.transport.verbs import PortInfo
from dlfs.units import human_bytes
from dlfs.wire.messages import QpEndpoint, RegionRefused, Regions, RemoteRegion, decode, reply
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Connection

if TYPE_CHECKING:
    from dlfs.client.cluster import ClusterClient

log = logging.getLogger(__name__)
PIECE = 1 << 20  # bytes per work request
SEND_DEPTH = 128  # work requests in flight per link
BATCH = 16  # work requests per post_send chain, at most
REGIONS_PER_LINK = 512  # chunk registrations a link holds on its daemon before releasing old ones
CONNECT_TIMEOUT = 10.0
BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0
NO_RDMA_BACKOFF = 60.0  # a daemon that serves TCP only is asked again this much later


class _Read:
    """One read's work requests: done when every one of them has completed (or the link died)."""

    __slots__ = ("block", "cid", "remaining", "error", "done")

    def __init__(self, block: Block, cid: bytes, pieces: int) -> None:
        self.block, self.cid, self.remaining = block, cid, pieces
        self.error: str | None = None
        self.done = trio.Event()


class Link:
    """The RC queue pair to one data daemon, and the chunk regions it holds there."""

    def __init__(self, reader: RdmaReader, node: str, conn: Connection, qp: QP, cq: CompletionQueue,
                 depth: int = SEND_DEPTH, piece: int = PIECE) -> None:
        self.reader, self.node, self.conn, self.qp, self.cq = reader, node, conn, qp, cq
        self.piece = piece
        self.slots = trio.Semaphore(depth)
        self.reads: dict[int, _Read] = {}  # wr_id -> its read
        self.regions: OrderedDict[bytes, RemoteRegion] = OrderedDict()
        self.busy: Counter[bytes] = Counter()  # regions with reads in flight: never released
        self._asking: dict[bytes, trio.Event] = {}
        self.broken: str | None = None
        self.closed = False
        self.poller = trio.CancelScope()

    def usable(self) -> bool:
        return self.broken is None and not self.closed and self.conn.closed is None

    # --- completions (called from the completion queue's task) ---
    def completed(self, wc: WC) -> None:
        read = self.reads.pop(wc.wr_id, None)
        if read is None:
            return
        self.slots.release()
        if wc.status != e.IBV_WC_SUCCESS:
            why = f"work request completed with status {cqe_status_to_str(wc.status)} (vendor error {wc.vendor_err:#x})"
            read.error = read.error or why
            # On an RC queue pair one error moves the pair to the error state: the link is done.
            self.broken = self.broken or why
        read.remaining -= 1
        if read.remaining == 0:
            self._finish(read)

    def _finish(self, read: _Read) -> None:
        self.busy[read.cid] -= 1
        if self.busy[read.cid] <= 0:
            del self.busy[read.cid]
        read.done.set()

    # --- regions ---
    async def region(self, cid: bytes, timeout: float) -> RemoteRegion:
        """Where chunk `cid` is registered on the daemon (asked once, then remembered)."""
        while True:
            hit = self.regions.get(cid)
            if hit is not None:
                self.regions.move_to_end(cid)
                return hit
            asking = self._asking.get(cid)
            if asking is None:
                break
            await asking.wait()
        done = self._asking[cid] = trio.Event()
        try:
            release = []
            for old in list(self.regions):
                if len(self.regions) < REGIONS_PER_LINK:
                    break
                if old not in self.busy:
                    del self.regions[old]
                    release.append(old)
            try:
                meta, _ = await self.conn.call(Msg.RDMA_REGION, {"ids": [cid], "release": release}, timeout=timeout)
                entry = reply(Regions, meta, Msg.RDMA_REGION, self.node).regions[0]
                if "error" in entry:
                    refused = decode(RegionRefused, entry, f"RDMA_REGION reply from {self.node}")
                    err = error_from_status(refused.status, refused.error)
                    if isinstance(err, NotFound):
                        raise err
                    raise RdmaFailure(f"{self.node} did not register chunk {cid.hex()} for RDMA: {err}")
                region = decode(RemoteRegion, entry, f"RDMA_REGION reply from {self.node}")
            except (NotFound, RdmaFailure):
                raise
            except (DlfsError, IndexError) as exc:
                raise RdmaFailure(f"asking {self.node} where chunk {cid.hex()} is registered failed: {exc}") from None
            if region.id != cid:
                raise RdmaFailure(f"{self.node} answered RDMA_REGION for another chunk")
            self.regions[cid] = region
            return region
        finally:
            del self._asking[cid]
            done.set()

    # --- reads ---
    async def read(self, block: Block, region: RemoteRegion, offset: int, n: int, timeout: float) -> None:
        """Fill `block` with bytes [offset, offset+n) of the region; RdmaFailure if the link fails."""
        pieces = [(pos, min(self.piece, n - pos)) for pos in range(0, n, self.piece)]
        read = _Read(block, region.id, len(pieces))
        self.busy[region.id] += 1
        posted = 0
        with trio.move_on_after(timeout) as deadline:
            try:
                try:
                    while posted < len(pieces):
                        await self.slots.acquire()
                        batch = [pieces[posted]]
                        while posted + len(batch) < len(pieces) and len(batch) < BATCH and self.slots.value > 0:
                            self.slots.acquire_nowait()
                            batch.append(pieces[posted + len(batch)])
                        self._post(read, batch, region, offset)
                        posted += len(batch)
                finally:
                    # Pieces never posted will never complete: the read is done when the posted ones are.
                    read.remaining -= len(pieces) - posted
                    if posted < len(pieces) and read.remaining == 0 and not read.done.is_set():
                        self._finish(read)
                await read.done.wait()
            except trio.Cancelled:
                # Timed out, or cancelled from outside (a hedged fetch won elsewhere), with READs still
                # posted: they would land in memory the caller reuses, so the queue pair goes first.
                if not read.done.is_set():
                    self.reader.fail(self, f"no completion within {timeout:g} s" if deadline.cancel_called
                                     else "a read was cancelled with RDMA READs in flight")
                raise
        if deadline.cancelled_caught:
            self.reader.fail(self, f"no completion within {timeout:g} s")
            raise RdmaFailure(f"RDMA READ from {self.node} timed out")
        if read.error is not None:
            self.reader.fail(self, read.error)
            raise RdmaFailure(f"RDMA READ from {self.node} failed: {read.error}")

    def _post(self, read: _Read, batch: list[tuple[int, int]], region: RemoteRegion, offset: int) -> None:
        """Post one chain of RDMA READ work requests; each holds a send slot until it completes."""
        if not self.usable():
            for _ in batch:
                self.slots.release()
            raise RdmaFailure(f"RDMA link to {self.node} is down ({self.broken or 'closed'})")
        wrs: list[SendWR] = []
        try:
            wrs = read_chain(batch, read.block.addr, read.block.lkey, region.addr + offset, region.rkey,
                             self.reader.wr_ids)
            for wr in wrs:
                self.reads[wr.wr_id] = read
            self.qp.post_send(wrs[0])
        except PyverbsError as exc:
            for wr in wrs:
                self.reads.pop(wr.wr_id, None)
            for _ in batch:
                self.slots.release()
            why = f"post_send failed ({exc}; queue pair {self.state()})"
            self.reader.fail(self, why)
            raise RdmaFailure(f"RDMA READ from {self.node}: {why}") from None
        finally:
            for wr in wrs:
                wr.close()  # frees its copy of the SGE list, which the device no longer needs

    def state(self) -> str:
        try:
            return qp_state(self.qp)
        except PyverbsError as exc:
            return f"unknown ({exc})"

    def close(self, why: str) -> None:
        """Tear the link down: no more DMA into any block once the queue pair is destroyed."""
        if self.closed:
            return
        self.closed = True
        self.broken = self.broken or why
        self.poller.cancel()
        try:
            break_qp(self.qp)  # flushes what is in flight
        except PyverbsError:
            pass
        self.qp.close()
        self.cq.close()
        for read in set(self.reads.values()):
            read.error = read.error or f"link closed ({self.broken})"
            read.remaining = 0
            self._finish(read)
        for _ in self.reads:  # wake readers waiting for a slot: they find the link closed
            self.slots.release()
        self.reads.clear()


class RdmaReader:
    """RDMA READs of chunk ranges for one cluster client (the RangeReader it uses when it can)."""

    name = "rdma"

    def __init__(self, client: ClusterClient, port: PortInfo, arena_limit: int) -> None:
        self.client = client
        self.port = port
        self.device = RdmaDevice(port)
        self.arena = Arena(local_write_registrar(self.device.pd), arena_limit)
        self.slabs: SlabRegistry | None = None  # the mount's cache arena, once attached
        self.links: dict[str, Link] = {}
        self.wr_ids = itertools.count(1)
        self._connecting: dict[str, trio.Lock] = {}
        self._growing = trio.Lock()
        self._backoff: dict[str, tuple[float, float]] = {}  # node -> (RDMA off until, last back-off)
        self.nursery: trio.Nursery | None = None
        self.reads = self.bytes_read = self.failures = 0

    @classmethod
    @asynccontextmanager
    async def open(cls, client: ClusterClient, port: PortInfo, arena_limit: int) -> AsyncIterator[RdmaReader]:
        """A reader whose links' completion tasks live in a nursery of its own; closed on exit."""
        reader = cls(client, port, arena_limit)
        try:
            # The first segment now: registration problems show at start, not at the first read.
            first = reader.arena.growth(1)
            if first is not None:
                await trio.to_thread.run_sync(reader.arena.add_segment, min(first, SEGMENT))
            async with open_nursery() as nursery:
                reader.nursery = nursery
                try:
                    yield reader
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            reader.close()

    def fail(self, link: Link, why: str) -> None:
        """A link failed: close it, log it once, and leave its node on TCP for a growing while."""
        if link.closed:
            return
        self.failures += 1
        if self.links.get(link.node) is link:
            del self.links[link.node]
        _, last = self._backoff.get(link.node, (0.0, 0.0))
        wait = min(max(last * 2, BACKOFF_MIN), BACKOFF_MAX)
        self._backoff[link.node] = (trio.current_time() + wait, wait)
        log.warning("RDMA to %s failed (%s); reading over TCP, RDMA again in %.0f s", link.node, why, wait)
        link.close(why)

    async def _link(self, spec: NodeSpec) -> Link:
        link = self.links.get(spec.name)
        if link is not None and link.usable():
            return link
        if link is not None:
            self.fail(link, link.broken or "its data connection closed")
        async with self._connecting.setdefault(spec.name, trio.Lock()):
            link = self.links.get(spec.name)
            if link is not None and link.usable():
                return link
            until, _ = self._backoff.get(spec.name, (0.0, 0.0))
            if trio.current_time() < until:
                raise RdmaFailure(f"RDMA to {spec.name} is off for {until - trio.current_time():.0f} s more")
            link = await self._connect(spec)
            self.links[spec.name] = link
            return link

    async def _connect(self, spec: NodeSpec) -> Link:
        """A queue pair connected to the daemon's over its data connection (Unreachable if that is down)."""
        assert self.nursery is not None
        conn = await self.client.connection(spec, "data")
        depth = min(SEND_DEPTH, self.device.max_qp_wr)
        cq = CompletionQueue(self.device, depth)
        try:
            qp = QP(self.device.pd, qp_init_attr(cq.cq, depth))
        except BaseException:
            cq.close()
            raise
        psn = new_psn()
        try:
            local = self.device.endpoint(qp, psn, self.device.initiator_depth)
            meta, _ = await conn.call(Msg.RDMA_CONNECT, local.to_meta(), timeout=CONNECT_TIMEOUT)
            remote = reply(QpEndpoint, meta, Msg.RDMA_CONNECT, spec.name)
            connect_qp(qp, self.port, e.IBV_ACCESS_LOCAL_WRITE, remote, psn, responder_depth=1,
                       initiator_depth=min(self.device.initiator_depth, remote.rd_atomic))
        except BaseException as exc:
            qp.close()
            cq.close()
            if isinstance(exc, UsageError):  # the daemon serves TCP only
                self._backoff[spec.name] = (trio.current_time() + NO_RDMA_BACKOFF, NO_RDMA_BACKOFF)
                log.info("%s; reading from it over TCP", exc)
                raise RdmaFailure(str(exc)) from None
            if isinstance(exc, (DlfsError, PyverbsError)) and not isinstance(exc, Unreachable):
                self._backoff[spec.name] = (trio.current_time() + BACKOFF_MIN, BACKOFF_MIN)
                log.warning("RDMA set-up with %s failed (%s); reading over TCP", spec.name, exc)
                raise RdmaFailure(f"RDMA set-up with {spec.name} failed: {exc}") from None
            raise
        link = Link(self, spec.name, conn, qp, cq, depth, min(PIECE, self.device.max_msg))
        self.nursery.start_soon(self._poll, link, name=f"dlfs-rdma-completions {spec.name}")
        log.info("RDMA link to %s: queue pair %d -> %d, %d READs in flight", spec.name, qp.qp_num, remote.qpn,
                 min(self.device.initiator_depth, remote.rd_atomic))
        return link

    async def _poll(self, link: Link) -> None:
        with link.poller:
            await link.cq.run(link.completed)

    def attach_arena(self, arena: mmap.mmap, slab_size: int) -> None:
        """Let reads land straight in the slabs of the mount's cache `arena` (see SlabRegistry)."""
        self.slabs = SlabRegistry(local_write_registrar(self.device.pd), arena, slab_size)

    async def read_range(self, spec: NodeSpec, cid: bytes, offset: int, length: int,
                         timeout: float, into: memoryview | None = None) -> memoryview:
        """Bytes [offset, offset+length) of a chunk on `spec`, shorter at the chunk's end (as TCP's
        READ_RANGE): into `into` when it lies in a slab of the attached cache arena, else into the
        reader's own registered memory. NotFound if the node lacks the chunk; RdmaFailure if RDMA
        cannot read it."""
        link = await self._link(spec)
        region = await link.region(cid, timeout)
        end = min(offset + length, region.length)
        if offset >= end:
            return memoryview(b"")
        n = end - offset
        block = await self._slab_block(into, n) if into is not None else None
        if block is None:
            block = await self._block(n)
        await link.read(block, region, offset, n, timeout)
        self.reads += 1
        self.bytes_read += n
        self._backoff.pop(spec.name, None)
        return block.view()

    async def _slab_block(self, into: memoryview, n: int) -> Block | None:
        """`into` as a block of the cache arena's registered memory, the slab registered (in a thread)
        the first time; None if it is not in the arena."""
        if self.slabs is None or len(into) < n:
            return None
        addr = buffer_address(into)
        slab = self.slabs.slab_of(addr, n)
        if slab is None:
            return None
        lkey = self.slabs.lkey(slab)
        if lkey is None:
            try:
                lkey = await trio.to_thread.run_sync(self.slabs.add, slab)
            except (PyverbsError, OSError) as exc:
                raise RdmaFailure(f"cannot register a cache slab for RDMA: {exc}") from None
        return Block(addr, lkey, into, n)

    async def _block(self, n: int) -> Block:
        """Registered memory for `n` bytes, the arena grown (in a thread) if need be."""
        block = self.arena.take(n)
        while block is None:
            async with self._growing:
                block = self.arena.take(n)
                if block is not None:
                    break
                grow = self.arena.growth(n)
                if grow is None:
                    raise RdmaFailure(f"all {human_bytes(self.arena.limit)} of RDMA memory is in use")
                try:
                    await trio.to_thread.run_sync(self.arena.add_segment, grow)
                except (PyverbsError, OSError) as exc:
                    raise RdmaFailure(f"cannot register {human_bytes(grow)} more for RDMA: {exc}") from None
                block = self.arena.take(n)
        return block

    def stats(self) -> dict[str, int]:
        return {"rdma_reads": self.reads, "rdma_bytes": self.bytes_read, "rdma_failures": self.failures,
                "rdma_links": len(self.links),
                "rdma_registered": self.arena.registered + (len(self.slabs.mrs) * self.slabs.slab_size
                                                            if self.slabs is not None else 0)}

    def close(self) -> None:
        for link in list(self.links.values()):
            link.close("the reader closed")
        self.links.clear()
        if self.slabs is not None:
            self.slabs.close()
        self.arena.close()
        self.device.close()
