"""Talking to the cluster: connections to every daemon, chunk placement, and replica failover."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
import xxhash

from dlfs.config import Cluster, NodeSpec
from dlfs.errors import ControlUnavailable, DlfsError, RdmaFailure, Unreachable
from dlfs.tasks import open_nursery
from dlfs.transport.base import RangeReader
from dlfs.wire.messages import Deleted, Missing, reply
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import CALL_TIMEOUT, Connection, Response, connect

log = logging.getLogger(__name__)
SUSPECT_MIN = 1.0
SUSPECT_MAX = 60.0
CONNECT_TIMEOUT = 5.0
PROBE_TIMEOUT = 5.0


def rank(cid: bytes, nodes: list[NodeSpec]) -> list[NodeSpec]:
    """Every node in the chunk's rendezvous (highest-random-weight) order. A chunk's R replicas are the
    first R of its rank; repair places a copy further down when one of them is lost, and readers
    look there next."""
    return sorted(nodes, key=lambda n: xxhash.xxh64_intdigest(n.name.encode() + b"\0" + cid), reverse=True)


@dataclass
class Health:
    """A node that failed is suspect until `until`; each failure doubles the wait (to a bound)."""

    until: float = 0.0
    backoff: float = 0.0
    failures: int = 0

    def fail(self, now: float) -> None:
        self.failures += 1
        self.backoff = min(max(self.backoff * 2, SUSPECT_MIN), SUSPECT_MAX)
        self.until = now + self.backoff

    def suspect(self, now: float) -> bool:
        return now < self.until


class ClusterClient:
    """Connections to the cluster's daemons, opened on first use and reopened after a failure.

    Every connection's reader task lives in the nursery handed in; leaving it closes them all.
    """

    def __init__(self, cluster: Cluster, nursery: trio.Nursery) -> None:
        self.cluster = cluster
        self.nursery = nursery
        self._conns: dict[tuple[str, str], Connection] = {}
        self._locks: dict[tuple[str, str], trio.Lock] = {}
        self.health: dict[str, Health] = {}
        self.rdma: RangeReader | None = None  # set by client.transport.chunk_transport when RDMA is used
        self.tcp_fallbacks = 0  # reads RDMA could not serve, read over TCP instead

    async def _hold(self, spec: NodeSpec, service: str,
                    task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED) -> None:
        address = spec.meta if service == "meta" else spec.data
        async with connect(address, self.cluster.key, service, CONNECT_TIMEOUT) as conn:
            task_status.started(conn)
            await conn.done.wait()

    async def connection(self, spec: NodeSpec, service: str) -> Connection:
        """The open connection to that daemon, reopened after a failure, and before the daemon's
        idle timeout could close it under a call (rpc.IDLE_TIMEOUT)."""
        k = (spec.name, service)
        conn = self._conns.get(k)
        if conn is not None and conn.closed is None and not conn.idle_expiring():
            return conn
        async with self._locks.setdefault(k, trio.Lock()):
            conn = self._conns.get(k)
            if conn is not None and conn.closed is None and conn.idle_expiring():
                del self._conns[k]
                # An RDMA link may hold it still (the daemon keeps those open); else it is done.
                if self.rdma is None or service != "data":
                    await conn.aclose()
                conn = None
            if conn is None or conn.closed is not None:
                conn = await self.nursery.start(self._hold, spec, service, name=f"dlfs-conn {spec.name}/{service}")
                self._conns[k] = conn
        return conn

    async def call(self, spec: NodeSpec, service: str, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT,
                   into: memoryview | None = None) -> Response:
        """One request to one daemon; a node that cannot be reached becomes suspect for a while."""
        try:
            conn = await self.connection(spec, service)
            reply = await conn.call(msg, meta, data, timeout, into)
        except ControlUnavailable:
            raise  # the daemon answered: it is etcd behind it that did not
        except Unreachable:
            self._failed(spec)
            raise
        if spec.name in self.health:
            del self.health[spec.name]
        return reply

    def _failed(self, spec: NodeSpec) -> None:
        h = self.health.setdefault(spec.name, Health())
        h.fail(trio.current_time())
        log.info("node %s is suspect for %.0f s (failure %d)", spec.name, h.backoff, h.failures)

    async def read_from(self, spec: NodeSpec, cid: bytes, offset: int, length: int,
                        timeout: float = CALL_TIMEOUT, into: memoryview | None = None) -> bytes | bytearray | memoryview:
        """Bytes [offset, offset+length) of a chunk on one node, into `into` if given (RDMA where the
        client uses it and it works, else TCP; RDMA lands elsewhere if `into` is not registrable).
        NotFound, Unreachable and CorruptData as READ_RANGE raises them."""
        if self.rdma is not None:
            try:
                data = await self.rdma.read_range(spec, cid, offset, length, timeout, into)
            except RdmaFailure as exc:
                # The RDMA path logged its failure; the reader gets its bytes over TCP all the same.
                self.tcp_fallbacks += 1
                log.debug("chunk %s from %s over TCP: %s", cid.hex(), spec.name, exc)
            except Unreachable:
                self._failed(spec)
                raise
            else:
                self.health.pop(spec.name, None)
                return data
        _, data = await self.call(spec, "data", Msg.READ_RANGE, {"id": cid, "offset": offset, "length": length},
                                  timeout=timeout, into=into)
        return data

    def suspect(self, name: str) -> bool:
        h = self.health.get(name)
        return h is not None and h.suspect(trio.current_time())

    def failing(self, name: str) -> bool:
        """Failed and not yet answered since: read last, so an application read never waits on it
        while another replica can serve (the prober finds out when it is back)."""
        return name in self.health

    async def probe_failing(self, interval: float = 1.0) -> None:
        """Run for the client's life: ping each failing data node once its back-off has passed; an
        answer clears it (in call), silence doubles its back-off. Bounded: one ping at a time."""
        while True:
            await trio.sleep(interval)
            for name in list(self.health):
                if self.suspect(name) or name not in {n.name for n in self.cluster.data_nodes}:
                    continue
                try:
                    await self.call(self.cluster.node(name), "data", Msg.PING, timeout=PROBE_TIMEOUT)
                    log.info("node %s answers again", name)
                except DlfsError:
                    pass

    def meta_nodes(self) -> list[NodeSpec]:
        """Metadata daemons: this machine's first, suspect ones last."""
        return sorted(self.cluster.meta_nodes, key=lambda n: (self.suspect(n.name), n.name != self.cluster.local))

    async def call_meta(self, msg: Msg, meta: dict[str, Any] | None = None,
                        data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT) -> Response:
        """Ask the first metadata daemon that answers (reads are the same on all of them)."""
        last: DlfsError | None = None
        for spec in self.meta_nodes():
            try:
                return await self.call(spec, "meta", msg, meta, data, timeout)
            except ControlUnavailable:
                raise  # every metadata daemon would say the same
            except Unreachable as exc:
                last = exc
                log.warning("metadata daemon on %s: %s", spec.name, exc)
        raise last or Unreachable("no metadata daemon in the cluster")

    def replicas(self, cid: bytes) -> list[NodeSpec]:
        """Where to read a chunk, in order: its R placed nodes (this machine's first), then the rest
        of its rank (where repair puts copies of lost replicas); failing nodes go last."""
        ranked = rank(cid, self.cluster.data_nodes)
        r = self.cluster.replicas
        order = {n.name: (self.failing(n.name), i >= r, n.name != self.cluster.local, i) for i, n in enumerate(ranked)}
        return sorted(ranked, key=lambda n: order[n.name])

    async def holders(self, ids: list[bytes]) -> tuple[dict[bytes, list[str]], list[str]]:
        """Which data nodes store each chunk, and which nodes could not be asked."""
        held: dict[bytes, list[str]] = {c: [] for c in ids}
        down: list[str] = []

        async def ask(spec: NodeSpec) -> None:
            try:
                for i in range(0, len(ids), 20000):
                    want = ids[i : i + 20000]
                    meta, _ = await self.call(spec, "data", Msg.HAS_CHUNKS, {"ids": want}, timeout=30)
                    missing = set(reply(Missing, meta, Msg.HAS_CHUNKS, spec.name).missing)
                    for c in want:
                        if c not in missing:
                            held[c].append(spec.name)
            except Unreachable as exc:
                log.warning("data daemon on %s: %s", spec.name, exc)
                down.append(spec.name)

        async with open_nursery() as n:
            for spec in self.cluster.data_nodes:
                n.start_soon(ask, spec)
        return held, down

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]:
        """The chunks stored on fewer than R reachable nodes, with the nodes that do hold them."""
        held, _ = await self.holders(ids)
        return {c: nodes for c, nodes in held.items() if len(nodes) < self.cluster.replicas}

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]:
        """Delete every stored chunk (of `only`, where given) that no dataset and no ingest holds;
        returns how many, and the data nodes that could not be swept."""
        freed = 0
        skipped: list[str] = []
        for spec in self.cluster.data_nodes:
            try:
                if only is None:
                    meta, data = await self.call(spec, "data", Msg.LIST_CHUNKS)
                    ids = [bytes(data[i : i + 16]) for i in range(0, len(data), 16)]
                else:  # deleting a chunk a node does not hold does nothing: no list needed
                    ids = sorted(only)
                dead = [c for c in ids if c not in live]
                for i in range(0, len(dead), 20000):
                    meta, _ = await self.call(spec, "data", Msg.DELETE_CHUNKS, {"ids": dead[i : i + 20000]})
                    freed += reply(Deleted, meta, Msg.DELETE_CHUNKS, spec.name).deleted
            except Unreachable as exc:
                log.warning("garbage collection skipped %s: %s", spec.name, exc)
                skipped.append(spec.name)
        return freed, skipped
