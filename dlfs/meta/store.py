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
from fractions import Fraction
from pathlib import Path

from dlfs.config import check_dataset_name
from dlfs.errors import Conflict, CorruptData, DlfsError, NotFound, ProtocolError, StorageFull, UsageError
from dlfs.format.index import MAX_INDEX_BYTES, Index, file_checksum
from dlfs.meta.catalog import Catalog, CatalogDamaged, ChunkTable, VersionInfo
from dlfs.private import DIR_MODE, FILE_MODE, private_dirs

__all__ = ["MetaStore", "Session", "VersionInfo"]

log = logging.getLogger(__name__)
NS = 10**9  # nanoseconds a second: an index file's mtime in ns is its commit time
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
        private_dirs(self.index_dir)
        self.catalog = self._open_catalog()
        # Sessions live only as long as this daemon: an ingest that outlived it starts over.
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(mode=DIR_MODE)
        self.sessions: dict[str, Session] = {}
        self.expired: list[str] = []  # sessions dropped for idleness, for the cluster's record of them to go too
        self.session_ttl = session_ttl()
        self._learn_chunk_sets()

    def _open_catalog(self) -> Catalog:
        """The catalog; one SQLite cannot read is kept aside and rebuilt from the index files."""
        path, legacy = self.root / "catalog.db", self.root / "catalog.json"
        try:
            catalog = Catalog(path, legacy=legacy)
        except CatalogDamaged as exc:
            aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            for suffix in ("", "-wal", "-shm"):  # SQLite's journal files belong to the damaged copy
                part = path.with_name(path.name + suffix)
                if part.exists():
                    part.replace(aside.with_name(aside.name + suffix))
            self.catalog = catalog = Catalog(path, legacy=legacy)
            found, lost = self._adopt_index_files()
            log.warning("%s: kept as %s and rebuilt from the index files: versions recovered: %d%s",
                        exc, aside.name, found, _lost_phrase(lost))
            return catalog
        if not catalog.all_versions() and any(self.index_dir.glob("*/*.idx")):
            # An empty catalog beside index files was truncated or deleted: a new commit would reuse
            # their numbers and overwrite them.
            self.catalog = catalog
            found, lost = self._adopt_index_files()
            log.warning("catalog %s holds no versions but index files exist: rebuilt from them: versions "
                        "recovered: %d%s", path, found, _lost_phrase(lost))
        return catalog

    def _adopt_index_files(self) -> tuple[int, list[str]]:
        """Record every committed index file not in the catalog; an unreadable one is renamed
        <version>.idx.damaged (never served; its version is lost). Returns (recorded, lost labels)."""
        found, lost = 0, []
        for path in sorted(self.index_dir.glob("*/*.idx")):
            name, number = path.parent.name, path.stem
            if not number.isdigit():
                continue
            try:
                info, chunks = read_version(path, name, int(number))
            except (CorruptData, OSError) as exc:
                log.info("cannot recover %s@%s: %s", name, number, exc)
                path.replace(path.with_name(path.name + ".damaged"))
                lost.append(f"{name}@{number}")
                continue
            found += self.catalog.insert(info, chunks)
        return found, lost

    def _learn_chunk_sets(self) -> None:
        """Record, from its index, the chunks of each version recorded without them (by a dlfs
        before the catalog kept them); a version whose index cannot be read is reported damaged."""
        for v in self.catalog.unknown_chunk_sets():
            if v.removed and not self.has_index(v.name, v.version):
                continue  # collected, or removed here at once: its chunks are needed nowhere
            try:
                self._learn(v)
            except CorruptData as exc:
                log.warning("%s", exc)

    def _learn(self, info: VersionInfo) -> frozenset[bytes]:
        """A version's chunks read from its index and recorded; CorruptData if it cannot be read."""
        label = f"{info.name}@{info.version}"
        why = self.check_index(info)
        if not why:
            try:
                index = Index(self.index_path(info.name, info.version))
            except (CorruptData, OSError) as exc:
                why = str(exc)
            else:
                try:
                    chunks = chunk_table(index)
                finally:
                    index.close()
                self.catalog.set_chunks(info.name, info.version, chunks)
                return frozenset(cid for cid, _ in chunks)
        raise CorruptData(f"the chunks of {label} are unknown: its index is damaged ({why}); garbage collection "
                          f"frees nothing until it is restored or removed (dlfs rm {label})")

    def check_index(self, info: VersionInfo) -> str:
        """Why this daemon's index file of `info` is not the one committed; "" when it is."""
        path = self.index_path(info.name, info.version)
        try:
            size = path.stat().st_size
            if size != info.index_size:
                return f"its file has {size} bytes, {info.index_size} were committed"
            if file_checksum(path) != info.index_sum:
                return "its file fails its checksum"
        except FileNotFoundError:
            return "its file is missing"
        except OSError as exc:
            return f"its file cannot be read: {exc.strerror}"
        return ""

    def _place_fetched(self, info: VersionInfo, fetched: Path) -> ChunkTable:
        """Check an index fetched from a peer against its version and move it into place; returns its
        chunk table."""
        chunks = _checked_copy(fetched, info)
        self._put_in_place(fetched, info.name, info.version, info.created,
                           f"cannot install the index of {info.name}@{info.version}")
        return chunks

    def _put_in_place(self, src: Path, name: str, version: int, created: float, what: str) -> Path:
        """Move an index file to where a version's index lives, durably (the file, then its directory,
        synced), stamped with the version's commit time; returns where it went."""
        dest = self.index_path(name, version)
        try:
            dest.parent.mkdir(mode=DIR_MODE, exist_ok=True)
            _stamp(src, created)
            with open(src, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(src, dest)
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise _os_error(exc, what) from None
        return dest

    def restore_index(self, info: VersionInfo, fetched: Path) -> bool:
        """Put a good copy of a version's index (from a peer) in place of a damaged or missing one."""
        chunks = self._place_fetched(info, fetched)
        if self.catalog.chunk_set(info.name, info.version) is None:
            self.catalog.set_chunks(info.name, info.version, chunks)
        log.info("index of %s@%d put in place from a peer's copy", info.name, info.version)
        return True

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
                # Past the end reads nothing: seek and pread refuse offsets near 2**63 (EINVAL).
                if offset >= os.fstat(f.fileno()).st_size:
                    return b""
                return os.pread(f.fileno(), length, offset)
        except FileNotFoundError:
            self.get(name, version)  # the one-line NotFound that says which versions there are
            # A live version whose file is gone is damage (`dlfs verify` names it), not absence.
            raise CorruptData(f"index of {name}@{version}: its file is missing on this metadata daemon") from None

    # --- ingest sessions -------------------------------------------------------------------
    def begin(self, name: str) -> str:
        check_dataset_name(name)
        self.expire_sessions()
        sid = secrets.token_hex(8)
        path = self.staging / f"{sid}.idx"
        path.touch(mode=FILE_MODE)
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
            if now - s.touched > self.session_ttl:
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
            raise _os_error(exc, f"cannot stage the index of {s.name}") from None

    def abort(self, sid: str) -> set[bytes]:
        """Drop a session and its staged index; returns the chunks it had pinned."""
        s = self.sessions.pop(sid, None)
        if s is None:
            return set()
        s.path.unlink(missing_ok=True)
        return s.pins

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

    def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        """Publish a staged index as the dataset's next version: the number is taken, the index file
        put in place and the version recorded in one catalog transaction."""
        s = self.session(sid)
        t = index.totals
        info = VersionInfo(s.name, 0, size, checksum, t.files, t.bytes, t.chunks, t.chunk_size, time.time())
        chunks = chunk_table(index)  # recorded with the version: collection never parses an index
        placed: list[Path] = []

        def publish(number: int) -> None:
            placed.append(self._put_in_place(s.path, s.name, number, info.created, f"cannot commit {s.name}"))

        try:
            info = self.catalog.add(info, publish, chunks)
        except DlfsError:
            for dest in placed:  # in place, but the version was not recorded: it never was
                dest.unlink(missing_ok=True)
            raise
        self.sessions.pop(sid, None)
        return info

    def install(self, sid: str, info: VersionInfo, index: Index) -> None:
        """Put a staged index in place under the number the cluster gave it (etcd), and record it."""
        s = self.session(sid)
        self._put_in_place(s.path, info.name, info.version, info.created, f"cannot commit {info.name}")
        self.catalog.insert(info, chunk_table(index))
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
        self.catalog.forget_chunks(name, version)
        d = self.index_dir / name
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()

    def has_index(self, name: str, version: int) -> bool:
        return self.index_path(name, version).exists()

    def knows_chunks(self, name: str, version: int) -> bool:
        return self.catalog.chunk_set(name, version) is not None

    def chunks_of(self, name: str, version: int) -> frozenset[bytes]:
        """The chunks one version references, as the catalog recorded them (from its index if it never
        did); CorruptData naming the version if neither can tell."""
        ids = self.catalog.chunk_set(name, version)
        if ids is not None:
            return ids
        info = self.find(name, version)
        if info is None:
            raise NotFound(f"{name}@{version} is not in this metadata daemon's catalog")
        return self._learn(info)

    def remove(self, name: str, version: int | None = None) -> list[VersionInfo]:
        """Tombstone a dataset (or one version) in the catalog; its index files go."""
        gone = [self.get(name, version)] if version is not None else [v for v in self.catalog.versions(name) if not v.removed]
        if not gone:
            raise NotFound(f"no dataset named {name!r}")
        self._tombstone(name, {v.version for v in gone}, time.time())
        return gone

    def _tombstone(self, name: str, versions: set[int], when: float) -> None:
        self.catalog.tombstone(name, versions, when, forget_chunks=True)
        for number in versions:
            self.index_path(name, number).unlink(missing_ok=True)
        if all(v.removed for v in self.catalog.versions(name)):
            shutil.rmtree(self.index_dir / name, ignore_errors=True)

    def apply_peer(self, info: VersionInfo, fetched: Path | None) -> bool:
        """Take a version a peer has: its tombstone, or (with its fetched index) the version itself.

        Returns whether anything changed here.
        """
        mine = self.find(info.name, info.version)
        if info.removed and fetched is not None:  # removed, but a mount holds it: its index is kept
            if mine is None or not mine.removed:
                self.tombstone(info)
            return not self.has_index(info.name, info.version) and self.restore_index(info, fetched)
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
            if mine.removed or fetched is None or self.has_index(info.name, info.version):
                return False
            return self.restore_index(mine, fetched)  # recorded here, but its file was lost
        if fetched is None:
            raise ValueError("a live version needs its index")
        return self.catalog.insert(info, self._place_fetched(info, fetched))

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
        """Every chunk a committed, live version references; CorruptData naming a live version whose
        chunks are unknown (nothing may be freed while one might be its)."""
        live: set[bytes] = set()
        for v in self.datasets():  # a transaction per version: the loop's catalog reads get in between
            live |= self.chunks_of(v.name, v.version)
        return live


def chunk_table(index: Index) -> ChunkTable:
    """An open index's chunks: (id, size) each."""
    return [(ref.id, ref.size) for ref in (index.chunk(i) for i in range(index.totals.chunks))]


def read_version(path: Path, name: str, version: int) -> tuple[VersionInfo, ChunkTable]:
    """A committed index file as its catalog row and chunks: what commit recorded, the time of the
    commit being the file's mtime (commit sets it)."""
    st = path.stat()
    index = Index(path)
    try:
        t, chunks = index.totals, chunk_table(index)
    finally:
        index.close()
    info = VersionInfo(name, version, st.st_size, file_checksum(path), t.files, t.bytes, t.chunks, t.chunk_size,
                       st.st_mtime_ns / NS)
    return info, chunks


def _checked_copy(fetched: Path, info: VersionInfo) -> ChunkTable:
    """A peer's copy of an index: the one committed (size and checksum), and it parses; its chunks."""
    if fetched.stat().st_size != info.index_size or file_checksum(fetched) != info.index_sum:
        raise CorruptData(f"index of {info.name}@{info.version} from a peer does not match its checksum")
    index = Index(fetched)  # parses: header, sizes, body checksum
    try:
        return chunk_table(index)
    finally:
        index.close()


def _stamp(path: Path, created: float) -> None:
    """An index file's mtime is its commit time: what a rebuilt catalog records as created."""
    ns = round(Fraction(created) * NS)  # exact: st_mtime_ns / NS (correctly rounded) gives `created` back
    os.utime(path, ns=(ns, ns))


def _lost_phrase(lost: list[str]) -> str:
    if not lost:
        return ""
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    return f"; {len(lost)} unreadable index files kept as *.idx.damaged, their versions lost ({', '.join(lost[:5])}{more})"


def _os_error(exc: OSError, what: str) -> DlfsError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: the metadata daemon's disk is full")
    return DlfsError(f"{what}: {exc.strerror}")
