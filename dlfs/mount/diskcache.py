"""The disk cache of a compute-only node: verified chunk ranges kept on local disk, shared by every
mount (and `dlfs warmup`) of the node that names the same directory, and kept across remounts.

Layout: DIR/catalogue.db (SQLite, WAL: several processes read and write it at once) says which byte
ranges of which chunk are held; DIR/chunks/ab/<chunk id>.<tag> is a sparse file with those ranges at
their offsets in the chunk. The catalogue is the truth: a range is listed only after its bytes were
written, so a crash leaves at worst bytes nobody lists; a chunk's file name is new each time the chunk
comes back after eviction, so no reader or writer holding an old name can mix the two. Ranges of one
chunk are merged as they come, so any range inside what was fetched before hits, however the next
epoch's windows fall.

Never trusted: a read from here goes through the same checks (each record's xxh3) as a fetch from a
replica (ChunkCache._from_sources); bytes that fail make the caller drop the chunk here and go to the
replicas. Bounded: by --cache-dir-size (kept in the catalogue: the last one given holds for every
process), else by the file system, of which 10% is left free; least recently read chunks go first,
and a full disk (ENOSPC) evicts and drops the write, never a read. Writes are off the read path: a
verified fetch is copied into one of a few reused buffers and written by a thread of its own;
when they are all taken (the disk falls behind) the write is dropped. Private: DIR 0700, files 0600.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlfs.errors import NO_ROOM, UsageError
from dlfs.mount.localchunks import DIRECT_ALIGN, DiskQueue, _pread_uncached, _read_window, direct_span
from dlfs.pagecache import all_cached
from dlfs.private import DIR_MODE, FILE_MODE, OTHERS, private_dirs
from dlfs.units import human_bytes

log = logging.getLogger(__name__)
Buffer = bytes | bytearray | memoryview
SCHEMA = 1
CATALOGUE = "catalogue.db"
SOURCE = "disk-cache"  # the name its reads are counted under, beside the nodes (dlfs stats "fetched by node")
FREE_SHARE = 0.10  # with no --cache-dir-size: evict while the file system has less than this share free
WRITE_SLOTS = 8  # buffers of fetched windows waiting for the writer: beyond them a write is dropped
# Records fetched alone (a quarter of a window or less: scan mode's misses) wait in buffers of their own
# size, as many as fit in what the slots would hold (16 MiB at least): one slot each would keep 8, and an epoch's
# misses come faster than the writer took 8 at a time (an ~8,000-file epoch dropped 1,258 of 6,300).
SMALL_WRITE = 4  # a write is small when at most slot_bytes / this
SMALL_QUEUED_MIN = 16 << 20  # small writes may wait up to this many bytes, however small the windows are
WRITE_BATCH = 64  # queued writes the writer takes at once (one pair of catalogue transactions)
WRITES = ("put", "own")  # the writer's jobs that write: into a reused window buffer, or a buffer of its own
FLUSH_EVERY = 2.0  # seconds between writes of the chunks read since (LRU order): not one per read
EVICT_BATCH = 16  # chunks evicted per catalogue transaction
BUSY_MS = 10_000  # a writer waits this long for another process's transaction
LOOKUP_BUSY_MS = 200  # a lookup on the read path gives up sooner: a miss costs only a fetch
CLOSE_TIMEOUT = 10.0
RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)
_dontcache = [RWF_DONTCACHE]

_TABLES = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunks(cid BLOB PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL,
                                  used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks(used);
CREATE TABLE IF NOT EXISTS ranges(cid BLOB NOT NULL, off INTEGER NOT NULL, end INTEGER NOT NULL,
                                  PRIMARY KEY (cid, off)) WITHOUT ROWID;
"""


def refusal(root: Path) -> tuple[str, str] | None:
    """Why a mount refuses the directory `root` as it is now, and what to do about it; None where it
    takes it (a loose mode it tightens). OSError where `root` cannot be looked at. `dlfs doctor` asks
    the same, so that it says what a mount would."""
    st = os.lstat(root)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symlink is not taken: name its target)", "name the directory itself"
    if st.st_uid != uid:
        return (f"belongs to uid {st.st_uid}, not {uid}: it would hold every file's bytes, so it must be this "
                "user's own", f"chown -R {uid} {root}, or name a directory of this user's")
    if not os.access(root, os.W_OK | os.X_OK):
        return f"is not writable by uid {uid}", "name a directory this user can write"
    return None


