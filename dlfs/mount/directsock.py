"""The mount's control socket: where dlfs.direct clients attach to the shared chunk cache.

A client finds the socket through the xattr user.dlfs.control on the mount's root, attaches (and
receives the cache's shared files and the index by SCM_RIGHTS), then reads most files with no request at
all: only records not yet in a slab come here, a batch at a time (DIRECT_READ), and are answered
pinned for that client. Each connection is one client process with one row of the pin table; when
the connection ends, for whatever reason, the row goes back once its owner released it or is gone
(dlfs/mount/pinrows.py: its views may outlive the connection).

The socket is the mount owner's (mode 0600, and the peer's uid is checked): a client maps the whole
cache, so file permissions cannot be enforced per file here; anyone else reads through the mount.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import trio

from dlfs.errors import Conflict, DlfsError, ProtocolError, UsageError, status_of
from dlfs.format.index import Index
from dlfs.mount.cache import DIRECT_CLIENTS, ChunkCache
from dlfs.mount.pinrows import ClientProcess, PinRows
from dlfs.private import owned_private_dir, private_dirs
from dlfs.tasks import open_nursery
from dlfs.wire.messages import Attached, DirectAnswer, DirectAttach, DirectRead, Empty, request, to_meta
from dlfs.wire.protocol import (
    DIRECT_BATCH,
    DIRECT_REQUEST_BYTES,
    REQUEST,
    RESPONSE,
    Frame,
    FrameStream,
    Msg,
    encode_frame,
)

log = logging.getLogger(__name__)
SUN_PATH_MAX = 107
FETCH_TASKS = 8  # windows of one batch fetched at once
INLINE_ANSWERS = 1  # answers with copies in them (up to DIRECT_REQUEST_BYTES, twice) built at once, all clients


@dataclass(frozen=True)
class _Conn:
    """One attached client's connection: its pin-table row, and what its answers go out through."""

    row: int
    pid: int
    stream: trio.SocketStream
    frames: FrameStream


def control_socket_path(home: Path, mountpoint: Path) -> Path:
    """Where a mount's control socket lives: under its home, or in the temp dir's dlfs-<uid> if that path
    is too long for a socket (a directory another user may have made first: `serve` checks it is ours)."""
    key = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    path = home / "run" / "direct" / f"{key}.sock"
    if len(os.fsencode(path.absolute())) > SUN_PATH_MAX:
        path = Path(tempfile.gettempdir()) / f"dlfs-{os.getuid()}" / f"{key}.sock"
    return path.absolute()


