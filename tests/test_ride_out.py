"""Reads that ride out faults: a frozen replica is hedged past, a restarted cluster is waited for
(within --retry-timeout), bad bytes on every replica fail at once, and back-off grows per round.

Real `dlfs node` processes (a two-node cluster on localhost, etcd behind it), frozen with SIGSTOP and
restarted with SIGTERM; the chunk cache is driven directly (dlfs/mount/cache.py) where a test needs
to look at its counters, and through a real FUSE mount where readers check every byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from chaoslab import Readers, make_files
from conftest import (
    DLFS,
    REPO,
    STOP_TIMEOUT,
    Node,
    dlfs_env,
    needs_fuse,
    running_cluster,
    start_node_process,
    wait_for_node,
)
from damage import inode_of
from etcdlab import etcd_available

from dlfs.client.cluster import SUSPECT_MAX, SUSPECT_MIN, ClusterClient, Health
from dlfs.client.replicas import HEDGE_MAX, HEDGE_MIN, HEDGE_UNLEARNED, LEARN_AFTER, FetchLatency
from dlfs.config import parse_cluster_file
from dlfs.errors import CorruptData, Unreachable
from dlfs.format.index import Index
from dlfs.mount.cache import ChunkCache
from dlfs.native import native

CHUNK_SIZE = "256K"


# --- units: no cluster ---------------------------------------------------------------------------
def test_health_counts_a_round_of_failures_once() -> None:
    """Fetches failing together (a node goes down under many) are one round: the back-off doubles
    once per round, from SUSPECT_MIN to SUSPECT_MAX, not once per failed fetch."""
    h = Health()
    assert h.fail(100.0)
    assert [h.fail(100.0 + k * 0.01) for k in range(1, 20)] == [False] * 19
    assert (h.rounds, h.failures, h.backoff) == (1, 20, SUSPECT_MIN)
    assert h.suspect(100.0 + SUSPECT_MIN / 2) and not h.suspect(100.0 + SUSPECT_MIN)
    now = 100.0
    for expect in (2 * SUSPECT_MIN, 4 * SUSPECT_MIN, 8 * SUSPECT_MIN, SUSPECT_MAX, SUSPECT_MAX):
        now = h.until  # the probe after the back-off fails: a new round
        assert h.fail(now)
        assert h.backoff == min(expect, SUSPECT_MAX)
    assert h.rounds == 6


def test_hedge_bound_is_learned_from_recent_fetches() -> None:
    """The p99 of recent fetch latencies, held to HEDGE_MIN..HEDGE_MAX (HEDGE_UNLEARNED before
    LEARN_AFTER fetches)."""
    lat = FetchLatency()
    for _ in range(LEARN_AFTER - 1):
        lat.observe(0.001)
    assert lat.hedge_after() == HEDGE_UNLEARNED
    lat.observe(0.001)
    assert lat.hedge_after() == HEDGE_MIN  # fast fetches: the floor
    slow = FetchLatency()
    for k in range(256):
        slow.observe(0.3 if k % 50 else 30.0)  # 2% of fetches stall: the p99 is one of them
    assert slow.hedge_after() == HEDGE_MAX
    mid = FetchLatency()
    for k in range(256):
        mid.observe(0.4 if k % 10 == 0 else 0.01)
    assert mid.hedge_after() == pytest.approx(0.4)


def test_mount_refuses_a_negative_retry_timeout(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    proc = subprocess.run([*DLFS, "mount", "x", str(tmp_path / "mnt"), "--retry-timeout", "-1"],
                          env=dlfs_env(tmp_path / "home"), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "--retry-timeout: expected a number of seconds (0 or more), got '-1'" in proc.stderr


# --- against a real cluster ----------------------------------------------------------------------
@dataclass
class Lab:
    base: Path
    nodes: list[Node]
    cluster_file: Path
    files: dict[str, bytes]  # the dataset "ride": relative path -> bytes

    def index(self, name: str = "ride") -> Index:
        return Index(self.nodes[0].home / f"meta/index/{name}/1.idx")

    def stop_all(self) -> None:
        """SIGTERM every node at once, then wait for each to exit cleanly (bounded)."""
        for node in self.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            rc = node.proc.wait(timeout=STOP_TIMEOUT)
            assert rc == 0, f"{node.name} exited {rc} after SIGTERM:\n{node.node_log()[-3000:]}"

    def start_all(self) -> None:
        """Start every stopped node at once, then wait for each."""
        for node in self.nodes:
            if node.proc.poll() is not None:
                node.proc, node.log = start_node_process(node.home, *node.node_args())
        for node in self.nodes:
            wait_for_node(node.home, node.proc, node.log, node.cluster)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if etcd_available():
        pytest.fail(etcd_available())  # make install provides it: its absence is a broken set-up
    base = tmp_path_factory.mktemp("rideout")
    src = base / "src"
    files = make_files(src, 48, seed=11)
    with running_cluster(base / "cluster", 2, replicas=2) as nodes:
        nodes[0].ingest(src, "ride", "--chunk-size", CHUNK_SIZE)
        try:
            yield Lab(base, nodes, base / "cluster" / "cluster.toml", files)
        finally:
            for node in nodes:  # never leave a node frozen: its stop would wait out its timeout
                if node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGCONT)


def expected(index: Index, files: dict[str, bytes]) -> dict[int, bytes]:
    """Each file's extents' bytes, by extent."""
    out: dict[int, bytes] = {}
    for rel, data in files.items():
        inode = index.inode(inode_of(index, rel))
        pos = 0
        for k in range(inode.count):
            raw_len = index.extent(inode.ref + k).record.raw_len
            out[inode.ref + k] = data[pos : pos + raw_len]
            pos += raw_len
    return out


@pytest.mark.timeout(120)
async def test_a_frozen_replica_is_hedged_past_and_read_again_once_it_answers(lab: Lab) -> None:
    """n1 (this machine's node: every chunk's first replica) is SIGSTOPped. With the fetch timeout
    out of reach (600 s), every read still gets its bytes: each fetch left unanswered is hedged to
    n2, which answers; n1 is then read last, and read first again once it answers a probe."""
    n1 = lab.nodes[0]
    index = lab.index()
    want = expected(index, lab.files)
    cluster = parse_cluster_file(lab.cluster_file)
    assert cluster.local == "n1"
    try:
        async with trio.open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            nursery.start_soon(client.probe_failing)
            cache = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False)
            cache.fetcher.replicas.fetch_timeout = 600.0
            assert all(client.replicas(index.chunk(c).id)[0].name == "n1" for c in range(index.totals.chunks))
            n1.proc.send_signal(signal.SIGSTOP)
            try:
                with trio.fail_after(90):
                    for ext in sorted(want):
                        assert bytes(await cache.record(ext)) == want[ext], ext
            finally:
                n1.proc.send_signal(signal.SIGCONT)
            s = cache.stats()
            assert s["hedges_won"] >= 1 and s["hedges"] >= s["hedges_won"], s
            assert cache.fetcher.fetches_by_node.get("n1", 0) == 0, cache.fetcher.fetches_by_node
            if native is not None:  # a hedge's bytes were copied into the slab: published for the serving threads
                assert all(cache.where(ext) is not None for ext in want), "hedged bytes must land in their slab"
            # n1 answers again (SIGCONT): the prober finds out, and its chunks are read from it first.
            with trio.fail_after(30):
                while client.failing("n1"):
                    await client.wait_answer(1.0)
            for ext in want:
                cache.consume(ext, len(want[ext]))
            again = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False)
            ext = min(want)
            assert bytes(await again.record(ext)) == want[ext]
            assert again.fetcher.fetches_by_node == {"n1": 1}
            nursery.cancel_scope.cancel()
    finally:
        index.close()


@pytest.mark.timeout(180)
async def test_reads_wait_for_a_restarted_cluster_within_their_bound(lab: Lab) -> None:
    """Both nodes down: a read with --retry-timeout 0 fails at once, with a short bound after some
    rounds, and with the default one gets its bytes once the nodes are back."""
    async with every_node_down(lab) as (index, want, client):
        exts = sorted(want)
        at_once = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False)
        with pytest.raises(Unreachable, match=r"no replica answered \(n1: .*n2: "):
            await at_once.record(exts[0])
        assert at_once.fetcher.replicas.waits == 0
        short = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False,
                           retry_timeout=0.5)
        with pytest.raises(Unreachable, match=r"no replica answered within 0\.5 s"):
            await short.record(exts[0])
        assert short.fetcher.replicas.waits >= 1
        patient = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False,
                             retry_timeout=60.0)
        got: dict[int, bytes] = {}

        async def read(ext: int) -> None:
            got[ext] = bytes(await patient.record(ext))

        async with trio.open_nursery() as readers:
            for ext in exts[:: max(1, len(exts) // 6)]:
                readers.start_soon(read, ext)
            await trio.to_thread.run_sync(lab.start_all)
        assert sorted(got) == exts[:: max(1, len(exts) // 6)] and all(got[e] == want[e] for e in got)
        # Reads of one window share its fetch: at least one fetch waited, and each that did got its bytes.
        assert patient.fetcher.replicas.rode_out >= 1 and patient.fetcher.replicas.waits >= 1, patient.stats()


@pytest.mark.timeout(180)
async def test_an_outage_longer_than_the_retry_timeout_fails_later_reads_at_once(lab: Lab) -> None:
    """Both nodes down for longer than the retry timeout: the first read waits it out and fails, and
    the reads after it fail at once, with no fetch and no wait (each waited the whole bound again in
    turn: a node down for good cost a job that bound per file); once a probe finds a node back, reads
    get their bytes again."""
    async with every_node_down(lab) as (index, want, client):
        exts = sorted(want)
        cache = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False, retry_timeout=1.0)
        t0 = trio.current_time()
        with pytest.raises(Unreachable, match=r"no replica answered within 1 s"):
            await cache.record(exts[0])
        assert 0.9 <= trio.current_time() - t0 < 5
        waits, t0 = cache.fetcher.replicas.waits, trio.current_time()
        for ext in exts[1:6]:
            with pytest.raises(Unreachable, match=r"no replica answered for 1 s \(n\d: no answer for \d+ s; "
                                                  r"n\d: no answer for \d+ s\)"):
                await cache.record(ext)
        assert trio.current_time() - t0 < 0.5 and cache.fetcher.replicas.waits == waits
        await trio.to_thread.run_sync(lab.start_all)
        with trio.fail_after(30):
            while client.failing("n1") and client.failing("n2"):  # a probe finds one back
                await client.wait_answer(1.0)
        assert bytes(await cache.record(exts[-1])) == want[exts[-1]]


@asynccontextmanager
async def every_node_down(lab: Lab) -> AsyncIterator[tuple[Index, dict[int, bytes], ClusterClient]]:
    """Both nodes stopped, and a client whose prober runs: (the index, each extent's bytes, the client);
    the nodes start again after, however the test ends."""
    index = lab.index()
    want = expected(index, lab.files)
    cluster = parse_cluster_file(lab.cluster_file)
    lab.stop_all()
    try:
        async with trio.open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            nursery.start_soon(client.probe_failing)
            yield index, want, client
            nursery.cancel_scope.cancel()
    finally:
        index.close()
        lab.start_all()


@pytest.mark.timeout(120)
async def test_bad_bytes_on_every_replica_fail_at_once(lab: Lab) -> None:
    """Every replica answers, with bytes that fail their check: that is no restart, so the read
    fails (CorruptData: EIO) in one round, however long its retry bound."""
    src = lab.base / "bad-src"
    files = make_files(src, 4, seed=12, sizes=(30_000, 30_000))
    lab.nodes[0].ingest(src, "bad", "--chunk-size", CHUNK_SIZE)
    index = lab.index("bad")
    try:
        ext = index.inode(inode_of(index, sorted(files)[0])).ref
        rec, cid = index.extent(ext).record, index.chunk(index.extent(ext).chunk).id
        for node in lab.nodes:
            path = node.home / "data/chunks" / cid.hex()[:2] / cid.hex()
            with open(path, "r+b") as f:
                f.seek(rec.offset + 1000)
                b = f.read(1)
                f.seek(rec.offset + 1000)
                f.write(bytes([b[0] ^ 0xFF]))
        async with trio.open_nursery() as nursery:
            client = ClusterClient(parse_cluster_file(lab.cluster_file), nursery)
            cache = ChunkCache(index, client, capacity=16 << 20, readahead=256 << 10, prefetch=False,
                               retry_timeout=60.0)
            with trio.fail_after(60), pytest.raises(CorruptData, match="no replica has good bytes"):
                await cache.record(ext)
            assert cache.fetcher.replicas.waits == 0 and not client.health
            nursery.cancel_scope.cancel()
    finally:
        index.close()


@needs_fuse
@pytest.mark.timeout(240)
def test_readers_of_a_mount_see_no_error_through_a_full_cluster_restart(lab: Lab) -> None:
    """Both nodes stopped and started again while 3 readers read every file of a mount round and round,
    each byte checked: no read fails, none is wrong, and the mount says its reads waited."""
    n1 = lab.nodes[0]
    mnt = n1.mount("ride", lab.base / "mnt-restart", "--no-short-circuit")
    try:
        log = n1.mount_log("ride")
        with Readers(mnt, lab.files, threads=3, seed=5) as readers:
            readers.wait_reads(100)
            lab.stop_all()
            lab.start_all()
            readers.wait_reads(100)
            seen = readers.stop()
        assert not seen.errors, seen.errors[:10]
        assert not seen.wrong, seen.wrong[:10]
        text = log.read_text(errors="replace")
        assert "reads wait for one for up to 60 s" in text, text[-3000:]
        assert "reads waiting for a replica are done" in text, text[-3000:]
    finally:
        lab.start_all()
        if os.path.ismount(mnt):
            n1.umount(mnt)