def check_cache_dir(root: Path) -> Path:
    """`root` made (0700) or found: a directory of this user's that no other user can read; a loose
    mode is tightened (with a warning), what refusal() says is a one-line UsageError."""
    try:
        private_dirs(root)
        why = refusal(root)
        mode = stat.S_IMODE(os.lstat(root).st_mode)
    except OSError as exc:
        raise UsageError(f"--cache-dir {root}: {exc.strerror}") from None
    if why is not None:
        raise UsageError(f"--cache-dir {root} {why[0]}")
    if mode & OTHERS:
        log.warning("--cache-dir %s had mode %04o: made it 0700 (it holds dataset bytes)", root, mode)
        os.chmod(root, DIR_MODE)
    return root


def room_left(root: Path) -> int:
    """Bytes a cache with no --cache-dir-size may still take on `root`'s file system before it leaves
    less than FREE_SHARE of it free (negative: that much over)."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize - int(st.f_blocks * st.f_frsize * FREE_SHARE)


@dataclass(frozen=True)
class Contents:
    """What a disk cache directory's catalogue says it holds (`dlfs doctor`)."""

    schema: int | None  # None: no catalogue's tables yet
    chunks: int
    bytes: int
    size: int | None  # --cache-dir-size as last given; None: bounded by the file system's free share


def contents(root: Path) -> Contents | None:
    """What the disk cache in `root` holds, read without writing to it; None where there is no catalogue."""
    path = root / CATALOGUE
    if not path.is_file():
        return None
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=BUSY_MS / 1000)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        chunks = int(db.execute("SELECT count(*) FROM chunks").fetchone()[0])
    except sqlite3.OperationalError:  # no tables: made, never written
        return Contents(None, 0, 0, None)
    finally:
        db.close()
    schema = int(meta["schema"]) if "schema" in meta else None
    size = int(meta["size"]) if "size" in meta else None
    return Contents(schema, chunks, int(meta.get("bytes", 0)), size)


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's word that a catalogue is not a database, or is one no longer whole."""
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT on a chunk file, or SQLITE_FULL on the catalogue: no room, not a fault."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in NO_ROOM


def _pwrite_all(fd: int, data: Buffer, off: int) -> None:
    """Write all of `data` at `off`, leaving no page cache behind where the kernel can (RWF_DONTCACHE):
    what is read from here goes to the mount's slabs, and the kernel keeps the FUSE file's pages."""
    view = memoryview(data)
    while view:
        try:
            n = os.pwritev(fd, [view], off, _dontcache[0])
        except OSError as exc:
            if _dontcache[0] and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                _dontcache[0] = 0
                continue
            raise
        view, off = view[n:], off + n


