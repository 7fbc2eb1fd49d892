"""RDMA verbs resources through pyverbs: device context -> protection domain -> completion queue
(with a completion channel whose fd trio waits on) -> memory regions -> reliable-connected queue
pairs, and the queue pair attributes that move a pair INIT -> RTR -> RTS.

The data daemon (dlfs/data/rdmaserve.py) registers chunk files mapped read-only for remote reads; the
client (dlfs/client/rdmareads.py) registers an arena that its RDMA READs land in. The exchange that
connects two queue pairs is QpEndpoint in dlfs/wire/messages.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyverbs.enums as e
import trio
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, WC, CompChannel
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr, qp_state_to_str
from pyverbs.wr import SGE, SendWR

from dlfs.errors import DlfsError
from dlfs.transport.verbs import PortInfo, gid_text
from dlfs.wire.messages import QpEndpoint

log = logging.getLogger(__name__)

# RC timing as ibv_rc_pingpong and rdma-core's tests use it: ack timeout 4.096 us * 2^14 (67 ms),
# 7 retries, so a dead peer fails a work request within about half a second.
ACK_TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12
HOP_LIMIT = 64  # RoCE v2 crosses routers
MAX_RD_ATOMIC = 16  # READs in flight per queue pair, at most (the device may allow fewer)


def new_psn() -> int:
    return secrets.randbits(24)


class RdmaDevice:
    """One port of a device, opened: its context, a protection domain, and its limits."""

    def __init__(self, port: PortInfo) -> None:
        self.port = port
        self.ctx = Context(name=port.device)
        try:
            self.pd = PD(self.ctx)
            attr = self.ctx.query_device()
            self.max_qp_wr = int(attr.max_qp_wr)
            # Initiator depth (READs this side issues at once) and responder resources (READs it serves).
            self.initiator_depth = max(1, min(MAX_RD_ATOMIC, int(attr.max_qp_init_rd_atom)))
            self.responder_depth = max(1, min(MAX_RD_ATOMIC, int(attr.max_qp_rd_atom)))
            self.max_msg = int(self.ctx.query_port(port.port).max_msg_sz)
        except BaseException:
            self.ctx.close()
            raise

    def endpoint(self, qp: QP, psn: int, rd_atomic: int) -> QpEndpoint:
        return QpEndpoint(qp.qp_num, psn, self.port.lid, self.port.gid, self.port.mtu, rd_atomic)

    def close(self) -> None:
        # Closing the context closes everything made from it (pyverbs tracks its children).
        self.ctx.close()


def _event_fds() -> set[int]:
    out = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry) == "anon_inode:[infinibandevent]":
                out.add(int(entry.name))
        except OSError:
            continue
    return out


def _channel_fd(make: Callable[[], CompChannel]) -> tuple[CompChannel, int]:
    """A completion channel and its file descriptor.

    pyverbs exposes the fd from rdma-core 57 on; before that (Debian's 44) it is the one new
    "[infinibandevent]" descriptor the channel's creation opened.
    """
    before = _event_fds()
    channel = make()
    fd = getattr(channel, "fd", None)
    if isinstance(fd, int):
        return channel, fd
    new = _event_fds() - before
    if len(new) != 1:
        channel.close()
        raise DlfsError(f"cannot find the completion channel's file descriptor ({len(new)} candidates)")
    return channel, new.pop()


class CompletionQueue:
    """A CQ with a completion channel; `run` hands every completion to a callback, sleeping in
    trio on the channel's fd between events (no busy-wait)."""

    def __init__(self, device: RdmaDevice, depth: int) -> None:
        self.channel, self.fd = _channel_fd(lambda: CompChannel(device.ctx))
        try:
            # Non-blocking: a wake-up without an event then fails fast instead of blocking trio.
            os.set_blocking(self.fd, False)
            self.cq = CQ(device.ctx, depth, None, self.channel, 0)
            self.cq.req_notify()
        except BaseException:
            self.channel.close()
            raise
        self.depth = depth
        self.closed = False

    def drain(self, on_completion: Callable[[WC], None]) -> int:
        """Hand over every completion queued now. A callback may close the queue: checked each round."""
        n = 0
        while not self.closed:
            got, wcs = self.cq.poll(64)
            for wc in wcs:
                on_completion(wc)
            n += got
            if got < 64:
                break
        return n

    async def run(self, on_completion: Callable[[WC], None]) -> None:
        """Deliver completions until cancelled or closed."""
        self.drain(on_completion)
        while not self.closed:
            try:
                await trio.lowlevel.wait_readable(self.fd)
            except trio.ClosedResourceError:
                return  # close() ran while we waited
            if self.closed:
                return  # woken, but closed before this task ran: the queue is gone
            try:
                self.channel.get_cq_event(self.cq)
            except PyverbsError:
                continue  # woken without an event (EAGAIN)
            self.cq.ack_events(1)
            # Re-arm before polling: a completion arriving in between then raises a new event.
            self.cq.req_notify()
            self.drain(on_completion)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            trio.lowlevel.notify_closing(self.fd)
        except RuntimeError:
            pass  # not inside trio: nobody can be waiting
        self.cq.close()
        self.channel.close()


# --- queue pair attributes (pure: they need no device, and the tests check them) ------------------
def qp_init_attr(cq: CQ | None, send_depth: int) -> QPInitAttr:
    """An RC queue pair on `cq`, with `send_depth` work requests that signal only when asked."""
    cap = QPCap(max_send_wr=send_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def init_attr(port: PortInfo, access: int) -> QPAttr:
    attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=port.port)
    attr.pkey_index = 0
    attr.qp_access_flags = access
    return attr


def rtr_attr(port: PortInfo, remote: QpEndpoint, responder_depth: int) -> QPAttr:
    """Ready to receive from `remote`: its qpn and first psn, the smaller MTU, and its address
    (a GRH with its GID on RoCE or when it has no LID, else its LID)."""
    attr = QPAttr(qp_state=e.IBV_QPS_RTR, port_num=port.port, path_mtu=min(port.mtu, remote.mtu))
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = responder_depth
    attr.min_rnr_timer = MIN_RNR_TIMER
    if port.ethernet or remote.lid == 0:
        route = GlobalRoute(dgid=GID(gid_text(remote.gid)), sgid_index=port.gid_index, hop_limit=HOP_LIMIT)
        attr.ah_attr = AHAttr(port_num=port.port, is_global=1, gr=route, dlid=remote.lid)
    else:
        attr.ah_attr = AHAttr(port_num=port.port, is_global=0, dlid=remote.lid)
    return attr


def rts_attr(port: PortInfo, psn: int, initiator_depth: int) -> QPAttr:
    attr = QPAttr(qp_state=e.IBV_QPS_RTS, port_num=port.port)
    attr.sq_psn = psn
    attr.timeout = ACK_TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    attr.max_rd_atomic = initiator_depth
    return attr


def connect_qp(qp: QP, port: PortInfo, access: int, remote: QpEndpoint, psn: int,
               responder_depth: int, initiator_depth: int) -> None:
    """RESET -> INIT -> RTR -> RTS, connected to `remote`."""
    qp.to_init(init_attr(port, access))
    qp.to_rtr(rtr_attr(port, remote, responder_depth))
    qp.to_rts(rts_attr(port, psn, initiator_depth))


def read_chain(pieces: list[tuple[int, int]], local_addr: int, lkey: int, remote_addr: int, rkey: int,
               wr_ids: Iterator[int]) -> list[SendWR]:
    """Signaled RDMA READ work requests for `pieces` ((offset, length) within the range), each
    naming the next: the first is the one to post. The caller closes them all once posted."""
    wrs: list[SendWR] = []
    after: SendWR | None = None
    try:
        for pos, size in reversed(pieces):  # built back to front: each names the one after it
            sge = SGE(local_addr + pos, size, lkey)
            try:
                wr = SendWR(wr_id=next(wr_ids), opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                            send_flags=e.IBV_SEND_SIGNALED, next_wr=after)
            finally:
                sge.close()  # SendWR copied it; pyverbs 44 never frees it by itself
            wr.set_wr_rdma(rkey, remote_addr + pos)
            wrs.append(wr)
            after = wr
    except BaseException:
        for wr in wrs:
            wr.close()
        raise
    wrs.reverse()
    return wrs


def qp_state(qp: QP) -> str:
    """The queue pair's state as the device sees it now ("RTS", "Error", ...)."""
    attr, _ = qp.query(e.IBV_QP_STATE)
    return str(qp_state_to_str(attr.qp_state))


def break_qp(qp: QP) -> None:
    """Move a queue pair to the error state: its outstanding work requests complete (flushed)."""
    qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)


