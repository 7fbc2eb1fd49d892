"""The serving threads' own fetches from the data daemons (native/remote.h): the route and the connections.

In scan mode (an epoch over more than the cache holds) each miss is one small record fetched alone.
Through Python that cost about 400 us of the mount's CPU per file (a dataset bigger than a 256 MiB
cache read at random through a daemon: 0.21-0.24x local disk). The serving threads now send those
READ_RANGEs themselves, on connections opened and authenticated here and handed over for good; this
owner keeps what is policy: which node each chunk is read from (its first replica in the client's order,
so failing nodes last, recomputed when that set changes; a chunk its node answered an error for is left
to Python until then), and how many connections each node has (one
more whenever the threads found none idle, up to one per thread that may fetch at once). Whatever the
threads cannot do (no connection yet, an error, a bound passed, a bad frame, a failed check) comes to
Python's fetcher as before: failover, hedging and the errors users see stay there. The threads wait for
a node no longer than Python would before hedging past it (its hedge bound, given them here), and a node
they gave up on that way is marked failing, as a hedge beaten would have marked it: the route then names
another replica until it answers a probe.
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.errors import DlfsError, ProtocolError, Unreachable
from dlfs.format.index import Index
from dlfs.native import native
from dlfs.wire.protocol import REQUEST, RESPONSE, Frame, Msg
from dlfs.wire.rpc import CONNECT_TIMEOUT, open_stream

log = logging.getLogger(__name__)

# Ranks the whole route may cost (chunks x data nodes, ~0.27 us each in a worker thread: ~6 s, once at
# the start and again whenever a node starts or stops failing). Beyond it the route is learned instead:
# a chunk's entry is made when Python first fetches one of its records alone (a cluster of 1,000 data
# nodes and a dataset of 1.3 TB in 8 MiB chunks is 160 million ranks).
ROUTE_WORK_MAX = 20_000_000
KEEP_EVERY = 0.02  # seconds between two looks at the threads' wants and the nodes' health, while wanted
KEEP_IDLE = 0.25  # ... and once nothing was wanted for a second (an idle mount wakes 4 times a second)


class IndexChunkIds(Sequence[bytes]):
    """A mounted index's chunk ids, read from its mapping as asked: no list of them is held."""

    def __init__(self, index: Index) -> None:
        self._ix = index

    def __len__(self) -> int:
        return self._ix.totals.chunks

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return [self._ix.chunk(k).id for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._ix.chunk(i % len(self)).id

    def __iter__(self) -> Iterator[bytes]:
        return (self._ix.chunk(k).id for k in range(len(self)))


def route_work(chunks: int, data_nodes: int) -> int:
    """What making the route costs, in ranks (see ROUTE_WORK_MAX)."""
    return chunks * data_nodes


class RemoteReads:
    """Owner of the serving threads' route and data connections, for one mount."""

    def __init__(self, client: ClusterClient, chunk_ids: Sequence[bytes], fetchers: int,
                 learned: bool | None = None, bound: Callable[[], float] | None = None,
                 in_place: str | None = None) -> None:
        assert native is not None
        self.client = client
        # This machine's node where the mount reads its chunk files in place: its daemon would send the same
        # bytes (a copy that failed its check there, again), so the route names the next replica.
        self.in_place = in_place
        self.bound = bound  # seconds: how long a fetch may wait for its node (Python's hedge bound)
        self.chunk_ids = chunk_ids
        # The route made whole, or learned chunk by chunk (learn()) where making it would cost too much.
        self.work = route_work(len(chunk_ids), len(client.cluster.data_nodes))  # ranks of the whole route
        self.learned = self.work > ROUTE_WORK_MAX if learned is None else learned
        self._known = bytearray()  # learned route: 1 for each chunk whose entry is made
        nodes = client.cluster.data_nodes[: native.WIRE["nodes"]]
        self.slot = {spec.name: i + 1 for i, spec in enumerate(nodes)}
        self.specs = {i + 1: spec for i, spec in enumerate(nodes)}
        # As many connections to a node as threads may fetch at once: each holds one for its fetch.
        self.per_node = max(1, min(fetchers, native.WIRE["conns"]))
        self.opened = 0
        self.lanes = 0  # of those, lanes the daemon's native threads serve
        self.failed_opens = 0
        self._health_seen = -1  # the client's health_changes when the route was last made
        self._opening: dict[int, int] = {}  # node slot -> connections being opened now
        self._bound_ms = 0  # the bound last given the threads
        self._timeouts_seen = 0  # every node's fetches past the bound, summed, when last looked at
        self._node_timeouts: dict[int, int] = {}  # node slot -> its fetches past the bound, when last looked at

    def _first(self, cid: bytes) -> int:
        """Chunk `cid`'s node slot: its first replica in the client's order (failing nodes last) but the one
        read in place; 0 if none."""
        for spec in self.client.replicas(cid):
            if spec.name != self.in_place:
                return self.slot.get(spec.name, 0)
        return 0

    def route(self) -> array.array:
        """Each chunk's node slot (_first)."""
        out = array.array("H", bytes(2 * len(self.chunk_ids)))
        for i, cid in enumerate(self.chunk_ids):
            out[i] = self._first(cid)
        return out

    async def _reroute(self) -> None:
        if self.client.health_changes == self._health_seen:
            return
        self._health_seen = self.client.health_changes
        assert native is not None
        if self.learned:  # forgotten, to be learned again in the new health's order
            self._known = bytearray(len(self.chunk_ids))
            native.remote_route(bytes(2 * len(self.chunk_ids)))
            return
        # Rendezvous ranks of every chunk: a thread's work on a big dataset, not the loop's.
        table = await trio.to_thread.run_sync(self.route)
        native.remote_route(table)

    def learn(self, chunk: int) -> None:
        """A record of `chunk` was fetched alone by Python (scan mode's miss): where the route is learned,
        its entry is made now (its first replica), so the threads fetch the chunk's other records."""
        if not self.learned or chunk >= len(self._known) or self._known[chunk]:
            return
        self._known[chunk] = 1
        assert native is not None
        native.remote_route_set(chunk, self._first(self.chunk_ids[chunk]))

    async def open_one(self, slot: int) -> None:
        """One more authenticated connection to node `slot`'s data daemon, handed to the threads."""
        spec = self.specs[slot]
        fs, node = await open_stream(spec.data, self.client.cluster.key, "data")
        try:
            if node != spec.name:
                raise Unreachable(f"{spec.data} is node {node}, not {spec.name}")
            # A lane where the daemon serves them (its native threads); else a plain connection, its Python's.
            await fs.send(Frame(REQUEST, Msg.RANGE_LANE, 0))
            with trio.fail_after(CONNECT_TIMEOUT):
                answer = await fs.receive()
            if answer.msg != Msg.RANGE_LANE or answer.kind != RESPONSE:
                raise ProtocolError(f"{spec.data} answered {answer.msg} to RANGE_LANE")
            self.lanes += answer.status == 0
            fd = fs.detach()
        except BaseException:
            with trio.CancelScope(shield=True):
                await fs.aclose()
            raise
        try:
            assert native is not None
            native.remote_add(slot, fd)
        except OSError:
            os.close(fd)
            raise
        self.opened += 1

    async def keep(self) -> None:
        """Run for the mount's life: the route follows the nodes' health, and a node whose connections
        the threads found all busy (or lost) gets more, opened in the background (a silent node holds up
        no other's), never more at once than the threads asked for."""
        assert native is not None
        self._follow_bound()
        await self._reroute()
        seen: dict[int, int] = {}
        wanted_all, last_wanted = 0, trio.current_time()
        async with trio.open_nursery() as nursery:
            while native.engine_running():  # after that, nothing fetches (the engine closed what it was handed)
                await trio.sleep(KEEP_EVERY if trio.current_time() - last_wanted < 1.0 else KEEP_IDLE)
                self._follow_bound()
                self._timed_out()
                await self._reroute()
                now_all = native.remote_node_stats(0)["wanted"]
                if now_all == wanted_all:
                    continue
                wanted_all, last_wanted = now_all, trio.current_time()
                for slot in self.specs:
                    s = native.remote_node_stats(slot)
                    wanted, seen[slot] = s["wanted"] - seen.get(slot, 0), s["wanted"]
                    if not wanted or self.client.failing(self.specs[slot].name):
                        continue
                    for _ in range(min(wanted, self.per_node - s["open"] - self._opening.get(slot, 0))):
                        self._opening[slot] = self._opening.get(slot, 0) + 1
                        nursery.start_soon(self._open_logged, slot)
            nursery.cancel_scope.cancel()

    def _follow_bound(self) -> None:
        """The threads' fetches wait no longer than Python's would before a hedge."""
        if self.bound is not None:
            assert native is not None
            ms = max(1, round(self.bound() * 1000))
            if ms != self._bound_ms:
                self._bound_ms = ms
                native.remote_wait(ms)

    def _timed_out(self) -> None:
        """A node that let a thread's fetch pass the bound is failing (read last, probed until it answers)."""
        assert native is not None
        total = native.remote_node_stats(0)["timeouts"]
        if total == self._timeouts_seen:
            return
        self._timeouts_seen = total
        for slot, spec in self.specs.items():
            n = native.remote_node_stats(slot)["timeouts"]
            if n > self._node_timeouts.get(slot, 0):
                self._node_timeouts[slot] = n
                self.client.timed_out(spec, native.remote_wait() / 1000)

    async def _open_logged(self, slot: int) -> None:
        try:
            await self.open_one(slot)
        except (DlfsError, OSError, trio.TooSlowError, trio.BrokenResourceError, trio.EndOfChannel) as exc:
            self.failed_opens += 1
            if self.failed_opens <= 3 or self.failed_opens % 100 == 0:
                log.info("a data connection for the serving threads to %s: %s (their misses go through Python "
                         "meanwhile)", self.specs[slot].name, exc)
        finally:
            self._opening[slot] -= 1

    def stats(self) -> dict[str, dict[str, int]]:
        """Per data node: the threads' connections and fetches."""
        assert native is not None
        return {spec.name: dict(native.remote_node_stats(slot)) for slot, spec in self.specs.items()}
