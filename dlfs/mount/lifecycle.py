"""Mount lifecycle: fetch and open the index, start the FUSE session, serve, unmount cleanly."""

from __future__ import annotations

import errno
import logging
import os
import platform
import re
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pyfuse3
import trio

from dlfs.cgroup import MemoryLimit, memory_limit
from dlfs.client.cluster import ClusterClient
from dlfs.client.indexes import fetch_index
from dlfs.client.replicas import RETRY_TIMEOUT
from dlfs.client.transport import arena_for_cache, choose_for, chunk_transport
from dlfs.config import Cluster, check_dataset_name
from dlfs.errors import MountError, NotFound, UsageError
from dlfs.format.index import Index
from dlfs.fsprobe import DEAD, SILENT, forget, probe
from dlfs.logs import set_context
from dlfs.mount.cache import ENGINE_ROW, PREFETCH_WORKERS, ChunkCache
from dlfs.mount.directsock import ControlServer, control_socket_path
from dlfs.mount.diskcache import DiskCache
from dlfs.mount.diskreads import DiskReads
from dlfs.mount.localchunks import open_local_chunks
from dlfs.mount.ops import CONTROL_XATTR, TIMEOUT, DlfsOperations
from dlfs.mount.pressure import watch_memory
from dlfs.mount.records import (
    DETACHED,
    LIVE,
    MountRecord,
    drop_record,
    forget_record,
    judge,
    local_mounts,
    mount_record,
    read_record,
    write_record,
)
from dlfs.mount.remotereads import ROUTE_WORK_MAX, IndexChunkIds, RemoteReads
from dlfs.mount.statsfile import SAMPLE_NOW, MountStats
from dlfs.native import engine_stats, engine_threads, miss_readers, native, start_engine
from dlfs.private import tighten_home
from dlfs.procmounts import is_mount_point, mount_points
from dlfs.procs import Holder, holders, raise_open_files_limit, running, set_title, start_ticks
from dlfs.tasks import open_nursery
from dlfs.transport.base import Address
from dlfs.units import counted, human_bytes, human_mib
from dlfs.wire.messages import META_DAEMON, VersionInfo, reply
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
# Half of a dataset's bytes in files at least this big (Index.bulk_file_size): a mount serves from /dev/fuse
# rather than io_uring (want_io_uring).
# A ring answers a READ on the CPU that sent it, so the reader's copy of one window and the answer to
# the next take turns on one CPU; from /dev/fuse a thread on the other answers meanwhile. Cold 16-40 MB
# files: 0.70-0.83x local disk against 0.55-0.71x; warm, the slower round trip costs them ~3%.
URING_BIG_FILES = 16 << 20
# --direct-io: files this big are opened FOPEN_DIRECT_IO. A smaller one keeps its pages: read whole in one
# READ, it would cost a second one to find its end, which the kernel knows from its size otherwise.
DIRECT_IO_MIN = 1 << 20
URING_START = 2.0  # seconds the engine may take to try FUSE over io_uring before a mount says it did not start
# The mount's kernel read-ahead: READs of 1 MiB (max_pages), about one ahead of the reader. The mount
# keeps its own windows in flight ahead of a stream, so more READs in flight only raced them: at 4 MiB
# three of each big file's first four READs reached Python before its first window was asked for (125
# READs to Python a pass of 32 big files, 40 at 1 MiB). Big files read whole, cold, one reader: 1,115
# MB/s at 4 MiB against 1,198 at 1 MiB (2 MiB 1,161, 8 MiB 1,045; ad-hoc, 6 passes each); three runs
# each of `dlfs bench --only cold`, 2 readers: 0.86-0.90x local disk at 4 MiB, 0.89-0.98x at 1 MiB;
# two of `dlfs bench --quick`: alike within their noise, raw 1 MiB readinto 1,062-1,163 MB/s against
# 1,252-1,276.
READ_AHEAD_KB = 1024
URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")
MOUNT_PROCESS_NAME = "dlfs-mount"  # its name in top and pgrep; `ps -ef` shows `dlfs mount NAME@V MNT`


