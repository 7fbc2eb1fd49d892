"""The catalog and index files of the metadata daemon, no network.

    catalog.json               every dataset's committed versions (replaced atomically)
    index/<name>/<version>.idx the committed index files, immutable
    staging/<session>.idx      an ingest's index while it uploads; never visible until commit
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlfs.config import check_dataset_name
from dlfs.errors import Conflict, CorruptData, DlfsError, NotFound, StorageFull
from dlfs.format.index import Index, file_checksum

log = logging.getLogger(__name__)
SESSION_IDLE = 3600.0


@dataclass(frozen=True)
class VersionInfo:
    name: str
    version: int
    index_size: int
    index_sum: int
    files: int
    bytes: int
    chunks: int
    chunk_size: int
    created: float

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


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
        self.catalog_path = root / "catalog.json"
        self.index_dir.mkdir(parents=True, exist_ok=True)
        # Sessions live only as long as this daemon: an ingest that outlived it starts over.
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.catalog: dict[str, list[VersionInfo]] = self._load()
        self.sessions: dict[str, Session] = {}
        self._chunk_sets: dict[tuple[str, int], frozenset[bytes]] = {}

    def _load(self) -> dict[str, list[VersionInfo]]:
        try:
            doc = json.loads(self.catalog_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CorruptData(f"catalog {self.catalog_path} does not parse: {exc}") from None
        try:
            return {name: [VersionInfo(**v) for v in versions] for name, versions in doc["datasets"].items()}
        except (KeyError, TypeError, AttributeError) as exc:  # valid JSON, wrong shape: still one clear line
            raise CorruptData(f"catalog {self.catalog_path} is not a dlfs catalog ({type(exc).__name__}: {exc})") from None

    def _save(self) -> None:
        doc = {"format": 1, "datasets": {n: [asdict(v) for v in vs] for n, vs in self.catalog.items()}}
        tmp = self.catalog_path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.catalog_path)
            _fsync_dir(self.root)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, "cannot write the catalog") from None

    def datasets(self) -> list[VersionInfo]:
        return [v for name in sorted(self.catalog) for v in self.catalog[name]]

    def get(self, name: str, version: int | None = None) -> VersionInfo:
        versions = self.catalog.get(name)
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
        self.get(name, version)
        with open(self.index_path(name, version), "rb") as f:
            f.seek(offset)
            return f.read(length)

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
        """Publish a staged index as the dataset's next version (atomic: rename, then catalog)."""
        s = self.session(sid)
        versions = self.catalog.get(s.name, [])
        number = versions[-1].version + 1 if versions else 1
        t = index.totals
        info = VersionInfo(s.name, number, size, checksum, t.files, t.bytes, t.chunks, t.chunk_size, time.time())
        dest = self.index_path(s.name, number)
        try:
            dest.parent.mkdir(exist_ok=True)
            with open(s.path, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(s.path, dest)
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise _os_error(exc, f"cannot commit {s.name}") from None
        self.catalog[s.name] = versions + [info]
        try:
            self._save()
        except DlfsError:
            self.catalog[s.name] = versions
            dest.unlink(missing_ok=True)
            raise
        self._chunk_sets[(s.name, number)] = frozenset(index.chunk_ids())
        self.sessions.pop(sid, None)
        return info

    def remove(self, name: str, version: int | None = None) -> list[VersionInfo]:
        """Drop a dataset (or one version) from the catalog; its index files go with it."""
        gone = [self.get(name, version)] if version is not None else list(self.catalog.get(name, []))
        if not gone:
            raise NotFound(f"no dataset named {name!r}")
        keep = [v for v in self.catalog[name] if v not in gone]
        old = self.catalog[name]
        if keep:
            self.catalog[name] = keep
        else:
            del self.catalog[name]
        try:
            self._save()
        except DlfsError:
            self.catalog[name] = old
            raise
        for v in gone:
            self.index_path(name, v.version).unlink(missing_ok=True)
            self._chunk_sets.pop((name, v.version), None)
        if not keep:
            shutil.rmtree(self.index_dir / name, ignore_errors=True)
        return gone

    def live_chunks(self) -> set[bytes]:
        """Every chunk a committed version or an open ingest still needs."""
        live: set[bytes] = set()
        for v in self.datasets():
            key = (v.name, v.version)
            if key not in self._chunk_sets:
                idx = Index(self.index_path(v.name, v.version))
                try:
                    self._chunk_sets[key] = frozenset(idx.chunk_ids())
                finally:
                    idx.close()
            live |= self._chunk_sets[key]
        for s in self.sessions.values():
            live |= s.pins
        return live


def _os_error(exc: OSError, what: str) -> DlfsError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: the metadata daemon's disk is full")
    return DlfsError(f"{what}: {exc.strerror}")
