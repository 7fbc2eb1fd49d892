"""Talking to the cluster: connections to every daemon, chunk placement, and replica failover."""

from __future__ import annotations

import itertools
import logging
import math
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
# A failing node is probed again after a back-off that grows per round of failures, from SUSPECT_MIN
# to SUSPECT_MAX: short, so that a node back from a restart is read from again within a second or two.
SUSPECT_MIN = 0.25
SUSPECT_MAX = 2.0
CONNECT_TIMEOUT = 5.0
PROBE_TIMEOUT = 2.0  # a PING is answered in well under a millisecond by a daemon that runs
PROBE_EVERY = 0.25
# Catalog reads (the same answer from every metadata daemon) that wait this long for one daemon ask the
# next one too, the first answer winning: a frozen or cut-off daemon cost each mount and command its
# connect bound (10 s) before the next was asked. A write stays with one daemon (its session is there).
META_HEDGE = 1.0
# A collection sweeps SWEEP_NODES data nodes at once, each within SWEEP_NODE_BOUND (a node not done by then
# is skipped: its chunks are freed by a later collection). One after another, a frozen node held a `dlfs rm`
# past its caller's 60 s call bound, which then asked another daemon and reported "no dataset named ...".
SWEEP_NODES = 16
SWEEP_NODE_BOUND = 30.0
# A daemon that has not answered within this (its connect included) is taken as down by what asks all of them
# (`dlfs status`, a collection's sweep), rather than waited for to the call's own bound.
SILENT_AFTER = 5.0
META_READS = frozenset({Msg.GET_DATASET, Msg.READ_INDEX, Msg.LIST_DATASETS})
FULL_RETRY = 30.0  # seconds writes pass over a data node that said its disk is full, before asking it again
# Connections to each data daemon that chunk reads take in turn: while one reply's turnaround at the
# daemon (the next request found, its header sent, a thread to sendfile it) leaves its connection
# idle, the other's reply streams (big files through a daemon: +23% at the median of 8 rounds; 3
# or 4 gave no more).
READ_LANES = 2


def _passed_over(failed: list[tuple[str, Unreachable]], answered: str) -> None:
    """The metadata daemons a call went past before `answered` did: a warning each (the call went on)."""
    for name, exc in failed:
        log.warning("metadata daemon on %s: %s (%s answered instead)", name, exc, answered)


def _none_answered(failed: list[tuple[str, Unreachable]]) -> Unreachable:
    """The one error of a call no metadata daemon answered: the daemon's own where there is one, else each
    daemon's (not a warning per daemon and then the error again)."""
    if not failed:
        return Unreachable("no metadata daemon in the cluster")
    if len(failed) == 1:
        return failed[0][1]
    return Unreachable("no metadata daemon answered (" + "; ".join(f"{n}: {e}" for n, e in failed) + ")")


def rank(cid: bytes, nodes: list[NodeSpec]) -> list[NodeSpec]:
    """Every node in the chunk's rendezvous (highest-random-weight) order. A chunk's R replicas are the
    first R of its rank; repair places a copy further down when one of them is lost, and readers
    look there next."""
    return sorted(nodes, key=lambda n: xxhash.xxh64_intdigest(n.name.encode() + b"\0" + cid), reverse=True)


@dataclass
class Health:
    """A node that failed is suspect (not probed) until `until`. Failures while it is suspect belong to
    the round that made it so (many fetches in flight fail together when a node goes): the back-off
    doubles (to a bound) once per round, not once per failed fetch."""

    until: float = 0.0
    backoff: float = 0.0
    failures: int = 0
    rounds: int = 0
    since: float = 0.0  # when it stopped answering (trio's clock): its first failure since it last answered

    def fail(self, now: float) -> bool:
        """Note a failure; True if it began a new round."""
        self.failures += 1
        if now < self.until:
            return False
        self.rounds += 1
        self.backoff = min(max(self.backoff * 2, SUSPECT_MIN), SUSPECT_MAX)
        self.until = now + self.backoff
        return True

    def suspect(self, now: float) -> bool:
        return now < self.until


