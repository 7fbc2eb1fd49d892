"""The catalog: every dataset's committed versions (and the tombstones of removed ones), in SQLite.

One transaction per change, from any thread: the metadata daemon changes it from the event loop
(remove, a peer's tombstone) and from worker threads (commit, a peer's version) alike, and a version
number is taken in the same transaction that records it, so two commits of one name on this daemon
can never get the same number (they did through the JSON file this replaces: no lock, one fixed
`catalog.tmp`). A catalog.json of an older dlfs is imported once and kept as catalog.json.imported.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from dlfs.errors import CorruptData, DlfsError, StorageFull

SCHEMA = 1
BUSY_TIMEOUT = 10.0  # seconds a transaction waits for another process holding the database


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
    removed: float = 0.0  # when it was removed: the tombstone stops peers bringing it back

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


COLUMNS = [f.name for f in fields(VersionInfo)]


class Catalog:
    def __init__(self, path: Path, legacy: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, shared by the loop and worker threads
        try:
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit that returned survives a power cut
            with self._tx() as db:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
                db.execute("CREATE TABLE IF NOT EXISTS versions (name TEXT NOT NULL, version INTEGER NOT NULL, "
                           "index_size INTEGER NOT NULL, index_sum INTEGER NOT NULL, files INTEGER NOT NULL, "
                           "bytes INTEGER NOT NULL, chunks INTEGER NOT NULL, chunk_size INTEGER NOT NULL, "
                           "created REAL NOT NULL, removed REAL NOT NULL DEFAULT 0, PRIMARY KEY (name, version))")
                row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA,))
                elif row[0] != SCHEMA:
                    raise CorruptData(f"catalog {path} has schema {row[0]}; this dlfs reads {SCHEMA}")
        except sqlite3.DatabaseError as exc:
            raise CorruptData(f"catalog {path} is not a dlfs catalog: {exc}") from None
        if legacy is not None and legacy.exists():
            self._import(legacy)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    def _import(self, legacy: Path) -> None:
        """Take an older dlfs's catalog.json (its damage is one clear error, as it always was)."""
        try:
            doc = json.loads(legacy.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptData(f"catalog {legacy} does not parse: {exc}") from None
        try:
            versions = [VersionInfo(**v) for vs in doc["datasets"].values() for v in vs]
        except (KeyError, TypeError, AttributeError) as exc:
            raise CorruptData(f"catalog {legacy} is not a dlfs catalog ({type(exc).__name__}: {exc})") from None
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

    def add(self, info: VersionInfo, publish: Any = None) -> VersionInfo:
        """Record `info` under the next free number of its name (the number it carries is ignored),
        in one transaction; `publish(number)`, if given, runs inside it (say, putting the index file in
        place), so a failure there records nothing. Returns the version as recorded."""
        with self._tx() as db:
            info = replace(info, version=_next(db, info.name))
            if publish is not None:
                publish(info.version)
            db.execute(f"INSERT INTO versions VALUES ({', '.join('?' * len(COLUMNS))})", _row(info))
        return info

    def insert(self, info: VersionInfo) -> bool:
        """Record a version as a peer has it (number and all); False if this catalog has that number."""
        with self._tx() as db:
            cur = db.execute(f"INSERT OR IGNORE INTO versions VALUES ({', '.join('?' * len(COLUMNS))})", _row(info))
            return cur.rowcount == 1

    def tombstone(self, name: str, versions: set[int], when: float) -> None:
        with self._tx() as db:
            db.executemany("UPDATE versions SET removed = ? WHERE name = ? AND version = ? AND removed = 0",
                           [(when, name, v) for v in sorted(versions)])


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
                    self.c._db.execute("ROLLBACK")
                    raise _error(e, self.c.path) from None
            else:
                self.c._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise _error(exc, self.c.path) from None
        finally:
            self.c._lock.release()


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
    if isinstance(exc, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text):
        return CorruptData(f"catalog {path} is damaged: {text}")
    return DlfsError(f"catalog {path}: {text}")
