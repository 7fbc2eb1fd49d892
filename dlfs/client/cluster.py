"""Talking to the cluster: connections to every daemon, chunk placement, and replica failover."""

from __future__ import annotations

import logging
from typing import Any

import trio
import xxhash

from dlfs.config import Cluster, NodeSpec
from dlfs.errors import CorruptData, DlfsError, NotFound, Unreachable
from dlfs.tasks import open_nursery
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import CALL_TIMEOUT, Connection, Reply, connect

log = logging.getLogger(__name__)


def placement(cid: bytes, nodes: list[NodeSpec], replicas: int) -> list[NodeSpec]:
    """The R nodes that hold a chunk: rendezvous (highest-random-weight) hashing."""
    ranked = sorted(nodes, key=lambda n: xxhash.xxh64_intdigest(n.name.encode() + b"\0" + cid), reverse=True)
    return ranked[:replicas]


class ClusterClient:
    """Connections to the cluster's daemons, opened on first use and reopened after a failure.

    Every connection's reader task lives in the nursery handed in; leaving it closes them all.
    """

    def __init__(self, cluster: Cluster, nursery: trio.Nursery) -> None:
        self.cluster = cluster
        self.nursery = nursery
        self._conns: dict[tuple[str, str], Connection] = {}
        self._locks: dict[tuple[str, str], trio.Lock] = {}

    async def _hold(self, spec: NodeSpec, service: str,
                    task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED) -> None:
        address = spec.meta if service == "meta" else spec.data
        async with connect(address, self.cluster.key, service) as conn:
            task_status.started(conn)
            await conn.done.wait()

    async def connection(self, spec: NodeSpec, service: str) -> Connection:
        k = (spec.name, service)
        conn = self._conns.get(k)
        if conn is not None and conn.closed is None:
            return conn
        async with self._locks.setdefault(k, trio.Lock()):
            conn = self._conns.get(k)
            if conn is None or conn.closed is not None:
                conn = await self.nursery.start(self._hold, spec, service, name=f"dlfs-conn {spec.name}/{service}")
                self._conns[k] = conn
        return conn

    async def call(self, spec: NodeSpec, service: str, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT) -> Reply:
        conn = await self.connection(spec, service)
        return await conn.call(msg, meta, data, timeout)

    def meta_nodes(self) -> list[NodeSpec]:
        """Metadata daemons, this machine's first."""
        return sorted(self.cluster.nodes, key=lambda n: n.name != self.cluster.local)

    async def call_meta(self, msg: Msg, meta: dict[str, Any] | None = None,
                        data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT) -> Reply:
        """Ask the first metadata daemon that answers (reads are the same on all of them)."""
        last: DlfsError | None = None
        for spec in self.meta_nodes():
            try:
                return await self.call(spec, "meta", msg, meta, data, timeout)
            except Unreachable as exc:
                last = exc
                log.warning("metadata daemon on %s: %s", spec.name, exc)
        raise last or Unreachable("no metadata daemon in the cluster")

    def replicas(self, cid: bytes) -> list[NodeSpec]:
        """The nodes holding a chunk, the local one first."""
        nodes = placement(cid, self.cluster.nodes, self.cluster.replicas)
        return sorted(nodes, key=lambda n: n.name != self.cluster.local)

    async def read_range(self, cid: bytes, offset: int, length: int, timeout: float = 30.0) -> tuple[bytes | bytearray | memoryview, str]:
        """Bytes of a chunk from the first replica that has them; returns (bytes, node)."""
        errors = []
        for spec in self.replicas(cid):
            try:
                _, data = await self.call(spec, "data", Msg.READ_RANGE,
                                          {"id": cid, "offset": offset, "length": length}, timeout=timeout)
                return data, spec.name
            except (Unreachable, NotFound, CorruptData) as exc:
                errors.append(f"{spec.name}: {exc}")
        raise Unreachable(f"chunk {cid.hex()}: no replica answered ({'; '.join(errors)})")

    async def missing_replicas(self, ids: list[bytes]) -> list[tuple[bytes, str]]:
        """(chunk, node) for every placed replica that is not stored (or whose node is down)."""
        by_node: dict[str, list[bytes]] = {}
        for cid in ids:
            for spec in placement(cid, self.cluster.nodes, self.cluster.replicas):
                by_node.setdefault(spec.name, []).append(cid)
        missing: list[tuple[bytes, str]] = []

        async def ask(name: str, want: list[bytes]) -> None:
            try:
                for i in range(0, len(want), 20000):
                    meta, _ = await self.call(self.cluster.node(name), "data", Msg.HAS_CHUNKS, {"ids": want[i : i + 20000]})
                    missing.extend((c, name) for c in meta["missing"])
            except Unreachable as exc:
                log.warning("data daemon on %s: %s", name, exc)
                missing.extend((c, name) for c in want)

        async with open_nursery() as n:
            for name, want in by_node.items():
                n.start_soon(ask, name, want)
        return missing

    async def sweep(self, live: set[bytes]) -> int:
        """Delete every stored chunk that no dataset and no ingest holds; returns how many."""
        freed = 0
        for spec in self.cluster.nodes:
            try:
                meta, data = await self.call(spec, "data", Msg.LIST_CHUNKS)
                ids = [bytes(data[i : i + 16]) for i in range(0, len(data), 16)]
                dead = [c for c in ids if c not in live]
                for i in range(0, len(dead), 20000):
                    meta, _ = await self.call(spec, "data", Msg.DELETE_CHUNKS, {"ids": dead[i : i + 20000]})
                    freed += int(meta["deleted"])
            except Unreachable as exc:
                log.warning("garbage collection skipped %s: %s", spec.name, exc)
        return freed