class ControlServer:
    def __init__(self, cache: ChunkCache, index: Index, label: str, mountpoint: Path, path: Path) -> None:
        if cache.shared is None:
            raise UsageError("the shared cache needs dlfs's C helper")
        self.cache, self.index, self.shared = cache, index, cache.shared
        self.label, self.mountpoint, self.path = label, mountpoint, path
        self.rows = PinRows(self.shared, DIRECT_CLIENTS)
        self._nursery: trio.Nursery | None = None  # where held rows are watched: serve's
        self._index_fd = os.open(index.path, os.O_RDONLY | os.O_CLOEXEC)
        self.attached = self.attaches = self.requests = 0
        self.served_pinned = self.served_inline = 0
        self._inline = trio.Semaphore(INLINE_ANSWERS)  # bounds the copies, whatever the number of clients

    def close(self) -> None:
        os.close(self._index_fd)

    def stats(self) -> dict[str, int]:
        # A client whose connection ended while its views live is attached still: it holds a row.
        return {"direct_clients": self.attached + len(self.rows.held), "direct_rows_held": len(self.rows.held),
                "direct_refused_releases": self.shared.refused_releases,
                "direct_attaches": self.attaches, "direct_requests": self.requests,
                "direct_pinned": self.served_pinned, "direct_inline": self.served_inline,
                "direct_reclaimed_pins": self.rows.reclaimed_pins}

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the socket file is removed on the way out."""
        # Whoever can replace the socket receives the attaches of root's dlfs.direct clients: its directory
        # is ours alone, or the mount does not start.
        private_dirs(self.path.parent.parent)
        owned_private_dir(self.path.parent)
        self.path.unlink(missing_ok=True)  # a dead mount's: this mountpoint is ours now
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(128)
            listener = trio.SocketListener(sock)
        except BaseException:
            sock.close()
            raise
        try:
            async with open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.serve_listeners(self._client, [listener], handler_nursery=nursery)
        finally:
            self.path.unlink(missing_ok=True)

    async def _client(self, stream: trio.SocketStream) -> None:
        pid, uid, _ = struct.unpack("3i", stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        frames = FrameStream(stream, peer=f"dlfs.direct client pid {pid}")
        if uid not in (0, os.getuid()):
            log.warning("refused a dlfs.direct client of uid %d (pid %d): the control socket is the mount "
                        "owner's", uid, pid)
            await stream.aclose()
            return
        frames.authenticated()
        proc = ClientProcess(pid, stream.socket)  # watched from now on: its pid may be reused once it ends
        row = self.rows.take()
        if row is not None:
            self.attached += 1
        try:
            while True:
                try:
                    f = await frames.receive()
                except trio.EndOfChannel:
                    return
                if f.kind != REQUEST:
                    raise ProtocolError(f"{frames.peer} sent a response frame")
                self.requests += 1
                try:
                    if row is None:
                        raise Conflict(f"{DIRECT_CLIENTS} dlfs.direct processes are attached to {self.label} "
                                       "already: no room for another")
                    reply = await self._answer(f, _Conn(row, pid, stream, frames))
                except DlfsError as exc:
                    reply = Frame(RESPONSE, f.msg, f.req_id, status_of(exc), {"error": exc.message})
                if reply is not None:
                    await frames.send(reply)
        except ProtocolError as exc:
            log.warning("%s; closing its connection", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("%s went: %s", frames.peer, exc)
        except Exception:
            # A bug costs this client its connection, never the mount.
            log.exception("%s: request failed; closing its connection", frames.peer)
        finally:
            if row is not None:
                self.attached -= 1
                assert self._nursery is not None
                self.rows.end(row, proc, self._nursery)
            else:
                proc.close()
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _answer(self, f: Frame, conn: _Conn) -> Frame | None:
        """The reply to `f`, or None if it was sent here already. A body of the wrong shape is refused
        before any handler runs: one ProtocolError naming the field, and the connection goes on."""
        route = self.HANDLERS.get(f.msg)
        if route is None:
            raise ProtocolError(f"message {f.msg} is not spoken on a mount's control socket")
        kind, handler = route
        return await handler(self, request(kind, f.meta, f.msg), f, conn)

    async def _attach(self, req: DirectAttach, f: Frame, conn: _Conn) -> None:
        self.attaches += 1
        body = Attached(conn.row, self.label, str(self.mountpoint))
        assert self.cache.ctl_fd is not None and self.cache.slabs.fd is not None
        fds = array.array("i", [self.cache.ctl_fd, self.cache.slabs.fd, self._index_fd])
        await send_with_fds(conn.stream, encode_frame(Frame(RESPONSE, f.msg, f.req_id, 0, to_meta(body))), fds)
        log.debug("dlfs.direct client pid %d attached as row %d", conn.pid, conn.row)

    async def _stats(self, req: Empty, f: Frame, conn: _Conn) -> Frame:
        return Frame(RESPONSE, f.msg, f.req_id, 0, {**self.cache.stats(), **self.stats(),
                                                     "fetched_by_node": self.cache.fetcher.fetched_by_node})

    async def _read(self, req: DirectRead, f: Frame, conn: _Conn) -> None:
        exts = req.exts
        n_ext = self.index.totals.extents
        if any(e >= n_ext for e in exts):
            raise ProtocolError(f"DIRECT_READ takes up to {DIRECT_BATCH} extents of the index, each 0..{n_ext - 1}")
        asked = sum(self.index.extent(e).record.raw_len for e in exts)
        if asked > DIRECT_REQUEST_BYTES:
            raise UsageError(f"DIRECT_READ asked for {asked} bytes: at most {DIRECT_REQUEST_BYTES} in one request")
        pinned: list[int] = []  # slabs pinned for this answer
        try:
            async with AsyncExitStack() as turn:  # to copy: taken by the first record not in a slab, kept until sent
                body, data = await self._gather(exts, conn.row, turn, pinned)
                await conn.frames.send(Frame(RESPONSE, f.msg, f.req_id, 0, to_meta(body), data))
        except BaseException:
            # Never delivered whole (a send that raises stops short of the end): the client makes no
            # view of these pins, so they are let go here.
            for slab in pinned:
                self.shared.unpin_for(conn.row, slab)
            raise

    async def _gather(self, exts: list[int], row: int, turn: AsyncExitStack,
                      pinned: list[int]) -> tuple[DirectAnswer, bytes]:
        """Where each record of `exts` is: slabs pinned for `row` where it lies whole in one (each added to
        `pinned` as it is taken), else copied inline (once this answer has its turn to copy, entered into
        `turn`); and the copies, in order."""
        at: list[tuple[int, int] | None] = [None] * len(exts)
        inline: dict[int, bytes] = {}
        errors: list[tuple[int, int, str]] = []
        by_window: dict[tuple[int, int], list[int]] = {}
        for i, e in enumerate(exts):
            by_window.setdefault(self.cache.planner.window_of(e), []).append(i)
        limit = trio.CapacityLimiter(FETCH_TASKS)
        copying: list[bool] = []  # whether this answer holds its turn to copy
        await self.cache.fetch_alone(exts)  # the misses read alone, together; the rest by window below

        async def fetch(positions: list[int]) -> None:
            async with limit:
                for i in sorted(positions, key=lambda i: exts[i]):  # in order: the window comes with the first
                    try:
                        raw = await self.cache.record(exts[i], direct=True)
                        if self.cache.where(exts[i]) is None and not copying:
                            copying.append(True)
                            await turn.enter_async_context(self._inline)
                            raw = await self.cache.record(exts[i], direct=True)  # it may have gone meanwhile
                    except DlfsError as exc:
                        errors.append((i, status_of(exc), exc.message))
                        continue
                    # No await from here to the pin: the record cannot be dropped in between.
                    where = self.cache.where(exts[i])
                    if where is None:
                        inline[i] = bytes(raw)  # not in a slab (compressed, too big, RDMA memory): a copy
                    else:
                        self.shared.pin_for(row, where[0])
                        pinned.append(where[0])
                        at[i] = where

        async with open_nursery() as nursery:
            for positions in by_window.values():
                nursery.start_soon(fetch, positions)
        self.served_pinned += len(exts) - len(inline) - len(errors)
        self.served_inline += len(inline)
        return DirectAnswer(at, errors), b"".join(inline[i] for i in sorted(inline))

    # Each message's request schema (dlfs/wire/messages.py) and its handler, which answers the request
    # decoded into it on a connection (None: the handler sent the reply itself).
    HANDLERS: ClassVar[dict[int, tuple[type[Any], Callable[[ControlServer, Any, Frame, _Conn],
                                                           Awaitable[Frame | None]]]]] = {
        Msg.DIRECT_ATTACH: (DirectAttach, _attach),
        Msg.DIRECT_READ: (DirectRead, _read),
        Msg.DIRECT_STATS: (Empty, _stats),
    }


async def send_with_fds(stream: trio.SocketStream, data: bytes, fds: array.array[int]) -> None:
    """Send `data` with descriptors attached to its first byte (SCM_RIGHTS)."""
    sent = await stream.socket.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    if sent < len(data):
        await stream.send_all(data[sent:])
