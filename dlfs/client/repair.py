"""Checking and healing replicas: which chunks the live datasets need, whether R good copies of each
exist on reachable data nodes (`verify`), and copying from a good one until they do (`repair`).
Each metadata daemon checks its own index files too (`check_indexes`); a damaged one is reported, the
rest still checked, and repair puts a peer's good copy in its place where one exists.

A good copy may live on any data node. Repair places a missing one on the first nodes of the
chunk's rendezvous rank that lack it, so it lands back on its placed node when that node is up, and
further down the rank (where readers look next) when it is not.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from dlfs.client.cluster import ClusterClient, rank
from dlfs.config import NodeSpec
from dlfs.errors import CorruptData, DlfsError, NotFound, StorageFull, Unreachable
from dlfs.format.chunk import verify_chunk
from dlfs.format.index import Index
from dlfs.tasks import open_nursery
from dlfs.wire.messages import META_DAEMON, DatasetList, IndexesChecked, Stored, Verified, VersionInfo, reply
from dlfs.wire.protocol import MAX_DATA, Msg

log = logging.getLogger(__name__)
BATCH_IDS = 512  # chunk ids per VERIFY_CHUNKS: keeps its reply (reasons included) far below MAX_META
BATCH_BYTES = 256 << 20  # chunk bytes per VERIFY_CHUNKS: the daemon reads them all before it answers
VERIFY_IN_FLIGHT = 2  # batches per node at once
REPAIR_IN_FLIGHT = 8  # chunks being copied at once, and at most
REPAIR_BYTES = 512 << 20  # this many bytes of them in memory
READ_PIECE = 64 << 20
CHECK_BATCH = 256  # versions per CHECK_INDEXES: keeps its request far below MAX_META
MIN_RATE = 20e6  # bytes/s a daemon must at least manage: the time bounds of big transfers follow from it


def _bound(nbytes: int) -> float:
    """Seconds allowed for a call that moves or reads `nbytes`."""
    return 30.0 + nbytes / MIN_RATE


@dataclass
class ChunkInfo:
    """A chunk some live dataset version needs: its size, and which versions name it."""

    size: int
    datasets: set[str] = field(default_factory=set)  # "name@version"

    def label(self, most: int = 3) -> str:
        names = sorted(self.datasets)
        more = f" +{len(names) - most} more" if len(names) > most else ""
        return ", ".join(names[:most]) + more


class Progress(Protocol):
    """What a progress display is told: the totals once, then increments."""

    def start(self, items: int, nbytes: int) -> None: ...

    def advance(self, items: int, nbytes: int) -> None: ...


async def live_versions(client: ClusterClient, name: str | None = None,
                        version: int | None = None) -> list[VersionInfo]:
    """The live dataset versions: all of them, every version of `name`, or `name@version`.

    NotFound when a named dataset or version does not exist.
    """
    if name is not None and version is not None:
        meta, _ = await client.call_meta(Msg.GET_DATASET, {"name": name, "version": version}, timeout=30)
        return [reply(VersionInfo, meta, Msg.GET_DATASET, META_DAEMON)]
    meta, _ = await client.call_meta(Msg.LIST_DATASETS, timeout=30)
    versions = [v for v in reply(DatasetList, meta, Msg.LIST_DATASETS, META_DAEMON).datasets if not v.removed]
    if name is not None:
        versions = [v for v in versions if v.name == name]
        if not versions:
            raise NotFound(f"no dataset named {name!r} (see `dlfs datasets`)")
    return versions


@dataclass
class IndexReport:
    """What the metadata daemons said of their index files of the live versions."""

    damaged: dict[str, str] = field(default_factory=dict)  # "name@version" -> why (on which daemons)
    intact_elsewhere: set[str] = field(default_factory=set)  # damaged on one daemon, good on another
    restored: list[str] = field(default_factory=list)  # "name@version on node"
    unchecked: dict[str, str] = field(default_factory=dict)  # metadata daemon -> why it could not check


async def check_indexes(client: ClusterClient, versions: list[VersionInfo], restore: bool = False) -> IndexReport:
    """Ask every metadata daemon whether its index files of `versions` are the ones committed (and,
    with `restore`, to replace a damaged one with a peer's good copy)."""
    out = IndexReport()
    # A silent daemon is left after SILENT_AFTER, not after its handshake's longer bound.
    metas, out.unchecked = await client.answering(client.cluster.meta_nodes, "meta")
    bad: dict[str, dict[str, str]] = {}  # label -> node -> why
    answered: dict[str, set[str]] = {}  # node -> labels it checked

    async def ask(spec: NodeSpec) -> None:
        for i in range(0, len(versions), CHECK_BATCH):
            batch = versions[i : i + CHECK_BATCH]
            refs = [{"name": v.name, "version": v.version} for v in batch]
            try:
                meta, _ = await client.call(spec, "meta", Msg.CHECK_INDEXES, {"versions": refs, "restore": restore},
                                            timeout=_bound(2 * sum(v.index_size for v in batch)))
            except DlfsError as exc:
                out.unchecked[spec.name] = str(exc)
                return
            got = reply(IndexesChecked, meta, Msg.CHECK_INDEXES, spec.name)
            for label, why in got.damaged.items():
                bad.setdefault(label, {})[spec.name] = why
            out.restored += [f"{label} on {spec.name}" for label in got.restored]
            answered.setdefault(spec.name, set()).update(f"{v.name}@{v.version}" for v in batch)

    async with open_nursery() as n:
        for spec in metas:
            n.start_soon(ask, spec)
    for label, where in sorted(bad.items()):
        whys = [f"{why} (on {node})" if len(client.cluster.meta_nodes) > 1 else why for node, why in sorted(where.items())]
        out.damaged[label] = "; ".join(whys)
        if any(label in labels for node, labels in answered.items() if node not in where):
            out.intact_elsewhere.add(label)
    out.restored.sort()
    return out


def _read_chunk_table(path: Path) -> list[tuple[bytes, int]]:
    index = Index(path)
    try:
        return [(ref.id, ref.size) for ref in (index.chunk(i) for i in range(index.totals.chunks))]
    finally:
        index.close()


async def dataset_chunks(client: ClusterClient, home: Path, versions: list[VersionInfo] | None = None,
                         unreadable: dict[str, str] | None = None) -> dict[bytes, ChunkInfo]:
    """Every chunk the given versions (default: every live one) reference, with their sizes and
    the versions that name each; the indexes are fetched into the local index cache. With
    `unreadable`, a version whose index no metadata daemon can send intact is left out and noted
    there ("name@version" -> why) rather than raised."""
    from dlfs.client.indexes import fetch_index  # the mount's index cache, shared with it

    if versions is None:
        versions = await live_versions(client)
    # Each metadata daemon on its own, for a good copy where the first one's is damaged.
    views = [ClusterClient(dataclasses.replace(client.cluster, nodes=[spec]), client.nursery)
             for spec in client.meta_nodes()] if unreadable is not None and len(client.cluster.meta_nodes) > 1 else [client]
    chunks: dict[bytes, ChunkInfo] = {}
    for v in versions:
        label = f"{v.name}@{v.version}"
        errors: list[str] = []
        for view in views:
            try:
                path = await fetch_index(view, v, home)
                break
            except CorruptData as exc:
                if unreadable is None:
                    raise
                errors.append(str(exc))
        else:
            assert unreadable is not None
            unreadable[label] = "; ".join(errors)
            continue
        table = await trio.to_thread.run_sync(_read_chunk_table, path)
        for cid, size in table:
            chunks.setdefault(cid, ChunkInfo(size)).datasets.add(label)
    return chunks


async def presence(client: ClusterClient, ids: list[bytes], nodes: list[NodeSpec]) -> tuple[dict[bytes, list[str]], list[str]]:
    """ClusterClient.holders over `nodes` only (those known to be up), so that nodes already known
    to be down are not asked again; a node failing now lands in the second list, holding nothing."""
    view = ClusterClient(dataclasses.replace(client.cluster, nodes=nodes), client.nursery)
    held, failed = await view.holders(ids)
    if failed:
        gone = set(failed)
        held = {c: [n for n in names if n not in gone] for c, names in held.items()}
    return held, failed


@dataclass
class Census:
    """The live versions, their chunks, and those stored on fewer than R reachable nodes (by
    presence alone: what `dlfs status` can afford; `verify` reads them)."""

    versions: list[VersionInfo] = field(default_factory=list)
    chunks: dict[bytes, ChunkInfo] = field(default_factory=dict)
    short: dict[bytes, list[str]] = field(default_factory=dict)  # chunk -> the nodes holding it
    error: str = ""  # why the datasets could not be listed


async def census(client: ClusterClient, up: list[NodeSpec], home: Path) -> Census:
    """A Census asking only the nodes in `up` (those that just answered): nodes known to be down
    are not waited for again, and their copies do not count."""
    out = Census()
    view = ClusterClient(dataclasses.replace(client.cluster, nodes=up), client.nursery)
    if not view.cluster.meta_nodes:
        out.error = "no metadata daemon answered"
        return out
    try:
        out.versions = await live_versions(view)
        out.chunks = await dataset_chunks(view, home, out.versions)
        held, _ = await presence(view, sorted(out.chunks), view.cluster.data_nodes)
    except DlfsError as exc:
        out.error = str(exc)
        return out
    out.short = {c: nodes for c, nodes in held.items() if len(nodes) < client.cluster.replicas}
    return out


@dataclass(frozen=True)
class BadReplica:
    node: str
    chunk: bytes
    reason: str


@dataclass
class VerifyReport:
    """What verify found: for each chunk the reachable nodes with a good copy, every bad copy,
    and the data nodes that could not be checked."""

    replicas: int
    good: dict[bytes, list[str]]
    bad: list[BadReplica] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    replicas_checked: int = 0
    bytes_checked: int = 0

    @property
    def missing(self) -> list[bytes]:
        """Chunks with no good copy on any reachable node."""
        return sorted(c for c, nodes in self.good.items() if not nodes)

    @property
    def under_replicated(self) -> list[bytes]:
        """Chunks with at least one but fewer than R good copies."""
        return sorted(c for c, nodes in self.good.items() if 0 < len(nodes) < self.replicas)

    def needs_repair(self) -> list[bytes]:
        """Chunks with a bad copy or fewer than R good ones."""
        bad = {b.chunk for b in self.bad}
        return sorted(c for c, nodes in self.good.items() if c in bad or len(nodes) < self.replicas)

    @property
    def healthy(self) -> bool:
        return not self.bad and not self.missing and not self.under_replicated


async def verify(client: ClusterClient, chunks: dict[bytes, ChunkInfo],
                 progress: Progress | None = None) -> VerifyReport:
    """Read and check every copy of every chunk on every reachable data node."""
    nodes, unreachable = await client.answering(client.cluster.data_nodes)
    report = VerifyReport(client.cluster.replicas, {c: [] for c in chunks}, unreachable=unreachable)
    ids = sorted(chunks)
    held, failed = await presence(client, ids, nodes)
    for name in failed:
        report.unreachable.setdefault(name, "stopped answering")
    by_node: dict[str, list[bytes]] = {s.name: [] for s in nodes if s.name not in report.unreachable}
    for cid, names in held.items():
        for name in names:
            if name in by_node:
                by_node[name].append(cid)
    if progress is not None:
        progress.start(sum(map(len, by_node.values())),
                       sum(chunks[c].size for held_ids in by_node.values() for c in held_ids))

    async def check_batch(spec: NodeSpec, batch: list[bytes], limiter: trio.CapacityLimiter) -> None:
        nbytes = sum(chunks[c].size for c in batch)
        async with limiter:
            if spec.name in report.unreachable:
                return
            try:
                meta, _ = await client.call(spec, "data", Msg.VERIFY_CHUNKS, {"ids": batch}, timeout=_bound(nbytes))
            except Unreachable as exc:
                report.unreachable.setdefault(spec.name, str(exc))
                return
        bad = reply(Verified, meta, Msg.VERIFY_CHUNKS, spec.name).bad
        for cid in batch:
            reason = bad.get(cid.hex())
            if reason is None:
                report.good[cid].append(spec.name)
            else:
                report.bad.append(BadReplica(spec.name, cid, reason.removeprefix(f"chunk {cid.hex()}: ")))
        report.replicas_checked += len(batch)
        report.bytes_checked += nbytes
        if progress is not None:
            progress.advance(len(batch), nbytes)

    async with open_nursery() as n:
        for spec in nodes:
            limiter = trio.CapacityLimiter(VERIFY_IN_FLIGHT)
            for batch in _batches(by_node.get(spec.name, []), chunks):
                n.start_soon(check_batch, spec, batch, limiter)
    # A node lost partway holds no copy we can count on.
    lost = set(report.unreachable)
    for cid, names in report.good.items():
        order = {s.name: i for i, s in enumerate(rank(cid, client.cluster.data_nodes))}
        report.good[cid] = sorted((nm for nm in names if nm not in lost), key=order.__getitem__)
    report.bad = sorted((b for b in report.bad if b.node not in lost), key=lambda b: (b.chunk, b.node))
    return report


def _batches(ids: list[bytes], chunks: dict[bytes, ChunkInfo]) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    batch: list[bytes] = []
    nbytes = 0
    for cid in ids:
        size = chunks[cid].size
        if batch and (len(batch) >= BATCH_IDS or nbytes + size > BATCH_BYTES):
            out.append(batch)
            batch, nbytes = [], 0
        batch.append(cid)
        nbytes += size
    if batch:
        out.append(batch)
    return out


@dataclass
class RepairReport:
    """What repair did, and what it could not do."""

    copied: list[tuple[bytes, str, str]] = field(default_factory=list)  # (chunk, from, to)
    removed: list[tuple[bytes, str]] = field(default_factory=list)  # (chunk, node): bad copies deleted
    unhealed: dict[bytes, str] = field(default_factory=dict)  # chunk -> why
    healthy: int = 0  # chunks with R good copies at the end


async def repair(client: ClusterClient, chunks: dict[bytes, ChunkInfo], report: VerifyReport,
                 progress: Progress | None = None) -> RepairReport:
    """Bring every chunk of `report` back to R good copies on reachable nodes: delete its bad
    copies and copy a good one (read whole, checked here) to the first nodes of its rank that lack
    one. A chunk with no good copy anywhere keeps its bad copies (their intact records still serve
    reads) and is reported as unhealed."""
    out = RepairReport()
    todo = report.needs_repair()
    biggest = max((chunks[c].size for c in todo), default=0)
    limiter = trio.CapacityLimiter(max(1, min(REPAIR_IN_FLIGHT, REPAIR_BYTES // max(biggest, 1))))
    out.healthy = len(report.good) - len(todo)
    bad_on: dict[bytes, list[BadReplica]] = {}
    for b in report.bad:
        bad_on.setdefault(b.chunk, []).append(b)
    if progress is not None:
        progress.start(len(todo), sum(chunks[c].size for c in todo))

    async def heal(cid: bytes) -> None:
        async with limiter:
            await _heal_chunk(client, cid, chunks[cid], list(report.good[cid]), bad_on.get(cid, []),
                              set(report.unreachable), out)
        if progress is not None:
            progress.advance(1, chunks[cid].size)

    async with open_nursery() as n:
        for cid in todo:
            n.start_soon(heal, cid)
    out.copied.sort()
    out.removed.sort()
    return out


async def _read_good_copy(client: ClusterClient, cid: bytes, size: int,
                          sources: list[str]) -> tuple[bytes | bytearray | None, str, dict[str, str]]:
    """The whole chunk from the first source whose bytes check out here: (bytes, node, {node: why}
    for the sources that failed)."""
    errors: dict[str, str] = {}
    for name in sources:
        spec = client.cluster.node(name)
        try:
            buf = bytearray()
            while len(buf) < size:
                length = min(READ_PIECE, MAX_DATA, size - len(buf))
                piece = await client.read_from(spec, cid, len(buf), length, timeout=_bound(length))
                if not piece:
                    raise CorruptData(f"chunk {cid.hex()} ends at {len(buf)} of {size} bytes")
                buf += piece
            await trio.to_thread.run_sync(verify_chunk, buf, cid)
            return buf, name, errors
        except (Unreachable, NotFound, CorruptData) as exc:
            log.warning("repair: cannot use the copy of chunk %s on %s: %s", cid.hex(), name, exc)
            errors[name] = str(exc)
    return None, "", errors


async def _heal_chunk(client: ClusterClient, cid: bytes, info: ChunkInfo, good: list[str],
                      bad: list[BadReplica], unreachable: set[str], out: RepairReport) -> None:
    want = client.cluster.replicas
    hint = f" (unreachable nodes {', '.join(sorted(unreachable))} may hold one)" if unreachable else ""
    if not good:
        kept = f"; kept the bad copies on {', '.join(b.node for b in bad)}" if bad else ""
        out.unhealed[cid] = f"no good copy on any reachable node: its data is lost{hint}{kept}"
        return
    data: bytes | bytearray | None = None
    source = ""
    failed: dict[str, str] = {}
    if len(good) < want:
        # Read before deleting anything: if no copy can be read, the bad ones stay.
        data, source, failed = await _read_good_copy(client, cid, info.size, good)
        if data is None:
            out.unhealed[cid] = f"no good copy could be read ({'; '.join(f'{k}: {v}' for k, v in failed.items())})"
            return
    # A copy that failed just now is no longer counted, nor written over.
    good = [g for g in good if g not in failed]
    skip = set(unreachable) | set(good) | set(failed)
    for b in bad:
        try:
            await client.call(client.cluster.node(b.node), "data", Msg.DELETE_CHUNKS, {"ids": [cid]}, timeout=30)
            out.removed.append((cid, b.node))
        except DlfsError as exc:
            log.warning("repair: cannot delete the bad copy of chunk %s on %s: %s", cid.hex(), b.node, exc)
            skip.add(b.node)
    have = list(good)
    errors: list[str] = []
    if data is not None:
        for spec in rank(cid, client.cluster.data_nodes):
            if len(have) >= want:
                break
            if spec.name in skip:
                continue
            try:
                meta, _ = await client.call(spec, "data", Msg.PUT_CHUNK, {"id": cid}, data, timeout=_bound(len(data)))
                if reply(Stored, meta, Msg.PUT_CHUNK, spec.name).stored:
                    out.copied.append((cid, source, spec.name))
                    have.append(spec.name)
                    continue
                # A copy appeared since verify: count it only if it is good.
                check, _ = await client.call(spec, "data", Msg.VERIFY_CHUNKS, {"ids": [cid]}, timeout=_bound(len(data)))
                if reply(Verified, check, Msg.VERIFY_CHUNKS, spec.name).bad:
                    errors.append(f"{spec.name} holds a bad copy that could not be replaced")
                else:
                    have.append(spec.name)
            except (Unreachable, StorageFull, CorruptData) as exc:
                log.warning("repair: cannot copy chunk %s to %s: %s", cid.hex(), spec.name, exc)
                errors.append(f"{spec.name}: {exc}")
    if len(have) >= want:
        out.healthy += 1
    else:
        why = "; ".join(errors) or "not enough reachable data nodes"
        out.unhealed[cid] = f"only {len(have)} of {want} good copies ({why}){hint}"