class ClusterClient:
    """Connections to the cluster's daemons, opened on first use and reopened after a failure.

    Every connection's reader task lives in the nursery handed in; leaving it closes them all.
    """

    def __init__(self, cluster: Cluster, nursery: trio.Nursery) -> None:
        self.cluster = cluster
        self.nursery = nursery
        self._conns: dict[tuple[str, str, int], Connection] = {}  # (node, service, lane) -> connection
        self._locks: dict[tuple[str, str, int], trio.Lock] = {}
        # (node, service, lane) -> (when its last connect attempt failed, why): calls that waited for that
        # attempt get its answer, rather than each trying again (a frozen node's 10 s bound, one call after another).
        self._refused: dict[tuple[str, str, int], tuple[float, Unreachable]] = {}
        self._lanes = itertools.count()  # which of READ_LANES the next chunk read takes
        self.health: dict[str, Health] = {}
        self.health_changes = 0  # bumped whenever a node starts or stops failing (remotereads re-routes)
        self._answer = trio.Event()  # set (and replaced) whenever a failing node answers again
        self.rdma: RangeReader | None = None  # set by client.transport.chunk_transport when RDMA is used
        self.tcp_fallbacks = 0  # reads RDMA could not serve, read over TCP instead
        self._full: dict[str, tuple[float, str]] = {}  # data node -> (until when writes pass it over, why)

    async def _hold(self, spec: NodeSpec, service: str,
                    task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED) -> None:
        address = spec.meta if service == "meta" else spec.data
        async with connect(address, self.cluster.key, service, CONNECT_TIMEOUT) as conn:
            task_status.started(conn)
            await conn.done.wait()

    async def connection(self, spec: NodeSpec, service: str, lane: int = 0) -> Connection:
        """The open connection to that daemon (the lane'th of them), reopened after a failure, and
        before the daemon's idle timeout could close it under a call (rpc.IDLE_TIMEOUT)."""
        k = (spec.name, service, lane)
        conn = self._conns.get(k)
        if conn is not None and conn.closed is None and not conn.idle_expiring():
            return conn
        asked = trio.current_time()
        async with self._locks.setdefault(k, trio.Lock()):
            refused = self._refused.get(k)
            if refused is not None and refused[0] >= asked:  # an attempt this call waited for failed just now
                raise refused[1]
            conn = self._conns.get(k)
            if conn is not None and conn.closed is None and conn.idle_expiring():
                del self._conns[k]
                # An RDMA link may hold it still (the daemon keeps those open); else it is done.
                if self.rdma is None or service != "data":
                    await conn.aclose()
                conn = None
            if conn is None or conn.closed is not None:
                try:
                    conn = await self.nursery.start(self._hold, spec, service, name=f"dlfs-conn {spec.name}/{service}")
                except Unreachable as exc:
                    self._refused[k] = (trio.current_time(), exc)
                    raise
                self._refused.pop(k, None)
                self._conns[k] = conn
        return conn

    async def call(self, spec: NodeSpec, service: str, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT,
                   into: memoryview | None = None, lane: int = 0) -> Response:
        """One request to one daemon (on its lane'th connection); a node that cannot be reached becomes
        suspect for a while."""
        try:
            conn = await self.connection(spec, service, lane)
            reply = await conn.call(msg, meta, data, timeout, into)
        except ControlUnavailable:
            raise  # the daemon answered: it is etcd behind it that did not
        except Unreachable:
            self._failed(spec)
            raise
        self._answered(spec.name)
        return reply

    def _failed(self, spec: NodeSpec, why: str = "") -> None:
        if spec.name not in self.health:
            self.health_changes += 1
        h = self.health.setdefault(spec.name, Health(since=trio.current_time()))
        if h.fail(trio.current_time()) and (h.rounds <= 4 or h.rounds % 30 == 0):  # a long outage: a line a minute
            log.info("node %s is failing%s: read last, probed in %.2f s (round %d, %d failures)", spec.name, why,
                     h.backoff, h.rounds, h.failures)

    def _answered(self, name: str) -> None:
        h = self.health.pop(name, None)
        if h is not None:
            self.health_changes += 1
            log.info("node %s answers again (after %d failures)", name, h.failures)
            self._answer.set()
            self._answer = trio.Event()

    def lagged(self, spec: NodeSpec, other: float) -> None:
        """A fetch from `spec` was beaten by a hedge to another replica (which answered in `other`
        seconds): read it last until it answers a probe, as if it had failed."""
        self._failed(spec, f" (another replica answered in {other * 1e3:.0f} ms while it did not)")

    def timed_out(self, spec: NodeSpec, bound: float) -> None:
        """A fetch from `spec` got no answer within `bound` seconds (the serving threads'): read it last until
        it answers a probe, as a node a hedge beat."""
        self._failed(spec, f" (no answer within {bound * 1e3:.0f} ms)")

    async def wait_answer(self, timeout: float) -> None:
        """Until a failing node answers again (a probe or a read), or `timeout` seconds."""
        with trio.move_on_after(max(timeout, 0.0)):
            await self._answer.wait()

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
                self._answered(spec.name)
                return data
        _, data = await self.call(spec, "data", Msg.READ_RANGE, {"id": cid, "offset": offset, "length": length},
                                  timeout=timeout, into=into, lane=next(self._lanes) % READ_LANES)
        return data

    def suspect(self, name: str) -> bool:
        h = self.health.get(name)
        return h is not None and h.suspect(trio.current_time())

    def silent_from(self, name: str, asked: float) -> None:
        """A failing node's call made at `asked` (trio's clock) got no answer: it has been silent since."""
        h = self.health.get(name)
        if h is not None and asked < h.since:
            h.since = asked

    def failing_since(self, name: str) -> float | None:
        """When the node began failing (trio's clock), if it has not answered since."""
        h = self.health.get(name)
        return h.since if h is not None else None

    def failing(self, name: str) -> bool:
        """Failed and not yet answered since: read last, so an application read never waits on it
        while another replica can serve (the prober finds out when it is back)."""
        return name in self.health

    async def probe_failing(self, interval: float = PROBE_EVERY) -> None:
        """Run for the client's life: ping each failing data node once its back-off has passed, each in
        a task of its own (a silent node holds up no other's probe; one ping per node at a time). An
        answer clears it (in call) and wakes the reads waiting for a replica; silence starts its next
        back-off round."""
        probing: set[str] = set()

        async def probe(spec: NodeSpec) -> None:
            try:
                await self.call(spec, "data", Msg.PING, timeout=PROBE_TIMEOUT)
            except DlfsError:
                pass
            finally:
                probing.discard(spec.name)

        async with open_nursery() as nursery:
            while True:
                await trio.sleep(interval)
                data = {n.name: n for n in self.cluster.data_nodes}
                for name in list(self.health):
                    if name in probing or name not in data or self.suspect(name):
                        continue
                    probing.add(name)
                    nursery.start_soon(probe, data[name], name=f"dlfs-probe {name}")

    def mark_full(self, name: str, why: str) -> bool:
        """Pass data node `name` over for chunk writes for FULL_RETRY (its disk is full); True if it was
        not so marked already (the caller then says so, once)."""
        fresh = self.full(name) is None
        self._full[name] = (trio.current_time() + FULL_RETRY, why)
        return fresh

    def full(self, name: str) -> str | None:
        """Why chunk writes pass data node `name` over now (its disk was full), or None."""
        entry = self._full.get(name)
        if entry is not None and trio.current_time() >= entry[0]:
            del self._full[name]  # time to ask it again: room may have been made
            entry = None
        return entry[1] if entry is not None else None

    def meta_nodes(self) -> list[NodeSpec]:
        """Metadata daemons: this machine's first, failing ones last (until their node answers again: a
        node frozen, once found, cost each later call a 10 s connect bound when only its back-off counted)."""
        return sorted(self.cluster.meta_nodes, key=lambda n: (self.failing(n.name), n.name != self.cluster.local))

    async def call_meta(self, msg: Msg, meta: dict[str, Any] | None = None,
                        data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT) -> Response:
        """Ask the first metadata daemon that answers (reads are the same on all of them; a catalog read
        asks the next one too after META_HEDGE)."""
        if msg in META_READS and not data:
            return await self._read_meta(msg, meta, timeout)
        failed: list[tuple[str, Unreachable]] = []
        for spec in self.meta_nodes():
            try:
                reply = await self.call(spec, "meta", msg, meta, data, timeout)
            except ControlUnavailable:
                raise  # every metadata daemon would say the same
            except Unreachable as exc:
                # A connection torn down because this client stops (Ctrl-C) is no fault of the daemon's.
                await trio.lowlevel.checkpoint_if_cancelled()
                failed.append((spec.name, exc))
                continue
            _passed_over(failed, spec.name)
            return reply
        raise _none_answered(failed)

    async def _read_meta(self, msg: Msg, meta: dict[str, Any] | None, timeout: float) -> Response:
        """A catalog read from the metadata daemons in order, the next asked too whenever none has answered
        within META_HEDGE: the first answer wins (an error answered, NotFound say, is an answer); a daemon
        that cannot be reached moves on to the next at once."""
        queue = self.meta_nodes()
        send, recv = trio.open_memory_channel[tuple[NodeSpec, Response | DlfsError]](len(queue))
        last: DlfsError | None = None
        failed: list[tuple[str, Unreachable]] = []  # said once: with the answer, or as the error
        answer: Response | DlfsError | None = None
        flying: dict[str, tuple[NodeSpec, float]] = {}  # name -> (spec, when asked)

        async def ask(spec: NodeSpec) -> None:
            try:
                send.send_nowait((spec, await self.call(spec, "meta", msg, meta, timeout=timeout)))
            except DlfsError as exc:
                send.send_nowait((spec, exc))

        async with trio.open_nursery() as nursery:
            while queue or flying:
                if queue and (not flying or last is not None):
                    spec = queue.pop(0)
                    flying[spec.name] = (spec, trio.current_time())
                    nursery.start_soon(ask, spec)
                    last = None  # the next is asked after a hedge's wait, or once this one fails
                    continue
                with trio.move_on_after(META_HEDGE if queue else math.inf):
                    spec, out = await recv.receive()
                    _, asked = flying.pop(spec.name)
                    if isinstance(out, Unreachable) and not isinstance(out, ControlUnavailable):
                        # (ControlUnavailable: the daemon answered that etcd did not; every one would say so.)
                        await trio.lowlevel.checkpoint_if_cancelled()
                        failed.append((spec.name, out))
                        last = out
                        continue
                    _passed_over(failed, spec.name)
                    answer = out
                    for other, _ in flying.values():  # beaten by a hedge: read last, as a data hedge's loser
                        self.lagged(other, trio.current_time() - asked)
                    nursery.cancel_scope.cancel()
                    break
                if queue:  # no answer within the bound: ask the next one too
                    last = Unreachable(f"no answer within {META_HEDGE:g} s")
        if isinstance(answer, DlfsError):
            raise answer
        if answer is not None:
            return answer
        raise _none_answered(failed)  # (every daemon asked failed: it is in `failed`)

    def replicas(self, cid: bytes) -> list[NodeSpec]:
        """Where to read a chunk, in order: its R placed nodes (this machine's first), then the rest
        of its rank (where repair puts copies of lost replicas); failing nodes go last."""
        ranked = rank(cid, self.cluster.data_nodes)
        r = self.cluster.replicas
        order = {n.name: (self.failing(n.name), i >= r, n.name != self.cluster.local, i) for i, n in enumerate(ranked)}
        return sorted(ranked, key=lambda n: order[n.name])

    async def holders(self, ids: list[bytes], enough: int | None = None) -> tuple[dict[bytes, list[str]], list[str]]:
        """Which data nodes store each chunk, and which nodes could not be asked. With `enough`, the asking
        stops once every chunk has that many (a node yet to answer is not waited for: a frozen one held an
        ingest's commit its whole call bound, holding none of its chunks)."""
        held: dict[bytes, list[str]] = {c: [] for c in ids}
        down: list[str] = []
        short = len(held)  # chunks with fewer than `enough` holders so far

        async def ask(spec: NodeSpec) -> None:
            nonlocal short
            try:
                for c in await self._held(spec, ids):
                    held[c].append(spec.name)
                    short -= len(held[c]) == enough
            except Unreachable as exc:
                log.warning("data daemon on %s: %s", spec.name, exc)
                down.append(spec.name)
            if enough is not None and short <= 0:
                n.cancel_scope.cancel()

        async with open_nursery() as n:
            for spec in self.cluster.data_nodes:
                n.start_soon(ask, spec)
        return held, down

    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]:
        """The chunks stored on fewer than R reachable nodes, with the nodes that do hold them (those known
        once each chunk has R: not every node's answer is waited for)."""
        held, _ = await self.holders(ids, enough=self.cluster.replicas)
        return {c: nodes for c, nodes in held.items() if len(nodes) < self.cluster.replicas}

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]:
        """Delete every stored chunk (of `only`, where given) that no dataset and no ingest holds;
        returns how many chunks went (each once, however many of its replicas were deleted), and the
        data nodes that could not be swept."""
        gone: set[bytes] = set()
        limit = trio.CapacityLimiter(SWEEP_NODES)
        up, down = await self.answering(self.cluster.data_nodes)  # a silent node is left at once
        for name, why in down.items():
            log.warning("garbage collection skipped %s: %s", name, why)
        skipped = list(down)

        async def one(spec: NodeSpec) -> None:
            async with limit:
                try:
                    with trio.fail_after(SWEEP_NODE_BOUND):
                        if only is None:
                            meta, data = await self.call(spec, "data", Msg.LIST_CHUNKS)
                            ids = [bytes(data[i : i + 16]) for i in range(0, len(data), 16)]
                        else:  # those of `only` it holds: what it deletes is then what it held
                            ids = await self._held(spec, sorted(only - live))
                        dead = [c for c in ids if c not in live]
                        for i in range(0, len(dead), 20000):
                            batch = dead[i : i + 20000]
                            meta, _ = await self.call(spec, "data", Msg.DELETE_CHUNKS, {"ids": batch})
                            if reply(Deleted, meta, Msg.DELETE_CHUNKS, spec.name).deleted:
                                gone.update(batch)  # listed or found there a moment ago, under the gc lock
                except (Unreachable, trio.TooSlowError) as exc:
                    why = exc if isinstance(exc, Unreachable) else f"not done within {SWEEP_NODE_BOUND:g} s"
                    log.warning("garbage collection skipped %s: %s", spec.name, why)
                    skipped.append(spec.name)

        async with open_nursery() as n:
            for spec in up:
                n.start_soon(one, spec)
        return len(gone), skipped

    async def ask_each(self, asks: list[tuple[NodeSpec, str]], msg: Msg) -> dict[tuple[str, str], Response | str]:
        """`msg` to each (node, service) at once, each within SILENT_AFTER (its connect included): by (node
        name, service), the reply, or why there was none."""
        out: dict[tuple[str, str], Response | str] = {}

        async def one(spec: NodeSpec, service: str) -> None:
            try:
                with trio.fail_after(SILENT_AFTER):
                    out[spec.name, service] = await self.call(spec, service, msg, timeout=SILENT_AFTER)
            except DlfsError as exc:
                out[spec.name, service] = str(exc) or "no answer"
            except trio.TooSlowError:
                out[spec.name, service] = f"no answer within {SILENT_AFTER:g} s: stopped, overloaded or cut off"

        async with open_nursery() as n:
            for spec, service in asks:
                n.start_soon(one, spec, service)
        return out

    async def answering(self, nodes: list[NodeSpec], service: str = "data") -> tuple[list[NodeSpec], dict[str, str]]:
        """The daemons of `service` among `nodes` that answer a PING within SILENT_AFTER, in their order,
        and why each other one did not."""
        got = await self.ask_each([(s, service) for s in nodes], Msg.PING)
        down = {s.name: r for s in nodes if isinstance(r := got[s.name, service], str)}
        return [s for s in nodes if s.name not in down], down

    async def _held(self, spec: NodeSpec, ids: list[bytes]) -> list[bytes]:
        """Those of `ids` that data node `spec` stores."""
        held: list[bytes] = []
        for i in range(0, len(ids), 20000):
            want = ids[i : i + 20000]
            meta, _ = await self.call(spec, "data", Msg.HAS_CHUNKS, {"ids": want}, timeout=30)
            missing = set(reply(Missing, meta, Msg.HAS_CHUNKS, spec.name).missing)
            held += [c for c in want if c not in missing]
        return held
