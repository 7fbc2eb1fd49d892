"""The bytes a daemon holds for requests in flight, bounded per connection and in total.

A server reserves a frame's declared size (meta and data, from its header) before it reads the
frame's body, and a handler whose reply's size is known before it is read reserves that too; all of
it is released once the request's answer is sent, or its connection ends. Whatever peers send, the
bytes held never exceed `total`, nor `per_connection` for any one connection:

- a reservation that could never fit (over `per_connection`) is refused at once (ProtocolError);
- one that does not fit now waits, its connection reading no further frames meanwhile (backpressure),
  for at most `wait` seconds, then is refused as busy (Unreachable: the client tries another replica);
- waits for the total are served in arrival order, so a big request is not starved by small ones.

A reservation bounds what its frame may come to hold, not what it holds at once: the frame's buffer
grows only as its bytes arrive (protocol.py), and a frame whose bytes stop coming ends its connection
after FRAME_STALL, which releases the reservation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import trio

from dlfs.errors import ProtocolError, Unreachable
from dlfs.units import human_bytes
from dlfs.wire.protocol import MAX_DATA

NODE_MEMORY = 512 << 20  # default total, over all connections of a node's daemons
# One frame of the largest size the protocol allows fits a connection (ingest and repair put whole
# chunks, up to MAX_DATA), so no valid request is refused outright; the total still bounds them all.
CONNECTION_MEMORY = MAX_DATA
# The least `dlfs node --memory` accepts: a 16 MiB index piece (READ_INDEX) and a default 8 MiB chunk.
MIN_NODE_MEMORY = 32 << 20
MEMORY_WAIT = 30.0  # seconds a request waits for memory before it is answered busy


def auto_node_memory() -> int:
    """The default total: an eighth of the memory the node may use (its cgroup's limit where there is
    one: a node in a pod shares it with the mount and the training job), within [MIN, NODE_MEMORY]."""
    from dlfs.cgroup import memory_limit

    return min(NODE_MEMORY, max(MIN_NODE_MEMORY, memory_limit().effective // 8))


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    granted: trio.Event = field(default_factory=trio.Event)


class ConnectionShare:
    """One connection's part of a budget: the bytes its requests hold now (`held`)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        self._freed = trio.Event()  # set (and replaced) whenever this connection releases bytes

    async def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` more for this connection; see MemoryBudget for waits and refusals."""
        await self.budget._reserve(self, nbytes)

    def release(self, nbytes: int) -> None:
        self.budget._release(self, nbytes)

    def close(self) -> None:
        """Release whatever the connection still holds (it ended mid-request)."""
        self.budget._release(self, self.held)


class MemoryBudget:
    """Bytes held for requests in flight: at most `total` over all connections, at most
    `per_connection` (no more than `total`) for any one. `owner` names the daemon in errors."""

    def __init__(self, owner: str, total: int = NODE_MEMORY, per_connection: int = CONNECTION_MEMORY,
                 wait: float = MEMORY_WAIT) -> None:
        self.owner = owner
        self.total = total
        self.per_connection = min(per_connection, total)
        self.wait = wait
        self.reserved = 0  # bytes held now, over all connections
        self.high_water = 0  # the most ever held at once
        self.waits = 0  # reservations that had to wait for room (counted as they begin to)
        self.busy = 0  # ... and found none within `wait`
        self.refused = 0  # reservations over the per-connection cap
        self._queue: deque[_Waiter] = deque()  # waiting for the total, first come first served

    def connection(self) -> ConnectionShare:
        return ConnectionShare(self)

    async def _reserve(self, share: ConnectionShare, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if nbytes > self.per_connection:
            self.refused += 1
            raise ProtocolError(f"{self.owner} refuses a request of {human_bytes(nbytes)}: over its cap of "
                                f"{human_bytes(self.per_connection)} for one connection's requests in flight")
        waited = False
        with trio.move_on_after(self.wait):
            while share.held + nbytes > self.per_connection:
                self.waits += not waited
                waited = True
                await share._freed.wait()
            # Claimed on the connection first, so that its other reservations see it while this waits.
            share.held += nbytes
            try:
                if self._queue or self.reserved + nbytes > self.total:
                    self.waits += not waited
                    await self._wait_in_line(nbytes)
                else:
                    self._take(nbytes)
            except BaseException:
                self._release_claim(share, nbytes)
                raise
            return
        self.busy += 1
        raise Unreachable(f"{self.owner} is busy: no memory for a request of {human_bytes(nbytes)} within "
                          f"{self.wait:g} s (requests in flight hold {human_bytes(self.reserved)} of "
                          f"{human_bytes(self.total)}, {human_bytes(share.held)} on this connection)")

    async def _wait_in_line(self, nbytes: int) -> None:
        w = _Waiter(nbytes)
        self._queue.append(w)
        try:
            await w.granted.wait()
        except BaseException:
            if w.granted.is_set():  # granted just as the wait ended: give it back
                self._give_back(nbytes)
            else:
                self._queue.remove(w)
                self._grant()  # those behind it may fit now
            raise

    def _take(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.high_water = max(self.high_water, self.reserved)

    def _grant(self) -> None:
        while self._queue and self.reserved + self._queue[0].nbytes <= self.total:
            w = self._queue.popleft()
            self._take(w.nbytes)
            w.granted.set()

    def _give_back(self, nbytes: int) -> None:
        self.reserved -= nbytes
        self._grant()

    def _release_claim(self, share: ConnectionShare, nbytes: int) -> None:
        share.held -= nbytes
        share._freed.set()
        share._freed = trio.Event()

    def _release(self, share: ConnectionShare, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self._release_claim(share, nbytes)
        self._give_back(nbytes)
