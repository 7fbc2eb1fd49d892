"""The dlfs protocol: framed, versioned, numbered messages with request ids for pipelining.

Every frame (little-endian):

    header  20 B  magic u16 0xD1F5, version u8, kind u8 (0 request, 1 response), message id u16,
                  status u16 (0 ok, else an errors.py status), request id u32, meta length u32,
                  data length u32
    meta          msgpack map (a request's arguments, a response's results or error message), one
                  schema per message in messages.py, checked before a handler sees it
    data          raw bytes (chunk contents, index pieces), received straight into one buffer

A frame that does not parse, or breaks a size limit, closes its connection (ProtocolError); the
peer's other connections and the daemon are unaffected. A header allocates nothing: a frame's bytes
land in their destination as they arrive (a buffer that grows with them), and once a frame has begun
its bytes must keep coming (FRAME_STALL). A request the daemon has no memory for
(budget.py) is read past, kept nowhere, and answered with an error; its connection goes on.

RDMA set-up rides on an authenticated data connection (dlfs/data/rdmaserve.py, dlfs/client/rdmareads.py):

    RDMA_CONNECT  request  QpEndpoint of the client's RC queue pair (rd_atomic: READs it wants in flight)
                  response QpEndpoint of the daemon's queue pair for this connection (rd_atomic: READs
                           it accepts at once); both pairs are then moved INIT -> RTR -> RTS
    RDMA_REGION   request  {"ids": [chunk id, ...], "release": [chunk id, ...]}
                  response {"regions": [RemoteRegion or {"id", "error", "status"}, ...]}: where each
                           chunk's registered read-only mapping is (address, rkey, length); the daemon
                           keeps it registered until the client releases it or the connection ends

A mount's serving threads fetch scan mode's records themselves (native/remote.h), on connections that
carry nothing else:

    RANGE_LANE     request  {}, the first request of an authenticated data connection, none in flight
                   response {}: from now on the daemon's native threads (native/rangeserve.h) answer the
                            connection's READ_RANGEs, one at a time, in order, as its Python would; any
                            other frame closes it. An error (a daemon without them): the connection
                            stays as it was, served by Python.

dlfs.direct talks to a mount over its control socket (a Unix socket named by the xattr
user.dlfs.control on the mount's root; dlfs/mount/directsock.py), in the same frames, with no key: the
socket is the mount owner's alone (mode 0600, and its peer's uid is checked):

    DIRECT_ATTACH  request  {"pid"}
                   response {"row", "label", "mountpoint"}, sent with three descriptors (SCM_RIGHTS):
                            the shared cache's control region and arena (native/shm.h) and the index
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
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import trio

from dlfs.errors import ProtocolError
from dlfs.pagecache import all_cached

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
# A received frame's buffer grows as its bytes come: to this at first, then to at most twice what came.
GROW_PIECE = 1 << 20
# A big body is waited for in pieces this big (SO_RCVLOWAT), not woken for every segment that lands.
RECV_PIECE = 1 << 20
PIECE_WAIT = 0.25  # seconds at most a receive waits for a whole piece before it takes what is there
FRAME_STALL = 30.0  # seconds a begun frame may go without a byte before its connection is closed


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
    CHECK_INDEXES = 33  # verify / repair: is each index file here the one committed (restore it from a peer)
    # data daemon
    PUT_CHUNK = 50
    READ_RANGE = 51
    HAS_CHUNKS = 52
    DELETE_CHUNKS = 53
    LIST_CHUNKS = 54
    VERIFY_CHUNKS = 55
    RDMA_CONNECT = 56
    RDMA_REGION = 57
    STAGE_CHUNK = 58  # a client on the daemon's machine asks where to write a chunk (ingest without the loopback)
    PUT_STAGED = 59  # ... and hands it over once written: framing checked, the client's hash trusted, synced
    RANGE_LANE = 63  # this connection carries READ_RANGE alone from now on (the daemon's native threads serve it)
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
# A range this small whose every page is in the page cache is sent by the event loop itself: sendfile
# cannot wait for the disk then, and a worker thread would cost more than the copy.
INLINE_SEND_MAX = 1 << 20


def _sendfile_steps(sock_fd: int, r: FileRange) -> Iterator[None]:
    """The whole range into the (non-blocking) socket, pausing (a yield) whenever it is full: the
    caller waits for room, bounded by SENDFILE_STALL, and resumes it."""
    offset, left = r.offset, r.length
    while left:
        try:
            n = os.sendfile(sock_fd, r.fd, offset, left)
        except BlockingIOError:
            yield
            continue
        if n == 0:
            raise OSError(errno.EIO, "file ended before the range sent")
        offset += n
        left -= n


def _sendfile(sock_fd: int, r: FileRange) -> None:
    """In a worker thread: the whole range sent, waiting in poll while the socket is full."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    for _ in _sendfile_steps(sock_fd, r):
        if not poller.poll(SENDFILE_STALL * 1000):
            raise TimeoutError(f"peer read nothing for {SENDFILE_STALL:g} s") from None


