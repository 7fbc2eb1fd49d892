"""The mount's control socket: where dlfs.direct clients attach to the shared chunk cache.

A client finds the socket through the xattr user.dlfs.control on the mount's root, attaches (and
receives the cache's memfds and the index by SCM_RIGHTS), then reads most files with no request at
all: only records not yet in a slab come here, a batch at a time (DIRECT_READ), and are answered
pinned for that client. Each connection is one client process with one row of the pin table; when
the connection ends, for whatever reason, its row is zeroed and every pin it held is released.

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
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from dlfs.client.cache import DIRECT_CLIENTS, ChunkCache
from dlfs.errors import Conflict, DlfsError, ProtocolError, UsageError, status_of
from dlfs.format.index import Index
from dlfs.tasks import open_nursery
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


def control_socket_path(home: Path, mountpoint: Path) -> Path:
    """Where a mount's control socket lives: under its home, or the temp dir if that path is too long."""
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
        self._free_rows = list(range(DIRECT_CLIENTS - 1, -1, -1))
        self._index_fd = os.open(index.path, os.O_RDONLY | os.O_CLOEXEC)
        self.attached = self.attaches = self.requests = self.reclaimed_pins = 0
        self.served_pinned = self.served_inline = 0
        self._inline = trio.Semaphore(INLINE_ANSWERS)  # bounds the copies, whatever the number of clients

    def close(self) -> None:
        os.close(self._index_fd)

    def stats(self) -> dict[str, int]:
        return {"direct_clients": self.attached, "direct_attaches": self.attaches, "direct_requests": self.requests,
                "direct_pinned": self.served_pinned, "direct_inline": self.served_inline,
                "direct_reclaimed_pins": self.reclaimed_pins}

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the socket file is removed on the way out."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
        row = self._free_rows.pop() if self._free_rows else None
        if row is not None:
            self.shared.clear_row(row)
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
                    reply = await self._answer(f, row, pid, stream, frames)
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
                held = self.shared.clear_row(row)
                self._free_rows.append(row)
                self.attached -= 1
                if held:
                    self.reclaimed_pins += held
                    log.info("%s ended holding %d pins: released", frames.peer, held)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _answer(self, f: Frame, row: int, pid: int, stream: trio.SocketStream,
                      frames: FrameStream) -> Frame | None:
        """The reply to `f`, or None if it was sent here already."""
        if f.msg == Msg.DIRECT_ATTACH:
            self.attaches += 1
            reply = Frame(RESPONSE, f.msg, f.req_id, 0, {"row": row, "label": self.label,
                                                          "mountpoint": str(self.mountpoint)})
            assert self.cache.ctl_fd is not None and self.cache.arena_fd is not None
            fds = array.array("i", [self.cache.ctl_fd, self.cache.arena_fd, self._index_fd])
            await send_with_fds(stream, encode_frame(reply), fds)
            log.debug("dlfs.direct client pid %d attached as row %d", pid, row)
            return None
        if f.msg == Msg.DIRECT_READ:
            await self._read(f, row, frames)
            return None
        if f.msg == Msg.DIRECT_STATS:
            return Frame(RESPONSE, f.msg, f.req_id, 0, {**self.cache.stats(), **self.stats(),
                                                         "fetched_by_node": self.cache.fetched_by_node})
        raise ProtocolError(f"message {f.msg} is not spoken on a mount's control socket")

    async def _read(self, f: Frame, row: int, frames: FrameStream) -> None:
        exts = f.meta.get("exts")
        n_ext = self.index.totals.extents
        if (not isinstance(exts, list) or len(exts) > DIRECT_BATCH
                or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < n_ext for e in exts)):
            raise ProtocolError(f"DIRECT_READ takes up to {DIRECT_BATCH} extents of the index, each 0..{n_ext - 1}")
        asked = sum(self.index.extent(e).record.raw_len for e in exts)
        if asked > DIRECT_REQUEST_BYTES:
            raise UsageError(f"DIRECT_READ asked for {asked} bytes: at most {DIRECT_REQUEST_BYTES} in one request")
        async with AsyncExitStack() as turn:  # to copy: taken by the first record not in a slab, kept until sent
            meta, data = await self._gather(exts, row, turn)
            await frames.send(Frame(RESPONSE, f.msg, f.req_id, 0, meta, data))

    async def _gather(self, exts: list[int], row: int, turn: AsyncExitStack) -> tuple[dict[str, Any], bytes]:
        """Where each record of `exts` is: slabs pinned for `row` where it lies whole in one, else copied
        inline (once this answer has its turn to copy, entered into `turn`); and the copies, in order."""
        at: list[list[int] | None] = [None] * len(exts)
        inline: dict[int, bytes] = {}
        errors: list[list[Any]] = []
        by_window: dict[tuple[int, int], list[int]] = {}
        for i, e in enumerate(exts):
            by_window.setdefault(self.cache.window_of(e), []).append(i)
        limit = trio.CapacityLimiter(FETCH_TASKS)
        copying: list[bool] = []  # whether this answer holds its turn to copy

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
                        errors.append([i, status_of(exc), exc.message])
                        continue
                    # No await from here to the pin: the record cannot be dropped in between.
                    where = self.cache.where(exts[i])
                    if where is None:
                        inline[i] = bytes(raw)  # not in a slab (compressed, too big, RDMA memory): a copy
                    else:
                        self.shared.pin_for(row, where[0])
                        at[i] = list(where)

        async with open_nursery() as nursery:
            for positions in by_window.values():
                nursery.start_soon(fetch, positions)
        self.served_pinned += len(exts) - len(inline) - len(errors)
        self.served_inline += len(inline)
        return {"at": at, "errors": errors}, b"".join(inline[i] for i in sorted(inline))


async def send_with_fds(stream: trio.SocketStream, data: bytes, fds: array.array[int]) -> None:
    """Send `data` with descriptors attached to its first byte (SCM_RIGHTS)."""
    sent = await stream.socket.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    if sent < len(data):
        await stream.send_all(data[sent:])