# --- chunk files mapped read-only (the data daemon's side) -------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14: fault the whole range in now
MADV_POPULATE_WRITE = 23


class MappedFile:
    """A file mapped read-only and shared, by address (what a memory registration needs).

    Mapped through libc with ctypes, which drops the GIL: mapping and faulting a chunk in from
    disk runs in a worker thread without stalling the event loop.
    """

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.length = os.fstat(fd).st_size
            if self.length == 0:
                raise DlfsError(f"{path} is empty: nothing to register")
            addr = _libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {path} failed: {os.strerror(err)}")
            self.addr: int = addr
        finally:
            os.close(fd)
        # Registration pins the pages; bringing them in first keeps that step short.
        if _libc.madvise(self.addr, self.length, MADV_POPULATE_READ) != 0:
            _libc.madvise(self.addr, self.length, MADV_WILLNEED)

    def close(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, self.length)
            self.addr = 0


# --- the client's landing memory ----------------------------------------------------------------
SEGMENT = 256 << 20
MIN_BLOCK = 4096


def block_size(n: int) -> int:
    """`n` rounded up to one of 8 sizes per power of two (at most 1/8 more): ctypes makes and keeps
    one array type per size, so sizes must come from a small set."""
    if n <= MIN_BLOCK:
        return MIN_BLOCK
    step = 1 << (n.bit_length() - 4)
    return (n + step - 1) // step * step


