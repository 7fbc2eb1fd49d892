"""The catalog and index files of the metadata daemon, no network.

    catalog.db                 every dataset's committed versions (SQLite, dlfs/meta/catalog.py)
    index/<name>/<version>.idx the committed index files, immutable
    staging/<session>.idx      an ingest's index while it uploads; never visible until commit
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
from dlfs.errors import Conflict, CorruptData, DlfsError, NotFound, StorageFull
from dlfs.format.index import Index, file_checksum
from dlfs.meta.catalog import Catalog, VersionInfo

__all__ = ["MetaStore", "Session", "VersionInfo"]

log = logging.getLogger(__name__)
SESSION_IDLE = 3600.0


@dataclass
class Session:
    name: str
    path: Path
    pins: set[bytes]
    touched: float


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MetaStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.index_dir = root / "index"
        self.staging = root / "staging"
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(root / "catalog.db", legacy=root / "catalog.json")
        # Sessions live only as long as this daemon: an ingest that outlived it starts over.
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.sessions: dict[str, Session] = {}
        self.expired: list[str] = []  # sessions dropped for idleness, for the cluster's record of them to go too
        self._chunk_sets: dict[tuple[str, int], frozenset[bytes]] = {}

    def all_versions(self) -> list[VersionInfo]:
        """Every version ever committed here, tombstones included (what peers sync from)."""
        return self.catalog.all_versions()

    def datasets(self) -> list[VersionInfo]:
        return [v for v in self.all_versions() if not v.removed]

    def find(self, name: str, version: int) -> VersionInfo | None:
        """A version, live or removed, if this daemon knows it."""
        return self.catalog.find(name, version)

    def next_version(self, name: str) -> int:
        """Versions are never reused, not even those of removed versions."""
        return self.catalog.next_version(name)

    def get(self, name: str, version: int | None = None) -> VersionInfo:
        versions = [v for v in self.catalog.versions(name) if not v.removed]
        if not versions:
            raise NotFound(f"no dataset named {name!r}")
        if version is None:
            return versions[-1]
        for v in versions:
            if v.version == version:
                return v
        raise NotFound(f"dataset {name!r} has no version {version} (it has {', '.join(str(v.version) for v in versions)})")

    def index_path(self, name: str, version: int) -> Path:
        return self.index_dir / name / f"{version}.idx"

    def read_index(self, name: str, version: int, offset: int, length: int) -> bytes:
        """A piece of a version's index: a live one, or a removed one whose index is still kept (its
        chunks are not collected yet: a mount holds it, and a collection on a peer needs its list)."""
        info = self.find(name, version)
        try:
            if info is None:
                raise FileNotFoundError
            with open(self.index_path(name, version), "rb") as f:
                f.seek(offset)
                return f.read(length)
        except FileNotFoundError:
            self.get(name, version)  # the one-line NotFound that says which versions there are
            raise NotFound(f"the index of {name}@{version} is gone from this metadata daemon") from None

    # --- ingest sessions -------------------------------------------------------------------
    def begin(self, name: str) -> str:
        check_dataset_name(name)
        self.expire_sessions()
        sid = secrets.token_hex(8)
        path = self.staging / f"{sid}.idx"
        path.touch()
        self.sessions[sid] = Session(name, path, set(), time.monotonic())
        return sid

    def session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise Conflict(f"ingest session {sid} is unknown (the node restarted or it expired); run the ingest again")
        s.touched = time.monotonic()
        return s

    def expire_sessions(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if now - s.touched > SESSION_IDLE:
                log.info("dropping idle ingest session %s of %s", sid, s.name)
                self.abort(sid)
                self.expired.append(sid)

    def put_index(self, sid: str, offset: int, data: bytes | bytearray) -> None:
        s = self.session(sid)
        try:
            with open(s.path, "r+b") as f:
                f.seek(offset)
                f.write(data)
        except OSError as exc:
            raise _os_error(exc, f"cannot stage the index of {s.name}") from None

    def abort(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.path.unlink(missing_ok=True)

    def staged_chunks(self, sid: str, size: int, checksum: int) -> tuple[Session, Index]:
        """Check the staged index is whole and the one the client meant; returns it opened."""
        s = self.session(sid)
        actual = s.path.stat().st_size
        if actual != size:
            raise CorruptData(f"staged index of {s.name} has {actual} bytes, the client sent {size}")
        if file_checksum(s.path) != checksum:
            raise CorruptData(f"staged index of {s.name} does not match the client's checksum")
        return s, Index(s.path)

    def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        """Publish a staged index as the dataset's next version: the number is taken, the index file
        put in place and the version recorded in one catalog transaction."""
        s = self.session(sid)
        t = index.totals
        info = VersionInfo(s.name, 0, size, checksum, t.files, t.bytes, t.chunks, t.chunk_size, time.time())

        placed: list[Path] = []

        def publish(number: int) -> None:
            dest = self.index_path(s.name, number)
            try:
                dest.parent.mkdir(exist_ok=True)
                with open(s.path, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(s.path, dest)
                placed.append(dest)
                _fsync_dir(dest.parent)
            except OSError as exc:
                raise _os_error(exc, f"cannot commit {s.name}") from None

        try:
            info = self.catalog.add(info, publish)
        except DlfsError:
            for dest in placed:  # in place, but the version was not recorded: it never was
                dest.unlink(missing_ok=True)
            raise
        self._chunk_sets[(s.name, info.version)] = frozenset(index.chunk_ids())
        self.sessions.pop(sid, None)
        return info

    def install(self, sid: str, info: VersionInfo, index: Index) -> None:
        """Put a staged index in place under the number the cluster gave it (etcd), and record it."""
        s = self.session(sid)
        dest = self.index_path(info.name, info.version)
        try:
            dest.parent.mkdir(exist_ok=True)
            with open(s.path, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(s.path, dest)
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise _os_error(exc, f"cannot commit {info.name}") from None
        self.catalog.insert(info)
        self._chunk_sets[(info.name, info.version)] = frozenset(index.chunk_ids())
        self.sessions.pop(sid, None)

    def tombstone(self, info: VersionInfo) -> None:
        """A peer's or the cluster's removal of a version; its index stays until its chunks are freed."""
        if self.find(info.name, info.version) is None:
            self.catalog.insert(info)
        else:
            self.catalog.tombstone(info.name, {info.version}, info.removed)

    def drop_index(self, name: str, version: int) -> None:
        """The version's chunks are collected: its index file is no longer needed anywhere."""
        self.index_path(name, version).unlink(missing_ok=True)
        self._chunk_sets.pop((name, version), None)
        d = self.index_dir / name
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()

    def has_index(self, name: str, version: int) -> bool:
        return self.index_path(name, version).exists()

    def chunks_of(self, name: str, version: int) -> frozenset[bytes]:
        """The chunks one version references, from its index here (cached)."""
        key = (name, version)
        if key not in self._chunk_sets:
            idx = Index(self.index_path(name, version))
            try:
                self._chunk_sets[key] = frozenset(idx.chunk_ids())
            finally:
                idx.close()
        return self._chunk_sets[key]

    def remove(self, name: str, version: int | None = None) -> list[VersionInfo]:
        """Tombstone a dataset (or one version) in the catalog; its index files go."""
        gone = [self.get(name, version)] if version is not None else [v for v in self.catalog.versions(name) if not v.removed]
        if not gone:
            raise NotFound(f"no dataset named {name!r}")
        self._tombstone(name, {v.version for v in gone}, time.time())
        return gone

    def _tombstone(self, name: str, versions: set[int], when: float) -> None:
        self.catalog.tombstone(name, versions, when)
        for number in versions:
            self.index_path(name, number).unlink(missing_ok=True)
            self._chunk_sets.pop((name, number), None)
        if all(v.removed for v in self.catalog.versions(name)):
            shutil.rmtree(self.index_dir / name, ignore_errors=True)

    def apply_peer(self, info: VersionInfo, fetched: Path | None) -> bool:
        """Take a version a peer has: its tombstone, or (with its fetched index) the version itself.

        Returns whether anything changed here.
        """
        mine = self.find(info.name, info.version)
        if info.removed:
            if mine is None:
                return self.catalog.insert(info)
            if not mine.removed:
                self._tombstone(info.name, {info.version}, info.removed)
                return True
            return False
        if mine is not None:
            if mine.index_sum != info.index_sum and not mine.removed:
                log.error("dataset %s version %d differs between daemons (index %016x here, %016x on a peer); "
                          "keeping this daemon's", info.name, info.version, mine.index_sum, info.index_sum)
            return False
        if fetched is None:
            raise ValueError("a live version needs its index")
        if file_checksum(fetched) != info.index_sum or fetched.stat().st_size != info.index_size:
            raise CorruptData(f"index of {info.name}@{info.version} from a peer does not match its checksum")
        Index(fetched).close()  # parses: header, sizes, body checksum
        dest = self.index_path(info.name, info.version)
        dest.parent.mkdir(exist_ok=True)
        os.replace(fetched, dest)
        _fsync_dir(dest.parent)
        return self.catalog.insert(info)

    def staging_file(self) -> Path:
        return self.staging / f"peer-{secrets.token_hex(8)}.idx"

    def pins(self) -> set[bytes]:
        return {c for s in self.sessions.values() for c in s.pins}

    def live_chunks(self) -> set[bytes]:
        """Every chunk a committed version or an open ingest still needs."""
        live = self.committed_chunks()
        for s in self.sessions.values():
            live |= s.pins
        return live

    def committed_chunks(self) -> set[bytes]:
        """Every chunk a committed, live version references."""
        live: set[bytes] = set()
        for v in self.datasets():
            live |= self.chunks_of(v.name, v.version)
        return live


def _os_error(exc: OSError, what: str) -> DlfsError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: the metadata daemon's disk is full")
    return DlfsError(f"{what}: {exc.strerror}")
