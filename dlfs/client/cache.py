"""The mount's chunk cache: verified, decoded records in memory, fetched by ranges of a chunk.

A miss fetches the missing record together with the records after it in the same chunk (one
request, up to `readahead` bytes), verifies each against its checksum, and keeps them all: reading
a dataset in any order then costs about one request per `readahead` bytes, not one per file.
The fetched buffer is kept whole as one block and records are views into it (no copy until the
kernel's).

Scan resistant (CoorDL's no-thrash idea): an epoch reads every file once in a random order, so
evicting by recency only throws away read-ahead before it is used. Blocks therefore stay resident
until the resident part is full; after that a miss fetches just its own record (no read-ahead) into
a small LRU scratch area, which serves the several kernel reads of one large file. A dataset
larger than the cache then costs one fetch per missed file, and the resident part keeps hitting.
Concurrent misses of one record share one fetch. A replica that is down, or whose bytes fail
their checksum, is passed over for the next one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from time import perf_counter

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.counters import LatencyHistogram
from dlfs.errors import CorruptData, NotFound, Unreachable
from dlfs.format.chunk import decode_record
from dlfs.format.index import Extent, Index
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
FETCH_TIMEOUT = 10.0


class ChunkCache:
    def __init__(self, index: Index, client: ClusterClient, capacity: int = 2 << 30,
                 readahead: int = 4 << 20) -> None:
        self.index = index
        self.client = client
        self.capacity = capacity
        self.readahead = readahead
        self._records: dict[int, tuple[bytes | memoryview, int]] = {}  # extent -> (raw bytes, block)
        self._scratch_cap = capacity // 8
        self._resident_cap = capacity - self._scratch_cap
        self._resident: dict[int, int] = {}  # block -> bytes; never evicted
        self._scratch: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()  # block -> (bytes, extents)
        self._resident_size = self._scratch_size = 0
        self._next_block = 0
        self._inflight: dict[int, trio.Event] = {}
        self.hits = self.misses = self.fetches = self.fetched_bytes = self.evictions = 0
        self.corrupt = 0
        self.failovers = 0  # fetches that moved on to another replica after one failed
        self.fetched_by_node: dict[str, int] = {}  # bytes
        self.fetches_by_node: dict[str, int] = {}
        self.fetch_seconds = LatencyHistogram()

    def _resident_full(self, more: int) -> bool:
        return self._resident_size + more > self._resident_cap

    def _add_block(self, nbytes: int, records: dict[int, bytes | memoryview]) -> None:
        bid = self._next_block
        self._next_block += 1
        for ext, raw in records.items():
            self._records[ext] = (raw, bid)
        if not self._resident_full(nbytes):
            self._resident[bid] = nbytes
            self._resident_size += nbytes
            return
        self._scratch[bid] = (nbytes, list(records))
        self._scratch_size += nbytes
        while self._scratch_size > self._scratch_cap and len(self._scratch) > 1:
            old, (size, exts) = self._scratch.popitem(last=False)
            self._scratch_size -= size
            for e in exts:
                if self._records.get(e, (b"", -1))[1] == old:
                    self._records.pop(e, None)
                    self.evictions += 1

    async def record(self, ext: int) -> bytes | memoryview:
        """The raw bytes of extent `ext`, verified; CorruptData if no replica has good bytes."""
        while True:
            hit = self._records.get(ext)
            if hit is not None:
                if hit[1] in self._scratch:
                    self._scratch.move_to_end(hit[1])
                self.hits += 1
                return hit[0]
            pending = self._inflight.get(ext)
            if pending is None:
                break
            await pending.wait()  # someone is fetching it; look again when they are done
        self.misses += 1
        return await self._fetch(ext)

    def _run(self, ext: int) -> list[int]:
        """`ext` and the extents right after it in its chunk, up to the readahead budget."""
        first = self.index.extent(ext)
        chunk = self.index.chunk(first.chunk)
        end_ext = chunk.first_extent + chunk.n_extents
        run = [ext]
        if self._resident_full(self.readahead):
            return run  # read-ahead would only land in the scratch area and be evicted unused
        start = first.record.offset
        i = ext + 1
        while i < end_ext and i not in self._records and i not in self._inflight:
            e = self.index.extent(i)
            if e.record.offset + e.record.stored_len - start > self.readahead:
                break
            run.append(i)
            i += 1
        return run

    async def _fetch(self, ext: int) -> bytes | memoryview:
        run = self._run(ext)
        done = trio.Event()
        for i in run:
            self._inflight[i] = done
        try:
            extents = [self.index.extent(i) for i in run]
            chunk = self.index.chunk(extents[0].chunk)
            base = extents[0].record.offset
            end = extents[-1].record.offset + extents[-1].record.stored_len
            # Replica by replica (the local one first): bytes that fail their checksum on one
            # replica are read again from the next, as are replicas that are down.
            errors: list[str] = []
            corrupt = False
            for spec in self.client.replicas(chunk.id):
                if errors:
                    self.failovers += 1
                t0 = perf_counter()
                try:
                    _, data = await self.client.call(spec, "data", Msg.READ_RANGE,
                                                     {"id": chunk.id, "offset": base, "length": end - base},
                                                     timeout=FETCH_TIMEOUT)
                except (Unreachable, NotFound, CorruptData) as exc:
                    errors.append(f"{spec.name}: {exc}")
                    continue
                self.fetch_seconds.observe(perf_counter() - t0)
                self.fetches += 1
                self.fetched_bytes += len(data)
                self.fetches_by_node[spec.name] = self.fetches_by_node.get(spec.name, 0) + 1
                self.fetched_by_node[spec.name] = self.fetched_by_node.get(spec.name, 0) + len(data)
                try:
                    return self._keep(run, extents, chunk.id, base, data, spec.name, ext)
                except CorruptData as exc:
                    self.corrupt += 1
                    corrupt = True
                    log.warning("%s; trying the next replica", exc)
                    errors.append(str(exc))
            cls = CorruptData if corrupt else Unreachable
            raise cls(f"chunk {chunk.id.hex()}: no replica has good bytes ({'; '.join(errors)})")
        finally:
            for i in run:
                self._inflight.pop(i, None)
            done.set()

    def _keep(self, run: list[int], extents: list[Extent], cid: bytes, base: int,
              data: bytes | bytearray | memoryview, node: str, ext: int) -> bytes | memoryview:
        """Verify the fetched records and keep them as one block; returns `ext`'s, or raises
        CorruptData if it is bad (keeping nothing: the next replica's copy replaces them all)."""
        view = memoryview(data)
        kept: dict[int, bytes | memoryview] = {}
        nbytes = len(view)
        for i, e in zip(run, extents):
            rec = e.record
            piece = view[rec.offset - base : rec.offset - base + rec.stored_len]
            try:
                raw = decode_record(piece, rec, f"chunk {cid.hex()} (from {node}) record at offset {rec.offset}")
            except CorruptData:
                if i != ext:
                    continue  # read ahead only: whoever needs it will fetch and report it
                raise
            if raw is not piece:
                nbytes += len(raw)  # decompressed: its own memory
            kept[i] = raw
        self._add_block(nbytes, kept)
        return kept[ext]

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "fetches": self.fetches,
                "fetched_bytes": self.fetched_bytes, "evictions": self.evictions,
                "cached_bytes": self._resident_size + self._scratch_size, "corrupt": self.corrupt}