@dataclass
class MountOptions:
    home: Path
    cluster: Cluster
    dataset: str
    version: int | None
    mountpoint: Path
    cache_size: int = 2 << 30  # the CLI passes auto_cache_size() unless told
    readahead: int = 4 << 20
    allow_other: bool = False
    metrics: Address | None = None  # serve Prometheus metrics here
    short_circuit: bool = True  # read the local node's chunk files in place
    threads: int = field(default_factory=engine_threads)  # native threads serving /dev/fuse
    io_uring: str = "auto"  # auto | on | off: FUSE over io_uring (see want_io_uring)
    memory: MemoryLimit = field(default_factory=memory_limit)  # what the cache's pressure watch reads
    log_file: Path | None = None  # where this mount logs, for its record (`dlfs mounts`); None: stderr
    cache_dir: Path | None = None  # the node's disk cache (dlfs/mount/diskcache.py); None: RAM only
    cache_dir_size: int | None = None  # its bound; None: the one it was last given, else the free space
    retry_timeout: float = RETRY_TIMEOUT  # how long a read waits for a replica to answer (a restart) before EIO
    direct_io: str = "auto"  # auto | on | off: big files read past the page cache (see want_direct_io)


def parse_dataset_ref(ref: str) -> tuple[str, int | None]:
    """NAME or NAME@VERSION."""
    name, sep, version = ref.partition("@")
    check_dataset_name(name)
    if not sep:
        return name, None
    if not version.isdigit():
        raise UsageError(f"bad dataset version in {ref!r} (use NAME@VERSION, e.g. imagenet@2)")
    return name, int(version)


