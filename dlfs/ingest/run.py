"""One ingest, end to end: walk, pack and store chunks, upload the index, commit it atomically.

Nothing is visible until the metadata daemon commits the index, and it commits only once every
chunk the index names is stored on its replicas. An ingest that fails gives its session up, and the
metadata daemon frees the chunks it stored that nothing else needs. Packing is deterministic (sorted
walk, content-named chunks), so running a killed ingest again finds the chunks it already stored
and skips them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import trio

from dlfs.client.cluster import ClusterClient, rank
from dlfs.config import Cluster, NodeSpec, check_dataset_name
from dlfs.data.store import boot_id
from dlfs.errors import NO_ROOM, DlfsError, NotFound, ProtocolError, StorageFull, Unreachable, UsageError
from dlfs.format.chunk import MAX_CHUNK_SIZE, ChunkBuffer
from dlfs.format.index import HEADER, IndexWriter, header_body_sum
from dlfs.ingest.pack import Packed, Packer
from dlfs.ingest.source import LocalTree, Source
from dlfs.ingest.walk import Selection, Tree
from dlfs.private import private_dirs
from dlfs.tasks import open_nursery
from dlfs.wire.messages import META_DAEMON, DataStatus, IngestBegun, Missing, Staged, VersionInfo, reply
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
INDEX_PIECE = 8 << 20
UPLOADERS = 3
MIN_CHUNK_SIZE = 64 << 10
ABORT_WAIT = 30.0  # seconds a failed ingest waits for its session to be given up and its chunks freed
# Seconds a chunk being stored when the ingest stops (a failed sibling, a cancelled caller; not Ctrl-C,
# which stops at once) has to finish: what it started on a daemon (a staged file, a stored chunk) then
# belongs to the session before the session is given up, instead of landing after the abort.
DRAIN_WAIT = 10.0
DIRECT_ALIGN = 4096  # O_DIRECT's unit of length (and of the buffer's address: mmap'd buffers are page-aligned)
KEEPALIVE_DEFAULT = 60.0  # seconds between keepalives where the metadata daemon does not say its TTL


@dataclass
class IngestReport:
    info: VersionInfo
    tree_entries: int
    skipped: list[bytes]
    chunks_sent: int
    chunks_present: int
    bytes_sent: int
    seconds: float
    unchanged: bool = False  # the newest version already held exactly this: `info` is that version
    index_copies: int = 0  # metadata daemons that held the new version's index when the ingest returned
    index_wanted: int = 0  # ... of those it asked for (the cluster's replicas, at most its metadata daemons)


class _Stopped(Exception):
    """The packer thread's way out once its ingest has been cancelled."""


class Progress(Protocol):
    """What the caller's progress display is told: the totals once, then increments."""

    def start(self, files: int | None, nbytes: int | None) -> None:
        """The totals to come (None: not known until the end)."""
        ...

    def advance(self, files: int, nbytes: int) -> None: ...


def build_index(tree: Tree, extents: dict[int, tuple[int, int]], writer: IndexWriter) -> None:
    """Fill the inode and directory tables once every file's extents are known."""
    import stat as st

    writer.size_inodes(len(tree.nodes))  # a tree listed while it was packed grew after the writer was made
    for n in tree.nodes:
        if st.S_ISDIR(n.mode):
            ref, count = writer.add_dirents(n.children)
        elif st.S_ISLNK(n.mode):
            ref, count = writer.add_name(n.target)
        else:
            ref, count = extents.get(n.ino, (0, 0))
        writer.set_inode(n.ino, n.mode, n.uid, n.gid, n.nlink, n.size, n.mtime_ns, ref, count, n.parent)


def check_chunk_size(chunk_size: int) -> int:
    """The chunk size, if the chunk format allows it; else a UsageError naming the bounds."""
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size must be between {MIN_CHUNK_SIZE >> 10} KiB and {MAX_CHUNK_SIZE >> 20} MiB")
    return chunk_size


