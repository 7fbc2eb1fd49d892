"""A mount's counters, published for `dlfs stats` (a JSON file) and Prometheus (`--metrics`).

The file sits beside the mount's record under $DLFS_HOME/run/mounts/ and is replaced whole once a
second, so any user who can read the state directory can watch the mount with no socket and no
privilege; it is removed when the mount ends. SIGUSR1 to the mount writes it at once (SAMPLE_NOW): a
benchmark or a script that wants counters as of now need not wait for the next second.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import trio

from dlfs.mount.diskcache import SOURCE as DISK_CACHE
from dlfs.native import engine_stats
from dlfs.private import private_dirs, write_private
from dlfs.transport.base import Address

log = logging.getLogger(__name__)
STATS_FORMAT = 1
WRITE_INTERVAL = 1.0
SAMPLE_NOW = signal.SIGUSR1


def stats_file(home: Path, mountpoint: Path) -> Path:
    from dlfs.mount.records import stats_file as beside_record  # named after the mount's record

    return beside_record(home, mountpoint)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".stats.{os.getpid()}.tmp")
    write_private(tmp, text)
    os.replace(tmp, path)


class MountStats:
    """Reads the counters of one mount's operations, cache and cluster client when asked."""

    def __init__(self, label: str, mountpoint: Path, ops: Any, cache: Any, client: Any, control: Any = None) -> None:
        self.label, self.mountpoint, self.ops, self.cache, self.client = label, mountpoint, ops, cache, client
        self.control = control  # the dlfs.direct control socket, if served
        self.started = time.time()
        self.metrics: Address | None = None
        self.remote: Any = None  # the serving threads' own fetches (remotereads.RemoteReads), once started

    def snapshot(self) -> dict[str, Any]:
        ops, c = self.ops, self.cache
        # READs answered by the native engine come from the cache's slabs: each is a hit; the Python
        # handlers' own (misses and what is not in a slab) are counted and timed by them.
        eng = engine_stats()
        native_reads = eng.get("reads", 0)
        # What the engine read from this machine's chunk files itself (random blocks, whole records in
        # scan mode) are misses, and fetches from it too.
        blocks = eng.get("block_reads", 0) + eng.get("record_reads", 0)
        block_bytes = eng.get("block_bytes", 0) + eng.get("record_bytes", 0)
        fetches_by = dict(c.fetcher.fetches_by_node)
        fetched_by = dict(c.fetcher.fetched_by_node)

        def fetched(source: str | None, n: int, nbytes: int) -> None:
            """`n` fetches of `nbytes` by the serving threads, counted under `source` beside Python's."""
            if source is not None and n:
                fetches_by[source] = fetches_by.get(source, 0) + n
                fetched_by[source] = fetched_by.get(source, 0) + nbytes

        fetched(c.fetcher.local.node if c.fetcher.local is not None else None, blocks, block_bytes)
        # Records the serving threads fetched from the data daemons themselves (scan mode): misses too,
        # counted as fetched from their node whether or not they passed their check (as the fetcher's).
        threads = self.remote.stats() if self.remote is not None else {}
        for name, r in threads.items():
            fetched(name, r["reads"], r["bytes"])
        remote, remote_bytes = sum(r["reads"] for r in threads.values()), sum(r["bytes"] for r in threads.values())
        # Records they read from the disk cache's files (scan mode): misses, fetched from the disk cache.
        cached, cached_bytes = eng.get("disk_cache_reads", 0), eng.get("disk_cache_bytes", 0)
        fetched(DISK_CACHE, cached, cached_bytes)
        nodes = sorted(set(fetched_by) | set(fetches_by))
        return {
            "format": STATS_FORMAT, "time": time.time(), "pid": os.getpid(), "started": self.started,
            "dataset": self.label, "mountpoint": str(self.mountpoint),
            "metrics": str(self.metrics) if self.metrics else None,
            "reads": ops.reads + native_reads, "read_bytes": ops.bytes_read + eng.get("read_bytes", 0),
            "read_errors": ops.errors, "read_seconds": ops.read_seconds.to_dict(),
            "python_reads": ops.reads, "engine": eng, "direct_io_min": ops.direct_io_min,
            "scan_kept": c.scan_latched,
            "cache_hits": c.hits + native_reads - blocks - eng.get("remote_reads", 0) - cached,
            "cache_misses": c.misses + blocks + eng.get("remote_reads", 0) + cached, "cache_evictions": c.held.evictions,
            "cache_bytes": c.stats()["cached_bytes"], "cache_capacity": c.capacity,
            "cache_given_back": c.slabs.given_back, "cache_touched": c.slabs.touched, "cache_huge_pages": c.slabs.huge,
            "fetches": c.fetcher.fetches + blocks + remote + cached,
            "fetched_bytes": c.fetcher.fetched_bytes + block_bytes + remote_bytes + cached_bytes,
            # read in place from this machine's chunk files (short-circuit), not through a daemon: all of
            # fetched_bytes on one node; a local copy that fails its check counts here, its good bytes
            # in fetched_bytes under the replica that had them
            "in_place_bytes": (c.fetcher.local.bytes if c.fetcher.local is not None else 0) + block_bytes,
            # windows of this machine's chunk files read, checked and published in C as they landed
            "windows_landed": c.fetcher.local.landed if c.fetcher.local is not None else 0,
            # and windows of other machines' chunks fetched on the serving threads' connections so
            "windows_landed_remote": c.landed_remote,
            # files read in order whose stream the serving threads started (no READ of theirs missed yet)
            "streams_hinted": c.hinted,
            "fetch_seconds": c.fetcher.fetch_seconds.to_dict(),
            "by_node": {n: {"fetches": fetches_by.get(n, 0), "bytes": fetched_by.get(n, 0)} for n in nodes},
            # the serving threads' connections to each data node (scan mode's fetches), where they fetch
            "thread_connections": {n: r["open"] for n, r in threads.items() if r["open"]},
            "failovers": c.fetcher.failovers, "checksum_failures": c.fetcher.corrupt,
            "disk_cache": c.fetcher.disk.status() if c.fetcher.disk is not None else None,
            "failing_nodes": sorted(self.client.health),
            **(self.control.stats() if self.control is not None else {}),
        }

    async def publish(self, nursery: trio.Nursery, home: Path, metrics: Address | None) -> None:
        """Serve metrics on `metrics` (if given; a bad address fails here, before the mount is
        made) and keep the stats file current until the nursery ends."""
        if metrics is not None:
            from dlfs.metrics import MountCollector, registry_of, serve_metrics

            self.metrics = await nursery.start(serve_metrics, metrics, registry_of(MountCollector(self.snapshot)),
                                               name="dlfs-mount-metrics")
            log.info("%s: metrics on http://%s/metrics", self.label, self.metrics)
        nursery.start_soon(self.write_every, stats_file(home, self.mountpoint), name="dlfs-mount-stats")

    async def write_every(self, path: Path, interval: float = WRITE_INTERVAL) -> None:
        private_dirs(path.parent)
        warned = sampled_badly = False
        asked = trio.Event()

        async def on_signal(signals: Any) -> None:
            nonlocal asked
            async for _ in signals:
                asked.set()

        try:
            with trio.open_signal_receiver(SAMPLE_NOW) as signals:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(on_signal, signals)
                    while True:
                        try:
                            text = json.dumps(self.snapshot())
                        except Exception:  # a figure that cannot be read must not stop the others, nor say so often
                            if not sampled_badly:
                                log.exception("%s: cannot take the mount's figures for %s", self.label, path)
                                sampled_badly = True
                        else:
                            try:
                                await trio.to_thread.run_sync(_write_atomic, path, text)
                            except OSError as exc:
                                if not warned:  # a full disk must not take the mount down, nor fill its log
                                    log.warning("%s: cannot write %s: %s", self.label, path, exc.strerror or exc)
                                    warned = True
                        with trio.move_on_after(interval):
                            await asked.wait()
                        asked = trio.Event()
        finally:
            # Here, not in an exit callback: a write still running in its thread would bring it back.
            path.unlink(missing_ok=True)
