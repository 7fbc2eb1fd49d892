"""Catalog replication between metadata daemons: every daemon holds the whole catalog.

A daemon pulls from its peers: their catalogs (tombstones included), then the index of every live
version it lacks, checked against its checksum before it is installed. It pulls at start, every
SYNC_INTERVAL, and at once when a peer says it committed or removed something (NOTIFY). A daemon
that was down therefore catches up as soon as it is back.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from dlfs.config import NodeSpec
from dlfs.errors import DlfsError, NotFound, Unreachable
from dlfs.meta.store import MetaStore, VersionInfo
from dlfs.tasks import open_nursery
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Response

log = logging.getLogger(__name__)
SYNC_INTERVAL = 15.0
PEER_TIMEOUT = 10.0
INDEX_PIECE = 16 << 20


class PeerCaller(Protocol):
    async def call(self, spec: NodeSpec, service: str, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = ...) -> Response: ...


class CatalogSync:
    def __init__(self, store: MetaStore, node: str, peers: list[NodeSpec], caller: PeerCaller | None) -> None:
        self.store = store
        self.node = node
        self.peers = [p for p in peers if p.name != node]
        self.caller = caller
        self.wake = trio.Event()
        self.lock = trio.Lock()  # one pull at a time: two would fetch the same index twice

    async def pull(self, peer: NodeSpec) -> int:
        """Bring this daemon up to date with one peer; returns how many versions changed here."""
        assert self.caller is not None
        meta, _ = await self.caller.call(peer, "meta", Msg.CATALOG, timeout=PEER_TIMEOUT)
        changed = 0
        async with self.lock:
            for raw in meta["versions"]:
                info = VersionInfo(**raw)
                mine = self.store.find(info.name, info.version)
                if mine is not None and (mine.removed or not info.removed):
                    continue  # nothing to learn: same version, or already removed here
                fetched = None
                if not info.removed:
                    try:
                        fetched = await self._fetch_index(peer, info)
                    except NotFound:
                        continue  # removed on the peer meanwhile; its tombstone comes next time
                try:
                    if await trio.to_thread.run_sync(self.store.apply_peer, info, fetched):
                        changed += 1
                        what = "removal of" if info.removed else "version"
                        log.info("caught up from %s: %s %s@%d", peer.name, what, info.name, info.version)
                finally:
                    if fetched is not None:
                        fetched.unlink(missing_ok=True)
        return changed

    async def _fetch_index(self, peer: NodeSpec, info: VersionInfo) -> Any:
        assert self.caller is not None
        path = self.store.staging_file()
        with open(path, "wb") as f:
            offset = 0
            while offset < info.index_size:
                _, piece = await self.caller.call(
                    peer, "meta", Msg.READ_INDEX,
                    {"name": info.name, "version": info.version, "offset": offset, "length": INDEX_PIECE},
                    timeout=PEER_TIMEOUT * 3)
                if not piece:
                    break
                f.write(piece)
                offset += len(piece)
        return path

    async def pull_all(self) -> list[str]:
        """Pull from every peer; returns the names of the peers that could not be reached."""
        missed: list[str] = []

        async def one(peer: NodeSpec) -> None:
            try:
                await self.pull(peer)
            except DlfsError as exc:
                log.info("catalog sync with %s failed: %s", peer.name, exc)
                missed.append(peer.name)

        async with open_nursery() as n:
            for peer in self.peers:
                n.start_soon(one, peer)
        return missed

    async def notify(self) -> None:
        """Tell every peer this catalog changed, so they pull now (best effort, bounded)."""
        if self.caller is None:
            return

        async def one(peer: NodeSpec) -> None:
            try:
                await self.caller.call(peer, "meta", Msg.NOTIFY, {"node": self.node}, timeout=PEER_TIMEOUT)  # type: ignore[union-attr]
            except DlfsError as exc:
                log.info("could not notify %s of a catalog change: %s (it will catch up later)", peer.name, exc)

        async with open_nursery() as n:
            for peer in self.peers:
                n.start_soon(one, peer)

    async def peer_pins(self) -> set[bytes] | None:
        """Chunks pinned by ingests open on any peer; None if a peer cannot be asked."""
        pins: set[bytes] = set()
        for peer in self.peers:
            try:
                meta, _ = await self.caller.call(peer, "meta", Msg.PINS, timeout=PEER_TIMEOUT)  # type: ignore[union-attr]
            except Unreachable:
                return None
            pins.update(bytes(c) for c in meta["ids"])
        return pins

    async def run(self) -> None:
        """Pull from every peer now, then every SYNC_INTERVAL or when woken by a NOTIFY."""
        if not self.peers or self.caller is None:
            return
        while True:
            await self.pull_all()
            with trio.move_on_after(SYNC_INTERVAL):
                await self.wake.wait()
            self.wake = trio.Event()
