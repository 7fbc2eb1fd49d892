"""Short-circuit reads: ranges of chunks that this machine's own data daemon holds, read straight
from its chunk files (as HDFS reads local blocks) instead of through the daemon and a socket.

They are one source of the cache's fetch pipeline (dlfs/mount/cache.py), beside the daemons over TCP
and RDMA: a window is read in place into a slab, checked record by record there, and served from it
until the kernel has it, like any other fetch. A chunk that is not here, is short or fails a check is
read from the replicas as usual (the caller's fallback).

Chunk files are kept open (up to open_files_budget(), two descriptors each: plain and O_DIRECT); the
mount opens its dataset's as it starts (open_ahead), so no file's first read waits for an open.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import queue
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import monotonic_ns
from typing import Any

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.data.store import boot_id, chunk_path
from dlfs.errors import DlfsError
from dlfs.native import native
from dlfs.pagecache import all_cached
from dlfs.wire.messages import DataStatus, reply
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
OPEN_FILES = 4096  # chunk files kept open at most (two descriptors each): 32 GiB of 8 MiB chunks
OPEN_AHEAD_BATCH = 64  # chunk files opened ahead per hop to a thread
RECHECK = 1.0  # seconds a kept descriptor (or a chunk found absent) is trusted before its path is looked at again
THREAD_BYTES = 1 << 20  # ranges this big are read, and verified, in a worker thread: not on the event loop
DIRECT_MIN = 256 << 10  # windows this big go from the disk straight to their slab (O_DIRECT)
DIRECT_ALIGN = 4096  # O_DIRECT's alignment of offset, length and memory (a page covers every device's)
# Reads of this machine's chunk files go to one of two lanes, a thread each, in the order asked; each
# thread goes from one read straight to the next, with no hop through the event loop between. Windows
# (reads of WINDOW_LANE_MIN or more) take turns in one lane: two 4 MiB reads at once share the disk's
# bandwidth, so the window a reader waits for landed later (big files read whole, cold: 0.80x local
# disk against 0.75x for two window threads at 1 reader, 0.89x against 0.84x at 2, 6 rounds each,
# rotated); small reads (records, 4 KiB blocks) have the other lane, never queued behind a window.
WINDOW_LANE_MIN = 1 << 20
# Records of a batch (dlfs.direct misses read alone) in flight at once: one at a time, a batch of 256
# took a disk's latency each (~4.5k files/s of ~110 KB here).
BATCH_DEPTH = 8
LAND_MAX = getattr(native, "LAND_MAX", 0)  # records of a window landed in C at most (native/cacheowner.c)
# Linux 6.14+: a buffered read that leaves no page cache behind (the kernel keeps what it is sent for
# the FUSE file: one copy of each byte in memory is enough). Cleared where the kernel has no such flag.
RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)
_dontcache = [RWF_DONTCACHE]


def _pread_uncached(fd: int, buf: memoryview, offset: int) -> int:
    """preadv of `buf` at `offset`, leaving the page cache as it was where the kernel can."""
    while True:
        try:
            return os.preadv(fd, [buf], offset, _dontcache[0])
        except OSError as exc:
            if not _dontcache[0] or exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _dontcache[0] = 0


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


def open_files_budget() -> int:
    """Chunk files this process may keep open: OPEN_FILES, within an eighth of its descriptor limit (two
    descriptors each: a quarter of them, the rest for connections and everything else)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_FILES
    return max(16, min(OPEN_FILES, soft // 8))


_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)  # Linux 5.6+
RESOLVE_CACHED = 0x20  # Linux 5.12+: EAGAIN rather than a lookup that would read the disk
AT_FDCWD = -100


def _open_cached(path: Path, flags: int) -> int:
    """open(path, flags) if its lookup needs nothing the kernel does not hold in memory (cheap on the
    event loop); BlockingIOError if it would read the disk, or the kernel cannot say (no RESOLVE_CACHED)."""
    if _OPENAT2 is None:
        raise BlockingIOError(errno.EAGAIN, "no openat2 here")
    how = _OpenHow(flags, 0, RESOLVE_CACHED)
    fd = _libc.syscall(ctypes.c_long(_OPENAT2), ctypes.c_long(AT_FDCWD), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.ENOSYS, errno.EINVAL, errno.E2BIG):  # would block; or an older kernel
        raise BlockingIOError(err, os.strerror(err))
    raise OSError(err, os.strerror(err), str(path))


def _open_both(path: Path, direct: bool, cached: bool = False) -> tuple[int | None, int | None]:
    """A chunk file opened plainly and with O_DIRECT (None: not there, or no O_DIRECT here). `cached`:
    only if that needs no disk I/O (BlockingIOError otherwise): then it may run on the event loop."""
    opener = _open_cached if cached else os.open
    try:
        fd = opener(path, os.O_RDONLY | os.O_CLOEXEC)
    except BlockingIOError:
        raise
    except OSError:
        return None, None
    try:
        dfd = opener(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC) if direct else None
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        dfd = None  # _direct_fd says why, the next time it is asked
    return fd, dfd


def _open_all(paths: list[Path], direct: bool) -> list[tuple[int | None, int | None]]:
    return [_open_both(p, direct) for p in paths]


def _pread_all(fd: int, pieces: list[tuple[memoryview, int]]) -> list[int]:
    """preadv each (buffer, offset) in turn; bytes read into each."""
    return [_pread_uncached(fd, buf, off) for buf, off in pieces]


def direct_span(off: int, n: int) -> tuple[int, int]:
    """[lo, hi): bytes [off, off+n) widened to whole pages, as an O_DIRECT read must cover them."""
    return off - off % DIRECT_ALIGN, -(-(off + n) // DIRECT_ALIGN) * DIRECT_ALIGN


def _read_window(fd: int, dfd: int, off: int, n: int, lo: int, hi: int, cached: bool,
                 into: memoryview) -> tuple[int, int]:
    """Bytes [off, off+n) into `into`: (where they start in it, how many of them were read). Copied
    from the page cache (`fd`) if it holds them all (`cached`), else the aligned [lo, hi) read from the
    disk (`dfd`, O_DIRECT)."""
    if cached:
        return 0, os.preadv(fd, [into[:n]], off)
    got = os.preadv(dfd, [into[: hi - lo]], lo)
    return off - lo, max(0, got - (off - lo))


RecordJob = tuple[int, int, int, int, int, int, bool, memoryview]  # _read_window's arguments


def _read_record(job: RecordJob) -> tuple[int, int] | OSError:
    try:
        return _read_window(*job)
    except OSError as exc:
        return exc


def _read_records(jobs: list[RecordJob], pool: ThreadPoolExecutor) -> list[tuple[int, int] | OSError]:
    """_read_window for each job (fd, dfd, off, n, lo, hi, cached, into), BATCH_DEPTH at once: its
    result, or the OSError it raised."""
    return list(pool.map(_read_record, jobs))


_last_ticket = 0


def ticket(later_ns: int = 0) -> int:
    """A place in the disk queue's order: when the read is wanted, in monotonic ns. Taken when a read is
    decided on, it is now (read-ahead queued in file order keeps that order, however its tasks are
    scheduled before they reach the queue: strictly increasing); `later_ns` on, for read-ahead a reader
    is expected to want that much later."""
    global _last_ticket
    at = monotonic_ns() + later_ns
    if later_ns:
        return at
    _last_ticket = max(at, _last_ticket + 1)
    return _last_ticket


class DiskQueue:
    """Reads of local files by threads of its own, one per lane (windows, small reads: see
    WINDOW_LANE_MIN), in each lane those a reader waits for (urgent) first, the rest in the order of
    their tickets (when each is wanted: by default, the order asked); each read's result is handed
    back to the event loop, while its thread goes straight on to the next read."""

    def __init__(self) -> None:
        Jobs = queue.PriorityQueue[tuple[int, int, int, Any]]
        self._lanes: tuple[Jobs, Jobs] = (queue.PriorityQueue(), queue.PriorityQueue())  # windows, small reads
        self._asked = itertools.count()  # ties (a ticket reused by a retry) in the order asked
        self._threads = [threading.Thread(target=self._serve, args=(jobs,), name=f"dlfs-disk-{name}", daemon=True)
                         for jobs, name in zip(self._lanes, ("windows", "small"))]
        self._started = False

    def _serve(self, jobs: queue.PriorityQueue[tuple[int, int, int, Any]]) -> None:
        while True:
            *_, job = jobs.get()
            if job is None:
                return
            fn, args, token, finished = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the waiter, which raises it
                result, error = None, exc
            try:
                token.run_sync_soon(finished, result, error)
            except trio.RunFinishedError:
                return

    async def run(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0, urgent: bool = False,
                  order: int | None = None) -> Any:
        """fn(*args), a read of `nbytes`, in the disk thread of its lane. Not cancellable once queued (as
        trio.to_thread.run_sync): the read may be landing in memory its caller owns."""
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()
        done = trio.Event()
        box: list[Any] = []

        def finished(result: Any, error: BaseException | None) -> None:
            box[:] = [result, error]
            done.set()

        self._lanes[nbytes < WINDOW_LANE_MIN].put((0 if urgent else 1, ticket() if order is None else order,
                                                   next(self._asked),
                                                   (fn, args, trio.lowlevel.current_trio_token(), finished)))
        with trio.CancelScope(shield=True):
            await done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def close(self) -> None:
        if self._started:
            for jobs in self._lanes:
                jobs.put((-1, -1, -1, None))


class LocalChunks:
    def __init__(self, chunk_dir: Path, node: str) -> None:
        self.chunk_dir = chunk_dir
        self.node = node
        self.disk = DiskQueue()
        self._fds: OrderedDict[bytes, int] = OrderedDict()
        self._direct_fds: OrderedDict[bytes, int] = OrderedDict()
        # cid -> (st_dev, st_ino or 0 for absent, when last looked at): what the path named then.
        self._seen: dict[bytes, tuple[int, int, float]] = {}
        # Chunk files whose bytes failed their check, skipped: (st_dev, st_ino, st_ctime_ns), since a file
        # put in its place once it is closed may get the same inode number.
        self._bad: dict[bytes, tuple[int, int, int]] = {}
        self.direct = True  # O_DIRECT works on this file system (until it says otherwise)
        self._opening: dict[bytes, trio.Event] = {}  # chunks whose files a thread is opening
        self.reads = self.bytes = self.fallbacks = self.direct_reads = 0
        self.landed = 0  # windows read, checked and published in C as they landed (land)
        self.open_files = open_files_budget()
        self.opened_ahead = 0  # chunk files opened by open_ahead, before a read asked
        self._batch: ThreadPoolExecutor | None = None  # read_records' readers, made at its first batch
        self.slow_opens = 0  # opens a read waited for in a thread (the path's metadata was not in memory)

    def _current(self, cid: bytes) -> bool:
        """Whether what is kept of chunk `cid` (a descriptor, or that it is absent) still holds: trusted
        for RECHECK seconds, then checked against the path (repair replaces a chunk file with a new inode,
        an admin may delete one, an ingest or a peer may bring one); if not, it is dropped."""
        seen = self._seen.get(cid)
        if seen is None:
            return False
        now = time.monotonic()
        if now - seen[2] < RECHECK:
            return True
        try:
            st = os.stat(chunk_path(self.chunk_dir, cid))
            dev_ino = (st.st_dev, st.st_ino)
        except OSError:
            dev_ino = (0, 0)
        if dev_ino == seen[:2]:
            self._seen[cid] = (*dev_ino, now)
            return True
        self.forget(cid)
        return False

    def here(self, cid: bytes) -> bool:
        """Whether chunk `cid`'s file was found here when last looked at (and not passed over as bad)."""
        seen = self._seen.get(cid)
        return seen is not None and seen[1] != 0

    def forget(self, cid: bytes) -> None:
        """Close what is kept of chunk `cid`: the next read opens its path again."""
        self._seen.pop(cid, None)
        for fds in (self._fds, self._direct_fds):
            fd = fds.pop(cid, None)
            if fd is not None:
                os.close(fd)

    def failed(self, cid: bytes) -> None:
        """The chunk file's bytes failed their check: its replicas are read instead until the file is
        replaced (by repair: another inode), so that a corrupt file costs one warning, not one a read."""
        fd = self._fds.get(cid)
        if fd is not None:
            st = os.fstat(fd)
            self._bad[cid] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        self.forget(cid)

    def _kept(self, cid: bytes) -> bool:
        """Whether _fd(cid) can answer from what is kept (a descriptor, or that the chunk is not here)."""
        return self._current(cid) and (cid in self._fds or self._seen[cid][1] == 0)

    async def _open(self, cid: bytes) -> None:
        """Open chunk `cid`'s file (both ways), for _fd and _direct_fd to keep: on the event loop where the
        kernel holds its path's lookup (openat2 RESOLVE_CACHED), else in a thread: a cold open reads the
        file system's metadata from the disk, queued behind the windows being read there, and on the
        event loop it would hold up every other read's answer meanwhile (a big-file epoch here: 105
        such reads, 152 ms of waiting in 1.0 s)."""
        busy = self._opening.get(cid)
        if busy is not None:
            await busy.wait()
            return
        path = chunk_path(self.chunk_dir, cid)
        try:
            opened = _open_both(path, self.direct, cached=True)
        except BlockingIOError:
            self.slow_opens += 1
            self._opening[cid] = done = trio.Event()
            try:
                opened = await trio.to_thread.run_sync(_open_both, path, self.direct)
            finally:
                del self._opening[cid]
                done.set()
        self._install(cid, opened)

    def _install(self, cid: bytes, opened: tuple[int | None, int | None]) -> None:
        """Keep what _open_both opened of chunk `cid` (or close it, if it is kept meanwhile)."""
        fd, dfd = opened
        if self._kept(cid):  # kept meanwhile (a read that did not wait for this one)
            for d in (fd, dfd):
                if d is not None:
                    os.close(d)
            return
        if self._fd(cid, opened=fd) == fd and dfd is not None:
            self._direct_fds[cid] = dfd
            if len(self._direct_fds) > self.open_files:
                os.close(self._direct_fds.popitem(last=False)[1])
        elif dfd is not None:
            os.close(dfd)

    async def open_ahead(self, cids: Sequence[bytes]) -> int:
        """Open the files of chunks `cids` (as many as are kept open at once, the first first) in a
        thread, before any read needs them: a cold epoch then finds each one open, where each file's
        first read would wait for the disk's metadata (~1 ms a chunk here, on every file's critical
        path), and the kept descriptors hold their inodes whatever the kernel drops. Files opened."""
        todo = [cid for cid in cids[: self.open_files] if not self._kept(cid)]
        n = 0
        for at in range(0, len(todo), OPEN_AHEAD_BATCH):
            batch = todo[at : at + OPEN_AHEAD_BATCH]
            paths = [chunk_path(self.chunk_dir, cid) for cid in batch]
            opened = await trio.to_thread.run_sync(_open_all, paths, self.direct)
            for cid, got in zip(batch, opened):
                if got[0] is None:
                    continue  # not here: asked when read, as any chunk held elsewhere
                self._install(cid, got)
                n += 1
        self.opened_ahead += n
        return n

    def _fd(self, cid: bytes, opened: int | None = -1) -> int | None:
        """Chunk `cid`'s file, kept open; None if it is not here. `opened`: what _open opened (None: it
        is not there), installed instead of opening here."""
        if self._current(cid):
            fd = self._fds.get(cid)
            if fd is not None:
                self._fds.move_to_end(cid)
                return fd
            if self._seen[cid][1] == 0:
                return None  # held elsewhere, as of less than RECHECK ago
        try:
            fd = os.open(chunk_path(self.chunk_dir, cid), os.O_RDONLY | os.O_CLOEXEC) if opened == -1 else opened
            if fd is None:
                raise FileNotFoundError
        except OSError:
            self._seen[cid] = (0, 0, time.monotonic())  # held elsewhere: asked again after RECHECK
            return None
        st = os.fstat(fd)
        if self._bad.get(cid) == (st.st_dev, st.st_ino, st.st_ctime_ns):  # still the file that failed its check
            os.close(fd)
            self._seen[cid] = (0, 0, time.monotonic())
            return None
        self._bad.pop(cid, None)
        self._seen[cid] = (st.st_dev, st.st_ino, time.monotonic())
        self._fds[cid] = fd
        if len(self._fds) > self.open_files:
            old, oldfd = self._fds.popitem(last=False)
            os.close(oldfd)
            self._drop_direct(old)
            self._seen.pop(old, None)
        return fd

    def _drop_direct(self, cid: bytes) -> None:
        fd = self._direct_fds.pop(cid, None)
        if fd is not None:
            os.close(fd)

    def _direct_fd(self, cid: bytes) -> int | None:
        fd = self._direct_fds.get(cid)
        if fd is not None:
            self._direct_fds.move_to_end(cid)
            return fd
        try:
            fd = os.open(chunk_path(self.chunk_dir, cid), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                self.direct = False
                log.info("no O_DIRECT on %s: windows are read through the page cache", self.chunk_dir)
            return None
        st, seen = os.fstat(fd), self._seen.get(cid)
        if seen is None or (st.st_dev, st.st_ino) != seen[:2]:  # replaced since _fd opened it: not the same bytes
            os.close(fd)
            return None
        self._direct_fds[cid] = fd
        if len(self._direct_fds) > self.open_files:
            os.close(self._direct_fds.popitem(last=False)[1])
        return fd

    async def _read_direct(self, cid: bytes, off: int, n: int, cached: bool, into: memoryview,
                           urgent: bool = False, order: int | None = None) -> memoryview | None:
        """Bytes [off, off+n) of the chunk in `into`: copied from the page cache if it has them all
        (`cached`), else read from the disk straight into `into` (O_DIRECT, the range widened to whole
        4 KiB pages, so the bytes start a little into it: no copy, and no page cache kept of them); None
        if that cannot be done here."""
        lo, hi = direct_span(off, n)
        fd, dfd = self._fd(cid), (self._direct_fd(cid) if hi - lo <= len(into) else None)
        if fd is None or dfd is None:
            return None
        # Their own descriptors: no eviction here can close them under the thread.
        fd, dfd = os.dup(fd), os.dup(dfd)
        try:
            start, got = await self.disk.run(_read_window, fd, dfd, off, n, lo, hi, cached, into, nbytes=hi - lo,
                                              urgent=urgent, order=order)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False  # this file system takes O_DIRECT opens but not their reads
            return None
        finally:
            os.close(fd)
            os.close(dfd)
        if got < n:  # a chunk file shorter than the index says: the caller's fallback
            return memoryview(b"")
        self.direct_reads += not cached
        return into[start : start + n]

    async def land(self, cid: bytes, off: int, n: int, owner: Any, slab: int, at: int, room: int,
                   records: list[tuple[int, int, int, int]], urgent: bool = False,
                   order: int | None = None) -> int | None:
        """Bytes [off, off+n) of the chunk read into `slab` at `at` (a disk thread), their records
        (ext, offset in the chunk, stored length, checksum: uncompressed) checked and published in C
        with no GIL, and the READs parked for them answered there, as the window lands (owner.land):
        where the bytes start in the slab. None where this cannot be done here or something failed
        (not here, short, a bad record: nothing is published then), for the caller's usual path, which
        reads the window again and says what is wrong."""
        if not self._kept(cid):
            await self._open(cid)
        fd = self._fd(cid)
        if fd is None:
            return None
        # From the disk straight into the slab (O_DIRECT, page-aligned), or copied from the page cache where
        # it holds the window or the file system takes no O_DIRECT.
        dfd = self._direct_fd(cid) if self.direct and not all_cached(fd, off, n) else None
        cached = dfd is None
        lo, hi = (off, off + n) if cached else direct_span(off, n)
        src = fd if dfd is None else dfd
        if hi - lo > room:
            return None
        start = at + off - lo
        recs = [(ext, start + roff - off, length, csum) for ext, roff, length, csum in records]
        src = os.dup(src)  # its own: no eviction here can close it under the thread
        try:
            got, bad = await self.disk.run(owner.land, src, lo, hi - lo, slab, at, recs, nbytes=hi - lo,
                                           urgent=urgent, order=order)
        except OSError as exc:
            if exc.errno == errno.EINVAL and not cached:
                self.direct = False  # this file system takes O_DIRECT opens but not their reads
            return None
        finally:
            os.close(src)
        if bad >= 0:
            return None
        self.reads += 1
        self.bytes += n
        self.direct_reads += not cached
        self.landed += 1
        return start

    async def read_ranges(self, cid: bytes, ranges: list[tuple[int, int]],
                          into: memoryview | None = None, urgent: bool = False,
                          order: int | None = None) -> list[memoryview] | None:
        """The (offset, length) ranges of the chunk (the first into `into` when given), if this machine
        holds its chunk and they are all there; else None. Unchecked: the caller verifies them. A first
        range with `into` that the page cache does not hold comes from the disk straight into it
        (O_DIRECT; it may then start a little into `into`), and a big one that it holds is copied in a
        disk thread; otherwise what the page cache has is copied at once, and the rest is read from
        disk in a disk thread (`urgent`: before read-ahead waiting there; `order`: a ticket, its place
        among read-ahead)."""
        if not self._kept(cid):
            await self._open(cid)
        fd = self._fd(cid)
        if fd is None:
            return None
        # Not in the page cache: from the disk straight to the slab, exactly the range (a buffered read
        # would read ahead through the chunk, at random mostly for nothing, and fill a memory cgroup's
        # page cache with it).
        cached = into is not None and self.direct and all_cached(fd, *ranges[0])
        if into is not None and self.direct and (ranges[0][1] >= DIRECT_MIN or not cached):
            try:
                first = await self._read_direct(cid, ranges[0][0], ranges[0][1], cached, into, urgent, order)
            except OSError as exc:
                self._fall_back(cid, f"at offset {ranges[0][0]}: {exc}")
                return None
            if first is not None and len(first) < ranges[0][1]:
                self._fall_back(cid, f"is short at offset {ranges[0][0]}")
                return None
            if first is not None:
                others = await self.read_ranges(cid, ranges[1:]) if len(ranges) > 1 else []
                if others is None:
                    return None
                self.reads += 1
                self.bytes += ranges[0][1]
                return [first, *others]
        bufs = [into[:n] if i == 0 and into is not None else memoryview(bytearray(n)) for i, (_, n) in enumerate(ranges)]
        try:
            # A big range goes to the thread even from the page cache: its copy would stall the loop.
            got = [_read_cached(fd, buf, off) if n < THREAD_BYTES else 0 for buf, (off, n) in zip(bufs, ranges)]
            rest = [(buf[g:], off + g) for buf, (off, n), g in zip(bufs, ranges, got) if g < n]
            if rest:
                # On its own descriptor, which no eviction here can close, so the other readers go on.
                dup = os.dup(fd)
                try:
                    more = await self.disk.run(_pread_all, dup, rest, nbytes=sum(len(b) for b, _ in rest),
                                               urgent=urgent, order=order)
                finally:
                    os.close(dup)
                late = iter(more)
                got = [g if g == n else g + next(late) for (_, n), g in zip(ranges, got)]
        except OSError as exc:
            self._fall_back(cid, f"at offset {ranges[0][0]}: {exc}")
            return None
        for (off, n), g in zip(ranges, got):
            if g < n:
                self._fall_back(cid, f"is short ({g} of {n} bytes at offset {off})")
                return None
        self.reads += len(ranges)
        self.bytes += sum(n for _, n in ranges)
        return bufs

    async def read_records(self, items: list[tuple[bytes, int, int, memoryview]]) -> list[memoryview | None]:
        """Records (chunk, offset, length, buffer) of this machine's chunk files, each into its own
        buffer, in one trip to the disk thread (a batch of dlfs.direct misses: one hop per record cost
        the event loop more than the read): from the disk (O_DIRECT, page-aligned: the bytes start a
        little into the buffer) unless the page cache holds them all. Unchecked; None for one that is not
        here or cannot be read here (the caller fetches it as usual)."""
        out: list[memoryview | None] = [None] * len(items)
        jobs: list[RecordJob] = []
        which: list[int] = []
        for k, (cid, off, n, into) in enumerate(items):
            if not self._kept(cid):
                await self._open(cid)
            fd = self._fd(cid)
            if fd is None:
                continue
            lo, hi = direct_span(off, n)
            dfd = self._direct_fd(cid) if self.direct and hi - lo <= len(into) else None
            cached = dfd is None or all_cached(fd, off, n)
            if cached and n > len(into):
                continue
            # Their own descriptors: no eviction here can close them under the thread.
            jobs.append((os.dup(fd), os.dup(dfd if dfd is not None else fd), off, n, lo, hi, cached, into))
            which.append(k)
        if not jobs:
            return out
        try:
            if self._batch is None:
                self._batch = ThreadPoolExecutor(BATCH_DEPTH, thread_name_prefix="dlfs-disk-batch")
            # A lane by its biggest read: a batch of records is small reads, never queued behind a window.
            results = await self.disk.run(_read_records, jobs, self._batch, nbytes=max(j[3] for j in jobs),
                                          urgent=True)
        finally:
            for job in jobs:
                os.close(job[0])
                os.close(job[1])
        for k, job, got in zip(which, jobs, results):
            cid, off, n, into = items[k]
            if isinstance(got, OSError):
                if got.errno == errno.EINVAL and not job[6]:
                    self.direct = False  # this file system takes O_DIRECT opens but not their reads
                    continue
                self._fall_back(cid, f"at offset {off}: {got}")
                continue
            start, n_got = got
            if n_got < n:
                self._fall_back(cid, f"is short at offset {off}")
                continue
            out[k] = into[start : start + n]
            self.reads += 1
            self.bytes += n
            self.direct_reads += not job[6]
        return out

    def _fall_back(self, cid: bytes, what: str) -> None:
        """A read of chunk `cid`'s local copy failed (`what`, after "chunk ... (local copy of ...)"):
        counted, said; the caller reads it from the replicas."""
        self.fallbacks += 1
        log.warning("chunk %s (local copy of %s) %s; reading it from the replicas", cid.hex(), self.node, what)

    def failed_check(self, cid: bytes, exc: Exception) -> None:
        """Bytes of chunk `cid`'s local copy failed their check (`exc` says which): counted, said, and the
        file passed over for its replicas until repair replaces it (failed). A node's fetches count what
        it served well, so the caller counts none."""
        self.fallbacks += 1
        self.failed(cid)
        log.warning("%s; reading it from the replicas", exc)

    def close(self) -> None:
        self.disk.close()
        if self._batch is not None:
            self._batch.shutdown(wait=False)
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()

    def stats(self) -> dict[str, int]:
        return {"local_reads": self.reads, "local_bytes": self.bytes, "local_fallbacks": self.fallbacks,
                "local_direct_reads": self.direct_reads, "local_landed": self.landed,
                "local_open_files": len(self._fds),
                "local_opened_ahead": self.opened_ahead, "local_slow_opens": self.slow_opens}


async def open_local_chunks(client: ClusterClient) -> LocalChunks | None:
    """Short-circuit reads from this machine's data daemon, if it runs here and its chunk files can
    be read; None otherwise (every read then goes through the daemons)."""
    name = client.cluster.local
    if name is None or name not in {n.name for n in client.cluster.data_nodes}:
        return None
    try:
        meta, _ = await client.call(client.cluster.node(name), "data", Msg.STATUS, timeout=5.0)
        status = reply(DataStatus, meta, Msg.STATUS, name)
    except DlfsError as exc:
        log.info("no short-circuit reads: the local data daemon %s does not answer (%s)", name, exc)
        return None
    chunk_dir = Path(status.chunk_dir)
    # The same boot id proves the same machine: a path that merely exists here (a shared home) is not enough.
    if not status.boot_id or status.boot_id != boot_id() or not os.access(chunk_dir, os.R_OK | os.X_OK):
        log.info("no short-circuit reads: the chunk files of %s are not readable here", name)
        return None
    log.info("short-circuit reads from %s's chunk files in %s", name, chunk_dir)
    return LocalChunks(chunk_dir, name)
