"""The dlfs protocol: framed, versioned, numbered messages with request ids for pipelining.

Every frame (little-endian):

    header  20 B  magic u16 0xD1F5, version u8, kind u8 (0 request, 1 response), message id u16,
                  status u16 (0 ok, else an errors.py status), request id u32, meta length u32,
                  data length u32
    meta          msgpack map (a request's arguments, a response's results or error message)
    data          raw bytes (chunk contents, index pieces), received straight into one buffer

A frame that does not parse, or breaks a size limit, closes its connection (ProtocolError); the
peer's other connections and the daemon are unaffected. A request the daemon has no memory for
(budget.py) is read past, kept nowhere, and answered with an error; its connection goes on.

RDMA set-up rides on an authenticated data connection (dlfs/data/rdma.py, dlfs/client/rdma.py):

    RDMA_CONNECT  request  QpEndpoint of the client's RC queue pair (rd_atomic: READs it wants in flight)
                  response QpEndpoint of the daemon's queue pair for this connection (rd_atomic: READs
                           it accepts at once); both pairs are then moved INIT -> RTR -> RTS
    RDMA_REGION   request  {"ids": [chunk id, ...], "release": [chunk id, ...]}
                  response {"regions": [RemoteRegion or {"id", "error", "status"}, ...]}: where each
                           chunk's registered read-only mapping is (address, rkey, length); the daemon
                           keeps it registered until the client releases it or the connection ends

dlfs.direct talks to a mount over its control socket (a Unix socket named by the xattr
user.dlfs.control on the mount's root; dlfs/fuse/control.py), in the same frames, with no key: the
socket is the mount owner's alone (mode 0600, and its peer's uid is checked):

    DIRECT_ATTACH  request  {"pid"}
                   response {"row", "label", "mountpoint"}, sent with three descriptors (SCM_RIGHTS):
                            the shared cache's control region and arena (native/direct.c) and the index
    DIRECT_READ    request  {"exts": [extent, ...]} (at most DIRECT_BATCH)
                   response {"at": [[slab, offset] | None, ...], "errors": [[i, status, message], ...]};
                            each [slab, offset] is pinned for the client's row; a None not named in
                            errors is in data (raw bytes, in order, each its extent's raw length)
    DIRECT_STATS   request  {}
                   response the mount's cache statistics (fetches, bytes fetched by node, ...)
"""

from __future__ import annotations

import enum
import errno
import os
import select
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import trio

from dlfs.errors import ProtocolError, Unreachable

MAGIC = 0xD1F5
VERSION = 1
HEADER = struct.Struct("<HBBHHIII")
REQUEST, RESPONSE = 0, 1
MAX_META = 1 << 20
MAX_DATA = 320 << 20
# Before the handshake a peer is unknown: it gets tiny frames only.
MAX_DATA_UNAUTHENTICATED = 0
MAX_META_UNAUTHENTICATED = 4096
DIRECT_BATCH = 4096  # extents in one DIRECT_READ
# Raw bytes one DIRECT_READ may ask for: any of them may come back inline, copied in the mount's memory.
DIRECT_REQUEST_BYTES = 4 << 20
SKIP_PIECE = 64 << 10  # a frame read past (not served) goes through a scratch buffer this big


class Msg(enum.IntEnum):
    """Every message of every service, numbered once. Never renumber; only add."""

    # handshake (auth.py)
    HELLO = 1
    AUTH = 2
    AUTH_OK = 3
    # any daemon
    PING = 10
    STATUS = 11
    TIME = 12  # reply: {"node", "time": the daemon's clock in seconds since the epoch} (dlfs doctor)
    # metadata daemon
    LIST_DATASETS = 20
    GET_DATASET = 21
    READ_INDEX = 22
    BEGIN_INGEST = 23
    PIN_CHUNKS = 24
    PUT_INDEX = 25
    COMMIT = 26
    ABORT_INGEST = 27
    REMOVE = 28
    # 29-31 (CATALOG, NOTIFY, PINS: the peer-to-peer catalog sync) retired: clusters use etcd
    COLLECT = 32
    # data daemon
    PUT_CHUNK = 50
    READ_RANGE = 51
    HAS_CHUNKS = 52
    DELETE_CHUNKS = 53
    LIST_CHUNKS = 54
    VERIFY_CHUNKS = 55
    RDMA_CONNECT = 56
    RDMA_REGION = 57
    # a mount's control socket (dlfs.direct)
    DIRECT_ATTACH = 60
    DIRECT_READ = 61
    DIRECT_STATS = 62


