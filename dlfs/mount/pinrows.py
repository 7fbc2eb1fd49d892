"""The rows of a mount's pin table (native/shm.h), one per attached dlfs.direct client, kept as long as
their owner may still pin or release through them.

A client pins and releases in its row without a word to the mount, and its views (and pins) may outlive
its connection: the mount ends one on a protocol error, the client on a timeout. So a row whose
connection ends goes back to the pool at once only if its owner marked it released (no view of it left,
no pin to come); else it is held until the owner does, or its process is gone. A row is handed out under
a new epoch each time: a late release of an earlier attachment is refused in C, and counted.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from typing import Any

import trio

from dlfs.procs import stat_fields

log = logging.getLogger(__name__)
RECHECK = 1.0  # seconds between looks at a held row's released mark (a gone process is seen at once)
SO_PEERPIDFD = 77  # Linux 6.5: the peer's pidfd, whatever pid namespace it is in (not in Python 3.11's socket)


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None if it is gone or a zombie."""
    fields = stat_fields(pid)
    return None if not fields or fields[0] in (b"Z", b"X") else int(fields[19])


def _readable(fd: int) -> bool:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class ClientProcess:
    """A client process, watched from its attach on: a pidfd where the kernel gives one (Linux 5.3; of
    the socket's peer, 6.5), else its pid and start time (a pid is reused once its process is gone). One
    whose pid namespace hides it (pid 0) is never known to be gone: its row waits for its release."""

    def __init__(self, pid: int, sock: Any = None) -> None:
        self.pid = pid
        self._fd = -1
        self._start: int | None = None
        self._gone = False
        if sock is not None:
            try:
                self._fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            except OSError:  # ENOPROTOOPT before Linux 6.5
                pass
        if self._fd < 0 and pid > 0:
            try:
                self._fd = os.pidfd_open(pid)
            except OSError as exc:
                if exc.errno != errno.ESRCH:  # ENOSYS before Linux 5.3, or a seccomp filter
                    self._start = _start_time(pid)
                self._gone = self._start is None

    def gone(self) -> bool:
        if not self._gone:
            if self._fd >= 0:
                self._gone = _readable(self._fd)
            elif self._start is not None:
                self._gone = _start_time(self.pid) != self._start
        return self._gone

    async def wait_gone(self) -> None:
        """Return once the process is gone (a pidfd says so at once; else this looks every RECHECK)."""
        while not self.gone():
            if self._fd >= 0:
                await trio.lowlevel.wait_readable(self._fd)
            else:
                await trio.sleep(RECHECK)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PinRows:
    """The rows handed to clients: taken at attach, given back when their owner released or left them."""

    def __init__(self, shared: Any, n: int) -> None:
        self.shared = shared
        self._free = list(range(n - 1, -1, -1))  # a stack: row 0 first
        self.held: dict[int, ClientProcess] = {}  # rows of ended connections whose owner may still use them
        self.reclaimed_pins = 0  # pins still counted in rows taken back

    def take(self) -> int | None:
        """A row under a new epoch, or None if every row is in use."""
        if not self._free:
            return None
        row = self._free.pop()
        self.shared.hand_out(row)
        return row

    def end(self, row: int, proc: ClientProcess, nursery: trio.Nursery) -> None:
        """The connection of `row`'s owner `proc` ended: the row goes back now, or once its owner
        released it or is gone (watched in `nursery`)."""
        if self.shared.released(row) or proc.gone():
            self._give_back(row, proc)
            return
        self.held[row] = proc
        log.debug("dlfs.direct row %d held for pid %d: its views may still pin through it", row, proc.pid)
        nursery.start_soon(self._hold, row, proc, name=f"pin row {row} of pid {proc.pid}")

    async def _hold(self, row: int, proc: ClientProcess) -> None:
        try:
            while not (self.shared.released(row) or proc.gone()):
                with trio.move_on_after(RECHECK):
                    await proc.wait_gone()
        except BaseException:  # the mount is stopping: the row goes with the cache
            proc.close()
            raise
        del self.held[row]
        self._give_back(row, proc)

    def _give_back(self, row: int, proc: ClientProcess) -> None:
        proc.close()
        held = self.shared.clear_row(row)
        self._free.append(row)
        if held:
            self.reclaimed_pins += held
            log.info("dlfs.direct client pid %d left %d pins in row %d: released", proc.pid, held, row)
