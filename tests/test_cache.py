"""The mount's chunk cache against a real one-node cluster: bytes, consumption, slab reuse, prefetch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
from test_services import make_chunk, make_index, running_node

from dlfs.client.cache import ChunkCache
from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster, NodeSpec
from dlfs.format.index import Index
from dlfs.wire.protocol import Msg

SLAB = 64 << 10


async def _dataset(tmp_path: Path, client: ClusterClient, spec: NodeSpec, n_chunks: int,
                   records: int = 8, size: int = 20_000) -> tuple[Index, list[bytes], int]:
    """Chunks stored on the node and an index naming one file per record: (index, payloads by
    extent, stored bytes)."""
    chunks, payloads, stored = [], [], 0
    for seed in range(n_chunks):
        cid, data, recs, raw = make_chunk(100 + seed, records=records, size=size)
        await client.call(spec, "data", Msg.PUT_CHUNK, {"id": cid}, data)
        chunks.append((cid, data, recs))
        payloads += raw
        stored += recs[-1].offset + recs[-1].stored_len - recs[0].offset  # what fetching every record spans
    path = tmp_path / "t.idx"
    path.write_bytes(make_index(chunks))
    return Index(path), payloads, stored


@pytest.mark.timeout(60)
async def test_random_epoch_through_a_small_cache_fetches_each_byte_about_once(tmp_path: Path) -> None:
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as n:
        client = ClusterClient(Cluster([spec], key, 1, "test", local=spec.name), n)
        index, payloads, stored = await _dataset(tmp_path, client, spec, n_chunks=12)
        # 6 slabs of 64K for 12 chunks of ~160K: most of the data cannot be resident at once.
        cache = ChunkCache(index, client, capacity=6 * SLAB, readahead=SLAB, prefetch=False)
        order = list(range(len(payloads)))
        random.Random(7).shuffle(order)
        for ext in order:
            got = await cache.record(ext)
            assert bytes(got) == payloads[ext], f"extent {ext}"
            cache.consume(ext, len(got))
        s = cache.stats()
        assert s["consumed"] == len(payloads)
        assert s["cached_bytes"] == 0, "consumed records must free their slabs"
        assert s["fetched_bytes"] <= 1.1 * stored, s
        n.cancel_scope.cancel()


@pytest.mark.timeout(60)
async def test_partly_served_record_stays_until_all_its_bytes_are_served(tmp_path: Path) -> None:
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as n:
        client = ClusterClient(Cluster([spec], key, 1, "test", local=spec.name), n)
        index, payloads, _ = await _dataset(tmp_path, client, spec, n_chunks=1, records=2, size=50_000)
        cache = ChunkCache(index, client, capacity=8 * SLAB, readahead=SLAB, prefetch=False)
        got = await cache.record(0)
        cache.consume(0, 20_000)
        before = cache.fetches
        assert bytes(await cache.record(0)) == payloads[0] and cache.fetches == before  # still a hit
        cache.consume(0, 30_000)
        assert bytes(await cache.record(0)) == payloads[0] and cache.fetches == before + 1  # fetched again
        assert len(got) == 50_000
        n.cancel_scope.cancel()


@pytest.mark.timeout(60)
async def test_a_miss_prefetches_the_rest_of_its_chunk(tmp_path: Path) -> None:
    async with running_node(tmp_path / "home") as (spec, key), trio.open_nursery() as n:
        client = ClusterClient(Cluster([spec], key, 1, "test", local=spec.name), n)
        # Chunks of 8 records of 20 kB: a 64K slab holds 3, so a chunk needs several fetches.
        index, payloads, stored = await _dataset(tmp_path, client, spec, n_chunks=4)
        cache = ChunkCache(index, client, capacity=64 * SLAB, readahead=SLAB)
        n.start_soon(cache.prefetch_worker)
        for c in range(4):
            await cache.record(c * 8 + 5)  # one miss in the middle of each chunk
        with trio.fail_after(10):
            while not all(ext in cache for ext in range(len(payloads))):
                await trio.sleep(0.01)
        for ext in range(len(payloads)):
            assert bytes(await cache.record(ext)) == payloads[ext]
        assert cache.misses == 4, "every other record was prefetched"
        assert cache.prefetched_bytes > 0 and cache.fetched_bytes <= stored, "nothing was fetched twice"
        n.cancel_scope.cancel()