@dataclass(slots=True)
class FileRange:
    """Frame data still in a file, sent with sendfile (never read into this process).

    Owns `fd`: the sender closes it once the frame is sent or abandoned."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


Payload = bytes | bytearray | memoryview | FileRange


@dataclass(slots=True)
class Frame:
    kind: int
    msg: int
    req_id: int
    status: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    data: Payload = b""


SENDFILE_STALL = 60.0  # seconds a peer may leave a file send unread before the connection ends


def _sendfile(sock_fd: int, r: FileRange) -> None:
    """In a worker thread: the whole range into the (non-blocking) socket, waiting while it is full."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    offset, left = r.offset, r.length
    while left:
        try:
            n = os.sendfile(sock_fd, r.fd, offset, left)
        except BlockingIOError:
            if not poller.poll(SENDFILE_STALL * 1000):
                raise TimeoutError(f"peer read nothing for {SENDFILE_STALL:g} s") from None
            continue
        if n == 0:
            raise OSError(errno.EIO, "file ended before the range sent")
        offset += n
        left -= n


def encode_header(f: Frame, meta: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, f.kind, f.msg, f.status, f.req_id, len(meta), len(f.data))


class Head(NamedTuple):
    """A parsed frame header: what its meta and data will be."""

    kind: int
    msg: int
    status: int
    req_id: int
    meta_len: int
    data_len: int


def parse_header(head: bytes | bytearray, peer: str, max_meta: int, max_data: int) -> Head:
    """(kind, msg, status, req_id, meta_len, data_len) of a frame header; ProtocolError if it is bad."""
    magic, version, kind, msg, status, req_id, meta_len, data_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"malformed frame from {peer}: bad magic {magic:#06x}")
    if version != VERSION:
        raise ProtocolError(f"frame from {peer}: protocol version {version} not spoken")
    if kind not in (REQUEST, RESPONSE):
        raise ProtocolError(f"malformed frame from {peer}: kind {kind}")
    if meta_len > max_meta or data_len > max_data:
        raise ProtocolError(f"frame from {peer} over the size limit (meta {meta_len}, data {data_len})")
    return Head(kind, msg, status, req_id, meta_len, data_len)


def encode_frame(f: Frame) -> bytes:
    """Header and meta of a frame (its data follows them on the wire); ProtocolError over a limit."""
    meta = pack_meta(f.meta)
    if len(meta) > MAX_META:
        raise ProtocolError(f"meta of {len(meta)} bytes is over the {MAX_META} limit")
    if len(f.data) > MAX_DATA:
        raise ProtocolError(f"data of {len(f.data)} bytes is over the {MAX_DATA} limit")
    return encode_header(f, meta) + meta


