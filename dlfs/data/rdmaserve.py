"""The data daemon's RDMA side: one RC queue pair per client connection, and chunk files mapped
read-only and registered for remote reads, so that clients READ chunk bytes with no CPU here.

A client connects its queue pair with RDMA_CONNECT and asks where chunks are with RDMA_REGION
(dlfs/wire/protocol.py, dlfs/wire/messages.py). Registrations are shared by every connection and counted per holder;
one whose last holder released it stays registered, for the next reader of that chunk, while the
pin budget allows. A connection that ends takes its queue pair and its holds with it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import pyverbs.enums as e
import trio
from pyverbs.cq import WC, cqe_status_to_str
from pyverbs.mr import MR
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP

from dlfs.data.store import ChunkStore
from dlfs.errors import DlfsError, NotFound, ProtocolError, status_of
from dlfs.transport.rdma import (
    CompletionQueue,
    MappedFile,
    RdmaDevice,
    Register,
    break_qp,
    connect_qp,
    new_psn,
    qp_init_attr,
)
from dlfs.transport.verbs import PortInfo
from dlfs.units import human_bytes
from dlfs.wire.messages import QpEndpoint, RegionRefused, RegionRequest, Regions, RemoteRegion, to_meta
from dlfs.wire.rpc import Reply, current_peer

log = logging.getLogger(__name__)
CQ_DEPTH = 64  # responder queue pairs complete nothing of their own; this CQ only reports trouble


class _Registration:
    __slots__ = ("cid", "mapped", "mr", "refs", "stale")

    def __init__(self, cid: bytes, mapped: MappedFile, mr: Any) -> None:
        self.cid, self.mapped, self.mr = cid, mapped, mr
        self.refs = 0
        self.stale = False  # the chunk file was deleted: no new holders; closed with its last one

    @property
    def length(self) -> int:
        return self.mapped.length

    def region(self) -> RemoteRegion:
        return RemoteRegion(self.cid, self.mapped.addr, int(self.mr.rkey), self.mapped.length)

    def close(self) -> None:
        self.mr.close()
        self.mapped.close()


class ChunkRegistry:
    """Chunk files mapped and registered for remote reads, within `budget` pinned bytes."""

    def __init__(self, store: ChunkStore, register: Register, budget: int) -> None:
        self.store = store
        self.register = register
        self.budget = budget
        self.pinned = 0
        self._regs: dict[bytes, _Registration] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # registered, held by nobody: oldest first
        self._pending: dict[bytes, trio.Event] = {}
        self._invalidated: set[bytes] = set()  # deleted while being registered
        # Mapping and faulting a chunk in reads it from disk: in threads, a few at a time.
        self._io = trio.CapacityLimiter(4)

    def _make_room(self, nbytes: int) -> None:
        while self.pinned + nbytes > self.budget and self._idle:
            cid, _ = self._idle.popitem(last=False)
            self._drop(self._regs.pop(cid))

    def _drop(self, reg: _Registration) -> None:
        self.pinned -= reg.length
        reg.close()

    def _map_and_register(self, cid: bytes) -> _Registration:
        try:
            mapped = MappedFile(self.store.path(cid))
        except FileNotFoundError:
            raise NotFound(f"chunk {cid.hex()} is not on this node") from None
        except OSError as exc:
            raise DlfsError(f"cannot map chunk {cid.hex()}: {exc.strerror or exc}") from None
        try:
            return _Registration(cid, mapped, self.register(mapped.addr, mapped.length))
        except PyverbsError as exc:
            mapped.close()
            raise DlfsError(f"cannot register chunk {cid.hex()} for RDMA: {exc}") from None

    async def acquire(self, cid: bytes) -> _Registration:
        """Hold the chunk's registration, made now if need be; `release` it when done."""
        while True:
            reg = self._regs.get(cid)
            if reg is not None:
                reg.refs += 1
                self._idle.pop(cid, None)
                return reg
            pending = self._pending.get(cid)
            if pending is None:
                break
            await pending.wait()
        done = self._pending[cid] = trio.Event()
        try:
            try:
                size = self.store.path(cid).stat().st_size
            except FileNotFoundError:
                raise NotFound(f"chunk {cid.hex()} is not on this node") from None
            self._make_room(size)
            if self.pinned + size > self.budget:
                raise DlfsError(f"RDMA registrations are at their {human_bytes(self.budget)} budget "
                                f"(all held by clients): chunk {cid.hex()} is served over TCP")
            self.pinned += size  # reserved before the thread runs, so concurrent acquires see it
            try:
                reg = await trio.to_thread.run_sync(self._map_and_register, cid, limiter=self._io)
            except BaseException:
                self.pinned -= size
                raise
            self.pinned += reg.length - size  # the file's size as mapped
            reg.refs = 1
            if cid in self._invalidated:
                reg.stale = True  # this holder reads what it asked for; nobody else gets it
            else:
                self._regs[cid] = reg
            return reg
        finally:
            del self._pending[cid]
            self._invalidated.discard(cid)
            done.set()

    def release(self, reg: _Registration) -> None:
        reg.refs -= 1
        if reg.refs > 0:
            return
        if reg.stale:
            self._drop(reg)
        else:
            self._idle[reg.cid] = None
            self._make_room(0)

    def invalidate(self, cid: bytes) -> None:
        """The chunk file was deleted (a bad replica, a collected chunk): new readers must not get
        the old mapping. Idle, it goes now; held, it goes when its last holder lets go."""
        if cid in self._pending:
            self._invalidated.add(cid)
        reg = self._regs.pop(cid, None)
        if reg is None:
            return
        self._idle.pop(cid, None)
        if reg.refs == 0:
            self._drop(reg)
        else:
            reg.stale = True

    def close(self) -> None:
        for reg in self._regs.values():
            reg.close()
        self._regs.clear()
        self._idle.clear()
        self.pinned = 0