async def ingest(cluster: Cluster, src: str | Source, name: str, chunk_size: int = 8 << 20, compress: bool = False,
                 progress: Progress | None = None, tmp_dir: Path | None = None,
                 select: Selection | None = None, force: bool = False,
                 interrupt: Interrupt | None = None) -> IngestReport:
    """Ingest `src` as a new version of dataset `name`; unless `force`, a tree the newest version already
    holds exactly (same files, bytes and metadata) makes no new version: the report says `unchanged`.
    `interrupt`: fired by the caller before it cancels this for the user (Ctrl-C): then nothing is
    waited for, not even the chunks being stored (see DRAIN_WAIT)."""
    check_dataset_name(name)
    check_chunk_size(chunk_size)
    source = LocalTree(src) if isinstance(src, str) else src
    t0 = time.monotonic()
    async with open_nursery() as nursery:
        client = ClusterClient(cluster, nursery)
        meta, _ = await client.call_meta(Msg.BEGIN_INGEST, {"name": name})
        begun = reply(IngestBegun, meta, Msg.BEGIN_INGEST, META_DAEMON)
        session = begun.session
        keepalive = trio.CancelScope()
        nursery.start_soon(_keep_alive, client, session, begun.ttl, keepalive)
        nursery.start_soon(client.probe_failing, name="dlfs-probe-failing-nodes")  # chunks go to them again once back
        try:
            report = await _ingest(client, session, source, name, chunk_size, compress, progress, tmp_dir, select,
                                   force, interrupt)
        except BaseException:
            keepalive.cancel()
            with trio.CancelScope(shield=True), trio.move_on_after(ABORT_WAIT):
                await _abort(cluster, session)
            raise
        if report.unchanged:  # its pins go; every chunk it stored is the newest version's, so none is freed
            keepalive.cancel()
            await _abort(cluster, session)
        nursery.cancel_scope.cancel()
    report.seconds = time.monotonic() - t0
    return report


class Interrupt:
    """Ctrl-C for an ingest: its caller fires it, then cancels the ingest. The chunks being stored are
    shielded from a cancel (see DRAIN_WAIT), but their connections are not: firing cancels them at once,
    before the connections close under them."""

    def __init__(self) -> None:
        self.fired = False
        self.storing: set[trio.CancelScope] = set()

    def fire(self) -> None:
        self.fired = True
        for scope in self.storing:
            scope.cancel()


async def _keep_alive(client: ClusterClient, session: str, ttl: float, scope: trio.CancelScope) -> None:
    """Touch the session well within its TTL, so that a slow walk, source or commit never outlives it
    (a killed ingest's session then expires in minutes)."""
    every = max(ttl / 4, 0.1) if ttl else KEEPALIVE_DEFAULT
    with scope:
        while True:
            await trio.sleep(every)
            try:
                await client.call_meta(Msg.PIN_CHUNKS, {"session": session, "ids": []}, timeout=max(every, 5.0))
            except DlfsError as exc:  # the ingest's own calls meet whatever this is, and report it
                log.info("ingest session %s: keepalive failed: %s", session, exc)


async def _abort(cluster: Cluster, session: str) -> None:
    """Give an ingest session up: its pins go, and the chunks nothing else needs are freed (best effort;
    in a cluster whose etcd is down, the session's metadata daemon finishes it once etcd answers)."""
    # A client of its own: when the ingest was cancelled from outside (Ctrl-C), the ingest's
    # connections live in a cancelled nursery and close under the call.
    try:
        async with open_nursery() as nursery:
            await ClusterClient(cluster, nursery).call_meta(Msg.ABORT_INGEST, {"session": session}, timeout=ABORT_WAIT)
            nursery.cancel_scope.cancel()
    except Exception as exc:  # the ingest's own error is the one to report
        log.info("could not abort ingest session %s: %s", session, exc)


