"""`dlfs warmup`: bring a dataset version (or the files under some of its paths) close before a job.

What it fetches is what a mount would: the windows of each chunk that hold the chosen files, cut as
the mount cuts them (dlfs/mount/cache.py's chunk_windows, at the mount's --readahead), so a later
mount's misses find them whole. Where they go:
- chunks this machine's data daemon holds: read once through the page cache. The mount reads a local
  window from the page cache when it holds all of it (cachestat, dlfs/pagecache.py) and from the
  disk with O_DIRECT otherwise, so a warm page cache saves the first epoch its disk reads; it is worth
  it when the dataset fits in memory beside the FUSE page cache (the kernel drops it first otherwise);
- every other chunk: fetched from its replicas, checked record by record (xxh3) and written to the
  disk cache (dlfs/mount/diskcache.py), which mounts of the node share while this runs.
Bounded: --rate is a token bucket over the bytes it reads or fetches; windows already in the disk
cache are passed over. Two warmups of one version into one disk cache take turns (dlfs/turns.py): the
second waits while the first makes progress, then passes over what it fetched (side by side, both
fetched everything), and goes on beside a first that has finished no window for WAIT_STALL.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.client.replicas import RETRY_TIMEOUT, Buffer, ReplicaReader
from dlfs.data.store import chunk_path
from dlfs.errors import CorruptData, DlfsError, NotFound, UsageError
from dlfs.format.chunk import decode_record
from dlfs.format.index import ROOT_INO, Extent, Index
from dlfs.mount.diskcache import DiskCache
from dlfs.mount.localchunks import THREAD_BYTES, open_local_chunks
from dlfs.mount.planner import chunk_windows, window_size, window_span
from dlfs.tasks import open_nursery
from dlfs.turns import Turn, holder
from dlfs.units import parse_size
from dlfs.wire.messages import META_DAEMON, VersionInfo, reply
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
WORKERS = 8  # windows in flight at once: enough to fill a link of a few Gbit/s with 4 MiB windows
FETCH_TIMEOUT = 30.0
READ_PIECE = 4 << 20  # page-cache warming reads a local chunk file this much at a time
BURST_SECONDS = 0.25  # the token bucket holds this much of the rate: short bursts, a steady average
WAIT_STALL = 2 * FETCH_TIMEOUT  # seconds a warmup waits on another of its version that finishes no window


def parse_rate(text: str) -> int:
    """Bytes per second in a rate such as 500MB/s, 1G/s or 100M (binary units, as every size here)."""
    rate = parse_size(text.strip().removesuffix("/s"))
    if rate < 1 << 10:
        raise UsageError(f"--rate {text!r} is below 1 KiB/s")
    return rate


class TokenBucket:
    """At most `rate` bytes a second on average, bursts of BURST_SECONDS of it; `take` waits its turn."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self.burst = max(int((rate or 0) * BURST_SECONDS), 1)
        self.tokens = float(self.burst)
        self.stamp: float | None = None

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = trio.current_time()
        if self.stamp is None:
            self.stamp = now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n  # into debt if need be: a window bigger than the burst still goes, later
        if self.tokens < 0:
            await trio.sleep(-self.tokens / self.rate)


@dataclass(frozen=True, slots=True)
class Window:
    """One fetch of the mount: extents [first, end) of chunk `ci`, bytes [offset, offset+length)."""

    ci: int
    first: int
    end: int
    offset: int
    length: int
    least: int  # the length without its last record's block sums: enough, where a disk cache holds that
    files: int = 0  # chosen files whose last extent is in it: done once it is


@dataclass
class WarmupReport:
    label: str
    files: int = 0
    windows: int = 0
    bytes: int = 0  # of the windows chosen
    fetched: int = 0  # over the network, into the disk cache
    cached: int = 0  # already in the disk cache
    page_cached: int = 0  # read from this machine's chunk files into the page cache
    skipped: int = 0  # not held here, and no disk cache to put them in
    seconds: float = 0.0
    by_node: dict[str, int] = field(default_factory=dict)


