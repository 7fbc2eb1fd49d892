"""Reading ranges of a chunk from its replicas: hedged against a slow one, retried through a restart.

A read is a race among the chunk's replicas (ClusterClient.replicas order). One fetch is in flight at
first; one that has not answered within `hedge_after()` (the p99 of recent fetch latencies, held to
HEDGE_MIN..HEDGE_MAX) is sent to the next replica too, and the first bytes back win: the other fetch is
cancelled, and its node, beaten by a hedge, is marked failing (read last) until it answers a probe.
So a frozen or partitioned node costs a read about that bound, not the fetch timeout. A fetch that
fails moves on to the next replica at once (a failover).

Memory: only one fetch at a time may receive into the caller's `into` (a cache slab, where TCP and
RDMA land bytes with no copy); a hedge gets a buffer of its own, and if it wins its bytes are copied
into `into` once the race is over. By then nothing can still write there: a TCP call cancelled while
its response was arriving into `into` closes its connection before it returns (dlfs/wire/rpc.py), and
an RDMA READ cancelled with work requests posted closes its queue pair (dlfs/client/rdmareads.py).

Riding out a restart: when a round gave no good bytes and some replica could not be reached, the read
waits (RETRY_FIRST, growing to RETRY_MAX, cut short when any node answers again) and runs another round,
until `retry_timeout` has passed since it began to wait, or since the last of its silent replicas stopped
answering if that is sooner: then Unreachable (EIO). A replica that *answered*
(NotFound, or bytes that fail their check) is not asked again within the read: a restart does not
change its answer, so a read whose every replica answered that way fails at once rather than waiting.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, TypeVar

import trio

from dlfs.config import NodeSpec
from dlfs.errors import CorruptData, DlfsError, Unreachable

if TYPE_CHECKING:  # the CLI reads RETRY_TIMEOUT from here: no connection machinery at import
    from dlfs.client.cluster import ClusterClient

log = logging.getLogger(__name__)
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
FETCH_TIMEOUT = 10.0  # one fetch from one replica, at most (a hedge usually ends it much sooner)
HEDGE_MIN, HEDGE_MAX = 0.2, 2.0  # the bounds on how long a fetch runs alone before it is hedged
HEDGE_UNLEARNED = 1.0  # the bound before LEARN_AFTER fetches were timed
LEARN_AFTER = 20
RECENT = 256  # fetch latencies the bound is learned from
RETRY_FIRST, RETRY_MAX = 0.1, 1.0  # waits between rounds of a read that no replica answered
RETRY_TIMEOUT = 60.0  # the mount's default: a soft NFS mount's patience


class FetchLatency:
    """How long recent fetches took, and the hedge bound learned from them."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._bound: float | None = None

    def observe(self, seconds: float) -> None:
        self._recent.append(seconds)
        if len(self._recent) % 16 == 0:
            self._bound = None  # learned again at the next hedge_after()

    def hedge_after(self) -> float:
        """Seconds a fetch runs alone before the next replica is asked too."""
        if len(self._recent) < LEARN_AFTER:
            return HEDGE_UNLEARNED
        if self._bound is None:
            ordered = sorted(self._recent)
            p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
            self._bound = min(max(p99, HEDGE_MIN), HEDGE_MAX)
        return self._bound


@dataclass(eq=False)
class _Attempt:
    spec: NodeSpec
    into: memoryview | None  # the caller's memory, for at most one attempt at a time
    hedged: bool = False  # it was still running when the next replica was asked too


@dataclass
class Fetched:
    """One replica's bytes for the ranges asked."""

    node: str
    got: list[Buffer]
    seconds: float


@dataclass
class _Read:
    """What one read learned so far: who answered (not asked again), and why each replica failed."""

    answered: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    corrupt: bool = False
    failed: bool = False  # a fetch of this round failed: the next one started is a failover


