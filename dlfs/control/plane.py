"""The cluster's control state in etcd: versions, node and mount leases, ingest pins, the gc lock.

Keys, under the cluster file's prefix (default /dlfs/):

    versions/<name>/<0000000007>  a version: {"info": VersionInfo, "holder": node, "freed": bool}.
                                  Kept after removal (a tombstone), so numbers are never reused.
    nodes/<name>                  a node's daemons and pid, bound to the node's lease
    mounts/<name>/<v>/<lease>     a mount of name@v, bound to the mount's own lease
    ingests/<session>             an open ingest, bound to its metadata daemon's node lease
    pins/<session>                the chunks an open ingest holds, as its metadata daemon published
                                  them for a collection: the gc lock's revision (8 bytes), then the
                                  chunk ids (16 bytes each); same lease
    gc                            the one collection in progress, bound to its node's lease

Every decision that two nodes could race is one etcd transaction: a version number is taken only
if its key is absent (two ingests of one name always get two numbers); a mount is recorded only if
its version's key is unchanged since it was read live (a removal in between makes it fail).

Pins cost etcd one key per ingest session, written only when a collection asks: an ingest's metadata
daemon keeps its pins in memory and takes a new one only after reading that no collection holds the
gc lock; a collection takes the lock, then waits until every session opened before it has published
its pins stamped with the lock's revision (dlfs/control/pins.py publishes them). So its snapshot, one
read at one revision, sees every chunk anything needs, and an ingest of a million chunks writes no
key per chunk. etcd's history is compacted by dlfs itself (compact(), after every collection and
periodically by the collecting node), COMPACT_MARGIN revisions behind the present for watchers.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from msgspec import Struct
from msgspec.structs import replace

from dlfs.config import EtcdConfig
from dlfs.control.etcd import (
    KV,
    Etcd,
    EtcdUnavailable,
    absent,
    delete_op,
    present,
    put_op,
    range_op,
    unchanged,
)
from dlfs.errors import Conflict, CorruptData, DlfsError, NotFound
from dlfs.wire.messages import VersionInfo, decode

log = logging.getLogger(__name__)
ALLOCATE_TRIES = 64  # concurrent commits of one name each retry with the next number
PIN_WAIT = 120.0  # seconds a pin waits for a collection in progress to end
PUBLISH_GRACE = 5.0  # seconds past the lease TTL a collection waits for open sessions' pins
COMPACT_MARGIN = 1000  # revisions of history kept behind the present: a watcher further behind re-reads
ID_BYTES = 16
STAMP = struct.Struct(">Q")  # a published pin set's first bytes: the gc lock's revision it answers


def pins_value(stamp: int, ids: set[bytes]) -> bytes:
    """A session's published pins (see the module's docstring)."""
    return STAMP.pack(stamp) + b"".join(sorted(ids))


def pins_of(value: bytes) -> tuple[int, set[bytes]]:
    """The stamp and chunk ids of a published pin set; CorruptData if it is not one."""
    if len(value) < STAMP.size or (len(value) - STAMP.size) % ID_BYTES:
        raise CorruptData(f"a pin set in etcd has {len(value)} bytes, not 8 + 16 per chunk")
    body = value[STAMP.size :]
    return STAMP.unpack_from(value)[0], {body[i : i + ID_BYTES] for i in range(0, len(body), ID_BYTES)}


@dataclass(frozen=True)
class VersionRecord:
    info: VersionInfo
    holder: str  # the metadata daemon that committed it (has its index for sure)
    freed: bool  # removed, unmounted everywhere, and its chunks collected
    mod_revision: int

    @property
    def label(self) -> str:
        return f"{self.info.name}@{self.info.version}"


@dataclass(frozen=True)
class MountRecord:
    name: str
    version: int
    node: str
    mountpoint: str
    pid: int
    lease: int


@dataclass(frozen=True)
class Snapshot:
    """Everything a collection decides from, read at one revision."""

    versions: list[VersionRecord]
    mounts: list[MountRecord]
    pins: set[bytes]
    revision: int

    def _held(self, r: VersionRecord) -> bool:
        return any(m.name == r.info.name and m.version == r.info.version for m in self.mounts)

    def needed(self) -> list[VersionRecord]:
        """Versions whose chunks must stay: live ones, and removed ones a mount still holds."""
        return [r for r in self.versions if not r.freed and (not r.info.removed or self._held(r))]

    def collectable(self) -> list[VersionRecord]:
        """Removed versions no mount holds whose chunks are not yet freed."""
        return [r for r in self.versions if r.info.removed and not r.freed and not self._held(r)]


class _VersionDoc(Struct, frozen=True):
    """A version's value in etcd (see the module's docstring)."""

    info: VersionInfo
    holder: str = ""
    freed: bool = False
    session: str = ""  # the ingest that allocated it: a retried allocation finds its own version


def _version_of(kv: KV) -> VersionRecord:
    doc = decode(_VersionDoc, kv.json(), f"version record {kv.key} in etcd", CorruptData)
    return VersionRecord(doc.info, doc.holder, doc.freed, kv.mod_revision)


def _mount_of(kv: KV) -> MountRecord:
    doc = kv.json()
    return MountRecord(str(doc["name"]), int(doc["version"]), str(doc["node"]), str(doc.get("mountpoint", "")),
                       int(doc.get("pid", 0)), kv.lease)


def _record(info: VersionInfo, holder: str, freed: bool = False, session: str = "") -> str:
    return json.dumps({"info": info.to_wire(), "holder": holder, "freed": freed, "session": session})


class ControlPlane:
    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self.etcd = Etcd(list(cfg.endpoints), cfg.ca_file, cfg.cert_file, cfg.key_file)
        self.p = cfg.prefix
        # The node whose collection this process runs (from before its gc lock take is sent until its
        # release), else "": a lock naming this node while it is "" was left by a take whose answer was
        # lost (release_stale_gc_lock).
        self.collecting = ""

    async def aclose(self) -> None:
        await self.etcd.aclose()

    # --- keys ------------------------------------------------------------------------------------------
    def version_key(self, name: str, version: int) -> str:
        return f"{self.p}versions/{name}/{version:010d}"

    def _versions_of(self, name: str | None = None) -> str:
        return f"{self.p}versions/{name}/" if name else f"{self.p}versions/"

    def _mounts_of(self, name: str | None = None, version: int | None = None) -> str:
        if name is None:
            return f"{self.p}mounts/"
        return f"{self.p}mounts/{name}/{version}/" if version is not None else f"{self.p}mounts/{name}/"

    def ingest_key(self, sid: str) -> str:
        return f"{self.p}ingests/{sid}"

    def pins_key(self, sid: str) -> str:
        return f"{self.p}pins/{sid}"

    @property
    def gc_key(self) -> str:
        return f"{self.p}gc"

    def node_key(self, name: str) -> str:
        return f"{self.p}nodes/{name}"

    @property
    def watched(self) -> list[str]:
        """The prefixes whose changes a metadata daemon follows."""
        return [self._versions_of(), self._mounts_of()]

    # --- versions --------------------------------------------------------------------------------------
    async def versions(self, name: str | None = None) -> tuple[list[VersionRecord], int]:
        kvs, revision = await self.etcd.range(self._versions_of(name), prefix=True)
        return [_version_of(kv) for kv in kvs], revision

    async def allocate(self, info: VersionInfo, holder: str, sid: str) -> VersionInfo:
        """Record `info` under its name's next number; the session's pins go in the same transaction."""
        for _ in range(ALLOCATE_TRIES):
            kvs, _ = await self.etcd.range(self._versions_of(info.name), prefix=True)
            number = max((int(kv.key.rsplit("/", 1)[1]) for kv in kvs), default=0) + 1
            mine = replace(info, version=number)
            key = self.version_key(info.name, number)
            r = await self.etcd.txn(
                [absent(key), present(self.ingest_key(sid))],
                [put_op(key, _record(mine, holder, session=sid)), delete_op(self.pins_key(sid)),
                 delete_op(self.ingest_key(sid))],
                [range_op(self.ingest_key(sid)), range_op(self._versions_of(info.name), prefix=True)])
            if r.succeeded:
                return mine
            if not r.ranges or not r.ranges[0]:
                # An earlier try may have been applied with its reply lost (the etcd client then asks
                # another member): the version it recorded names this session.
                for kv in r.ranges[1] if len(r.ranges) > 1 else []:
                    doc = decode(_VersionDoc, kv.json(), f"version record {kv.key} in etcd", CorruptData)
                    if doc.session == sid and not doc.freed:
                        return doc.info
                raise Conflict(f"ingest of {info.name}: its session lost its lease in etcd (its metadata daemon "
                               "was cut off from etcd for longer than lease_ttl); run the ingest again")
        raise Conflict(f"ingest of {info.name}: {ALLOCATE_TRIES} other commits of the name took every number "
                       "tried; run it again")

    async def remove(self, name: str, version: int | None) -> tuple[list[VersionInfo], list[MountRecord]]:
        """Tombstone the live versions (all, or one) of `name`; returns them and the mounts that still
        hold any of them (read in the same transaction)."""
        for _ in range(ALLOCATE_TRIES):
            recs, _ = await self.versions(name)
            live = [r for r in recs if not r.info.removed]
            if not live:
                raise NotFound(f"no dataset named {name!r}")
            if version is not None:
                live = [r for r in live if r.info.version == version]
                if not live:
                    have = ", ".join(str(r.info.version) for r in recs if not r.info.removed)
                    raise NotFound(f"dataset {name!r} has no version {version} (it has {have})")
            now = time.time()
            gone = [replace(r.info, removed=now) for r in live]
            r = await self.etcd.txn(
                [unchanged(self.version_key(g.name, g.version), rec.mod_revision) for g, rec in zip(gone, live)],
                [*(put_op(self.version_key(g.name, g.version), _record(g, rec.holder)) for g, rec in zip(gone, live)),
                 range_op(self._mounts_of(name), prefix=True)])
            if r.succeeded:
                numbers = {g.version for g in gone}
                mounts = [m for m in map(_mount_of, r.ranges[0]) if m.version in numbers]
                return gone, mounts
        raise Conflict(f"removal of {name}: the catalog kept changing under it; run it again")

    async def mark_freed(self, recs: list[VersionRecord]) -> None:
        """Record that these removed versions' chunks are collected (if no one changed them since)."""
        for rec in recs:
            key = self.version_key(rec.info.name, rec.info.version)
            await self.etcd.txn([unchanged(key, rec.mod_revision)], [put_op(key, _record(rec.info, rec.holder, True))])

    # --- collections ------------------------------------------------------------------------------------
    async def snapshot(self) -> Snapshot:
        r = await self.etcd.txn([], [range_op(self._versions_of(), prefix=True), range_op(self._mounts_of(), prefix=True),
                                     range_op(f"{self.p}pins/", prefix=True)])
        pins: set[bytes] = set()
        for kv in r.ranges[2]:
            pins |= pins_of(kv.value)[1]
        return Snapshot([_version_of(kv) for kv in r.ranges[0]], [_mount_of(kv) for kv in r.ranges[1]], pins,
                        r.revision)

    @asynccontextmanager
    async def gc_lock(self, node: str, lease: int) -> AsyncIterator[None]:
        """Hold the cluster's one collection; Conflict (naming the holder) if another node has it. Entered
        once every ingest session opened before the lock has published its pins (Conflict if one has not
        within the lease TTL and PUBLISH_GRACE: its node is cut off from etcd, or runs an older dlfs)."""
        if self.collecting:  # one at a time per process: the lock it holds is not stale
            raise Conflict(f"a garbage collection is already running on {self.collecting}")
        self.collecting = node  # before the take is sent: release_stale_gc_lock must not see it as stale
        try:
            await self.release_stale_gc_lock(node, taking=True)
            r = await self.etcd.txn([absent(self.gc_key)],
                                    [put_op(self.gc_key, json.dumps({"node": node, "since": time.time()}), lease)],
                                    [range_op(self.gc_key)])
            if not r.succeeded:
                holder = json.loads(r.ranges[0][0].value).get("node", "?") if r.ranges and r.ranges[0] else "?"
                raise Conflict(f"a garbage collection is already running on {holder}")
            held = r.revision
            try:
                await self._published(held)
                yield
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(self.etcd.timeout):
                    try:
                        await self.etcd.txn([unchanged(self.gc_key, held)], [delete_op(self.gc_key)])
                    except DlfsError as exc:  # the next release_stale_gc_lock of this node deletes it
                        log.warning("could not release the gc lock: %s", exc)
        finally:
            self.collecting = ""

    async def release_stale_gc_lock(self, node: str, taking: bool = False) -> bool:
        """Delete the gc lock if it names `node` while no collection of this node holds it: a take whose
        answer was lost (etcd went away mid-request, or a retry on another member met the first
        attempt's commit) or a release that failed. Bound to the node's own lease, which the node renews,
        it would otherwise keep every ingest's pins waiting for a collection that does not run.
        `taking`: called by gc_lock itself, between marking this node collecting and its take."""
        if self.collecting and not taking:
            return False
        kvs, _ = await self.etcd.range(self.gc_key)
        if not kvs or kvs[0].json().get("node") != node or (self.collecting and not taking):
            return False
        r = await self.etcd.txn([unchanged(self.gc_key, kvs[0].mod_revision)], [delete_op(self.gc_key)])
        if r.succeeded:
            log.warning("released a gc lock that named node %s while no collection of it ran (a take whose answer "
                        "was lost, or a failed release)", node)
        return bool(r.succeeded)

    async def _published(self, held: int) -> None:
        """Wait until every session opened before the gc lock (taken at `held`) published its pins for it."""
        deadline = trio.current_time() + self.cfg.lease_ttl + PUBLISH_GRACE
        while True:
            r = await self.etcd.txn([], [range_op(f"{self.p}ingests/", prefix=True),
                                         range_op(f"{self.p}pins/", prefix=True)])
            stamps = {kv.key.rsplit("/", 1)[1]: pins_of(kv.value)[0] for kv in r.ranges[1]}
            late = {kv.key.rsplit("/", 1)[1]: str(kv.json().get("node", "?")) for kv in r.ranges[0]
                    if kv.create_revision < held and stamps.get(kv.key.rsplit("/", 1)[1]) != held}
            if not late:
                return
            if trio.current_time() > deadline:
                raise Conflict(f"{len(late)} ingest session(s) on {', '.join(sorted(set(late.values())))} did not "
                               f"publish their pins within {self.cfg.lease_ttl + PUBLISH_GRACE:.0f} s (cut off from "
                               "etcd, or a node of an older dlfs); nothing was freed: run `dlfs gc` again later")
            await trio.sleep(0.05)

    async def gc_holder(self) -> tuple[int, int]:
        """The revision at which the running collection took the gc lock (0: none), and etcd's revision."""
        kvs, revision = await self.etcd.range(self.gc_key)
        return (kvs[0].create_revision if kvs else 0), revision

    # --- ingests ----------------------------------------------------------------------------------------
    async def open_ingest(self, sid: str, name: str, node: str, lease: int) -> None:
        await self.etcd.put(self.ingest_key(sid), json.dumps({"name": name, "node": node, "since": time.time()}), lease)

    async def clear_to_pin(self, sid: str) -> bool:
        """Whether an ingest may take a pin now: no collection holds the gc lock (a read, no write).
        Conflict if the session is gone from etcd."""
        r = await self.etcd.txn([absent(self.gc_key), present(self.ingest_key(sid))], [],
                                [range_op(self.ingest_key(sid))])
        if not r.succeeded and not r.ranges[0]:
            raise Conflict(f"ingest session {sid} is gone from etcd (its node's lease ended); run the ingest again")
        return r.succeeded

    async def publish_pins(self, stamp: int, node: str, pins: dict[str, set[bytes]]) -> int:
        """Publish, for the collection that took the gc lock at `stamp`, the pins of every session of
        `node` open in etcd (those `pins` does not name hold none: aborted, or expired here); each key
        is bound to its session's lease. Returns how many sessions were published."""
        kvs, _ = await self.etcd.range(f"{self.p}ingests/", prefix=True)
        done = 0
        for kv in kvs:
            if kv.json().get("node") != node:
                continue
            sid = kv.key.rsplit("/", 1)[1]
            r = await self.etcd.txn([present(kv.key)],
                                    [put_op(self.pins_key(sid), pins_value(stamp, pins.get(sid, set())), kv.lease)])
            done += r.succeeded
        return done

    async def close_ingest(self, sid: str) -> set[bytes]:
        """Drop an ingest and its pins; returns the chunks it had published (read in the same transaction)."""
        r = await self.etcd.txn([], [range_op(self.pins_key(sid)), delete_op(self.pins_key(sid)),
                                     delete_op(self.ingest_key(sid))])
        return {c for kv in r.ranges[0] for c in pins_of(kv.value)[1]}

    # --- history ----------------------------------------------------------------------------------------
    async def compact(self, margin: int = COMPACT_MARGIN) -> int:
        """Compact etcd's history up to `margin` revisions behind the present; returns the revision
        compacted to, 0 when there was nothing to do (so every collection can call it)."""
        _, now = await self.etcd.range(self.gc_key)
        target = now - margin
        if target <= 0:
            return 0
        return target if await self.etcd.compact(target) else 0

    async def ingests(self) -> list[dict[str, object]]:
        kvs, _ = await self.etcd.range(f"{self.p}ingests/", prefix=True)
        return [kv.json() for kv in kvs]

    # --- nodes and mounts -------------------------------------------------------------------------------
    async def nodes(self) -> dict[str, dict[str, object]]:
        kvs, _ = await self.etcd.range(f"{self.p}nodes/", prefix=True)
        return {kv.key.rsplit("/", 1)[1]: kv.json() for kv in kvs}

    async def mounts(self) -> list[MountRecord]:
        kvs, _ = await self.etcd.range(self._mounts_of(), prefix=True)
        return [_mount_of(kv) for kv in kvs]

    async def hold_mount(self, info: VersionInfo, node: str, mountpoint: str) -> int:
        """Take a lease on name@version for this mount; NotFound if it is removed (or gone)."""
        key = self.version_key(info.name, info.version)
        for _ in range(ALLOCATE_TRIES):
            kv = await self.etcd.get(key)
            if kv is None or _version_of(kv).info.removed:
                raise NotFound(f"{info.name}@{info.version} was removed")
            lease = await self.etcd.grant(self.cfg.lease_ttl)
            doc = {"name": info.name, "version": info.version, "node": node, "mountpoint": mountpoint,
                   "pid": os.getpid(), "since": time.time()}
            r = await self.etcd.txn([unchanged(key, kv.mod_revision)],
                                    [put_op(f"{self._mounts_of(info.name, info.version)}{lease:x}", json.dumps(doc), lease)])
            if r.succeeded:
                return lease
            await self.etcd.revoke(lease)
        raise Conflict(f"{info.name}@{info.version} kept changing while the mount took its lease")


