"""Where the cache's bytes come from, and whether they are good: this machine's chunk files first (a
window straight from the disk into its slab), then the node's disk cache where the mount has one,
then each replica over TCP or RDMA (raced against a slow one, waited for through a restart for a
read that needs its bytes: dlfs/client/replicas.py). A source whose bytes fail their check is passed
over for the next; what each gave is counted here. What a replica gave that passed goes to the disk
cache's writer, behind the read.

No decision about what to fetch is made here (planner.py), nor about what stays in memory (cache.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from dlfs.client.cluster import ClusterClient
from dlfs.client.replicas import Fetched, ReplicaReader
from dlfs.counters import LatencyHistogram
from dlfs.errors import CorruptData
from dlfs.format.chunk import BLOCK_SIZE, block_range, decode_record, verify_blocks
from dlfs.format.index import Extent, Index
from dlfs.mount.diskcache import SOURCE as DISK_CACHE
from dlfs.mount.diskcache import DiskCache
from dlfs.mount.localchunks import LocalChunks

log = logging.getLogger(__name__)
T = TypeVar("T")
RECENT = 64  # fetches remembered by source: where reads come from now, not over the mount's life
Buffer = bytes | bytearray | memoryview


def verify_window(run: list[int], extents: list[Extent], cid: bytes, base: int, data: Buffer, node: str,
                  need: int | None, in_slab: bool, at: int = 0
                  ) -> tuple[dict[int, bytes | memoryview], dict[int, int], int]:
    """Check the records of a fetched range (`data`: the chunk's bytes from offset `base`, lying `at`
    bytes into a slab when `in_slab`): (good records, where those lying whole in the slab start in it,
    bytes of memory outside the slab they take: decompressed ones). CorruptData if `need`'s is bad or
    none is good; a bad record only read ahead is left out (whoever needs it fetches and reports it).
    Touches nothing shared: it may run in a thread."""
    view = memoryview(data)
    kept: dict[int, bytes | memoryview] = {}
    offsets: dict[int, int] = {}
    own = 0 if in_slab else len(view)
    for i, e in zip(run, extents):
        rec = e.record
        piece = view[rec.offset - base : rec.offset - base + rec.stored_len]
        try:
            raw = decode_record(piece, rec, f"chunk {cid.hex()} (from {node}) record at offset {rec.offset}")
        except CorruptData:
            if i != need:
                continue
            raise
        if raw is not piece:
            own += len(raw)  # decompressed: its own memory
        elif in_slab:
            offsets[i] = at + rec.offset - base
        kept[i] = raw
    if not kept:
        raise CorruptData(f"chunk {cid.hex()} (from {node}): no record of the range is good")
    return kept, offsets, own


class Fetcher:
    def __init__(self, index: Index, client: ClusterClient, retry_timeout: float = 0.0) -> None:
        self.index = index
        self.client = client
        # Replicas are raced (hedged) and, for a read that needs its bytes, waited for up to
        # retry_timeout while none answers (a restart); read-ahead gives up after one round.
        self.replicas = ReplicaReader(client, retry_timeout)
        self.local: LocalChunks | None = None  # this machine's chunk files, read in place when set
        self.disk: DiskCache | None = None  # the node's disk cache, read after `local`, filled from replicas
        self.fetches = self.fetched_bytes = 0
        self.fetched_by_node: dict[str, int] = {}  # bytes
        self.fetches_by_node: dict[str, int] = {}
        self.recent: deque[str] = deque(maxlen=RECENT)  # where the latest fetches came from
        self.fetch_seconds = LatencyHistogram()

    @property
    def failovers(self) -> int:
        """Fetches that moved on to another replica after one failed."""
        return self.replicas.failovers

    @property
    def corrupt(self) -> int:
        """Replicas' bytes that failed their check."""
        return self.replicas.corrupt

    def count_local(self, nbytes: int) -> None:
        """A record read from this machine's chunk files outside ranges() (a batch of them), and good."""
        assert self.local is not None
        self._count(self.local.node, nbytes)

    def _count(self, node: str, nbytes: int) -> None:
        self.fetches += 1
        self.fetched_bytes += nbytes
        self.fetches_by_node[node] = self.fetches_by_node.get(node, 0) + 1
        self.fetched_by_node[node] = self.fetched_by_node.get(node, 0) + nbytes
        self.recent.append(node)

    def _fetched(self, f: Fetched) -> None:
        """A replica's bytes arrived (checked next): counted as fetched from it, good or not."""
        self.fetch_seconds.observe(f.seconds)
        self._count(f.node, sum(len(p) for p in f.got))

    async def ranges(self, cid: bytes, ranges: list[tuple[int, int]], into: memoryview | None,
                     check: Callable[[Sequence[Buffer], str], Awaitable[T]], urgent: bool = True,
                     order: int | None = None, keep: bool = True, least: int | None = None) -> T:
        """Ranges (offset, length) of chunk `cid` from the first source whose bytes pass `check`
        (CorruptData from it moves on to the next; so does a replica that is down). The first range
        lands in `into` where the source can put it there. What a replica sent is counted as fetched
        from it (good or not), what this machine's chunk files or the disk cache gave once it is good;
        good bytes from a replica go to the disk cache (`keep`). `urgent`: a read waits for replicas
        through a restart and goes before read-ahead at the disk; `order`: read-ahead's ticket; `least`:
        the first range's length the disk cache may give instead (a window without its last record's
        block sums). CorruptData or Unreachable if no source has good bytes."""
        if self.local is not None:
            pieces = await self.local.read_ranges(cid, ranges, into, urgent, order)
            if pieces is not None:
                local: list[Buffer] = list(pieces)
                try:
                    out = await check(local, self.local.node)
                except CorruptData as exc:
                    self.local.failed_check(cid, exc)
                else:
                    self._count(self.local.node, sum(len(p) for p in local))
                    return out
        if self.disk is not None:
            held = await self.disk.read(cid, ranges, into, urgent, order, least)
            if held is not None:
                try:
                    out = await check(held, DISK_CACHE)
                except CorruptData as exc:
                    self.disk.drop(cid)
                    log.warning("%s; dropped from the disk cache, reading it from the replicas", exc)
                else:
                    self._count(DISK_CACHE, sum(len(p) for p in held))
                    return out
        out, got = await self.replicas.read(cid, ranges, into, check, self._fetched, retry=urgent)
        if self.disk is not None and keep:  # copied now: the slab is reused once its records are read
            self.disk.put(cid, ranges, got)
        return out

    async def blocks(self, ext: int, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of extent `ext`'s record, reading only the 4 KiB blocks that hold them and
        their sums (a random read inside a big record); kept nowhere: the
        kernel keeps what it is sent."""
        e = self.index.extent(ext)
        cid = self.index.chunk(e.chunk).id
        rng = block_range(e.record, lo, hi - lo)
        start = lo - rng.first * BLOCK_SIZE

        async def check(got: Sequence[Buffer], node: str) -> memoryview:
            where = f"chunk {cid.hex()} (from {node}) record at offset {e.record.offset}"
            verify_blocks(got[0], got[1], rng, where)
            return memoryview(got[0])[start : start + hi - lo]

        # Not kept on disk: random blocks of big files are rarely read twice, and would each be an entry.
        return await self.ranges(cid, [(rng.data_offset, rng.data_len), (rng.sums_offset, rng.sums_len)],
                                 None, check, keep=False)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fetches": self.fetches, "fetched_bytes": self.fetched_bytes,
                               "corrupt": self.corrupt,
                               "tcp_fallbacks": self.client.tcp_fallbacks, **self.replicas.stats()}
        if self.client.rdma is not None:
            out.update(self.client.rdma.stats())
        if self.local is not None:
            out.update(self.local.stats())
        if self.disk is not None:
            out.update(self.disk.stats())
        return out