Register = Callable[[int, int], Any]  # (address, length) -> a registration with .lkey and .close()


def local_write_registrar(pd: PD) -> Register:
    """Registers memory that RDMA READs (and so the device) may write into."""
    return lambda addr, length: MR(pd, length, e.IBV_ACCESS_LOCAL_WRITE, address=addr)


class _Segment:
    def __init__(self, register: Register, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size)  # shared anonymous memory
        anchor = ctypes.c_ubyte.from_buffer(self.map)
        self.addr = ctypes.addressof(anchor)
        del anchor  # its buffer export would pin the mapping forever
        # Fault the pages in first (ctypes drops the GIL): registering then only pins them.
        _libc.madvise(self.addr, size, MADV_POPULATE_WRITE)
        self.mr = register(self.addr, size)
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, coalesced

    def take(self, n: int) -> int | None:
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, length - n)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (off, n))
        # Merge with the neighbours it touches.
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (free[lo][0], free[lo][1] + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]


class Block:
    """Registered bytes an RDMA READ lands in. `data` is the buffer the cache keeps; the bytes go
    back to the arena when nothing refers to it any more (no copy, no explicit free)."""

    __slots__ = ("addr", "lkey", "data", "length")

    def __init__(self, addr: int, lkey: int, data: Any, length: int) -> None:
        self.addr, self.lkey, self.data, self.length = addr, lkey, data, length

    def view(self) -> memoryview:
        # Views and their slices keep `data` alive, and with it these bytes out of the free list.
        return memoryview(self.data).cast("B")[: self.length]