def _files_under(index: Index, paths: Sequence[str], label: str) -> list[int]:
    """Inodes of the regular files under `paths` (of the dataset; all of it if none), each once."""
    tops: list[int] = []
    for p in paths or ["/"]:
        ino = ROOT_INO
        for part in (x for x in p.split("/") if x and x != "."):
            found = index.lookup(ino, os.fsencode(part))
            if found < 0:
                raise NotFound(f"no {p!r} in {label}")
            ino = found
        tops.append(ino)
    seen: set[int] = set()
    files: list[int] = []
    pending = list(tops)
    while pending:
        ino = pending.pop()
        if ino in seen:
            continue
        seen.add(ino)
        node = index.inode(ino)
        if stat.S_ISDIR(node.mode):
            pending.extend(child for _, _, child in index.entries(ino))
        elif stat.S_ISREG(node.mode) and node.count:
            files.append(ino)
    return files


def plan(index: Index, files: list[int], window: int) -> list[Window]:
    """The windows a mount reading `files` fetches, in chunk order (the order they lie on disk): those
    holding their extents, and every window of a chunk holding a small (one-record) file."""
    starts: dict[int, list[int]] = {}
    last_of: dict[tuple[int, int], int] = {}  # (chunk, window start) -> files ending there

    def window_start(ext: int) -> tuple[int, int]:
        ci = index.extent(ext).chunk
        s = starts.get(ci)
        if s is None:
            s = starts[ci] = chunk_windows(index, ci, window)
        return ci, s[bisect.bisect_right(s, ext) - 1]

    wanted: set[tuple[int, int]] = set()
    for ino in files:
        node = index.inode(ino)
        for ext in range(node.ref, node.ref + node.count):
            wanted.add(window_start(ext))
        if node.count == 1:  # a small file's miss queues the rest of its chunk too (ChunkCache.read)
            ci = index.extent(node.ref).chunk
            wanted.update((ci, s) for s in starts[ci][:-1])
        key = window_start(node.ref + node.count - 1)
        last_of[key] = last_of.get(key, 0) + 1
    out: list[Window] = []
    for ci, first in sorted(wanted):
        s = starts[ci]
        end = s[bisect.bisect_right(s, first)]
        out.append(Window(ci, first, end, *window_span(index, first, end), last_of.get((ci, first), 0)))
    return out


def _verify(index: Index, w: Window, cid: bytes, data: bytes | bytearray | memoryview, node: str) -> None:
    """Every record of the window, checked (and decompressed where stored so); CorruptData names the first bad."""
    view = memoryview(data)
    if len(view) != w.length:
        raise CorruptData(f"chunk {cid.hex()} (from {node}): {len(view)} of {w.length} bytes at offset {w.offset}")
    for i in range(w.first, w.end):
        rec: Extent = index.extent(i)
        r = rec.record
        decode_record(view[r.offset - w.offset : r.offset - w.offset + r.stored_len], r,
                      f"chunk {cid.hex()} (from {node}) record at offset {r.offset}")