def check_mountpoint(path: Path, nonempty: bool = False, home: Path | None = None) -> None:
    """Refuse, in one line, a mountpoint that cannot or should not take a mount: a dead mount, a missing
    or live one, a directory with entries (unless `nonempty`: the mount would hide them), one whose
    earlier mount from `home` was detached lazily and still serves files open there."""
    seen = probe(path)
    if seen.state == DEAD:  # a FUSE mount whose process is gone
        raise MountError(f"{path} is a dead mount (its process ended): clear it with "
                         f"`dlfs umount {path}` (or `fusermount3 -u -z {path}`), then mount again")
    if seen.state == SILENT:  # each look below would wait for it for good
        if is_mount_point(path):
            raise MountError(f"{path} is a mount whose process does not answer ({seen.describe()}: stopped or "
                             f"stuck): take it off with `dlfs umount {path}`, then mount again")
        raise MountError(f"the file system at {path} does not answer ({seen.describe()})")
    if not path.exists():
        raise UsageError(f"mountpoint {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path):
        mine = read_record(mount_record(home, path)) if home is not None else None
        of = f" of {mine.dataset}, process {mine.pid}" if mine is not None and running(mine.pid) else ""
        raise MountError(f"{path} is already a mount point{of} (unmount it first)")
    with os.scandir(path) as entries:
        has_entries = next(entries, None) is not None
    if has_entries and not nonempty:
        raise UsageError(f"mountpoint {path} is not empty (the mount would hide what is there): use an empty "
                         "directory, or --nonempty to mount over it")
    earlier = read_record(mount_record(home, path)) if home is not None else None
    state = judge(earlier, mount_points()) if earlier is not None else None
    if state is not None and state.state == DETACHED:
        raise MountError(f"{path}: the mount of {state.record.dataset} there was detached lazily and its process "
                         f"{state.record.pid} still serves files open under it; mount again once it ends (`dlfs "
                         "mounts` shows it) or at another mountpoint")
    if state is not None and state.state == LIVE:  # mounted in the mount namespace of its process, not in ours
        raise MountError(f"{path} is already a mount point of {state.record.dataset} (process {state.record.pid}, in "
                         "another mount namespace)")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing: this machine cannot mount FUSE file systems")


def uring_memory() -> int:
    """What FUSE over io_uring holds at most: a queue per CPU, each with its payload buffers and the
    buffers of the records it reads from chunk files (native/engine.h)."""
    per_cpu = getattr(native, "URING_BYTES_PER_CPU", 0) if native is not None else 0
    return per_cpu * (os.cpu_count() or 1)


def want_direct_io(mode: str, dataset_bytes: int, bulk_file: int | None, memory: int) -> bool:
    """Whether files of DIRECT_IO_MIN or more are read past the kernel's page cache. `auto`: for a dataset
    of big files (half its bytes in files of DIRECT_IO_MIN or more: `bulk_file`, Index.bulk_file_size)
    bigger than the memory this mount may use, whose every epoch is cold anyway: the reader then copies
    each byte once, from the mount's cache, instead of the kernel caching it in 4 KiB pages first (big
    files cold 1.06-1.12x local disk against 0.75-0.78x, 6 rounds each, 2026-12-05); `on`, `off`: as said."""
    if mode != "auto":
        return mode == "on"
    return bulk_file is not None and bulk_file >= DIRECT_IO_MIN and dataset_bytes > memory


def _kernel_at_least(major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def big_files(bulk_file: int | None) -> bool:
    """Whether a dataset is one of big files: half its bytes in files of URING_BIG_FILES or more
    (`bulk_file`: Index.bulk_file_size). Its serving threads answer from /dev/fuse, free to move and
    never preempting a reader (native/engine.c), not on the reader's own CPU."""
    return bulk_file is not None and bulk_file >= URING_BIG_FILES


def want_io_uring(mode: str, param: Path = URING_PARAM, cache_size: int | None = None,
                  bulk_file: int | None = None) -> bool:
    """Whether the engine serves through FUSE over io_uring. `auto`: where the kernel has it, switching
    the fuse module's enable_uring on as root if it is off (it only lets daemons that ask use rings,
    as this one does; without it a request often wakes a thread on another CPU), unless its buffers
    would hold more than a quarter of `cache_size` (many CPUs, a small memory limit), or the dataset's
    dataset's bytes are mostly in files of `URING_BIG_FILES` or more (`bulk_file`: half of them in files
    at least that big, Index.bulk_file_size; a mean would let a few small files beside big shards
    decide); `on`: the same, or a one-line error; `off`: never."""
    if mode == "off":
        return False
    if mode == "auto" and bulk_file is not None and big_files(bulk_file):
        log.info("FUSE over io_uring stays off: half the dataset's bytes are in files of %s or more, and big "
                 "reads go faster from /dev/fuse, answered on another CPU while the reader copies (a ring "
                 "answers on the reader's own); --io-uring on to use it anyway", human_mib(bulk_file))
        return False
    if mode == "auto" and cache_size is not None and uring_memory() > cache_size // 4:
        log.info("FUSE over io_uring stays off: its buffers (%s for %d CPUs) would be over a quarter of the "
                 "cache (%s); serving from /dev/fuse (--io-uring on to use it anyway)",
                 human_bytes(uring_memory()), os.cpu_count() or 1, human_bytes(cache_size))
        return False
    try:
        if param.read_text().strip() in ("Y", "1"):
            return True
        param.write_text("Y")
    except OSError as exc:
        if mode == "auto":
            if param.exists():
                log.info("FUSE over io_uring is off (%s: %s): serving from /dev/fuse", param, exc.strerror)
            return False
        raise MountError(f"--io-uring on: cannot enable FUSE over io_uring ({param}: {exc.strerror}); it needs "
                         "Linux 6.14 or newer built with CONFIG_FUSE_IO_URING, and root") from None
    log.info("enabled FUSE over io_uring (%s = Y)", param)
    return True


async def hold_version(stack: AsyncExitStack, nursery: trio.Nursery, opts: MountOptions, info: VersionInfo,
                       label: str) -> None:
    """The mount's lease on its version in etcd, kept alive until it ends: a `dlfs rm` anywhere then
    hides the version but frees none of its chunks while this mount lives (or its machine does, for
    lease_ttl after). etcd down delays the lease (logged) and never stops the mount."""
    from dlfs.control.etcd import EtcdUnavailable
    from dlfs.control.plane import ControlPlane, Lease

    assert opts.cluster.etcd is not None
    control = ControlPlane(opts.cluster.etcd)
    stack.push_async_callback(control.aclose)
    node = opts.cluster.local or socket.gethostname()
    take = partial(control.hold_mount, info, node, str(opts.mountpoint))
    lease = Lease(control, f"mount of {label}", take)
    try:
        lease.id = await take()  # a version removed since it was looked up is refused here, in one line
        lease.taken.set()
    except EtcdUnavailable as exc:
        lease.lost = str(exc)
        log.warning("%s: no lease on it in etcd yet (%s); until one is taken a `dlfs rm` elsewhere could free "
                    "chunks this mount reads (retrying)", label, exc)
    stack.push_async_callback(lease.revoke)  # after the unmount (callbacks run last-in first-out)
    nursery.start_soon(lease.run, name="dlfs-mount-lease")


def _raise_read_ahead(dev: int) -> None:
    """Let the kernel send 1 MiB reads rather than 128 KiB ones, one ahead (best effort; needs root)."""
    knob = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        knob.write_text(str(READ_AHEAD_KB))
    except OSError as exc:
        log.info("could not raise %s: %s", knob, exc.strerror)


async def serve_mount(opts: MountOptions, ready: Callable[[str], None]) -> None:
    """Mount and serve until unmounted or signalled; `ready` is told once the mount is live."""
    # Asked for a stats sample before the writer listens, or after it stopped: not a reason to die.
    signal.signal(SAMPLE_NOW, signal.SIG_IGN)
    tighten_home(opts.home)  # its index cache, records and control socket: once, before any is made
    raise_open_files_limit()  # chunk files kept open (localchunks.open_files_budget) and connections
    arena = arena_for_cache(opts.cache_size)
    choice = choose_for(opts.cluster, arena, f"mount of {opts.dataset}")
    async with AsyncExitStack() as stack:
        # What must outlive every task (descriptors a task may still be sending): closed after the nursery.
        last: list[Callable[[], None]] = []
        stack.callback(lambda: [close() for close in reversed(last)])
        nursery = await stack.enter_async_context(open_nursery())
        client = ClusterClient(opts.cluster, nursery)
        await stack.enter_async_context(chunk_transport(client, choice, arena))
        nursery.start_soon(client.probe_failing, name="dlfs-probe-failing-nodes")
        meta, _ = await client.call_meta(Msg.GET_DATASET, {"name": opts.dataset, "version": opts.version})
        info = reply(VersionInfo, meta, Msg.GET_DATASET, META_DAEMON)
        index = Index(await fetch_index(client, info, opts.home))
        stack.callback(index.close)
        try:  # every READ and LOOKUP looks at it: a cold epoch should not wait on its pages
            index.pin()
        except OSError as exc:
            log.info("the index is not pinned in memory (%s): lookups may wait for the disk", exc.strerror or exc)
        # Not on 2 MiB pages under a memory limit: a slab (4 MiB and two pages) shares huge pages with its
        # neighbours, and one given back under pressure must free what it held (a small cgroup's bench
        # was OOM-killed on huge pages).
        cache = ChunkCache(index, client, opts.cache_size, opts.readahead, retry_timeout=opts.retry_timeout,
                           huge_pages=not opts.memory.limited)
        last.append(cache.close)
        if client.rdma is not None:  # RDMA READs land in the shared slabs: dlfs.direct stays zero-copy
            client.rdma.attach_arena(cache.slabs.arena, cache.slab_size)
        cache.fetcher.local = await open_local_chunks(client) if opts.short_circuit else None
        if cache.fetcher.local is not None:
            stack.callback(cache.fetcher.local.close)
            # Its chunk files opened behind the mount's start, in chunk order (an epoch's first files first).
            chunk_ids = [index.chunk(ci).id for ci in range(min(index.totals.chunks, cache.fetcher.local.open_files))]
            nursery.start_soon(cache.fetcher.local.open_ahead, chunk_ids, name="dlfs-open-chunk-files")
        if opts.cache_dir is not None:  # closed after the nursery: its writer finishes what is queued
            cache.fetcher.disk = DiskCache(opts.cache_dir, opts.cache_dir_size, cache.slab_size)
            last.append(cache.fetcher.disk.close)
        for i in range(PREFETCH_WORKERS):
            nursery.start_soon(cache.prefetch_worker, name=f"dlfs-prefetch-{i}")
        nursery.start_soon(cache.prefault_worker, name="dlfs-prefault")
        nursery.start_soon(watch_memory, cache, opts.memory, name="dlfs-memory-watch")
        label = f"{info.name}@{info.version}"
        set_context(f"dataset={label}")
        set_title(f"dlfs mount {label} {opts.mountpoint}", MOUNT_PROCESS_NAME)  # the version, now that it is known
        if opts.cluster.etcd is not None:
            await hold_version(stack, nursery, opts, info, label)
        ops = DlfsOperations(index, cache, label)
        totals = index.totals
        bulk_file = index.bulk_file_size() or None
        direct_io = want_direct_io(opts.direct_io, totals.bytes, bulk_file, opts.memory.effective)
        if direct_io:
            ops.direct_io_min = DIRECT_IO_MIN
            if native is not None:
                native.set_direct_io(DIRECT_IO_MIN)  # before INIT, whose reply it amends
            if opts.direct_io == "auto":
                log.info("%s: files of %s or more are read past the page cache: the dataset (%s) is bigger than "
                         "the memory this mount may use (%s), so each epoch is cold anyway (--direct-io off to "
                         "keep them in the page cache)", label, human_mib(DIRECT_IO_MIN), human_bytes(totals.bytes),
                         human_bytes(opts.memory.effective))
        control = None
        if cache.shared is not None:
            control = ControlServer(cache, index, label, opts.mountpoint,
                                    control_socket_path(opts.home, opts.mountpoint))
            last.append(control.close)
            await nursery.start(control.serve, name="dlfs-direct-control")
            ops.control_path = os.fsencode(control.path)
        mount_stats = MountStats(label, opts.mountpoint, ops, cache, client, control)
        await mount_stats.publish(nursery, opts.home, opts.metrics)
        options = {"ro", "default_permissions", "noatime", f"fsname=dlfs:{label}", "subtype=dlfs"}
        if opts.allow_other:
            options.add("allow_other")
        try:
            pyfuse3.init(ops, str(opts.mountpoint), options)
        except RuntimeError as exc:
            raise MountError(f"cannot mount {opts.mountpoint}: {exc}") from None
        # Still mounted when we leave unless the kernel ended the session (fusermount3 -u).
        signalled = False

        def unmount() -> None:
            pyfuse3.close(unmount=signalled or not ended_by_kernel)

        ended_by_kernel = False

        stack.callback(unmount)  # pyfuse3.close stops the engine and lets go of the index before index.close
        uring = want_io_uring(opts.io_uring, cache_size=opts.cache_size, bulk_file=bulk_file)
        local_dir = os.fsencode(cache.fetcher.local.chunk_dir) if cache.fetcher.local is not None else None
        bulk = big_files(bulk_file) and not uring
        if start_engine(index, cache.shared, ENGINE_ROW, TIMEOUT, opts.threads, uring, ops.control_path,
                        CONTROL_XATTR, local_dir, bulk=bulk):
            log.info("%s: %d native threads serve the mount%s%s; misses go to Python", label, opts.threads,
                     ", with FUSE over io_uring" if uring else
                     " on any CPU, never preempting a reader (a dataset of big files)" if bulk else "",
                     f", files of {human_mib(DIRECT_IO_MIN)} or more past the page cache" if direct_io else "")
            stack.callback(lambda: log.info("%s: native engine: %s", label, engine_stats()))
            cache.readers = miss_readers  # how many read: the random-order latch counts windows per reader
            # Scan mode's misses of other machines' chunks fetched by the serving threads themselves, over
            # TCP (an RDMA client reads through Python).
            disk_reads, ids = None, IndexChunkIds(index)  # (read from the index as asked)
            if cache.shared is not None and cache.fetcher.disk is not None:
                # Scan mode's records the disk cache holds read from its files by the serving threads.
                try:
                    disk_reads = DiskReads(cache.fetcher.disk, ids)
                except OSError as exc:
                    log.warning("disk cache %s: the serving threads cannot read it (%s): Python does", opts.cache_dir,
                                exc.strerror or exc)
            if disk_reads is not None:
                try:  # before the first READ: what it holds now
                    await trio.to_thread.run_sync(disk_reads.refresh)
                except (OSError, sqlite3.Error) as exc:
                    log.warning("disk cache %s: %s; the serving threads read it once it answers", opts.cache_dir, exc)
                cache.threads_read_disk = True
                nursery.start_soon(disk_reads.keep, name="dlfs-disk-reads")
            if (cache.shared is not None and client.rdma is None
                    and not (cache.fetcher.local is not None and len(client.cluster.data_nodes) == 1)):
                # (The last: one data node, and this machine is it: every chunk is read in place.)
                # Connections for the serving threads' fetches and the windows read-ahead lands in C (cache.py).
                remote = RemoteReads(client, ids, opts.threads + (os.cpu_count() or 1) * uring + PREFETCH_WORKERS,
                                     bound=cache.fetcher.replicas.latency.hedge_after,
                                     in_place=cache.fetcher.local.node if cache.fetcher.local is not None else None)
                if remote.learned:
                    cache.on_alone = remote.learn
                    log.info("%s: the serving threads' route is learned as chunks are read: making it whole for %d "
                             "chunks over %d data nodes would cost %d ranks (at most %d)", label, index.totals.chunks,
                             len(client.cluster.data_nodes), remote.work, ROUTE_WORK_MAX)
                mount_stats.remote = remote
                cache.threads_fetch = True
                nursery.start_soon(remote.keep, name="dlfs-remote-reads")
                if disk_reads is not None:  # and what they fetch goes to the disk cache too
                    disk_reads.start_keeping()
                    stack.callback(disk_reads.close)  # before the index closes: the keeper reads chunk ids
        else:
            log.info("%s: served by Python alone (pyfuse3): the native engine is not available", label)
        nursery.start_soon(cache.drain_consumed, name="dlfs-drain-consumed")
        nursery.start_soon(cache.unpark_stale, name="dlfs-unpark-stale")
        record = mount_record(opts.home, opts.mountpoint)

        async def announce() -> None:
            # A stat through the kernel proves the session answers; only then is the mount ready.
            st = await trio.to_thread.run_sync(os.stat, opts.mountpoint)
            _raise_read_ahead(st.st_dev)
            if direct_io and not _kernel_at_least(6, 6):
                log.warning("%s: --direct-io on Linux %s: files of %s or more cannot be mapped shared (mmap gives "
                            "ENODEV) before Linux 6.6", label, platform.release(), human_mib(DIRECT_IO_MIN))
            write_record(opts.home, MountRecord(
                pid=os.getpid(), mountpoint=str(opts.mountpoint), dataset=label, started=time.time(),
                pid_start=start_ticks(os.getpid()) or 0, cache_size=opts.cache_size,
                cache_dir=str(opts.cache_dir) if opts.cache_dir else None,
                cache_dir_size=opts.cache_dir_size if opts.cache_dir else None,
                log=str(opts.log_file) if opts.log_file else None))
            # Only ours: after `umount --lazy` a new mount on this mountpoint may have written its own.
            stack.callback(forget_record, record, os.getpid())
            log.info("mounted %s at %s (%d files, %d bytes)", label, opts.mountpoint, info.files, info.bytes)
            ready(f"mounted {label} at {opts.mountpoint} ({counted(info.files, 'file')}, {human_bytes(info.bytes)})")
            if uring:  # rings are registered once INIT is answered; a kernel that refuses says so at once
                with trio.move_on_after(URING_START):  # "off" until the engine has tried
                    while engine_stats().get("io_uring") == "off":
                        await trio.sleep(0.01)
                state = engine_stats().get("io_uring")
                if state not in ("registering", "serving"):
                    log.warning("%s: FUSE over io_uring did not start (%s): serving from /dev/fuse", label, state)

        async def on_signal() -> None:
            # SIGHUP as libfuse's own handlers take it (a terminal closed under a --foreground mount): an
            # unmount, not a dead mountpoint.
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                async for sig in signals:
                    log.info("%s: %s, unmounting", label, signal.Signals(sig).name)
                    nonlocal signalled
                    signalled = True
                    pyfuse3.terminate()
                    return

        nursery.start_soon(announce, name="dlfs-mount-announce")
        nursery.start_soon(on_signal, name="dlfs-mount-signals")
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        # main() returns when the kernel ended the session (fusermount3 -u) or after terminate().
        ended_by_kernel = not signalled
        log.info("%s: unmounted from %s; cache %s", label, opts.mountpoint, cache.stats())
        nursery.cancel_scope.cancel()


def busy_message(mountpoint: Path, users: list[Holder], shown: int = 5) -> str:
    """Why an unmount was refused, naming the processes in the way (as `fuser -m` would)."""
    if not users:
        who = "no process this command can see holds it (one of another user or mount namespace may)"
    else:
        who = "in use by " + ", ".join(h.describe() for h in users[:shown])
        if len(users) > shown:
            who += f" and {len(users) - shown} more"
    return (f"cannot unmount {mountpoint}: it is busy, {who}; stop them, or `dlfs umount --lazy {mountpoint}` "
            "detaches it now and its mount ends when the last of them closes its files")


class Unmounted(NamedTuple):
    users: list[Holder]  # processes still using it, detached lazily (their files still read)
    silent: str | None = None  # why its process was not waited for: it does not answer (stopped or stuck)


def unmount(home: Path, mountpoint: Path, timeout: float = 15.0, lazy: bool = False) -> Unmounted:
    """Unmount and wait for the mount process to finish; a dead mount (its process killed) is cleared,
    a silent one (its process stopped or stuck) detached without it. `lazy` detaches a busy mount at
    once (fusermount3 -u -z): the processes then still using it are returned, and its process, serving
    them, ends when the last closes its files (not waited for)."""
    mountpoint = mountpoint.absolute()
    found = read_record(mount_record(home, mountpoint))
    pid = found.pid if found is not None else None
    if not is_mount_point(mountpoint):
        raise NotFound(f"{mountpoint} {'is not mounted' if os.path.lexists(mountpoint) else 'does not exist'}")
    seen = probe(mountpoint)
    dead = seen.state == DEAD  # the process serving it is gone: nothing to wait for
    silent = seen.state == SILENT
    # Before detaching: a detached mount's open files no longer show under its mountpoint.
    users = holders(str(mountpoint)) if lazy and not dead else []
    # Lazily for a dead mount: whatever still has a file open there holds only an error now. And for a
    # silent one: what waits on it (the probe's own child, at least) keeps waiting until it runs again.
    cmd = ["fusermount3", "-u", *(["-z"] if dead or silent or lazy else []), str(mountpoint)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        msg = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        if "busy" in msg.lower():
            raise MountError(busy_message(mountpoint, holders(str(mountpoint))))
        raise MountError(f"cannot unmount {mountpoint}: {msg}")
    forget(mountpoint)
    if dead:
        log.info("cleared the dead mount at %s (its process %s was gone)", mountpoint, pid or "?")
        drop_record(home, mountpoint)
        return Unmounted([])
    if silent:  # stopped or stuck: it ends once it runs again, not within any wait here
        log.info("detached %s without its mount process %s, which does not answer (%s)", mountpoint, pid or "?",
                 seen.describe())
        # The mountpoint is free for a mount that answers; the silent process, once it runs, serves what
        # still holds its files and ends (its record, by then another's, is not its to remove).
        drop_record(home, mountpoint)
        return Unmounted(users, seen.describe())
    if users:
        log.info("detached %s lazily; process %s ends when %d processes using it close their files", mountpoint,
                 pid or "?", len(users))
        return Unmounted(users)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        if not running(pid):
            return Unmounted([])
        time.sleep(0.05)
    if pid:
        log.warning("mount process %d of %s still running %g s after unmount", pid, mountpoint, timeout)
    return Unmounted([])


__all__ = ["MountOptions", "Unmounted", "check_mountpoint", "errno", "local_mounts", "mount_record", "parse_dataset_ref",
           "serve_mount", "unmount"]