async def _ingest(client: ClusterClient, session: str, source: Source, name: str, chunk_size: int, compress: bool,
                  progress: Progress | None, tmp_dir: Path | None, select: Selection | None,
                  force: bool, interrupt: Interrupt | None = None) -> IngestReport:
    # Abandoned on cancel (Ctrl-C): a walk of millions of files must not hold the ingest up.
    tree = await trio.to_thread.run_sync(source.walk, select, abandon_on_cancel=True)
    if progress:
        if source.streamed:  # listed as it is read (tar shards): the totals are known at the end
            progress.start(None, None)
        else:
            files = tree.files
            progress.start(len(files), sum(f.size for f in files))
    writer = IndexWriter(len(tree.nodes), chunk_size, time.time_ns())
    # Chunk buffers are reused: a pool bounds memory and makes the packer wait for the uploaders.
    pool: queue.Queue[ChunkBuffer] = queue.Queue()
    for _ in range(UPLOADERS + 2):
        pool.put(mmap.mmap(-1, chunk_size))  # page-aligned: a local daemon's copy is written with O_DIRECT
    send, recv = trio.open_memory_channel[Packed](0)
    stats = {"sent": 0, "present": 0, "bytes": 0}
    local = LocalStores(client)
    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()

    def emit(p: Packed) -> None:
        if stop.is_set():
            raise _Stopped()
        trio.from_thread.run(send.send, p, trio_token=token)

    def tick(nfiles: int, nbytes: int) -> None:
        if progress:
            progress.advance(nfiles, nbytes)

    interrupt = interrupt or Interrupt()
    storing = interrupt.storing  # the chunks being stored now, each shielded (see DRAIN_WAIT)
    drained = trio.CancelScope()  # bound_drain's, cancelled by the last uploader to finish
    uploading = [UPLOADERS]

    async def upload(recv: trio.MemoryReceiveChannel[Packed]) -> None:
        try:
            await upload_all(recv)
        finally:
            uploading[0] -= 1
            if not uploading[0]:
                drained.cancel()

    async def upload_all(recv: trio.MemoryReceiveChannel[Packed]) -> None:
        async with recv:
            # Once the ingest stops, the next receive raises Cancelled: no store starts after that, and
            # one under way is in `storing` (added before its first checkpoint) when bound_drain bounds it.
            async for p in recv:
                try:
                    with trio.CancelScope(shield=True) as scope:
                        storing.add(scope)
                        if interrupt.fired:
                            scope.cancel()
                        try:
                            await _store_chunk(client, session, p, stats, local)
                        finally:
                            storing.discard(scope)
                finally:
                    pool.put(p.buf)

    async def bound_drain() -> None:
        with drained:
            try:
                await trio.sleep_forever()
            finally:  # the ingest stops (or finished): what is still being stored has DRAIN_WAIT left,
                for scope in storing:  # or none after Ctrl-C, whichever step the ingest was at
                    if interrupt.fired:
                        scope.cancel()
                    else:
                        scope.deadline = min(scope.deadline, trio.current_time() + DRAIN_WAIT)

    def pack() -> dict[int, tuple[int, int]]:
        return Packer(source, tree, writer, chunk_size, compress, pool, emit, tick).run()

    async with open_nursery() as n:
        n.start_soon(bound_drain)
        for _ in range(UPLOADERS):
            n.start_soon(upload, recv.clone())
        recv.close()
        async with send:
            # Abandoned on cancel (Ctrl-C) rather than waited for, which would pack the whole
            # tree first; the packer stops at its next chunk.
            try:
                extents = await trio.to_thread.run_sync(pack, abandon_on_cancel=True)
            except BaseException as exc:
                stop.set()
                # Ctrl-C stops at once: no store is waited for (its connections are being torn down).
                if isinstance(exc, KeyboardInterrupt):
                    interrupt.fire()
                raise
    build_index(tree, extents, writer)
    newest = None if force else await _holding(client, name, writer.body_sum())
    info = newest or await commit_index(client, session, writer, tmp_dir)
    copies, wanted = (0, 0) if newest is not None else await spread_index(client, info)
    return IngestReport(info, len(tree.nodes), tree.skipped, stats["sent"], stats["present"], stats["bytes"], 0.0,
                        unchanged=newest is not None, index_copies=copies, index_wanted=wanted)


async def spread_index(client: ClusterClient, info: VersionInfo) -> tuple[int, int]:
    """(metadata daemons that hold the new version's index, how many were wanted): asked in turn until the
    cluster's replicas of them do. A daemon asked for a version fetches its index from the one that committed
    it, as it would by itself a moment later; until one has, that index is on one node only, and a mount would
    find no daemon to send it once that node stopped (n1 frozen right after an ingest: its mounts failed with
    "no metadata daemon could send the index"). So an ingest returns with its index on as many nodes as each
    of its chunks."""
    wanted = min(client.cluster.replicas, len(client.cluster.meta_nodes))
    copies = 0
    for spec in client.meta_nodes():  # failing ones last
        if copies >= wanted:
            break
        try:
            await client.call(spec, "meta", Msg.GET_DATASET, {"name": info.name, "version": info.version})
        except DlfsError as exc:
            log.info("the index of %s@%d is not on %s yet: %s", info.name, info.version, spec.name, exc)
            continue
        copies += 1
    return copies, wanted