def buffer_address(buf: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte (for a work request's scatter list)."""
    anchor = ctypes.c_ubyte.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # its buffer export would pin the mapping


class SlabRegistry:
    """Someone else's memory made RDMA-writable a slab at a time, as reads first land in each slab:
    the mount's shared cache arena, so READs land where dlfs.direct clients map them (no copy), and
    an idle mount pins nothing. Registrations last as long as the registry."""

    def __init__(self, register: Register, arena: mmap.mmap, slab_size: int) -> None:
        self.register, self.arena, self.slab_size = register, arena, slab_size
        self.base, self.size = buffer_address(arena), len(arena)
        self.mrs: dict[int, MR] = {}
        self._lock = threading.Lock()

    def slab_of(self, addr: int, n: int) -> int | None:
        """The slab holding [addr, addr+n), or None if the range is not inside one slab of the arena."""
        if not self.base <= addr or addr + n > self.base + self.size:
            return None
        slab = (addr - self.base) // self.slab_size
        return slab if (addr + n - 1 - self.base) // self.slab_size == slab else None

    def lkey(self, slab: int) -> int | None:
        mr = self.mrs.get(slab)
        return mr.lkey if mr is not None else None

    def add(self, slab: int) -> int:
        """Register slab `slab` (slow: its pages are faulted in and pinned; run it in a thread); its lkey."""
        with self._lock:
            mr = self.mrs.get(slab)
            if mr is None:
                addr = self.base + slab * self.slab_size
                _libc.madvise(addr, self.slab_size, MADV_POPULATE_WRITE)
                mr = self.mrs[slab] = self.register(addr, self.slab_size)
            return mr.lkey

    def close(self) -> None:
        with self._lock:
            for mr in self.mrs.values():
                mr.close()
            self.mrs.clear()


class Arena:
    """Registered memory for RDMA READs, grown a segment at a time up to `limit` bytes (what
    memlock was checked against). Thread-safe: blocks may die in worker threads."""

    def __init__(self, register: Register, limit: int) -> None:
        self.register = register
        self.limit = limit
        self.segments: list[_Segment] = []
        self.registered = 0
        self.in_use = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> Block | None:
        """A block of `n` bytes from the segments registered so far, or None."""
        size = block_size(n)
        with self._lock:
            for seg in self.segments:
                off = seg.take(size)
                if off is not None:
                    break
            else:
                return None
            self.in_use += size
        data = (ctypes.c_ubyte * size).from_buffer(seg.map, off)
        weakref.finalize(data, self._give, seg, off, size)
        return Block(seg.addr + off, seg.mr.lkey, data, n)

    def growth(self, n: int) -> int | None:
        """The size of the segment to add so that `n` bytes fit, or None at the limit."""
        size = block_size(n)
        grow = max(SEGMENT, size)
        if self.registered + grow > self.limit:
            grow = max(self.limit - self.registered, size)
        return grow if self.registered + grow <= self.limit else None

    def add_segment(self, size: int) -> None:
        """Map and register `size` more bytes. Slow (the pages are faulted in and pinned): the
        reader runs it in a thread."""
        seg = _Segment(self.register, size)
        with self._lock:
            self.segments.append(seg)
            self.registered += size

    def alloc(self, n: int) -> Block | None:
        """A block of `n` bytes, growing the arena here if need be; None when it is full."""
        block = self.take(n)
        if block is None:
            grow = self.growth(n)
            if grow is None:
                return None
            self.add_segment(grow)
            block = self.take(n)
        return block

    def _give(self, seg: _Segment, off: int, size: int) -> None:
        with self._lock:
            seg.give(off, size)
            self.in_use -= size

    def close(self) -> None:
        """Deregister every segment; their memory stays mapped while the cache still uses it."""
        with self._lock:
            for seg in self.segments:
                seg.mr.close()
            self.segments.clear()