def pack_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def unpack_meta(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001  msgpack raises several unrelated types on garbage
        raise ProtocolError(f"malformed frame: meta does not decode ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise ProtocolError("malformed frame: meta is not a map")
    return meta


# Where a frame's data should land: (request id, data length) -> a big enough view, or None.
Sink = Callable[[int, int], memoryview | None]


class FrameStream:
    """Frames over one byte stream; receive() fills buffers sized from the header."""

    def __init__(self, stream: trio.abc.Stream, peer: str = "peer") -> None:
        self.stream = stream
        self.peer = peer
        self._pending = bytearray()
        self._got = 0
        self.max_meta = MAX_META_UNAUTHENTICATED
        self.max_data = MAX_DATA_UNAUTHENTICATED
        # recv_into straight into the destination where the stream is a real socket.
        sock = getattr(stream, "socket", None)
        self._recv_into = getattr(sock, "recv_into", None)

    def authenticated(self) -> None:
        self.max_meta, self.max_data = MAX_META, MAX_DATA

    async def send(self, f: Frame) -> None:
        head = encode_frame(f)
        if isinstance(f.data, FileRange):
            try:
                await self.stream.send_all(head)
                await self._send_file(f.data)
            finally:
                f.data.close()
            return
        if len(f.data) <= 65536:
            await self.stream.send_all(head + bytes(f.data))
        else:
            await self.stream.send_all(head)
            await self.stream.send_all(f.data)

    async def _send_file(self, r: FileRange) -> None:
        sock = getattr(self.stream, "socket", None)
        if sock is None:  # not a socket (tests' memory streams): read it, then send it
            await self.stream.send_all(await trio.to_thread.run_sync(os.pread, r.fd, r.length, r.offset))
            return
        # The thread gets its own descriptor: closing the connection meanwhile cannot hand the
        # number to another file under it.
        fd = os.dup(sock.fileno())
        try:
            await trio.to_thread.run_sync(_sendfile, fd, r)
        finally:
            os.close(fd)

    async def _fill(self, view: memoryview) -> None:
        """Fill `view` exactly: leftover bytes first, then the socket.

        EndOfChannel if the peer ends first; `self._got` says how much arrived by then.
        """
        self._got = got = min(len(self._pending), len(view))
        if got:
            view[:got] = self._pending[:got]
            del self._pending[:got]
        while got < len(view):
            if self._recv_into is not None:
                n = await self._recv_into(view[got:])
                if n == 0:
                    raise trio.EndOfChannel
                got += n
            else:
                block = await self.stream.receive_some(len(view) - got)
                if not block:
                    raise trio.EndOfChannel
                view[got : got + len(block)] = block
                got += len(block)
            self._got = got

    async def receive(self, sink: Sink | None = None) -> Frame:
        """The next frame; EndOfChannel at a clean end, ProtocolError on garbage.

        `sink(req_id, data_len)` may name where the data goes (a view of at least data_len bytes):
        a fetch then lands straight in the cache's memory."""
        return await self.receive_body(await self.receive_head(), sink)

    async def receive_head(self) -> Head:
        """The next frame's header (EndOfChannel at a clean end, ProtocolError on garbage); its body
        comes next, with receive_body or skip_body."""
        head = bytearray(HEADER.size)
        try:
            await self._fill(memoryview(head))
        except trio.EndOfChannel:
            if self._got:  # a partial header is a broken frame, not a clean end
                raise ProtocolError(f"connection from {self.peer} ended inside a frame header") from None
            raise
        return parse_header(head, self.peer, self.max_meta, self.max_data)

    async def receive_body(self, head: Head, sink: Sink | None = None) -> Frame:
        """The frame whose header is `head`, its meta and data read into buffers of their size."""
        raw_meta = bytearray(head.meta_len)
        dest = sink(head.req_id, head.data_len) if sink is not None and head.data_len else None
        data: bytearray | memoryview = bytearray(head.data_len) if dest is None else dest[:head.data_len]
        try:
            await self._fill(memoryview(raw_meta))
            await self._fill(memoryview(data))
        except trio.EndOfChannel:
            raise ProtocolError(f"connection from {self.peer} ended inside a frame") from None
        meta = unpack_meta(raw_meta) if head.meta_len else {}
        return Frame(head.kind, head.msg, head.req_id, head.status, meta, data)

    async def skip_body(self, head: Head) -> None:
        """Read past the meta and data of a frame that will not be served, keeping none of it: the
        stream stays in step for the frames after it."""
        left = head.meta_len + head.data_len
        scratch = memoryview(bytearray(min(left, SKIP_PIECE)))
        try:
            while left:
                n = min(left, len(scratch))
                await self._fill(scratch[:n])
                left -= n
        except trio.EndOfChannel:
            raise ProtocolError(f"connection from {self.peer} ended inside a frame") from None

    async def aclose(self) -> None:
        await self.stream.aclose()


# --- RDMA set-up records ------------------------------------------------------------------------
def _field(meta: Mapping[str, Any], name: str, what: str, bits: int) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < (1 << bits):
        raise ProtocolError(f"malformed {what}: {name} must be an unsigned {bits}-bit number, got {value!r}")
    return value


def _bytes16(meta: Mapping[str, Any], name: str, what: str, means: str) -> bytes:
    value = meta.get(name)
    if not isinstance(value, bytes) or len(value) != 16:
        raise ProtocolError(f"malformed {what}: {name} must be {means}")
    return value


@dataclass(frozen=True, slots=True)
class QpEndpoint:
    """What the far side needs to connect to one reliable-connected queue pair."""

    qpn: int  # queue pair number, 24 bits
    psn: int  # first packet sequence number this side sends, 24 bits
    lid: int  # port LID (InfiniBand); 0 on RoCE, where the GID routes
    gid: bytes  # 16-byte port GID (sgid of the chosen index); zeros when unused
    mtu: int  # active path MTU as an ibv_mtu value (1 = 256 ... 5 = 4096)
    rd_atomic: int  # RDMA READs in flight at once: wanted (client) or accepted (daemon)

    def to_meta(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid, "mtu": self.mtu,
                "rd_atomic": self.rd_atomic}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> QpEndpoint:
        what = "RDMA endpoint"
        gid = _bytes16(meta, "gid", what, "16 bytes")
        mtu = _field(meta, "mtu", what, 8)
        if not 1 <= mtu <= 5:
            raise ProtocolError(f"malformed {what}: mtu {mtu} is not an ibv_mtu value (1-5)")
        rd_atomic = _field(meta, "rd_atomic", what, 8)
        if rd_atomic < 1:
            raise ProtocolError(f"malformed {what}: rd_atomic must be at least 1")
        return cls(_field(meta, "qpn", what, 24), _field(meta, "psn", what, 24), _field(meta, "lid", what, 16),
                   gid, mtu, rd_atomic)


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A chunk's registered read-only mapping on a data daemon: the target of RDMA READs."""

    id: bytes  # chunk id
    addr: int  # virtual address of the chunk's first byte in the daemon
    rkey: int  # remote key of its memory registration
    length: int  # bytes registered: the whole chunk file

    def to_meta(self) -> dict[str, Any]:
        return {"id": self.id, "addr": self.addr, "rkey": self.rkey, "length": self.length}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RemoteRegion:
        what = "RDMA region"
        cid = _bytes16(meta, "id", what, "a 16-byte chunk id")
        return cls(cid, _field(meta, "addr", what, 64), _field(meta, "rkey", what, 32), _field(meta, "length", what, 64))


def connection_lost(peer: str, exc: BaseException) -> Unreachable:
    return Unreachable(f"lost connection to {peer} ({type(exc).__name__}: {exc})")