async def _holding(client: ClusterClient, name: str, body_sum: int) -> VersionInfo | None:
    """The newest version of `name` if its index has this body (the same tree), else None."""
    try:
        meta, _ = await client.call_meta(Msg.GET_DATASET, {"name": name})
    except NotFound:
        return None
    newest = reply(VersionInfo, meta, Msg.GET_DATASET, META_DAEMON)
    _, head = await client.call_meta(Msg.READ_INDEX, {"name": name, "version": newest.version, "offset": 0,
                                                      "length": HEADER.size})
    return newest if header_body_sum(bytes(head)) == body_sum else None


async def _store_chunk(client: ClusterClient, session: str, p: Packed, stats: dict[str, int],
                       local: LocalStores) -> None:
    """Pin the chunk (so no collection takes it), then store it on R nodes: its placed nodes, or,
    for each placed node that is down or whose disk is full, the next node of its rank (as repair
    would; readers look there next)."""
    await client.call_meta(Msg.PIN_CHUNKS, {"session": session, "ids": [p.cid]})
    # A node that failed lately (down, frozen, cut off) is passed over as a down one is, until it answers a
    # probe again: each chunk placed on it waited its connect bound (10 s) first, one after another.
    candidates = sorted(rank(p.cid, client.cluster.data_nodes), key=lambda s: client.failing(s.name))
    want = client.cluster.replicas
    stored: list[str] = []
    errors: list[str] = []
    full: list[str] = []

    async def put(spec: NodeSpec) -> None:
        try:
            meta, _ = await client.call(spec, "data", Msg.HAS_CHUNKS, {"ids": [p.cid]})
            if reply(Missing, meta, Msg.HAS_CHUNKS, spec.name).missing:
                if why := client.full(spec.name):  # said so a moment ago: not sent again for nothing
                    full.append(why)
                    return
                if not (await local.here(spec) and await local.put(spec, p)):
                    await client.call(spec, "data", Msg.PUT_CHUNK, {"id": p.cid}, p.data, timeout=120)
                stats["sent"] += 1
                stats["bytes"] += len(p.data)
            else:
                stats["present"] += 1
            stored.append(spec.name)
        except StorageFull as exc:
            why = f"{spec.name}: {exc}"
            full.append(why)
            if client.mark_full(spec.name, why) and len(client.cluster.data_nodes) > want:  # else the error says it
                log.warning("data node %s is full (%s): chunks go to the next nodes of their rank", spec.name, exc)
        except Unreachable as exc:
            errors.append(str(exc))

    while len(stored) < want and candidates:
        batch, candidates = candidates[: want - len(stored)], candidates[want - len(stored) :]
        async with open_nursery() as n:
            for spec in batch:
                n.start_soon(put, spec)
    if len(stored) < want:
        why = f"chunk {p.cid.hex()}: stored on {len(stored)} of {want} nodes ({'; '.join(errors + full)})"
        raise StorageFull(why) if full and not errors else Unreachable(why)


