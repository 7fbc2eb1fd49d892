"""The catalog: every dataset's committed versions (and the tombstones of removed ones), in SQLite.

Each version's chunk set (id and size) is recorded in the transaction that records the version, so
garbage collection never parses an index (one damaged index file must not stop it).

One transaction per change, from any thread: the metadata daemon changes it from the event loop
(remove, a peer's tombstone) and from worker threads (commit, a peer's version) alike, and a version
number is taken in the same transaction that records it, so two commits of one name on this daemon
can never get the same number (they did through the JSON file this replaces: no lock, one fixed
`catalog.tmp`). A catalog.json of an older dlfs is imported once and kept as catalog.json.imported.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from msgspec import Struct
from msgspec.structs import replace

from dlfs.errors import CorruptData, DlfsError, StorageFull
from dlfs.private import FILE_MODE
from dlfs.wire.messages import VersionInfo, decode

SCHEMA = 1  # the chunk tables below were added without a bump: an older dlfs ignores them, and
# a version recorded without its chunks gets them from its index at the next open (dlfs/meta/store.py)
BUSY_TIMEOUT = 10.0  # seconds a transaction waits for another process holding the database


COLUMNS = list(VersionInfo.__struct_fields__)
ChunkTable = list[tuple[bytes, int]]  # a version's chunks: (id, size)


class CatalogDamaged(CorruptData):
    """SQLite cannot open or read the catalog file (truncated, overwritten): it can be rebuilt."""


class Catalog:
    def __init__(self, path: Path, legacy: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, shared by the loop and worker threads
        try:
            # SQLite gives its -wal and -shm files the database's mode: 0600 here, whatever the umask.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit that returned survives a power cut
            with self._tx() as db:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
                db.execute("CREATE TABLE IF NOT EXISTS versions (name TEXT NOT NULL, version INTEGER NOT NULL, "
                           "index_size INTEGER NOT NULL, index_sum INTEGER NOT NULL, files INTEGER NOT NULL, "
                           "bytes INTEGER NOT NULL, chunks INTEGER NOT NULL, chunk_size INTEGER NOT NULL, "
                           "created REAL NOT NULL, removed REAL NOT NULL DEFAULT 0, PRIMARY KEY (name, version))")
                # A version's chunk set is known iff it has a chunk_sets row (an empty set has no chunks rows).
                db.execute("CREATE TABLE IF NOT EXISTS chunk_sets (name TEXT NOT NULL, version INTEGER NOT NULL, "
                           "PRIMARY KEY (name, version))")
                db.execute("CREATE TABLE IF NOT EXISTS chunks (name TEXT NOT NULL, version INTEGER NOT NULL, "
                           "id BLOB NOT NULL, size INTEGER NOT NULL, PRIMARY KEY (name, version, id)) WITHOUT ROWID")
                row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA,))
                elif row[0] != SCHEMA:
                    raise CorruptData(f"catalog {path} has schema {row[0]}; this dlfs reads {SCHEMA}")
                # Every page read once: damage shows now, where it can be rebuilt, not in a later commit.
                check = db.execute("PRAGMA quick_check(1)").fetchone()
                if check is None or check[0] != "ok":
                    raise CatalogDamaged(f"catalog {path} is damaged: {check[0] if check else 'no answer'}")
        except sqlite3.Error as exc:
            self._close_quietly()
            raise _error(exc, path) from None  # damage is CatalogDamaged; "locked" and the like are not
        except DlfsError:
            self._close_quietly()
            raise
        if legacy is not None and legacy.exists():
            self._import(legacy)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _close_quietly(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    def _import(self, legacy: Path) -> None:
        """Take an older dlfs's catalog.json (its damage is one clear error, as it always was)."""
        try:
            doc = json.loads(legacy.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptData(f"catalog {legacy} does not parse: {exc}") from None
        datasets = decode(_LegacyCatalog, doc, f"catalog {legacy} of an older dlfs", CorruptData).datasets
        versions = [v for vs in datasets.values() for v in vs]
        with self._tx() as db:
            db.executemany(f"INSERT OR IGNORE INTO versions VALUES ({', '.join('?' * len(COLUMNS))})",
                           [_row(v) for v in versions])
        legacy.replace(legacy.with_name(legacy.name + ".imported"))

    def all_versions(self) -> list[VersionInfo]:
        """Every version ever committed here, tombstones included, by name then number."""
        with self._tx() as db:
            rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM versions ORDER BY name, version").fetchall()
        return [_info(r) for r in rows]

    def versions(self, name: str) -> list[VersionInfo]:
        with self._tx() as db:
            rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM versions WHERE name = ? ORDER BY version",
                              (name,)).fetchall()
        return [_info(r) for r in rows]

    def find(self, name: str, version: int) -> VersionInfo | None:
        with self._tx() as db:
            row = db.execute(f"SELECT {', '.join(COLUMNS)} FROM versions WHERE name = ? AND version = ?",
                             (name, version)).fetchone()
        return _info(row) if row else None

    def next_version(self, name: str) -> int:
        """Versions are never reused, not even those of removed versions."""
        with self._tx() as db:
            return _next(db, name)

    def add(self, info: VersionInfo, publish: Any = None, chunks: ChunkTable | None = None) -> VersionInfo:
        """Record `info` (and its chunks, if given) under the next free number of its name (the number
        it carries is ignored), in one transaction; `publish(number)`, if given, runs inside it (say,
        putting the index file in place), so a failure there records nothing. Returns the version as
        recorded."""
        with self._tx() as db:
            info = replace(info, version=_next(db, info.name))
            if publish is not None:
                publish(info.version)
            db.execute(f"INSERT INTO versions VALUES ({', '.join('?' * len(COLUMNS))})", _row(info))
            if chunks is not None:
                _put_chunks(db, info.name, info.version, chunks)
        return info

    def insert(self, info: VersionInfo, chunks: ChunkTable | None = None) -> bool:
        """Record a version as a peer has it (number and all), with its chunks if given; False if this
        catalog has that number."""
        with self._tx() as db:
            cur = db.execute(f"INSERT OR IGNORE INTO versions VALUES ({', '.join('?' * len(COLUMNS))})", _row(info))
            if cur.rowcount == 1 and chunks is not None:
                _put_chunks(db, info.name, info.version, chunks)
            return cur.rowcount == 1

    def tombstone(self, name: str, versions: set[int], when: float, forget_chunks: bool = False) -> None:
        """Mark versions removed; `forget_chunks`: their chunk sets go too (their chunks are not needed)."""
        with self._tx() as db:
            db.executemany("UPDATE versions SET removed = ? WHERE name = ? AND version = ? AND removed = 0",
                           [(when, name, v) for v in sorted(versions)])
            if forget_chunks:
                for v in sorted(versions):
                    _forget_chunks(db, name, v)

    # --- chunk sets --------------------------------------------------------------------------
    def set_chunks(self, name: str, version: int, chunks: ChunkTable) -> None:
        """Record the chunks of a version recorded without them (its index read later)."""
        with self._tx() as db:
            _forget_chunks(db, name, version)
            _put_chunks(db, name, version, chunks)

    def forget_chunks(self, name: str, version: int) -> None:
        with self._tx() as db:
            _forget_chunks(db, name, version)

    def chunk_set(self, name: str, version: int) -> frozenset[bytes] | None:
        """The chunk ids a version references; None if they were never recorded."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM chunk_sets WHERE name = ? AND version = ?", (name, version)).fetchone() is None:
                return None
            rows = db.execute("SELECT id FROM chunks WHERE name = ? AND version = ?", (name, version)).fetchall()
        return frozenset(r[0] for r in rows)

    def unknown_chunk_sets(self) -> list[VersionInfo]:
        """The versions (live or removed) whose chunks were never recorded, by name then number."""
        with self._tx() as db:
            rows = db.execute(f"SELECT {', '.join('v.' + c for c in COLUMNS)} FROM versions v WHERE NOT EXISTS "
                              "(SELECT 1 FROM chunk_sets s WHERE s.name = v.name AND s.version = v.version) "
                              "ORDER BY v.name, v.version").fetchall()
        return [_info(r) for r in rows]


class _LegacyCatalog(Struct, frozen=True):
    """catalog.json of an older dlfs: {"datasets": {name: [VersionInfo, ...]}}."""

    datasets: dict[str, list[VersionInfo]]


class _Transaction:
    """`with catalog._tx() as db`: the lock, BEGIN IMMEDIATE, then COMMIT, or ROLLBACK on any error;
    SQLite's errors become dlfs's one-line ones."""

    def __init__(self, catalog: Catalog) -> None:
        self.c = catalog

    def __enter__(self) -> sqlite3.Connection:
        self.c._lock.acquire()
        try:
            self.c._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self.c._lock.release()
            raise _error(exc, self.c.path) from None
        return self.c._db

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if kind is None:
                try:
                    self.c._db.execute("COMMIT")
                except sqlite3.Error as e:
                    _rollback(self.c._db)
                    raise _error(e, self.c.path) from None
            else:
                _rollback(self.c._db)
                if isinstance(exc, sqlite3.Error):
                    raise _error(exc, self.c.path) from None
        finally:
            self.c._lock.release()


def _put_chunks(db: sqlite3.Connection, name: str, version: int, chunks: ChunkTable) -> None:
    db.execute("INSERT OR IGNORE INTO chunk_sets VALUES (?, ?)", (name, version))
    db.executemany("INSERT OR IGNORE INTO chunks VALUES (?, ?, ?, ?)", ((name, version, cid, size) for cid, size in chunks))


def _forget_chunks(db: sqlite3.Connection, name: str, version: int) -> None:
    db.execute("DELETE FROM chunks WHERE name = ? AND version = ?", (name, version))
    db.execute("DELETE FROM chunk_sets WHERE name = ? AND version = ?", (name, version))


def _rollback(db: sqlite3.Connection) -> None:
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # a damaged file can fail this too: the error that matters is the one being raised


def _next(db: sqlite3.Connection, name: str) -> int:
    return int(db.execute("SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE name = ?", (name,)).fetchone()[0])


def _row(v: VersionInfo) -> tuple[Any, ...]:
    """A version as a row: its u64 index checksum as the i64 SQLite stores (the same 64 bits)."""
    return tuple(getattr(v, c) - (1 << 64) if c == "index_sum" and getattr(v, c) >= 1 << 63 else getattr(v, c)
                 for c in COLUMNS)


def _info(row: tuple[Any, ...]) -> VersionInfo:
    return VersionInfo(*(x + (1 << 64) if c == "index_sum" and x < 0 else x for c, x in zip(COLUMNS, row)))


def _error(exc: sqlite3.Error, path: Path) -> DlfsError:
    text = str(exc)
    if "disk is full" in text or "database or disk is full" in text:
        return StorageFull(f"cannot write the catalog {path}: the metadata daemon's disk is full")
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in text:
        return CatalogDamaged(f"catalog {path} is not a dlfs catalog: {text}")
    if isinstance(exc, sqlite3.DatabaseError) and "malformed" in text:
        return CatalogDamaged(f"catalog {path} is damaged: {text}")
    return DlfsError(f"catalog {path}: {text}")
