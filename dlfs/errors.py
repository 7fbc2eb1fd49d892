"""The one exception tree of dlfs, with exit codes and errno mapping.

Every user-facing failure is a DlfsError: the CLI prints its message as one line and exits with
its exit code; the FUSE boundary turns it into an errno.
"""

from __future__ import annotations

import errno
import os


class DlfsError(Exception):
    """A failure with a one-line message for the user."""

    exit_code = 1
    errno = errno.EIO

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(DlfsError):
    """Bad arguments or configuration."""

    exit_code = 2
    errno = errno.EINVAL


class KeyExposed(UsageError):
    """A cluster key file that other users can read or change: refused (`chmod 600` fixes it)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class Unreachable(DlfsError):
    """A node (daemon) cannot be reached or stopped answering."""

    exit_code = 3
    errno = errno.EIO


class NoNode(Unreachable):
    """No cluster file, and no local node running (or its runtime file unreadable): `problem` is what is
    wrong, `fix` what to do, the message both (doctor shows them in two columns)."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem} ({fix})")
        self.problem, self.fix = problem, fix


class NotFound(DlfsError):
    """A dataset, version, chunk or path does not exist."""

    exit_code = 4
    errno = errno.ENOENT


class CorruptData(DlfsError):
    """Bytes on disk or on the wire fail their checksum or do not parse."""

    exit_code = 5
    errno = errno.EIO


class SourceError(DlfsError):
    """The ingest source cannot be read, or changed while it was read."""

    exit_code = 6
    errno = errno.EIO


# What a write fails with when its file system (or the user's quota there) has no room left.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class StorageFull(DlfsError):
    """A daemon's disk is full."""

    exit_code = 7
    errno = errno.ENOSPC


class ProtocolError(DlfsError):
    """A peer sent a frame that does not parse or breaks the protocol."""

    exit_code = 8


class AuthError(DlfsError):
    """A peer failed the cluster-key handshake."""

    exit_code = 9
    errno = errno.EACCES


class Conflict(DlfsError):
    """The request clashes with current state (e.g. commit of a stale ingest)."""

    exit_code = 10
    errno = errno.EBUSY


class OperationPending(Conflict):
    """Another operation on the same volume or path is still running (the CSI plugin's ABORTED: the
    caller retries later)."""


class MountError(DlfsError):
    """The mount could not be set up or torn down."""

    exit_code = 11


class Refused(DlfsError):
    """A request the mount answers with an errno by design (EROFS for a write, ENOTDIR, EISDIR,
    ENAMETOOLONG, ENOSYS for what it never needs): an answer, not a failure, so never logged."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(message or os.strerror(err))
        self.errno = err


class CommandFailed(DlfsError):
    """`dlfs run` could not start its command: 127 where it is not found, 126 where it cannot be run
    (as a shell says)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TransportUnavailable(UsageError):
    """The configured transport cannot work here (`transport = "rdma"` with no usable RDMA port)."""


class RdmaFailure(Unreachable):
    """The RDMA path to one node failed (a work request or queue pair in error, set-up refused, a
    timeout); the client reads that range over TCP instead, so a reader never sees it."""


class ControlUnavailable(Unreachable):
    """The cluster's control plane (etcd) cannot be reached or has no quorum; the daemon that says so
    is fine, so a client does not fail over to another (each would say the same)."""


# Wire status codes: errors cross the protocol as (code, message) and are rebuilt on the other side.
_BY_STATUS: dict[int, type[DlfsError]] = {
    1: DlfsError,
    2: UsageError,
    3: Unreachable,
    4: NotFound,
    5: CorruptData,
    6: SourceError,
    7: StorageFull,
    8: ProtocolError,
    9: AuthError,
    10: Conflict,
    11: MountError,
    12: ControlUnavailable,
}
_STATUS_OF = {cls: code for code, cls in _BY_STATUS.items()}


def status_of(exc: DlfsError) -> int:
    """The wire status code of an error (its nearest known class)."""
    for cls in type(exc).__mro__:
        if cls in _STATUS_OF:
            return _STATUS_OF[cls]  # type: ignore[index]
    return 1


def error_from_status(status: int, message: str) -> DlfsError:
    """Rebuild the error a peer reported."""
    return _BY_STATUS.get(status, DlfsError)(message)