class Lease:
    """A lease kept alive in the background (a node's membership, a mount's hold on its version).

    `take` grants the lease and writes what it binds; if etcd says the lease has expired (this side
    was cut off for longer than its TTL), `take` runs again. Failures to reach etcd are logged once
    per outage and retried; nothing here ever stops the caller's data path.
    """

    def __init__(self, control: ControlPlane, what: str, take: Callable[[], Awaitable[int]]) -> None:
        self.control = control
        self.what = what
        self._take = take
        self.id = 0  # 0 until taken
        self.taken = trio.Event()
        self.lost: str = ""  # why the last attempt failed, while it is failing
        self.closed = False  # revoked: never taken again

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ttl = self.control.cfg.lease_ttl
        started = False
        while not self.closed:
            try:
                if not self.id:
                    self.id = int(await self._take())
                    if self.lost:
                        log.warning("%s: lease taken again in etcd", self.what)
                    self.lost = ""
                    self.taken.set()
                elif await self.control.etcd.keepalive(self.id) == 0:
                    log.warning("%s: its lease expired in etcd (cut off for over %d s); taking a new one", self.what, ttl)
                    self.id = 0
                    continue
                elif self.lost:
                    log.warning("%s: etcd reachable again", self.what)
                    self.lost = ""
            except EtcdUnavailable as exc:
                if not self.lost:
                    log.warning("%s: cannot renew its lease: %s (retrying)", self.what, exc)
                self.lost = str(exc)
            except DlfsError as exc:
                if not self.lost:
                    log.error("%s: %s", self.what, exc)
                self.lost = str(exc)
            if not started:
                started = True
                task_status.started()
            await trio.sleep(max(ttl / 3, 0.5))

    async def revoke(self) -> None:
        self.closed = True
        if self.id:
            with trio.CancelScope(shield=True), trio.move_on_after(self.control.etcd.timeout):
                try:
                    await self.control.etcd.revoke(self.id)
                except DlfsError as exc:
                    log.info("%s: could not revoke its lease (it expires by itself): %s", self.what, exc)
            self.id = 0