def _read_local(path: Path, offset: int, length: int) -> int:
    """Read [offset, offset+length) of a local chunk file through the page cache (kept there)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
        buf = memoryview(bytearray(min(length, READ_PIECE)))
        done = 0
        while done < length:
            n = os.preadv(fd, [buf[: min(len(buf), length - done)]], offset + done)
            if n <= 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


async def _removed(client: ClusterClient, info: VersionInfo) -> bool:
    """Whether version `info` is no longer in the catalog (False where that cannot be asked)."""
    try:
        await client.call_meta(Msg.GET_DATASET, {"name": info.name, "version": info.version})
    except NotFound:
        return True
    except DlfsError:
        return False
    return False


async def _turn(disk: DiskCache, label: str, note: Callable[[str], None]) -> Turn | None:
    """This process's turn at warming `label` into `disk`, once no other warmup of it there holds it
    (said in a line); None, having said so, where the one that does has finished no window for WAIT_STALL."""
    path = disk.root / "warmups" / f"{label}.lock"
    said = False
    while (turn := Turn.take(path)) is None:
        pid, since = holder(path)
        if not said:
            who = f" (process {pid})" if pid else ""
            note(f"waiting for another dlfs warmup of {label} into {disk.root}{who}: what it fetches is not "
                 "fetched twice")
            said = True
        if since is not None and since > WAIT_STALL:
            note(f"the other dlfs warmup of {label} into {disk.root} has finished no window for {since:.0f} s "
                 "(stopped or stuck?): going on beside it")
            return None
        await trio.sleep(0.2)
    return turn


async def warmup(client: ClusterClient, home: Path, name: str, version: int | None, paths: Sequence[str],
                 disk: DiskCache | None, readahead: int, rate: int | None,
                 progress: Callable[[str, int, int], None], short_circuit: bool = True,
                 note: Callable[[str], None] = log.warning, retry_timeout: float = RETRY_TIMEOUT) -> WarmupReport:
    """Warm `name@version` (the files under `paths`; all if none): this machine's chunks into the page
    cache (unless not `short_circuit`, as the mount's option), the rest into `disk` (skipped without
    one). `progress(event, files, bytes)` is told
    ("start", total files, total bytes) once, then ("done", files, bytes) as windows finish; `note`, a
    line for the user (a wait for another warmup). A window waits up to `retry_timeout` for a replica that
    stopped answering (a node restarting), as a mount's reads do."""
    from dlfs.client.indexes import fetch_index  # the mount's index cache, shared with it

    meta, _ = await client.call_meta(Msg.GET_DATASET, {"name": name, "version": version})
    info = reply(VersionInfo, meta, Msg.GET_DATASET, META_DAEMON)
    label = f"{info.name}@{info.version}"
    index = Index(await fetch_index(client, info, home))
    try:
        files = await trio.to_thread.run_sync(_files_under, index, list(paths), label)
        windows = await trio.to_thread.run_sync(plan, index, files, window_size(index, readahead))
        report = WarmupReport(label, len(files), len(windows), sum(w.length for w in windows))
        local = await open_local_chunks(client) if short_circuit else None
        if local is not None:
            local.close()  # only its directory is used here: its reads are made for the mount
        if disk is None and local is None:
            raise UsageError(f"{label}: this machine holds no chunks and no --cache-dir was given (nor has a "
                             "mount here one): there is nowhere to warm it")
        turn = await _turn(disk, label, note) if disk is not None else None
        progress("start", report.files, report.bytes)
        bucket = TokenBucket(rate)
        t0 = time.monotonic()
        send, recv = trio.open_memory_channel[Window](0)

        # As a mount reads: a replica that has not answered within the hedge bound is raced by the next (a
        # node frozen mid-warmup held every window in flight on it the whole fetch bound, 30 s), bad bytes
        # move on to the next, a node so passed over is asked last from then on, and a node restarting is
        # waited for (a restart of the data node ended a warmup at once, exit 3).
        replicas = ReplicaReader(client, retry_timeout=retry_timeout, fetch_timeout=FETCH_TIMEOUT)

        async def fetch(w: Window, cid: bytes) -> None:
            async def check(got: Sequence[Buffer], node: str) -> tuple[str, Buffer]:
                if w.length >= THREAD_BYTES:
                    await trio.to_thread.run_sync(_verify, index, w, cid, got[0], node)
                else:
                    _verify(index, w, cid, got[0], node)
                return node, got[0]

            node, data = (await replicas.read(cid, [(w.offset, w.length)], None, check, lambda f: None))[0]
            report.fetched += w.length
            report.by_node[node] = report.by_node.get(node, 0) + w.length
            assert disk is not None
            await trio.to_thread.run_sync(disk.store, cid, [(w.offset, w.length)], [data])

        async def worker() -> None:
            async for w in recv:
                cid = index.chunk(w.ci).id
                held = local is not None and chunk_path(local.chunk_dir, cid)
                if held and held.exists():
                    await bucket.take(w.length)
                    report.page_cached += await trio.to_thread.run_sync(_read_local, held, w.offset, w.length)
                elif disk is None:
                    report.skipped += w.length
                elif disk.holds(cid, [(w.offset, w.length)], w.least):
                    report.cached += w.length
                elif disk.broken:  # (it said so in a warning line): fetching on would keep nothing
                    raise DlfsError(f"disk cache {disk.root}: {disk.broken}, so nothing more is kept there; the next "
                                    "mount or warmup starts it over")
                else:
                    await bucket.take(w.length)
                    await fetch(w, cid)
                if turn is not None:
                    turn.touch()
                progress("done", w.files, w.length)

        try:
            async with open_nursery() as nursery:
                for i in range(WORKERS):
                    nursery.start_soon(worker, name=f"dlfs-warmup-{i}")
                async with send:  # closing it ends the workers' loops
                    for w in windows:
                        await send.send(w)
        except DlfsError as exc:
            # Its chunks gone from every node read as a node's failure ("no replica answered"); the cause is
            # worth the one question to say.
            if await _removed(client, info):
                raise NotFound(f"{label} was removed (dlfs rm) while it was being warmed up: nothing more to warm "
                               f"({exc})") from None
            raise
        finally:
            if turn is not None:
                turn.done()  # every window stored (store() returns once it is), or this warmup failed
        report.seconds = time.monotonic() - t0
        return report
    finally:
        index.close()