async def _sendfile_inline(sock_fd: int, r: FileRange) -> None:
    """_sendfile on the event loop, for a range the page cache holds: it waits only for room in the
    socket, as long as _sendfile would."""
    for _ in _sendfile_steps(sock_fd, r):
        with trio.move_on_after(SENDFILE_STALL) as waited:
            await trio.lowlevel.wait_writable(sock_fd)
        if waited.cancelled_caught:
            raise TimeoutError(f"peer read nothing for {SENDFILE_STALL:g} s") from None


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
    """Frames over one byte stream; receive() takes each frame's bytes as they arrive, into the
    sink's memory or a buffer that grows with them, never into one sized from the header alone."""

    def __init__(self, stream: trio.abc.Stream, peer: str = "peer") -> None:
        self.stream = stream
        self.peer = peer
        self._pending = bytearray()
        self.max_meta = MAX_META_UNAUTHENTICATED
        self.max_data = MAX_DATA_UNAUTHENTICATED
        self.stall = FRAME_STALL
        self.stalled = False  # a frame stalled: the ProtocolError raised was for that
        self.last_activity = 0.0  # trio clock when a frame was last sent or received whole
        # recv_into straight into the destination where the stream is a real socket.
        sock = getattr(stream, "socket", None)
        self._recv_into = getattr(sock, "recv_into", None)
        self._lowat = sock if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) else None
        self._lowat_set = 1

    def authenticated(self) -> None:
        self.max_meta, self.max_data = MAX_META, MAX_DATA

    def detach(self) -> int:
        """The socket's descriptor, no longer this stream's (the caller owns it; dlfs/mount/remotereads.py
        hands it to the serving threads). ProtocolError if bytes of a next frame were already taken."""
        sock = getattr(self.stream, "socket", None)
        if sock is None or self._pending:
            raise ProtocolError(f"the connection to {self.peer} cannot be handed over"
                                + (" (bytes of a frame already read)" if self._pending else " (not a socket)"))
        return int(sock.detach())

    async def send(self, f: Frame) -> None:
        head = encode_frame(f)
        if isinstance(f.data, FileRange):
            try:
                await self.stream.send_all(head)
                await self._send_file(f.data)
            finally:
                f.data.close()
            self.last_activity = trio.current_time()
            return
        if len(f.data) <= 65536:
            await self.stream.send_all(head + bytes(f.data))
        else:
            await self.stream.send_all(head)
            await self.stream.send_all(f.data)
        self.last_activity = trio.current_time()

    async def _send_file(self, r: FileRange) -> None:
        sock = getattr(self.stream, "socket", None)
        if sock is None:  # not a socket (tests' memory streams): read it, then send it
            await self.stream.send_all(await trio.to_thread.run_sync(os.pread, r.fd, r.length, r.offset))
            return
        if r.length <= INLINE_SEND_MAX and all_cached(r.fd, r.offset, r.length):
            await _sendfile_inline(sock.fileno(), r)
            return
        # The thread gets its own descriptor: closing the connection meanwhile cannot hand the
        # number to another file under it.
        fd = os.dup(sock.fileno())
        try:
            await trio.to_thread.run_sync(_sendfile, fd, r)
        finally:
            os.close(fd)

    async def _receive_into(self, view: memoryview) -> int:
        """Some bytes (at least one) into the start of `view`: leftovers first, then the stream.
        EndOfChannel if the peer has ended."""
        if self._pending:
            n = min(len(self._pending), len(view))
            view[:n] = self._pending[:n]
            del self._pending[:n]
            return n
        if self._recv_into is not None:
            n = await self._recv_into(view)
        else:
            block = await self.stream.receive_some(len(view))
            n = len(block)
            view[:n] = block
        if n == 0:
            raise trio.EndOfChannel
        return n

    @contextmanager
    def _unstalled(self) -> Iterator[trio.CancelScope]:
        """The bound on a begun frame: each wait for its next bytes ends after `stall` seconds, and
        the frame with it (ProtocolError). Receivers move the deadline on as bytes come."""
        with trio.CancelScope(deadline=trio.current_time() + self.stall) as bound:
            yield bound
        if bound.cancelled_caught:
            self.stalled = True
            raise ProtocolError(f"a frame from {self.peer} stalled: no byte of it for {self.stall:g} s")

    async def _fill(self, view: memoryview, bound: trio.CancelScope) -> None:
        """Fill `view` exactly (EndOfChannel if the peer ends first)."""
        got = 0
        try:
            while got < len(view):
                got += await self._receive_piece(view[got:], len(view) - got)
                bound.deadline = trio.current_time() + self.stall
        finally:
            self._wake_after(1)

    async def _grow(self, n: int, bound: trio.CancelScope) -> bytearray:
        """`n` bytes into a buffer that grows as they come: it holds at most GROW_PIECE, or twice
        what has arrived, whatever `n` a header declared."""
        buf = bytearray(min(n, GROW_PIECE))
        got = 0
        try:
            while got < n:
                if got == len(buf):
                    # bytes(k) is calloc'ed (its pages untouched): only buf's new part is written.
                    buf += bytes(min(n, 2 * got) - got)
                got += await self._receive_piece(memoryview(buf)[got:], n - got)
                bound.deadline = trio.current_time() + self.stall
        finally:
            self._wake_after(1)
        return buf

    async def _receive_piece(self, view: memoryview, owed: int) -> int:
        """Some bytes (at least one) of a frame that still owes `owed` into `view`: woken once a whole
        piece is there where the sender keeps up (_wake_after), else, after PIECE_WAIT, with what
        has come, so that the stall bound still counts from a slow sender's last byte."""
        self._wake_after(owed)
        if self._lowat_set > 1:
            with trio.move_on_after(min(PIECE_WAIT, self.stall / 4)):
                return await self._receive_into(view)  # cancelled while waiting: no byte taken
            self._wake_after(1)
        return await self._receive_into(view)

    def _wake_after(self, owed: int) -> None:
        """Wake a receive of a TCP stream only once min(`owed`, RECV_PIECE) bytes are there (never
        more than the frame still owes: they might never come); 1 between frames. A receive still
        takes whatever is there when it is made: this spares the wakeups, a few per piece instead of
        one for every segment that lands (a fetched window's recv calls down from ~50 to ~9)."""
        want = min(owed, RECV_PIECE) if owed >= RECV_PIECE or self._lowat_set != 1 else 1
        if self._lowat is not None and want != self._lowat_set:
            try:
                self._lowat.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:  # closed under it: nothing waits on it any more
                self._lowat, want = None, 1
            self._lowat_set = want

    async def receive(self, sink: Sink | None = None) -> Frame:
        """The next frame; EndOfChannel at a clean end, ProtocolError on garbage or a stall.

        `sink(req_id, data_len)` may name where the data goes (a view of at least data_len bytes):
        a fetch then lands straight in the cache's memory."""
        return await self.receive_body(await self.receive_head(), sink)

    async def wait_frame(self, timeout: float) -> bool:
        """True once the next frame's first bytes are here, False if none came within `timeout`
        (nothing is lost either way); EndOfChannel if the peer has ended."""
        if self._pending:
            return True
        with trio.move_on_after(timeout):
            block = await self.stream.receive_some(HEADER.size)  # cancelled: no bytes taken
            if not block:
                raise trio.EndOfChannel
            self._pending += block
            return True
        return False

    async def receive_head(self) -> Head:
        """The next frame's header (EndOfChannel at a clean end, ProtocolError on garbage); its body
        comes next, with receive_body or skip_body. Its first byte may take as long as the peer
        likes (callers bound idleness); the rest must not stall."""
        head = bytearray(HEADER.size)
        view = memoryview(head)
        got = await self._receive_into(view)
        with self._unstalled() as bound:
            try:
                await self._fill(view[got:], bound)
            except trio.EndOfChannel:
                raise ProtocolError(f"connection from {self.peer} ended inside a frame header") from None
        return parse_header(head, self.peer, self.max_meta, self.max_data)

    async def receive_body(self, head: Head, sink: Sink | None = None) -> Frame:
        """The frame whose header is `head`: its data into the sink's view where one is given, else
        (and its meta) into buffers that grow as the bytes arrive."""
        dest = sink(head.req_id, head.data_len) if sink is not None and head.data_len else None
        with self._unstalled() as bound:
            try:
                raw_meta = await self._grow(head.meta_len, bound)
                if dest is None:
                    data: bytearray | memoryview = await self._grow(head.data_len, bound)
                else:
                    data = dest[:head.data_len]
                    await self._fill(data, bound)
            except trio.EndOfChannel:
                raise ProtocolError(f"connection from {self.peer} ended inside a frame") from None
        meta = unpack_meta(raw_meta) if head.meta_len else {}
        self.last_activity = trio.current_time()
        return Frame(head.kind, head.msg, head.req_id, head.status, meta, data)

    async def skip_body(self, head: Head) -> None:
        """Read past the meta and data of a frame that will not be served, keeping none of it: the
        stream stays in step for the frames after it."""
        left = head.meta_len + head.data_len
        scratch = memoryview(bytearray(min(left, SKIP_PIECE)))
        with self._unstalled() as bound:
            try:
                while left:
                    n = min(left, len(scratch))
                    await self._fill(scratch[:n], bound)
                    left -= n
            except trio.EndOfChannel:
                raise ProtocolError(f"connection from {self.peer} ended inside a frame") from None
        self.last_activity = trio.current_time()

    async def aclose(self) -> None:
        await self.stream.aclose()