def _pieces(buf: bytearray, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
    """The bytes of each range, laid end to end in `buf` (as put() copies them)."""
    view, out, at = memoryview(buf), [], 0
    for _, n in ranges:
        out.append(view[at : at + n])
        at += n
    return out


def _read_ranges(path: Path, ranges: Sequence[tuple[int, int]], into: memoryview | None) -> list[memoryview] | None:
    """The ranges of the file (the first into `into` where it fits: straight from the disk, O_DIRECT,
    unless the page cache holds it all, so it may start a little into `into`); None if the file is
    short (a crash lost its bytes) or gone (evicted meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    out: list[memoryview] = []
    try:
        for i, (off, n) in enumerate(ranges):
            lo, hi = direct_span(off, n)
            if i == 0 and into is not None and hi - lo <= len(into):
                cached = all_cached(fd, off, n)
                dfd = -1
                if not cached:
                    try:
                        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                    except OSError:
                        cached = True  # no O_DIRECT on this file system: through the page cache
                try:
                    try:
                        start, got = _read_window(fd, dfd, off, n, lo, hi, cached, into)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL or cached:
                            raise
                        # O_DIRECT refused (memory not page-aligned, or a file system without it).
                        start, got = _read_window(fd, dfd, off, n, lo, hi, True, into)
                finally:
                    if dfd >= 0:
                        os.close(dfd)
                if got < n:
                    return None
                out.append(into[start : start + n])
                continue
            buf = memoryview(bytearray(n))
            got = 0
            while got < n:
                k = _pread_uncached(fd, buf[got:], off + got)
                if k <= 0:
                    return None
                got += k
            out.append(buf)
    finally:
        os.close(fd)
    return out


class DiskCache:
    """One process's view of a cache directory (see the module's comment for what it promises)."""

    def __init__(self, root: Path, size: int | None = None, slot_bytes: int = (4 << 20) + 2 * DIRECT_ALIGN) -> None:
        self.root = check_cache_dir(root)
        self.chunk_dir = private_dirs(root / "chunks")
        self.db_path = root / CATALOGUE
        self._local = threading.local()  # one connection per thread (SQLite's rule)
        try:
            self._open_catalogue(size)
        except sqlite3.DatabaseError as exc:
            if not damaged(exc):
                raise
            self._start_over(exc)
            self._open_catalogue(size)
        st = os.stat(self.db_path)
        self._ident = (st.st_dev, st.st_ino)  # the catalogue this process opened (see _gone)
        self.slot_bytes = slot_bytes
        self._slots: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._nslots = 0  # buffers made so far (lazily: an idle cache costs no memory)
        self._small_bytes = 0  # bytes of small writes queued (each in a buffer of its own)
        self._small_bound = max(WRITE_SLOTS * slot_bytes, SMALL_QUEUED_MIN)  # ... at most
        self._lock = threading.Lock()  # those bytes, and the one writer thread's start
        # (what, chunk, ranges, a buffer to write or the file to drop)
        self._jobs: queue.SimpleQueue[tuple[str, bytes, list[tuple[int, int]], bytearray | str | None]] = \
            queue.SimpleQueue()
        self._used: dict[bytes, float] = {}  # chunks read since the last flush -> when
        self._read_from: dict[bytes, str] = {}  # chunk -> the file it was last read from here
        self._bad: set[str] = set()  # files whose bytes failed a check: passed over until dropped
        self._writer: threading.Thread | None = None
        self._closed = False
        self._said_full = False
        # Why the catalogue stopped answering while this process used it (damaged under it): from then
        # on this process neither reads nor writes the cache; the next one to open it starts it over.
        self.broken: str | None = None
        self.disk = DiskQueue()
        # Told (chunk, its file's name, or None: none now) whenever this process writes, evicts or drops a
        # chunk's file: the mount's serving threads read files by name (diskreads.py). From the writer
        # thread and the event loop both.
        self.on_file: Callable[[bytes, str | None], None] | None = None
        self._sweeper = threading.Thread(target=self._sweep, name="dlfs-disk-cache-sweep", daemon=True)
        self._sweeper.start()
        self.hits = self.misses = self.hit_bytes = self.written = self.written_bytes = 0
        self.dropped = self.evicted = self.evicted_bytes = self.corrupt = self.full = self.errors = 0

    # --- the catalogue ---

    def _open_catalogue(self, size: int | None) -> None:
        """The catalogue opened (made with its tables where new); `size` noted as the bound."""
        # Made 0600 before SQLite opens it: its -wal and -shm files take the database's mode.
        os.close(os.open(self.db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE))
        with self._txn() as db:
            found = self._schema(db)
            if found is None:
                for statement in filter(str.strip, _TABLES.split(";")):
                    db.execute(statement)
                db.execute("INSERT INTO meta VALUES ('schema', ?), ('bytes', 0)", (SCHEMA,))
            elif found != SCHEMA:
                raise UsageError(f"--cache-dir {self.root} holds a disk cache of another format ({found}, this dlfs "
                                 f"reads {SCHEMA}): remove it (`rm -r {self.root}`) or name another")
            if size is not None:  # the last size given holds for every process using the directory
                db.execute("INSERT OR REPLACE INTO meta VALUES ('size', ?)", (size,))

    def note_damage(self, exc: BaseException) -> bool:
        """Whether `exc` says the catalogue is damaged; the first time, this process stops using the cache
        (one warning line, not one per write)."""
        if not (isinstance(exc, sqlite3.DatabaseError) and damaged(exc)):
            return False
        self._stop_using(f"its catalogue was damaged ({exc})", f"its catalogue is damaged ({exc})",
                         "sets it aside and starts over")
        return True

    def _stop_using(self, why: str, said: str, next_one: str) -> None:
        if self.broken is None:
            self.broken = why
            log.warning("disk cache %s: %s: this process stops using it; the next mount or warmup %s", self.root,
                        said, next_one)

    def _check_gone(self) -> bool:
        """_gone(), and if so this process stops using the cache (one line)."""
        if not self._gone():
            return False
        self._stop_using("its directory was removed or its catalogue replaced",
                         "its directory was removed or its catalogue replaced under it", "makes it again")
        return True

    def _gone(self) -> bool:
        """Whether the catalogue this process opened is no longer the directory's (removed, or replaced:
        set aside by another process): its writes would then list bytes in a file no one reads."""
        try:
            st = os.stat(self.db_path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ident

    def _sweep(self) -> None:
        """Remove the chunk files the catalogue does not list (an eviction cut short, or a process that
        wrote on under a directory removed and made again): nothing else would ever free them. A file is
        listed before it is written, so one the catalogue read after the listing lacks is no one's."""
        try:
            on_disk = self._chunk_files()
            if not on_disk:
                return
            listed = {name for name, in self._db().execute("SELECT file FROM chunks")}
            if self._gone():
                return  # (started over by another process meanwhile: these names are not the directory's)
            gone = freed = 0
            for entry in on_disk:
                if entry.name not in listed:
                    try:
                        freed += entry.stat(follow_symlinks=False).st_blocks * 512
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue  # (its eviction finished meanwhile)
                    gone += 1
            if gone:
                log.info("disk cache %s: removed %d chunk files no catalogue entry lists (%s)", self.root, gone,
                         human_bytes(freed))
        except (OSError, sqlite3.Error) as exc:
            log.debug("disk cache %s: sweep: %s", self.root, exc)
        finally:
            db = getattr(self._local, "db", None)
            if db is not None:
                db.close()

    def _chunk_files(self) -> list[os.DirEntry[str]]:
        """The files under chunks/ab/, listed or not."""
        return [entry for sub in os.scandir(self.chunk_dir) if sub.is_dir(follow_symlinks=False)
                for entry in os.scandir(sub.path) if entry.is_file(follow_symlinks=False)]

    def _start_over(self, exc: sqlite3.DatabaseError) -> None:
        """A damaged catalogue set aside (kept as catalogue.db.damaged, for a look), the chunk files it
        listed removed (nothing can say which bytes in them were written whole), the cache empty."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
        try:
            contents(self.root)
            return  # whole now: another process of this directory's started it over meanwhile
        except sqlite3.DatabaseError as again:
            if not damaged(again):
                raise
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{self.db_path}{suffix}", f"{self.db_path}.damaged{suffix}")
            except FileNotFoundError:
                pass  # (another process of this directory's got there first)
        removed = 0
        for entry in self._chunk_files():
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
        log.warning("disk cache %s: its catalogue is damaged (%s): set aside as %s.damaged, its %d chunk files "
                    "removed; starting empty", self.root, exc, CATALOGUE, removed)

    def _db(self, busy_ms: int = BUSY_MS) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.db_path, timeout=busy_ms / 1000, isolation_level=None, check_same_thread=True)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a power cut may lose the newest rows, never make one bad
            self._local.db = db
        db.execute(f"PRAGMA busy_timeout={busy_ms}")
        return db

    @contextmanager
    def _txn(self, busy_ms: int = BUSY_MS) -> Iterator[sqlite3.Connection]:
        """A write transaction (taken at once: BEGIN IMMEDIATE, so two processes never deadlock)."""
        db = self._db(busy_ms)
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        try:
            db.execute("COMMIT")
        except sqlite3.Error:
            if db.in_transaction:  # a COMMIT that failed (a full disk) may leave it open
                db.execute("ROLLBACK")
            raise

    @staticmethod
    def _schema(db: sqlite3.Connection) -> int | None:
        try:
            row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.OperationalError:
            return None  # no tables yet
        return None if row is None else int(row[0])

    @staticmethod
    def _covered(db: sqlite3.Connection, cid: bytes, ranges: Sequence[tuple[int, int]]) -> bool:
        for off, n in ranges:
            # Ranges of a chunk are merged, so only the last one starting at or before `off` can hold it.
            row = db.execute("SELECT end FROM ranges WHERE cid=? AND off<=? ORDER BY off DESC LIMIT 1",
                             (cid, off)).fetchone()
            if row is None or row[0] < off + n:
                return False
        return True

    def lookup(self, cid: bytes, ranges: Sequence[tuple[int, int]],
               least: int | None = None) -> tuple[Path, list[tuple[int, int]]] | None:
        """(the file holding all of `ranges` of chunk `cid`, those ranges), if this cache has them; else,
        with `least`, the first range cut to that length where it has that (a window without its last
        record's block sums, as kept before windows had them); None otherwise."""
        db = self._db(LOOKUP_BUSY_MS)
        row = db.execute("SELECT file FROM chunks WHERE cid=?", (cid,)).fetchone()
        if row is None:
            return None
        if self._covered(db, cid, ranges):
            return self._path(row[0]), list(ranges)
        shorter = [(ranges[0][0], least), *ranges[1:]] if least is not None and least < ranges[0][1] else None
        if shorter is not None and self._covered(db, cid, shorter):
            return self._path(row[0]), shorter
        return None

    def _path(self, name: str) -> Path:
        return self.chunk_dir / name[:2] / name

    def files(self) -> dict[bytes, str]:
        """Every chunk held now, and its file's name (blocking: a thread's)."""
        return dict(self._db().execute("SELECT cid, file FROM chunks").fetchall())

    def _tell(self, cid: bytes, name: str | None) -> None:
        if self.on_file is not None:
            self.on_file(cid, name)

    def size_bound(self) -> int | None:
        row = self._db().execute("SELECT value FROM meta WHERE key='size'").fetchone()
        return None if row is None else int(row[0])

    def held_bytes(self) -> int:
        """Bytes of chunk data held (the files may take up to a block more per range)."""
        return int(self._db().execute("SELECT value FROM meta WHERE key='bytes'").fetchone()[0])

    # --- reads (the event loop) ---

    async def read(self, cid: bytes, ranges: list[tuple[int, int]], into: memoryview | None = None,
                   urgent: bool = True, order: int | None = None, least: int | None = None) -> list[memoryview] | None:
        """The ranges of chunk `cid` (the first into `into` when given), unchecked (the caller checks
        them, and calls drop() if they are bad), if this cache holds them all (or, with `least`, the
        first cut to that length: see lookup); None otherwise."""
        if self._closed or self.broken:
            return None
        try:
            found = self.lookup(cid, ranges, least)
        except sqlite3.Error as exc:
            self.errors += 1
            if not self.note_damage(exc):
                log.debug("disk cache lookup of chunk %s: %s", cid.hex(), exc)
            return None
        if found is None or found[0].name in self._bad:
            self.misses += 1
            return None
        path, ranges = found
        self._read_from[cid] = path.name
        try:
            pieces = await self.disk.run(_read_ranges, path, ranges, into, nbytes=sum(n for _, n in ranges),
                                         urgent=urgent, order=order)
        except OSError as exc:
            self.errors += 1
            log.warning("disk cache %s: chunk %s: %s; reading it from the replicas", self.root, cid.hex(), exc)
            return None
        if pieces is None:  # evicted since the lookup (or lost in a crash): a miss; a bad entry is dropped
            self.misses += 1
            if path.exists():
                self.drop(cid)
            return None
        self._used[cid] = time.time()
        self.hits += 1
        self.hit_bytes += sum(n for _, n in ranges)
        return pieces

    def drop(self, cid: bytes) -> None:
        """Forget the file chunk `cid` was last read from here (its bytes failed a check): passed over
        at once, removed by the writer; a copy written since, under a new name, is kept."""
        name = self._read_from.pop(cid, None)
        if name is not None and name not in self._bad:
            self._tell(cid, None)  # nobody reads it from now on
            self.corrupt += 1
            self._bad.add(name)
            self._start_writer()
            self._jobs.put(("drop", cid, [], name))

    # --- writes ---

    def put(self, cid: bytes, ranges: list[tuple[int, int]], pieces: Sequence[Buffer]) -> bool:
        """Queue verified `pieces` (the bytes of `ranges` of chunk `cid`) for the writer, copied into
        a free buffer (a small write: one of its own size); never waits: False (dropped) when every buffer
        is taken (small writes: when they fill what the buffers would hold) or they do not fit."""
        n = sum(len(p) for p in pieces)
        if self._closed or self.broken or n > self.slot_bytes:
            return False
        if n <= self.slot_bytes // SMALL_WRITE:
            if not self._own(n):
                return False
            kind, buf = "own", bytearray(n)
        else:
            try:
                buf = self._slots.get_nowait()
            except queue.Empty:
                if self._nslots >= WRITE_SLOTS:
                    self.dropped += 1
                    return False
                self._nslots += 1
                buf = bytearray(self.slot_bytes)
            kind = "put"
        at = 0
        for p in pieces:
            buf[at : at + len(p)] = p
            at += len(p)
        self._start_writer()
        self._jobs.put((kind, cid, list(ranges), buf))
        return True

    def put_record(self, cid: bytes, offset: int, data: bytearray) -> bool:
        """put() of one record's verified bytes in a buffer of their own, which the writer takes as it is
        (a record the serving threads fetched: diskreads.py); False if dropped."""
        if self._closed or self.broken or not self._own(len(data)):
            return False
        self._start_writer()
        self._jobs.put(("own", cid, [(offset, len(data))], data))
        return True

    def _own(self, n: int) -> bool:
        """Room for a write of `n` bytes in a buffer of its own (counted until written), else dropped."""
        with self._lock:
            room = self._small_bytes + n <= self._small_bound
            self._small_bytes += n if room else 0
        if not room:
            self.dropped += 1
        return room

    def _start_writer(self) -> None:
        with self._lock:  # (the event loop's puts and the serving threads' keeper's start one writer)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="dlfs-disk-cache-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                jobs = [self._jobs.get(timeout=FLUSH_EVERY)]
            except queue.Empty:
                jobs = []
            # Writes queued behind the first go with it: one pair of catalogue transactions for them all.
            while jobs and jobs[-1][0] in WRITES and len(jobs) < WRITE_BATCH:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            puts = [(kind, cid, ranges, buf) for kind, cid, ranges, buf in jobs
                    if kind in WRITES and isinstance(buf, bytearray)]
            kind, cid, _, name = jobs[-1] if jobs else ("", b"", [], None)
            try:
                # (Once it is not used any more, what was queued is let go: the buffers go back below.)
                if puts and not self.broken and not self._check_gone():
                    self.store_many([(cid, ranges, _pieces(buf, ranges)) for _, cid, ranges, buf in puts])
                if kind == "drop" and not self.broken:
                    assert isinstance(name, str)
                    self._drop_chunk(cid, name)
                    self._bad.discard(name)
                if not self.broken and (kind in ("", "stop") or time.monotonic() - last_flush >= FLUSH_EVERY):
                    self._flush_used()
                    last_flush = time.monotonic()
            except (OSError, sqlite3.Error) as exc:
                self.errors += 1
                if not self.note_damage(exc):
                    log.warning("disk cache %s: %s", self.root, exc)
            finally:
                for kind, _, _, buf in puts:  # each taken job's buffer back once (none after an idle wait)
                    if kind == "put":
                        self._slots.put(buf)
                    else:  # its own: no longer counted
                        with self._lock:
                            self._small_bytes -= len(buf)
            if kind == "stop":
                db = getattr(self._local, "db", None)
                if db is not None:
                    db.close()
                return

    def store_many(self, items: Sequence[tuple[bytes, Sequence[tuple[int, int]], Sequence[Buffer]]]) -> int:
        """store() of several (chunk, ranges, pieces), their catalogue work in two transactions, not two
        each; bytes newly held. A full disk stores them one by one (each evicts and tries again)."""
        db = self._db()
        items = [it for it in items if not self._covered(db, it[0], it[1])]
        if len(items) < 2:
            return sum(self.store(*it) for it in items)
        try:
            added, kept = self._store_once(items)
        except (OSError, sqlite3.OperationalError) as exc:
            if not _disk_full(exc):
                raise
            return sum(self.store(*it) for it in items)
        self.written += kept
        self.written_bytes += added
        self._evict(self._excess(), keep=items[-1][0])
        return added

    def store(self, cid: bytes, ranges: Sequence[tuple[int, int]], pieces: Sequence[Buffer]) -> int:
        """Write verified bytes of chunk `cid` here and list them (blocking: a writer thread's, or
        warmup's); bytes newly held. A full disk (the chunk file's write, or the catalogue's) evicts and
        tries once more, then gives up (0); so does a cache this process stopped using (0)."""
        if self.broken or self._check_gone():
            return 0
        try:
            return self._store(cid, ranges, pieces)
        except sqlite3.DatabaseError as exc:
            if not self.note_damage(exc):
                raise
            return 0

    def holds(self, cid: bytes, ranges: Sequence[tuple[int, int]], least: int | None = None) -> bool:
        """Whether the cache holds all of `ranges` of chunk `cid` (or, with `least`, enough: see lookup;
        False once this process stopped using it)."""
        if self.broken:
            return False
        try:
            return self.lookup(cid, ranges, least) is not None
        except sqlite3.Error as exc:
            if not self.note_damage(exc):
                raise
            return False

    def _store(self, cid: bytes, ranges: Sequence[tuple[int, int]], pieces: Sequence[Buffer]) -> int:
        db = self._db()
        if self._covered(db, cid, ranges):
            return 0
        need = sum(len(p) for p in pieces)
        for attempt in (1, 2):
            try:
                added, _ = self._store_once([(cid, ranges, pieces)])
                break
            except (OSError, sqlite3.OperationalError) as exc:
                if not _disk_full(exc):
                    raise
                self.full += 1
                try:
                    freed = self._evict(max(need * 4, self.held_bytes() // 16), keep=cid) if attempt == 1 else 0
                except sqlite3.OperationalError as again:
                    if not _disk_full(again):
                        raise
                    freed = 0  # not even room to note an eviction
                if not freed:
                    log.info("disk cache %s: file system full and nothing more to evict; %s not kept",
                             self.root, human_bytes(need))
                    return 0
        self.written += 1
        self.written_bytes += added
        self._evict(self._excess(), keep=cid)
        return added

    def _store_once(self, items: Sequence[tuple[bytes, Sequence[tuple[int, int]], Sequence[Buffer]]]) -> tuple[int, int]:
        """Name, write and list each item's bytes (a chunk may come more than once); bytes newly held, and
        how many items were kept."""
        now = time.time()
        names = []
        with self._txn() as db:
            for cid, _, _ in items:
                row = db.execute("SELECT file FROM chunks WHERE cid=?", (cid,)).fetchone()
                if row is None:
                    name = f"{cid.hex()}.{secrets.token_hex(4)}"  # new each time: no old name is ever reused
                    db.execute("INSERT INTO chunks VALUES (?, ?, 0, ?)", (cid, name, now))
                else:
                    name = row[0]
                names.append(name)
        for (_, ranges, pieces), name in zip(items, names):
            path = self._path(name)
            private_dirs(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            try:
                for (off, _), piece in zip(ranges, pieces):
                    _pwrite_all(fd, piece, off)
            finally:
                os.close(fd)
        added, kept = 0, []
        with self._txn() as db:
            for (cid, ranges, _), name in zip(items, names):
                row = db.execute("SELECT file FROM chunks WHERE cid=?", (cid,)).fetchone()
                if row is None or row[0] != name:  # evicted while it was written: the file is no one's
                    self._path(name).unlink(missing_ok=True)
                    continue
                got = sum(self._merge(db, cid, off, off + n) for off, n in ranges)
                db.execute("UPDATE chunks SET bytes=bytes+?, used=? WHERE cid=?", (got, now, cid))
                added += got
                kept.append((cid, name))
            db.execute("UPDATE meta SET value=value+? WHERE key='bytes'", (added,))
        for cid, name in kept:
            self._tell(cid, name)
        return added, len(kept)

    @staticmethod
    def _merge(db: sqlite3.Connection, cid: bytes, lo: int, hi: int) -> int:
        """List [lo, hi) of chunk `cid`, merged with the ranges it touches; bytes newly covered."""
        rows = db.execute("SELECT off, end FROM ranges WHERE cid=? AND off<=? AND end>=?", (cid, hi, lo)).fetchall()
        before = sum(e - o for o, e in rows)
        lo, hi = min([lo, *(o for o, _ in rows)]), max([hi, *(e for _, e in rows)])
        db.executemany("DELETE FROM ranges WHERE cid=? AND off=?", [(cid, o) for o, _ in rows])
        db.execute("INSERT INTO ranges VALUES (?, ?, ?)", (cid, lo, hi))
        return hi - lo - before

    def _excess(self) -> int:
        """Bytes to evict now: over --cache-dir-size, or under the file system's free share."""
        bound = self.size_bound()
        if bound is not None:
            return self.held_bytes() - bound
        excess = -room_left(self.root)
        if excess > self.held_bytes() and not self._said_full:  # evicting all it holds would not be enough
            self._said_full = True
            log.warning("disk cache %s: its file system has less than %d%% free, so it keeps next to nothing; free "
                        "some space or give --cache-dir-size", self.root, FREE_SHARE * 100)
        return excess

    def _evict(self, nbytes: int, keep: bytes | None = None) -> int:
        """Drop least recently read chunks (not `keep`) until `nbytes` are freed; bytes freed."""
        freed = 0
        while freed < nbytes:
            with self._txn() as db:
                rows = db.execute("SELECT cid, file, bytes FROM chunks WHERE cid IS NOT ? ORDER BY used LIMIT ?",
                                  (keep, EVICT_BATCH)).fetchall()
                taken = []
                for cid, name, n in rows:
                    if freed >= nbytes:
                        break
                    db.execute("DELETE FROM ranges WHERE cid=?", (cid,))
                    db.execute("DELETE FROM chunks WHERE cid=?", (cid,))
                    db.execute("UPDATE meta SET value=value-? WHERE key='bytes'", (n,))
                    taken.append(name)
                    self._tell(cid, None)
                    freed += n
                # Unlinked inside the transaction: a writer that still had the name finds no row, and
                # throws its own file away.
                for name in taken:
                    self._path(name).unlink(missing_ok=True)
            self.evicted += len(taken)
            self.evicted_bytes += sum(int(r[2]) for r in rows[: len(taken)])
            if not taken:
                break
        return freed

    def _drop_chunk(self, cid: bytes, name: str) -> None:
        with self._txn() as db:
            row = db.execute("SELECT file, bytes FROM chunks WHERE cid=?", (cid,)).fetchone()
            if row is None or row[0] != name:  # gone already, or written again since
                return
            db.execute("DELETE FROM ranges WHERE cid=?", (cid,))
            db.execute("DELETE FROM chunks WHERE cid=?", (cid,))
            db.execute("UPDATE meta SET value=value-? WHERE key='bytes'", (row[1],))
            self._tell(cid, None)
            self._path(row[0]).unlink(missing_ok=True)
        log.warning("disk cache %s: dropped chunk %s (its bytes failed a check)", self.root, cid.hex())

    def note_used(self, cids: Iterable[bytes]) -> None:
        """Chunks read here by others than read() (the serving threads): recently used, for eviction."""
        now = time.time()
        for cid in cids:
            self._used[cid] = now

    def _flush_used(self) -> None:
        """Note in the catalogue when the chunks read since the last flush were read (LRU order)."""
        if not self._used:
            return
        used, self._used = self._used, {}
        with self._txn() as db:
            db.executemany("UPDATE chunks SET used=? WHERE cid=?", [(t, c) for c, t in used.items()])

    # --- lifecycle ---

    def close(self) -> None:
        """Finish the queued writes (bounded), note what was read, let go of the threads."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._jobs.put(("stop", b"", [], None))
            self._writer.join(CLOSE_TIMEOUT)
            if self._writer.is_alive():
                log.warning("disk cache %s: writes still queued after %g s; left unwritten", self.root, CLOSE_TIMEOUT)
        elif not self.broken:
            try:
                self._flush_used()
            except sqlite3.Error as exc:
                if not self.note_damage(exc):
                    log.warning("disk cache %s: %s", self.root, exc)
        # Its connection closed before this process's last one: a sweep still reading at close kept the
        # catalogue's write-ahead log open past it, and checkpointed it later, under whatever came next.
        self._sweeper.join(CLOSE_TIMEOUT)
        self.disk.close()
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None  # what it holds may still be asked (held_bytes), on a new connection

    def status(self) -> dict[str, Any]:
        """What the cache holds now and what bounds it, with this process's counts (`dlfs stats`): the
        catalogue's figures (a read: no writer waits for it) and, with no size, the file system's room."""
        held = bound = None  # (not used any more, or busy this instant: the next sample says)
        if not self.broken:  # (asked no more once it is not)
            try:  # (on the event loop: a lookup's short wait, not a writer's)
                db = self._db(LOOKUP_BUSY_MS)
                meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('bytes', 'size')").fetchall())
                held, bound = int(meta["bytes"]), (int(meta["size"]) if "size" in meta else None)
            except sqlite3.Error as exc:
                self.note_damage(exc)
        room = None
        if bound is None and not self.broken:
            try:
                room = room_left(self.root)
            except OSError:
                pass  # (removed under it: the writer says so once)
        return {"dir": str(self.root), "broken": self.broken, "held_bytes": held, "size_bytes": bound,
                "room_bytes": room, "free_share": FREE_SHARE,
                "written": self.written, "written_bytes": self.written_bytes, "evicted_chunks": self.evicted,
                "evicted_bytes": self.evicted_bytes, "dropped_writes": self.dropped, "full": self.full,
                "errors": self.errors}

    def stats(self) -> dict[str, int]:
        return {"disk_cache_hits": self.hits, "disk_cache_misses": self.misses, "disk_cache_hit_bytes": self.hit_bytes,
                "disk_cache_writes": self.written, "disk_cache_written_bytes": self.written_bytes,
                "disk_cache_dropped_writes": self.dropped, "disk_cache_evicted_chunks": self.evicted,
                "disk_cache_corrupt": self.corrupt, "disk_cache_full": self.full, "disk_cache_errors": self.errors}