class LocalStores:
    """The data daemons on this machine, which take a chunk as a file written straight into their
    store (STAGE_CHUNK, PUT_STAGED) rather than through a loopback socket: no copies into and out of
    the kernel's socket buffers, no second hash (the packer's is trusted: nothing came between)."""

    def __init__(self, client: ClusterClient) -> None:
        self.client = client
        self.known: dict[str, bool] = {}  # node name -> whether it takes staged chunks from here
        self.lock = trio.Lock()

    async def here(self, spec: NodeSpec) -> bool:
        async with self.lock:  # one STATUS per node, not one per chunk in flight
            if spec.name not in self.known:
                try:
                    meta, _ = await self.client.call(spec, "data", Msg.STATUS, timeout=10.0)
                    status = reply(DataStatus, meta, Msg.STATUS, spec.name)
                    # The same boot id proves the same machine: a path that merely exists here is not enough.
                    self.known[spec.name] = bool(status.boot_id) and status.boot_id == boot_id()
                except DlfsError as exc:
                    log.info("chunks go to %s over its socket: %s", spec.name, exc)
                    self.known[spec.name] = False
            return self.known[spec.name]

    async def put(self, spec: NodeSpec, p: Packed) -> bool:
        """Store `p` on `spec` through a staged file; False if this cannot be done (a daemon of another
        user, or of an older dlfs, or a full disk), and the caller sends it instead."""
        try:
            meta, _ = await self.client.call(spec, "data", Msg.STAGE_CHUNK, {"id": p.cid})
        except ProtocolError as exc:  # a daemon that does not know the message
            return self._cannot(spec, str(exc))
        path = reply(Staged, meta, Msg.STAGE_CHUNK, spec.name).path
        try:
            await trio.to_thread.run_sync(_write_staged, path, p.data)
        except PermissionError as exc:
            return self._cannot(spec, f"cannot write its files ({exc.strerror})")
        except OSError as exc:
            if exc.errno in NO_ROOM:  # sent instead: the daemon finds it full, and says so
                return False
            raise Unreachable(f"cannot write chunk {p.cid.hex()} into {spec.name}'s store: {exc.strerror}") from None
        await self.client.call(spec, "data", Msg.PUT_STAGED, {"id": p.cid, "path": path, "size": len(p.data)},
                               timeout=120)
        return True

    def _cannot(self, spec: NodeSpec, why: str) -> bool:
        log.info("chunks go to %s over its socket: %s", spec.name, why)
        self.known[spec.name] = False
        return False


def _write_staged(path: str, data: memoryview) -> None:
    """The chunk into the daemon's staged file; on a failure the file is emptied (a full disk gets its
    room back at once) and the daemon removes it later.

    Its aligned part goes with O_DIRECT where the file system takes it, from the page-aligned chunk
    buffer to the disk: copying it into fresh page-cache pages cost this VM more CPU than packing it
    (first touch of new memory), and an ingest bigger than memory then leaves the page cache alone.
    The tail, and everything where O_DIRECT is refused, is written through the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        done = 0
        aligned = len(data) - len(data) % DIRECT_ALIGN
        if aligned:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                while done < aligned:
                    done += os.write(fd, data[done:aligned])
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here, or a buffer it cannot take
                    raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
    except OSError:
        os.ftruncate(fd, 0)
        raise
    finally:
        os.close(fd)


async def commit_index(client: ClusterClient, session: str, writer: IndexWriter, tmp_dir: Path | None) -> VersionInfo:
    """Write the index, upload it in pieces to the session's metadata daemon, and commit it."""
    if tmp_dir is not None:
        private_dirs(tmp_dir)  # a client that never ran a node has no home yet
    with tempfile.TemporaryFile(dir=tmp_dir) as f:
        checksum, size = await trio.to_thread.run_sync(_write_index, writer, f, tmp_dir)
        f.seek(0)
        offset = 0
        while piece := await trio.to_thread.run_sync(f.read, INDEX_PIECE):
            await client.call_meta(Msg.PUT_INDEX, {"session": session, "offset": offset}, piece)
            offset += len(piece)
    meta, _ = await client.call_meta(Msg.COMMIT, {"session": session, "size": size, "checksum": checksum}, timeout=300)
    return reply(VersionInfo, meta, Msg.COMMIT, META_DAEMON)


def _write_index(writer: IndexWriter, f: BinaryIO, where: Path | None) -> tuple[int, int]:
    """The index into `f`, flushed; returns its checksum and size. A full local disk is StorageFull."""
    try:
        checksum = writer.write(f)
        f.flush()
        return checksum, f.tell()
    except OSError as exc:
        place = where if where is not None else tempfile.gettempdir()
        if exc.errno in NO_ROOM:
            raise StorageFull(f"cannot write the index locally: the disk is full at {place}") from None
        raise DlfsError(f"cannot write the index locally at {place}: {exc.strerror}") from None


__all__ = ["IngestReport", "Progress", "check_chunk_size", "ingest"]
