"""A metadata daemon's ingest pins in a cluster: held in memory, published to etcd when a collection asks.

A pin is taken only after a read of etcd says no collection holds the gc lock, and under `lock`; a
collection, once it holds the lock, waits for every open session to publish its pins stamped with
the lock's revision (ControlPlane.gc_lock). `run` watches the gc key and publishes, under the same
`lock`, the pins of every session of this node the moment a lock appears. A pin taken before the
lock was seen is therefore in what is published; one asked for after waits for the collection to
end. etcd is written once per session per collection, not once per chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import aclosing

import trio

from dlfs.control.plane import PIN_WAIT, ControlPlane
from dlfs.errors import Conflict, DlfsError

log = logging.getLogger(__name__)
WATCH_ROUND = 5.0  # seconds between reads of the gc key should a watch event be lost
RETRY_PAUSE = 1.0  # after etcd failed to answer
WATCH_PAUSE = 0.2  # after a watch that ended without a change


class PinPublisher:
    def __init__(self, control: ControlPlane, node: str, sessions: Callable[[], dict[str, set[bytes]]]) -> None:
        self.control = control
        self.node = node
        self.sessions = sessions  # this daemon's open sessions and their pins, read under `lock`
        self.lock = trio.Lock()
        self.published = 0  # the gc lock's revision last published for
        self.failing = ""  # why publishing fails, while it does (logged once)

    async def pin(self, sid: str, ids: list[bytes], into: set[bytes]) -> None:
        """Add `ids` to a session's pins once no collection runs (waits, bounded by PIN_WAIT)."""
        deadline = trio.current_time() + PIN_WAIT
        while True:
            async with self.lock:
                if await self.control.clear_to_pin(sid):
                    into.update(ids)
                    return
            if trio.current_time() > deadline:
                raise Conflict(f"a garbage collection held the cluster's gc lock for over {PIN_WAIT:.0f} s; "
                               "run the ingest again")
            await trio.sleep(0.2)

    async def publish(self, stamp: int) -> None:
        """This node's sessions' pins for the collection that took the gc lock at `stamp`."""
        async with self.lock:
            pins = {sid: set(ids) for sid, ids in self.sessions().items()}
            n = await self.control.publish_pins(stamp, self.node, pins)
        self.published = stamp
        if n:
            log.info("published the pins of %d ingest session(s) for the collection at revision %d", n, stamp)

    async def run(self) -> None:
        """Publish whenever a collection takes the gc lock, for as long as the daemon runs."""
        while True:
            try:
                stamp, revision = await self.control.gc_holder()
                if stamp and await self.control.release_stale_gc_lock(self.node):
                    continue
                if stamp and stamp != self.published:
                    await self.publish(stamp)
                if self.failing:
                    log.warning("ingest pins: etcd answers again")
                    self.failing = ""
                changed = False
                with trio.move_on_after(WATCH_ROUND):
                    async with aclosing(self.control.etcd.watch(self.control.gc_key, revision + 1)) as changes:
                        async for _ in changes:
                            changed = True
                            break  # read the key again: taken, or released
                if not changed:
                    await trio.sleep(WATCH_PAUSE)  # a watch that broke at once must not spin
            except DlfsError as exc:
                if not self.failing:
                    log.warning("ingest pins: cannot follow the gc lock in etcd: %s (retrying)", exc)
                self.failing = str(exc)
                await trio.sleep(RETRY_PAUSE)
