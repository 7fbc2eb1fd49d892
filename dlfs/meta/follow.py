"""A metadata daemon follows the cluster's catalog in etcd.

etcd holds what versions exist; each metadata daemon holds their index files, so that mounts on its
node fetch them nearby, and a local copy of the catalog (SQLite), so that it answers with etcd down.
The follower brings both in line with etcd: at start, whenever a watch on the versions or mounts
sees a change, and every RECONCILE_INTERVAL. A version it lacks is fetched from the daemon that
committed it (or any other), checked against its checksum, then installed. A removal tombstones the
local copy but keeps the index until the cluster marks the version freed.

One daemon, the first metadata node alive in etcd by name, also collects: a removed version that no
mount holds any more has its chunks freed (the others would only race it for the gc lock).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from dlfs.config import NodeSpec
from dlfs.control.etcd import EtcdUnavailable
from dlfs.control.plane import ControlPlane, VersionRecord
from dlfs.errors import Conflict, CorruptData, DlfsError, NotFound, Unreachable
from dlfs.meta.store import MetaStore, VersionInfo
from dlfs.private import private_opener
from dlfs.tasks import open_nursery
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Response

log = logging.getLogger(__name__)
RECONCILE_INTERVAL = 60.0
PEER_TIMEOUT = 10.0
ENSURE_WAIT = 30.0  # seconds a request waits for a version's index and row to arrive here (within a call's 60 s)
INDEX_PIECE = 16 << 20


class PeerCaller(Protocol):
    async def call(self, spec: NodeSpec, service: str, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = ...) -> Response: ...


class CatalogFollower:
    def __init__(self, store: MetaStore, control: ControlPlane, node: str, peers: list[NodeSpec],
                 caller: PeerCaller) -> None:
        self.store = store
        self.control = control
        self.node = node
        self.peers = [p for p in peers if p.name != node]
        self.caller = caller
        self.lock = trio.Lock()  # one reconcile at a time: two would fetch the same index twice
        self.wake = trio.Event()
        self.collect: Callable[[], Awaitable[Any]] | None = None  # set by the engine's run: frees removed versions
        self.unavailable = ""  # why etcd could not be read, while it cannot

    async def reconcile(self) -> list[VersionRecord]:
        """Bring the local catalog in line with etcd; returns etcd's versions."""
        recs, _ = await self.control.versions()
        async with self.lock:
            for rec in recs:
                try:
                    await self._apply(rec)
                except DlfsError as exc:
                    log.warning("cannot take %s from the cluster yet: %s", rec.label, exc)
        return recs

    async def _apply(self, rec: VersionRecord) -> None:
        info, mine = rec.info, self.store.find(rec.info.name, rec.info.version)
        if rec.freed:
            if mine is None or not mine.removed:
                await trio.to_thread.run_sync(self.store.tombstone, info)
            if self.store.has_index(info.name, info.version):
                await trio.to_thread.run_sync(self.store.drop_index, info.name, info.version)
            return
        if info.removed:
            if mine is None or not mine.removed:
                await trio.to_thread.run_sync(self.store.tombstone, info)
                log.info("dataset %s version %d removed in the cluster", info.name, info.version)
            return
        if mine is not None and not mine.removed and self.store.has_index(info.name, info.version):
            if mine.index_sum != info.index_sum:
                raise CorruptData(f"{rec.label} here has index {mine.index_sum:016x}, the cluster's is "
                                  f"{info.index_sum:016x}")
            return
        await self.fetch(rec)
        log.info("dataset %s version %d: index fetched (%d bytes)", info.name, info.version, info.index_size)

    async def ensure(self, rec: VersionRecord) -> None:
        """This daemon has `rec`'s catalog row and index (fetched now if not), within ENSURE_WAIT.

        The index file is put in place before its row is recorded, so a file alone may be a fetch
        still under way (a version committed elsewhere a moment ago): the lock waits for it to end."""
        if await trio.to_thread.run_sync(self._holds, rec):
            return
        try:
            with trio.fail_after(ENSURE_WAIT):
                async with self.lock:
                    if not await trio.to_thread.run_sync(self._holds, rec):
                        await self.fetch(rec)
        except trio.TooSlowError:
            raise Unreachable(f"the index of {rec.label} did not reach the metadata daemon on {self.node} within "
                              f"{ENSURE_WAIT:.0f} s (its fetch from a peer is still under way); try again") from None

    def _holds(self, rec: VersionRecord) -> bool:
        name, version = rec.info.name, rec.info.version
        return self.store.find(name, version) is not None and self.store.has_index(name, version)

    async def fetch(self, rec: VersionRecord, install: Callable[[VersionInfo, Path], Any] | None = None) -> None:
        """The index of `rec` from the daemon that committed it or any other, checked, then installed
        (by `install`: default, the store's apply_peer)."""
        order = sorted(self.peers, key=lambda p: p.name != rec.holder)
        errors = []
        for peer in order:
            path = self.store.ingests.scratch_file()
            try:
                await self._fetch_from(peer, rec, path)
                await trio.to_thread.run_sync(install or self.store.apply_peer, rec.info, path)
                return
            except DlfsError as exc:
                errors.append(f"{peer.name}: {exc}")
            finally:
                path.unlink(missing_ok=True)
        raise NotFound(f"no metadata daemon could send the index of {rec.label} ({'; '.join(errors) or 'no peers'})")

    async def _fetch_from(self, peer: NodeSpec, rec: VersionRecord, path: Path) -> None:
        info = rec.info
        with open(path, "wb", opener=private_opener) as f:
            offset = 0
            while offset < info.index_size:
                _, piece = await self.caller.call(
                    peer, "meta", Msg.READ_INDEX,
                    {"name": info.name, "version": info.version, "offset": offset,
                     "length": min(INDEX_PIECE, info.index_size - offset)},
                    timeout=PEER_TIMEOUT * 3)
                if not piece:
                    raise CorruptData(f"index of {rec.label} from {peer.name} ends early at {offset} bytes")
                f.write(piece)
                offset += len(piece)

    async def _watch(self, prefix: str) -> None:
        """Wake the follower on every change under `prefix`; reopened after any break."""
        revision = 0
        while True:
            try:
                _, revision = await self.control.etcd.range(prefix + "\0")  # only the current revision
                async for _ in self.control.etcd.watch(prefix, revision + 1):
                    self.wake.set()
            except EtcdUnavailable:
                pass
            self.wake.set()  # changes during the break (or before a compacted revision) are re-read
            await trio.sleep(1.0)

    async def collector(self) -> bool:
        """Whether this daemon is the one that frees removed versions: the first live metadata node."""
        nodes = await self.control.nodes()
        alive = sorted(n for n, doc in nodes.items() if "meta" in list(doc.get("roles") or []))  # type: ignore[call-overload]
        return bool(alive) and alive[0] == self.node

    async def run(self) -> None:
        async with open_nursery() as n:
            for prefix in self.control.watched:
                n.start_soon(self._watch, prefix, name=f"dlfs-watch-{prefix}")
            while True:
                self.wake = trio.Event()
                try:
                    recs = await self.reconcile()
                    if self.unavailable:
                        log.warning("etcd reachable again: catalog in step with the cluster")
                    self.unavailable = ""
                    if self.collect is not None and any(r.info.removed and not r.freed for r in recs) \
                            and await self.collector():
                        await self.collect()
                except EtcdUnavailable as exc:
                    if not self.unavailable:
                        log.warning("cannot follow the cluster's catalog: %s (running mounts are not affected)", exc)
                    self.unavailable = str(exc)
                except Conflict as exc:
                    log.info("collection skipped: %s", exc)
                except DlfsError as exc:
                    log.warning("following the cluster's catalog: %s", exc)
                with trio.move_on_after(RECONCILE_INTERVAL if not self.unavailable else 2.0):
                    await self.wake.wait()
                await trio.sleep(0.2)  # a burst of changes (a removal of many versions) is one reconcile
