"""Short-circuit reads: ranges of chunks that this machine's own data daemon holds, read straight
from its chunk files (as HDFS reads local blocks) instead of through the daemon and a socket.

They are one source of the cache's fetch pipeline (dlfs/client/cache.py), beside the daemons over TCP
and RDMA: a window is read in place into a slab, checked record by record there, and served from it
until the kernel has it, like any other fetch. A chunk that is not here, is short or fails a check is
read from the replicas as usual (the caller's fallback).
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from pathlib import Path

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.data.store import boot_id, chunk_path
from dlfs.errors import DlfsError
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
OPEN_FILES = 256
THREAD_BYTES = 1 << 20  # ranges this big are read, and verified, in a worker thread: not on the event loop


def _read_cached(fd: int, buf: memoryview, offset: int) -> int:
    """What of the range the page cache has, without waiting for the disk (RWF_NOWAIT)."""
    try:
        return os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no RWF_NOWAIT here: read the plain way
            return 0
        raise


def _pread_all(fd: int, pieces: list[tuple[memoryview, int]]) -> list[int]:
    """preadv each (buffer, offset) in turn; bytes read into each."""
    return [os.preadv(fd, [buf], off) for buf, off in pieces]


class LocalChunks:
    def __init__(self, chunk_dir: Path, node: str) -> None:
        self.chunk_dir = chunk_dir
        self.node = node
        self._fds: OrderedDict[bytes, int] = OrderedDict()
        self._absent: set[bytes] = set()
        self.reads = self.bytes = self.fallbacks = 0

    def _fd(self, cid: bytes) -> int | None:
        fd = self._fds.get(cid)
        if fd is not None:
            self._fds.move_to_end(cid)
            return fd
        if cid in self._absent:
            return None
        try:
            fd = os.open(chunk_path(self.chunk_dir, cid), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._absent.add(cid)  # held elsewhere: asked once
            return None
        self._fds[cid] = fd
        if len(self._fds) > OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    async def read_ranges(self, cid: bytes, ranges: list[tuple[int, int]],
                          into: memoryview | None = None) -> list[memoryview] | None:
        """The (offset, length) ranges of the chunk (the first into `into` when given), if this machine
        holds its chunk and they are all there; else None. Unchecked: the caller verifies them. What the
        page cache has is copied at once; the rest is read from disk in one worker thread."""
        fd = self._fd(cid)
        if fd is None:
            return None
        bufs = [into[:n] if i == 0 and into is not None else memoryview(bytearray(n)) for i, (_, n) in enumerate(ranges)]
        try:
            # A big range goes to the thread even from the page cache: its copy would stall the loop.
            got = [_read_cached(fd, buf, off) if n < THREAD_BYTES else 0 for buf, (off, n) in zip(bufs, ranges)]
            rest = [(buf[g:], off + g) for buf, (off, n), g in zip(bufs, ranges, got) if g < n]
            if rest:
                # On its own descriptor, which no eviction here can close, so the other readers go on.
                dup = os.dup(fd)
                try:
                    more = await trio.to_thread.run_sync(_pread_all, dup, rest)
                finally:
                    os.close(dup)
                late = iter(more)
                got = [g if g == n else g + next(late) for (_, n), g in zip(ranges, got)]
        except OSError as exc:
            self.fallbacks += 1
            log.warning("chunk %s (local copy of %s) at offset %d: %s; reading it from the replicas",
                        cid.hex(), self.node, ranges[0][0], exc)
            return None
        for (off, n), g in zip(ranges, got):
            if g < n:
                self.fallbacks += 1
                log.warning("chunk %s (local copy of %s) is short (%d of %d bytes at offset %d); reading it "
                            "from the replicas", cid.hex(), self.node, g, n, off)
                return None
        self.reads += len(ranges)
        self.bytes += sum(n for _, n in ranges)
        return bufs

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def stats(self) -> dict[str, int]:
        return {"local_reads": self.reads, "local_bytes": self.bytes, "local_fallbacks": self.fallbacks}


async def open_local_chunks(client: ClusterClient) -> LocalChunks | None:
    """Short-circuit reads from this machine's data daemon, if it runs here and its chunk files can
    be read; None otherwise (every read then goes through the daemons)."""
    name = client.cluster.local
    if name is None or name not in {n.name for n in client.cluster.data_nodes}:
        return None
    try:
        meta, _ = await client.call(client.cluster.node(name), "data", Msg.STATUS, timeout=5.0)
    except DlfsError as exc:
        log.info("no short-circuit reads: the local data daemon %s does not answer (%s)", name, exc)
        return None
    chunk_dir = Path(str(meta.get("chunk_dir", "")))
    # The same boot id proves the same machine: a path that merely exists here (a shared home) is not enough.
    if not meta.get("boot_id") or meta.get("boot_id") != boot_id() or not os.access(chunk_dir, os.R_OK | os.X_OK):
        log.info("no short-circuit reads: the chunk files of %s are not readable here", name)
        return None
    log.info("short-circuit reads from %s's chunk files in %s", name, chunk_dir)
    return LocalChunks(chunk_dir, name)
