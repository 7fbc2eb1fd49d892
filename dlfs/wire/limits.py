"""What a daemon bounds about its connections, whoever opens them.

- Accepting: when the process or the system is out of descriptors or memory (EMFILE, ENFILE,
  ENOBUFS, ENOMEM), the accept loop drops the oldest half-open connection, waits (a growing, bounded
  pause) and says so in one log line per LOG_INTERVAL, never a traceback per retry.
- Half-open connections (handshake not finished: the peer has proven nothing) are capped in total
  and per peer address; a new one past a cap drops the oldest of that peer (per-peer cap), else the
  oldest of all, so a flood cannot hold the slots a real client's handshake needs.
- Failed handshakes and connections the daemon closes are counted by reason (ConnectionStats, read
  by metrics.py), and logged through LogThrottle: a flood leaves counters, not lines.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)

MAX_HALF_OPEN = 512  # connections not yet authenticated, in total (and at most an eighth of the descriptors)
MAX_HALF_OPEN_PER_PEER = 64  # ... from one address (one uid on a Unix socket)
ACCEPT_PAUSE_MIN = 0.01  # seconds the accept loop waits after its first failure in a row,
ACCEPT_PAUSE_MAX = 1.0  # doubling up to this
LOG_INTERVAL = 10.0  # seconds between two log lines of one kind about peers
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Why a handshake did not finish: "cap" is a connection dropped for a newer one (see HalfOpen).
HANDSHAKE_FAILURES = ("timeout", "wrong_key", "malformed", "closed", "cap")
# Why the daemon closed an authenticated connection.
CLOSE_REASONS = ("idle", "stall", "protocol")


class LogThrottle:
    """One kind of log line at most once per `interval` seconds; the next line that is written says
    how many were left out meanwhile (the exact counts are in the metrics)."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL) -> None:
        self.logger = logger
        self.interval = interval
        self._next = -math.inf
        self._left_out = 0

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        if now < self._next:
            self._left_out += 1
            return
        if self._left_out:
            msg += " (%d more like it in the last %.0f s not logged)"
            args = (*args, self._left_out, self.interval)
        self._left_out = 0
        self._next = now + self.interval
        self.logger.log(level, msg, *args)


class ConnectionStats:
    """A daemon's connections: open now, and counts of what ended them early (plain ints, read by
    metrics.py)."""

    def __init__(self) -> None:
        self.authenticated = 0  # open now, handshake done
        self.accept_errors = 0  # accepts that failed for want of descriptors or memory
        self.handshake_failures = dict.fromkeys(HANDSHAKE_FAILURES, 0)
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)


@dataclass(eq=False)
class HalfOpenEntry:
    """One connection in its handshake; cancelling `scope` drops it."""

    peer: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


def default_half_open_cap() -> int:
    """MAX_HALF_OPEN, but at most an eighth of the process's descriptors: whatever a flood does, most
    descriptors stay for authenticated clients, chunk files and the daemon's own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_HALF_OPEN
    return min(MAX_HALF_OPEN, max(16, soft // 8))


class HalfOpen:
    """The daemon's connections whose handshake has not finished, oldest first. Admitting one past
    a cap drops the oldest of its peer (`per_peer`), else the oldest of all (`total`)."""

    def __init__(self, stats: ConnectionStats, total: int | None = None, per_peer: int | None = None) -> None:
        self.stats = stats
        self.total = max(1, total if total is not None else default_half_open_cap())
        self.per_peer = max(1, per_peer if per_peer is not None else MAX_HALF_OPEN_PER_PEER)
        self._all: dict[HalfOpenEntry, None] = {}  # insertion order: oldest first
        self._by_peer: dict[str, dict[HalfOpenEntry, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, peer: str) -> HalfOpenEntry:
        mine = self._by_peer.get(peer)
        if mine is not None and len(mine) >= self.per_peer:
            self._drop(next(iter(mine)))
        if len(self._all) >= self.total:
            self._drop(next(iter(self._all)))
        entry = HalfOpenEntry(peer)
        self._all[entry] = None
        self._by_peer.setdefault(peer, {})[entry] = None
        return entry

    def leave(self, entry: HalfOpenEntry) -> None:
        """The handshake ended (either way): no longer counted."""
        if entry not in self._all:
            return  # dropped already
        del self._all[entry]
        mine = self._by_peer[entry.peer]
        del mine[entry]
        if not mine:
            del self._by_peer[entry.peer]

    def drop_oldest(self) -> bool:
        """Drop the oldest half-open connection, if any (to free a descriptor)."""
        if not self._all:
            return False
        self._drop(next(iter(self._all)))
        return True

    def _drop(self, entry: HalfOpenEntry) -> None:
        self.leave(entry)
        entry.scope.cancel()
        self.stats.handshake_failures["cap"] += 1


def peer_key(stream: trio.abc.Stream) -> str:
    """Whom the per-peer cap counts a connection against: its IP address, or the uid of a Unix
    socket's peer."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return "local"
    try:
        if sock.family == socket.AF_UNIX:
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return f"uid {uid}"
        name = sock.getpeername()
    except OSError:
        return "unknown"
    return str(name[0]) if isinstance(name, tuple) else str(name)


async def accept_loop(listener: trio.SocketListener, handle: Callable[[trio.SocketStream], Awaitable[None]],
                      nursery: trio.Nursery, gate: HalfOpen, stats: ConnectionStats, what: str) -> None:
    """Accept connections on `listener` until cancelled, each handled by `handle` in `nursery`.

    Out of descriptors or memory, it drops the oldest half-open connection and pauses (growing to
    ACCEPT_PAUSE_MAX while the failures go on); any other accept error ends the loop."""
    throttle = LogThrottle(log)
    pause = 0.0
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
            stats.accept_errors += 1
            gate.drop_oldest()
            pause = min(max(pause * 2, ACCEPT_PAUSE_MIN), ACCEPT_PAUSE_MAX)
            throttle.log(logging.WARNING, "%s: cannot accept connections: %s (%d accept failures so far); "
                         "retrying with pauses up to %g s", what, os.strerror(exc.errno or 0), stats.accept_errors,
                         ACCEPT_PAUSE_MAX)
            await trio.sleep(pause)
            continue
        pause = 0.0
        nursery.start_soon(handle, stream)