class ReplicaReader:
    """Reads of chunk ranges from a cluster's replicas, for one mount: its counters live here."""

    def __init__(self, client: ClusterClient, retry_timeout: float = 0.0, fetch_timeout: float = FETCH_TIMEOUT) -> None:
        self.client = client
        self.retry_timeout = retry_timeout
        self.fetch_timeout = fetch_timeout
        self.latency = FetchLatency()
        self.failovers = 0  # fetches that moved on to another replica after one failed
        self.corrupt = 0  # replicas' bytes that failed their check
        self.hedges = self.hedges_won = 0  # fetches sent to a second replica; those the second answered first
        self.waits = 0  # rounds a read waited for a replica to answer again
        self.rode_out = 0  # reads that got their bytes after waiting
        self._waiting = 0  # reads waiting now
        self._since = 0.0  # when the first of them began to wait

    async def read(self, cid: bytes, ranges: list[tuple[int, int]], into: memoryview | None,
                   check: Callable[[Sequence[Buffer], str], Awaitable[T]],
                   fetched: Callable[[Fetched], None], retry: bool = True) -> tuple[T, list[Buffer]]:
        """(what `check` made of the first good bytes, those bytes) for ranges (offset, length) of chunk
        `cid`, the first landing in `into` where it can. `fetched` is told of every replica's bytes
        before they are checked (good or not). With `retry`, rounds repeat while a replica could not
        be reached, for up to retry_timeout from when it began to wait (see the module's docstring).
        CorruptData if replicas answered and none had good bytes, else Unreachable."""
        own = deadline = trio.current_time() + (self.retry_timeout if retry else 0.0)
        state = _Read()
        wait = RETRY_FIRST
        waited_since: float | None = None
        try:
            while True:
                now = trio.current_time()
                queue = []
                for spec in self.client.replicas(cid):
                    since = self.client.failing_since(spec.name)
                    if spec.name in state.answered:
                        continue
                    if self.retry_timeout and since is not None and now >= since + self.retry_timeout:
                        # Silent for longer than reads wait: not asked (the prober says when it is back).
                        state.errors[spec.name] = f"no answer for {now - since:.0f} s"
                    else:
                        queue.append(spec)
                state.failed = False
                # The outage began when the last of the unreachable replicas stopped answering: reads wait
                # retry_timeout from then, not each its own (nodes down for good would cost every read the
                # whole wait in turn).
                silent = [self.client.failing_since(n) for n in state.errors if n not in state.answered]
                deadline = own
                if retry and self.retry_timeout and silent and None not in silent:
                    deadline = min(own, max(t for t in silent if t is not None) + self.retry_timeout)
                if not queue and state.errors and now >= deadline:
                    break
                # A fetch never outlasts the read's own bound, nor (read-ahead, which a reader may wait for)
                # the time a read waits for replicas at all.
                bound = (self.fetch_timeout if not self.retry_timeout else
                         min(self.fetch_timeout, max(deadline - now, HEDGE_MIN)) if retry else
                         min(self.fetch_timeout, self.retry_timeout))
                while queue:
                    win = await self._race(cid, ranges, into, queue, state, bound)
                    if win is None:
                        break
                    fetched(win)
                    try:
                        out = await check(win.got, win.node)
                    except CorruptData as exc:
                        self.corrupt += 1
                        state.corrupt = state.failed = True
                        state.answered.add(win.node)
                        state.errors[win.node] = str(exc)
                        log.warning("%s; trying the next replica", exc)
                        continue
                    if waited_since is not None:
                        self.rode_out += 1
                    return out, win.got
                now = trio.current_time()
                unanswered = [n for n in state.errors if n not in state.answered]
                if not unanswered or now >= deadline:
                    break
                if waited_since is None:
                    waited_since = now
                    # The bound counts from here, not from the first round's start: a read that began before
                    # its replicas failed would end just before the last went silent for the bound, and the
                    # reads right after it would ask that one again rather than fail at once.
                    own = max(own, now + self.retry_timeout)
                    self._begin_wait(cid, state)
                self.waits += 1
                await self.client.wait_answer(min(wait, deadline - now))
                wait = min(wait * 2, RETRY_MAX)
        finally:
            if waited_since is not None:
                self._end_wait()
        why = "; ".join(f"{node}: {err}" for node, err in state.errors.items()) or "it has no replica"
        if state.corrupt:
            raise CorruptData(f"chunk {cid.hex()}: no replica has good bytes ({why})")
        # "for": it failed without waiting, its replicas silent for that long already (an outage before it).
        within = (f" for {self.retry_timeout:g} s" if deadline < own and waited_since is None else
                  f" within {self.retry_timeout:g} s") if retry and self.retry_timeout else ""
        raise Unreachable(f"chunk {cid.hex()}: no replica answered{within} ({why})")

    async def _race(self, cid: bytes, ranges: list[tuple[int, int]], into: memoryview | None,
                    queue: list[NodeSpec], state: _Read, bound: float) -> Fetched | None:
        """The first bytes from the replicas of `queue` (taken from its front as they are asked; a
        cancelled loser goes back to it), each fetch within `bound` seconds; None when each one asked
        failed (noted in `state`)."""
        send, recv = trio.open_memory_channel[tuple[_Attempt, Fetched | DlfsError]](math.inf)
        flying: list[_Attempt] = []
        win: tuple[_Attempt, Fetched] | None = None

        async def fetch(a: _Attempt) -> None:
            t0, asked = perf_counter(), trio.current_time()
            try:
                with trio.fail_after(bound):  # (the connect too, which has a bound of its own)
                    got = [await self.client.read_from(a.spec, cid, off, n, timeout=bound,
                                                       into=a.into if i == 0 else None)
                           for i, (off, n) in enumerate(ranges)]
            except trio.TooSlowError:
                self.client.timed_out(a.spec, bound)  # read last until it answers a probe
                self.client.silent_from(a.spec.name, asked)
                send.send_nowait((a, Unreachable(f"no answer within {bound:g} s")))
                return
            except DlfsError as exc:
                if isinstance(exc, Unreachable):
                    self.client.silent_from(a.spec.name, asked)
                send.send_nowait((a, exc))
                return
            send.send_nowait((a, Fetched(a.spec.name, got, perf_counter() - t0)))

        async with trio.open_nursery() as nursery:

            def start(hedge: bool) -> None:
                holder = any(a.into is not None for a in flying)
                a = _Attempt(queue.pop(0), None if holder else into)
                if hedge:
                    self.hedges += 1
                    for other in flying:
                        other.hedged = True
                elif state.failed:
                    self.failovers += 1
                flying.append(a)
                nursery.start_soon(fetch, a, name=f"dlfs-fetch {a.spec.name}")

            start(hedge=False)
            while flying:
                hedge_in = self.latency.hedge_after() if queue and len(flying) < 2 else math.inf
                with trio.move_on_after(hedge_in):
                    a, outcome = await recv.receive()
                    flying.remove(a)
                    if isinstance(outcome, Fetched):
                        win = (a, outcome)
                        nursery.cancel_scope.cancel()
                        break
                    state.failed = True
                    state.errors[a.spec.name] = str(outcome)
                    if not isinstance(outcome, Unreachable):  # NotFound, or a daemon's refusal: its answer
                        state.answered.add(a.spec.name)
                    if queue and len(flying) < 2:
                        start(hedge=False)
                    continue
                start(hedge=True)  # nothing within the bound: ask the next replica too
        if win is None:
            return None
        a, got = win
        self.latency.observe(got.seconds)
        for loser in flying:  # cancelled: asked again if the winner's bytes turn out bad
            queue.insert(0, loser.spec)
            if loser.hedged:
                self.client.lagged(loser.spec, got.seconds)
        if any(x.hedged for x in flying):  # the fetch it was sent beside did not answer first
            self.hedges_won += 1
        if into is not None and a.into is None and got.got and len(got.got[0]) <= len(into) \
                and not _within(got.got[0], into):
            # A hedge's bytes, in its own buffer: into the caller's memory now that nothing else writes there.
            n = len(got.got[0])
            into[:n] = got.got[0]
            got.got[0] = into[:n]
        return got

    def _begin_wait(self, cid: bytes, state: _Read) -> None:
        self._waiting += 1
        if self._waiting == 1:
            self._since = trio.current_time()
            why = "; ".join(f"{node}: {err}" for node, err in state.errors.items())
            log.warning("no replica of chunk %s answers (%s); reads wait for one for up to %g s", cid.hex(), why,
                        self.retry_timeout)

    def _end_wait(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            log.warning("reads waiting for a replica are done after %.1f s", trio.current_time() - self._since)

    def stats(self) -> dict[str, int]:
        return {"failovers": self.failovers, "hedges": self.hedges, "hedges_won": self.hedges_won,
                "retry_waits": self.waits, "rode_out": self.rode_out,
                "hedge_after_ms": round(self.latency.hedge_after() * 1e3)}


def _within(buf: Buffer, into: memoryview) -> bool:
    """Whether `buf` is a view of the same memory as `into` (the fetch landed there)."""
    return isinstance(buf, memoryview) and buf.obj is into.obj
