"""Ingest sessions: an ingest's index while it uploads, and the chunks it pins, no network.

    staging/<session>.idx   the index as sent so far; never visible until its commit moves it in place

Sessions live only as long as this daemon (an ingest that outlived it starts over): the staging
directory is emptied when it opens. A session nobody asked about for `ttl` seconds is dropped, its
id kept in `expired` for the engine's record of it to go too.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dlfs.config import check_dataset_name
from dlfs.errors import NO_ROOM, Conflict, CorruptData, DlfsError, ProtocolError, StorageFull, UsageError
from dlfs.format.index import MAX_INDEX_BYTES, Index, file_checksum
from dlfs.private import DIR_MODE, FILE_MODE

log = logging.getLogger(__name__)
SESSION_TTL = 180.0  # seconds an ingest session outlives its last request; a live client keeps it alive
TTL_ENV = "DLFS_SESSION_TTL"  # overrides SESSION_TTL (tests shorten it)


def session_ttl() -> float:
    """SESSION_TTL, or $DLFS_SESSION_TTL where set."""
    raw = os.environ.get(TTL_ENV)
    if not raw:
        return SESSION_TTL
    try:
        ttl = float(raw)
    except ValueError:
        ttl = 0.0
    if not 0 < ttl < 1e9:
        raise UsageError(f"${TTL_ENV} must be a positive number of seconds, not {raw!r}")
    return ttl


@dataclass
class Session:
    name: str
    path: Path
    pins: set[bytes]
    touched: float


class IngestSessions:
    def __init__(self, staging: Path) -> None:
        self.dir = staging
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=DIR_MODE)
        self.open: dict[str, Session] = {}
        self.expired: list[str] = []  # sessions dropped for idleness, for the engine's record of them to go too
        self.ttl = session_ttl()

    def begin(self, name: str) -> str:
        check_dataset_name(name)
        self.expire()
        sid = secrets.token_hex(8)
        path = self.dir / f"{sid}.idx"
        path.touch(mode=FILE_MODE)
        self.open[sid] = Session(name, path, set(), time.monotonic())
        return sid

    def session(self, sid: str) -> Session:
        s = self.open.get(sid)
        if s is None:
            raise Conflict(f"ingest session {sid} is unknown (the node restarted or it expired); run the ingest again")
        s.touched = time.monotonic()
        return s

    def expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.open.items()):
            if now - s.touched > self.ttl:
                log.info("dropping idle ingest session %s of %s", sid, s.name)
                self.abort(sid)
                self.expired.append(sid)

    def put_index(self, sid: str, offset: int, data: bytes | bytearray) -> None:
        """Bytes of a session's index at `offset`: in order (at most up to what is staged, so a piece
        may be sent again, never past a hole) and within MAX_INDEX_BYTES, so a commit hashes only
        bytes that were sent, never a sparse file a peer declared."""
        s = self.session(sid)
        if offset + len(data) > MAX_INDEX_BYTES:
            raise ProtocolError(f"index of {s.name} would pass {MAX_INDEX_BYTES >> 30} GiB, the most an index may hold")
        try:
            with open(s.path, "r+b") as f:
                staged = os.fstat(f.fileno()).st_size
                if offset > staged:
                    raise ProtocolError(f"index piece of {s.name} at offset {offset} is past the {staged} bytes staged: "
                                        "pieces are sent in order")
                f.seek(offset)
                f.write(data)
        except OSError as exc:
            raise os_error(exc, f"cannot stage the index of {s.name}") from None

    def abort(self, sid: str) -> set[bytes]:
        """Drop a session and its staged index; returns the chunks it had pinned."""
        s = self.open.pop(sid, None)
        if s is None:
            return set()
        s.path.unlink(missing_ok=True)
        return s.pins

    def end(self, sid: str) -> None:
        """A committed session: its staged index was moved into place."""
        self.open.pop(sid, None)

    def staged_chunks(self, sid: str, size: int, checksum: int) -> tuple[Session, Index]:
        """Check the staged index is whole and the one the client meant; returns it opened."""
        s = self.session(sid)
        actual = s.path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise ProtocolError(f"index of {s.name} declared {size} bytes, over the {MAX_INDEX_BYTES >> 30} GiB an index may hold")
        if actual != size:
            raise CorruptData(f"staged index of {s.name} has {actual} bytes, the client sent {size}")
        if file_checksum(s.path) != checksum:
            raise CorruptData(f"staged index of {s.name} does not match the client's checksum")
        return s, Index(s.path)

    def held(self) -> dict[str, set[bytes]]:
        """Each open session's pins (an aborted session holds nothing)."""
        return {sid: s.pins for sid, s in self.open.items()}

    def pins(self) -> set[bytes]:
        return {c for s in self.open.values() for c in s.pins}

    def scratch_file(self) -> Path:
        """A fresh path in the staging directory (a peer's index while it is fetched)."""
        return self.dir / f"peer-{secrets.token_hex(8)}.idx"


def os_error(exc: OSError, what: str) -> DlfsError:
    """A failed write of the metadata daemon's files as one line: StorageFull when its disk is full."""
    if exc.errno in NO_ROOM:
        return StorageFull(f"{what}: the metadata daemon's disk is full")
    return DlfsError(f"{what}: {exc.strerror}")