class _Session:
    """One client connection's queue pair and the registrations it holds (one entry per hold)."""

    def __init__(self, qp: QP, registry: ChunkRegistry, peer: str) -> None:
        self.qp = qp
        self.registry = registry
        self.peer = peer
        self.held: dict[bytes, list[_Registration]] = {}
        self.closed = False

    def hold(self, reg: _Registration) -> None:
        self.held.setdefault(reg.cid, []).append(reg)

    def release(self, cid: bytes) -> None:
        regs = self.held.get(cid)
        if not regs:
            return
        self.registry.release(regs.pop())
        if not regs:
            del self.held[cid]

    def close(self) -> None:
        self.closed = True
        # The queue pair goes first: once destroyed, nothing can still be reading these regions.
        try:
            break_qp(self.qp)
        except PyverbsError:
            pass
        self.qp.close()
        for regs in self.held.values():
            for reg in regs:
                self.registry.release(reg)
        self.held.clear()


class RdmaResponder:
    """The data daemon's verbs resources and its RDMA_CONNECT / RDMA_REGION handlers."""

    def __init__(self, port: PortInfo, store: ChunkStore, budget: int) -> None:
        self.port = port
        self.device = RdmaDevice(port)
        try:
            self.cq = CompletionQueue(self.device, CQ_DEPTH)
        except BaseException:
            self.device.close()
            raise
        pd = self.device.pd
        self.registry = ChunkRegistry(
            store, lambda addr, length: MR(pd, length, e.IBV_ACCESS_REMOTE_READ, address=addr), budget)
        self.sessions: set[_Session] = set()
        self.closed = False

    def describe(self) -> str:
        return f"{self.port.label()} ({self.port.link_layer}), pin budget {human_bytes(self.registry.budget)}"

    async def run(self) -> None:
        """Watch the completion queue for the daemon's life (responders only see errors there)."""
        await self.cq.run(self._completion)

    def _completion(self, wc: WC) -> None:
        log.warning("RDMA: unexpected completion on the data daemon's queue (qp %d, %s)",
                    wc.qp_num, cqe_status_to_str(wc.status))

    def _close_session(self, session: _Session) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            session.close()

    async def connect(self, remote: QpEndpoint) -> Reply:
        """RDMA_CONNECT: a queue pair for this connection, connected to the client's."""
        peer = current_peer()
        old = peer.state.pop("rdma", None)
        if old is not None:  # the client reconnects (its pair broke): the old pair goes
            self._close_session(old)
        qp = QP(self.device.pd, qp_init_attr(self.cq.cq, 1))
        psn = new_psn()
        try:
            connect_qp(qp, self.port, e.IBV_ACCESS_REMOTE_READ, remote, psn,
                       responder_depth=self.device.responder_depth, initiator_depth=1)
        except PyverbsError as exc:
            qp.close()
            raise DlfsError(f"cannot connect an RDMA queue pair to {peer.name}: {exc}") from None
        session = _Session(qp, self.registry, peer.name)
        self.sessions.add(session)
        peer.state["rdma"] = session
        peer.on_close(lambda: self._close_session(session))
        log.info("RDMA: queue pair %d connected to %s (qp %d)", qp.qp_num, peer.name, remote.qpn)
        return self.device.endpoint(qp, psn, self.device.responder_depth), b""

    async def regions(self, req: RegionRequest) -> Reply:
        """RDMA_REGION: release what the client no longer reads; register and hold what it asks for."""
        session = current_peer().state.get("rdma")
        if session is None:
            raise ProtocolError("RDMA_REGION before RDMA_CONNECT on this connection")
        for cid in req.release:
            session.release(cid)
        out: list[dict[str, Any]] = []
        for cid in req.ids:
            try:
                reg = await self.registry.acquire(cid)
            except DlfsError as exc:
                out.append(to_meta(RegionRefused(cid, exc.message, status_of(exc))))
                continue
            if session.closed:  # replaced by a newer RDMA_CONNECT meanwhile
                self.registry.release(reg)
                raise DlfsError("the queue pair of this request was replaced")
            session.hold(reg)
            out.append(reg.region().to_meta())
        return Regions(out), b""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for session in list(self.sessions):
            self._close_session(session)
        self.registry.close()
        self.cq.close()
        self.device.close()
