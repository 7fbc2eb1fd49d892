"""The catalog and index files of the metadata daemon, no network.

    catalog.db                 every dataset's committed versions (SQLite, dlfs/meta/catalog.py)
    index/<name>/<version>.idx the committed index files, immutable
    staging/                   ingests' indexes while they upload (dlfs/meta/sessions.py, `ingests`)

A commit moves a staged index into place and records it; every other change here is a catalog row
and the index file it names, kept in step (an index file is in place before its row is recorded).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from fractions import Fraction
from pathlib import Path

from msgspec.structs import replace

from dlfs.errors import CorruptData, DlfsError, NotFound
from dlfs.format.index import Index, file_checksum
from dlfs.meta.catalog import Catalog, CatalogDamaged, ChunkTable, VersionInfo
from dlfs.meta.sessions import IngestSessions, os_error
from dlfs.private import DIR_MODE, private_dirs

__all__ = ["MetaStore", "VersionInfo"]

log = logging.getLogger(__name__)
NS = 10**9  # nanoseconds a second: an index file's mtime in ns is its commit time
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
        private_dirs(self.index_dir)
        # A dataset's index directory is made by a commit and removed, once empty, by a collection: from
        # threads of their own, so one must not remove it between the other's mkdir and its rename.
        self._dirs = threading.Lock()
        self.catalog = self._open_catalog()
        self.ingests = IngestSessions(root / "staging")
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
            _stamp(src, created)
            with open(src, "rb+") as f:
                os.fsync(f.fileno())
            with self._dirs:
                dest.parent.mkdir(mode=DIR_MODE, exist_ok=True)
                os.replace(src, dest)
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise os_error(exc, what) from None
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

    def commit(self, sid: str, index: Index, size: int, checksum: int) -> VersionInfo:
        """Publish a staged index as the dataset's next version: the number is taken, the index file
        put in place and the version recorded in one catalog transaction."""
        s = self.ingests.session(sid)
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
        self.ingests.end(sid)
        return info

    def install(self, sid: str, info: VersionInfo, index: Index) -> None:
        """Put a staged index in place under the number the cluster gave it (etcd), and record it."""
        s = self.ingests.session(sid)
        self._put_in_place(s.path, info.name, info.version, info.created, f"cannot commit {info.name}")
        self.catalog.insert(info, chunk_table(index))
        self.ingests.end(sid)

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
        with self._dirs:  # (two collections of one dataset's versions may end at once: one removes it)
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
        """Tombstone a dataset (or one version) in the catalog; its index files go. Returns the versions
        as tombstoned (`removed` set, as etcd's removal returns them)."""
        gone = [self.get(name, version)] if version is not None else [v for v in self.catalog.versions(name) if not v.removed]
        if not gone:
            raise NotFound(f"no dataset named {name!r}")
        now = time.time()
        self._tombstone(name, {v.version for v in gone}, now)
        return [replace(v, removed=now) for v in gone]

    def _tombstone(self, name: str, versions: set[int], when: float) -> None:
        self.catalog.tombstone(name, versions, when, forget_chunks=True)
        for number in versions:
            self.index_path(name, number).unlink(missing_ok=True)
        if all(v.removed for v in self.catalog.versions(name)):
            with self._dirs:
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

    def live_chunks(self) -> set[bytes]:
        """Every chunk a committed version or an open ingest still needs."""
        return self.committed_chunks() | self.ingests.pins()

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

