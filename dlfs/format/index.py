"""The index format: one dataset version's whole namespace, in one mmap-able file.

Layout (little-endian; every section starts on an 8-byte boundary, in this order):

    header   HEADER.size B  magic "DLFSINDX", version, counts, totals, chunk size, xxh3-64 of the
                            body, xxh3-64 of the header bytes before it
    chunks   32 B each      chunk id (16 B), chunk bytes u64, first extent u32, extents u32
    inodes   48 B each      mode, uid, gid, nlink u32; size i64; mtime ns i64; ref u64; count u32;
                            parent u32.  Inode number = position + 1 (the root is inode 1).
                            ref/count: regular file -> extents; directory -> dirents;
                            symlink -> the target in the names blob.
    dirents  16 B each      name offset u64, name length u32, inode u32; each directory's entries
                            are contiguous and sorted by name bytes (binary search for lookup)
    extents  32 B each      chunk u32, offset u32, stored length u32, raw length u32, xxh3-64 u64,
                            flags u32, spare u32; ordered by (chunk, offset), so a chunk's extents
                            are one run and a file's extents are one run. One extent is one record
                            of the chunk (at most MAX_RECORD_BYTES raw, so a big file has many),
                            offset is where its stored bytes start, and flags are its record flags
                            (format/chunk.py): FLAG_LZ4 = 1 (lz4-compressed), FLAG_BLOCK_SUMS = 2
                            (one xxh3-64 per 4 KiB follows the stored bytes: `block_range`)
    names    bytes          names and symlink targets, as raw bytes (any byte but / and NUL); a name
                            is 1..NAME_MAX bytes, as on Linux

LAYOUT below is the one statement of every record's fields; native/indexview.h restates it as C
structs, and tests/test_index_layout.py parses that header and holds the two together.

The file is read with mmap: opening touches only the header and a streaming checksum pass, so a
10-million-file index costs its page cache, not Python objects.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import xxhash

from dlfs.errors import CorruptData, SourceError
from dlfs.format.chunk import ID_BYTES, Record

MAGIC = b"DLFSINDX"
VERSION = 1
NAME_MAX = 255  # bytes of one name (Linux's NAME_MAX): ingest writes none longer, lookup refuses longer


def name_problem(name: bytes) -> str:
    """Why `name` cannot be one name in an index, as "is ..." or "holds ..."; '' if it can. The one
    statement of the rule (1 to NAME_MAX bytes, no / or NUL, not . or ..): every source checks its
    names with it, in its own words, before the index writer does."""
    if not name:
        return "is empty"
    if name in (b".", b".."):
        return f"is {name.decode()}"
    if len(name) > NAME_MAX:
        return f"is {len(name)} bytes (a name is at most {NAME_MAX})"
    if b"/" in name:
        return "holds a /"
    if b"\0" in name:
        return "holds a NUL byte"
    return ""
# Bytes of one index file at most (about 70 million files): what a metadata daemon stages and hashes.
MAX_INDEX_BYTES = 8 << 30
# Every record's fields in file order, as struct codes (little-endian, no padding).
LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    "header": (("magic", "8s"), ("version", "I"), ("flags", "I"), ("n_chunks", "Q"), ("n_inodes", "Q"),
               ("n_dirents", "Q"), ("n_extents", "Q"), ("names_size", "Q"), ("files", "Q"), ("bytes", "Q"),
               ("chunk_size", "Q"), ("created_ns", "q"), ("body_sum", "Q"), ("head_sum", "Q")),
    "chunk": (("id", f"{ID_BYTES}s"), ("size", "Q"), ("first_extent", "I"), ("n_extents", "I")),
    "inode": (("mode", "I"), ("uid", "I"), ("gid", "I"), ("nlink", "I"), ("size", "q"), ("mtime_ns", "q"),
              ("ref", "Q"), ("count", "I"), ("parent", "I")),
    "dirent": (("name_off", "Q"), ("name_len", "I"), ("ino", "I")),
    "extent": (("chunk", "I"), ("offset", "I"), ("stored_len", "I"), ("raw_len", "I"), ("checksum", "Q"),
               ("flags", "I"), ("spare", "I")),
}


def _record(kind: str) -> struct.Struct:
    return struct.Struct("<" + "".join(code for _, code in LAYOUT[kind]))


HEADER, CHUNK, INODE, DIRENT, EXTENT = (_record(k) for k in ("header", "chunk", "inode", "dirent", "extent"))
ROOT_INO = 1


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True, slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    mtime_ns: int
    ref: int
    count: int
    parent: int


@dataclass(frozen=True, slots=True)
class Extent:
    """One piece of a file: a record in a chunk."""

    chunk: int
    record: Record


@dataclass(frozen=True, slots=True)
class ChunkRef:
    id: bytes
    size: int
    first_extent: int
    n_extents: int


@dataclass(frozen=True, slots=True)
class Totals:
    inodes: int
    dirents: int
    extents: int
    chunks: int
    names_size: int
    files: int
    bytes: int
    chunk_size: int
    created_ns: int


class Sections(NamedTuple):
    """An open index's mapping and the offsets and counts of its sections (native/indexview.h)."""

    map: mmap.mmap
    inodes: int
    dirents: int
    names: int
    extents: int
    n_inodes: int
    n_dirents: int
    names_size: int
    n_extents: int
    chunks: int
    n_chunks: int


class IndexWriter:
    """Collects one version's namespace and writes it as an index file.

    Inode numbers are chosen by the caller (1..n, root first); `set_inode` may be called in any order.
    """

    def __init__(self, n_inodes: int, chunk_size: int, created_ns: int = 0) -> None:
        self.inodes = bytearray(INODE.size * n_inodes)
        self.n_inodes = n_inodes
        self.dirents = bytearray()
        self.extents = bytearray()
        self.chunks = bytearray()
        self.names = bytearray()
        self.chunk_size = chunk_size
        self.created_ns = created_ns
        self.files = 0
        self.bytes = 0

    def add_name(self, name: bytes) -> tuple[int, int]:
        off = len(self.names)
        self.names += name
        return off, len(name)

    def add_chunk(self, cid: bytes, size: int, first_extent: int, n_extents: int) -> int:
        self.chunks += CHUNK.pack(cid, size, first_extent, n_extents)
        return len(self.chunks) // CHUNK.size - 1

    def extents_count(self) -> int:
        return len(self.extents) // EXTENT.size

    def add_extent(self, chunk: int, rec: Record) -> int:
        self.extents += EXTENT.pack(
            chunk, rec.offset, rec.stored_len, rec.raw_len, rec.checksum, rec.flags, 0
        )
        return len(self.extents) // EXTENT.size - 1

    def add_dirents(self, entries: list[tuple[bytes, int]]) -> tuple[int, int]:
        """Add one directory's entries (name, inode); returns (first dirent, count). SourceError for a
        name no lookup could find (name_problem)."""
        first = len(self.dirents) // DIRENT.size
        for name, _ in entries:
            why = name_problem(name)
            if why:
                shown = name[:60] + b"..." if len(name) > 60 else name
                raise SourceError(f"cannot store the name {shown!r}: it {why}")
        for name, ino in sorted(entries):
            off, n = self.add_name(name)
            self.dirents += DIRENT.pack(off, n, ino)
        return first, len(entries)

    def size_inodes(self, n_inodes: int) -> None:
        """Room for `n_inodes` (never fewer than the writer was made with)."""
        if n_inodes > self.n_inodes:
            self.inodes.extend(bytes(INODE.size * (n_inodes - self.n_inodes)))
            self.n_inodes = n_inodes

    def set_inode(
        self, ino: int, mode: int, uid: int, gid: int, nlink: int, size: int, mtime_ns: int,
        ref: int, count: int, parent: int,
    ) -> None:
        if stat.S_ISREG(mode):
            self.files += 1
            self.bytes += size
        INODE.pack_into(
            self.inodes, (ino - 1) * INODE.size,
            mode, uid, gid, nlink, size, mtime_ns, ref, count, parent,
        )

    def _sections(self) -> list[tuple[bytearray, bytes]]:
        sections = [self.chunks, self.inodes, self.dirents, self.extents, self.names]
        return [(s, b"\0" * (_align(len(s)) - len(s))) for s in sections]

    def body_sum(self) -> int:
        """xxh3-64 of everything but the header: equal for two ingests of the same tree, whenever made."""
        hasher = xxhash.xxh3_64()
        for s, pad in self._sections():
            hasher.update(s)
            hasher.update(pad)
        return hasher.intdigest()

    def write(self, out: BinaryIO) -> int:
        """Write the index; returns the xxh3-64 of the whole file (its identity on the wire)."""
        head = HEADER.pack(
            MAGIC, VERSION, 0,
            len(self.chunks) // CHUNK.size, self.n_inodes, len(self.dirents) // DIRENT.size,
            len(self.extents) // EXTENT.size, len(self.names), self.files, self.bytes,
            self.chunk_size, self.created_ns, self.body_sum(), 0,
        )
        head = head[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(head[:-8]))
        whole = xxhash.xxh3_64(head)
        out.write(head)
        for s, pad in self._sections():
            out.write(s)
            out.write(pad)
            whole.update(s)
            whole.update(pad)
        return whole.intdigest()


def header_body_sum(head: bytes) -> int | None:
    """The body checksum an index header records, or None if `head` is not a sound index header."""
    if len(head) < HEADER.size:
        return None
    fields = HEADER.unpack(head[: HEADER.size])
    if fields[0] != MAGIC or xxhash.xxh3_64_intdigest(head[: HEADER.size - 8]) != fields[-1]:
        return None
    return int(fields[-2])


def file_checksum(path: str | os.PathLike[str]) -> int:
    """xxh3-64 of a whole file, read in pieces (never all in memory)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.intdigest()


class Index:
    """A read-only, mmap'd index: every lookup reads the file's bytes in place."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size)
            self.totals, body_sum = self._parse_header(head, size)
            # Checksum by streaming reads, not through the mapping: pages read that way are
            # page cache, not this process's resident memory.
            h = xxhash.xxh3_64()
            while block := f.read(1 << 22):
                h.update(block)
            if h.intdigest() != body_sum:
                raise CorruptData(f"index {self.path}: checksum mismatch (corrupt file)")
            self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        self._view: Any = None  # dlfs._native.IndexView from the first lookup or bulk_file_size on; False without the helper
        t = self.totals
        self._chunks = HEADER.size
        self._inodes = self._chunks + _align(t.chunks * CHUNK.size)
        self._dirents = self._inodes + _align(t.inodes * INODE.size)
        self._extents = self._dirents + _align(t.dirents * DIRENT.size)
        self._names = self._extents + _align(t.extents * EXTENT.size)

    def _parse_header(self, head: bytes, size: int) -> tuple[Totals, int]:
        if len(head) < HEADER.size:
            raise CorruptData(f"index {self.path}: truncated header ({len(head)} bytes)")
        (magic, version, _flags, n_chunks, n_inodes, n_dirents, n_extents, names_size, files,
         nbytes, chunk_size, created_ns, body_sum, head_sum) = HEADER.unpack(head)
        if magic != MAGIC:
            raise CorruptData(f"index {self.path}: not a dlfs index (bad magic)")
        if xxhash.xxh3_64_intdigest(head[:-8]) != head_sum:
            raise CorruptData(f"index {self.path}: header checksum mismatch")
        if version != VERSION:
            raise CorruptData(f"index {self.path}: index format version {version} is not supported")
        expect = (HEADER.size + _align(n_chunks * CHUNK.size) + _align(n_inodes * INODE.size)
                  + _align(n_dirents * DIRENT.size) + _align(n_extents * EXTENT.size)
                  + _align(names_size))
        if size < expect:
            raise CorruptData(f"index {self.path}: truncated ({size} bytes, header says {expect})")
        if size > expect:  # too long is not truncation: say what is wrong
            raise CorruptData(f"index {self.path}: {size - expect} stray bytes after the last section")
        if n_inodes < 1:
            raise CorruptData(f"index {self.path}: no root inode")
        totals = Totals(n_inodes, n_dirents, n_extents, n_chunks, names_size, files, nbytes,
                        chunk_size, created_ns)
        return totals, body_sum

    def pin(self) -> None:
        """Keep every page of the index in memory (mlock): a lookup never waits for the disk, even
        once the page cache was dropped or pressed out (a mount's memory bound counts the index).
        OSError where the kernel refuses (RLIMIT_MEMLOCK)."""
        from dlfs.native import native

        if native is None:
            raise OSError(errno.ENOSYS, "pinning the index needs dlfs's C helper")
        native.lock_pages(self._map)

    def close(self) -> None:
        if self._view:
            self._view.close()  # its hold on the mapping, which cannot be closed under it
        try:
            self._map.close()
        except BufferError:
            from dlfs.native import engine_stats  # here: dlfs.native imports this module

            # A serving thread stuck in I/O was abandoned (and logged) and may still read it: kept until exit.
            if not engine_stats().get("abandoned"):
                raise

    def sections(self) -> Sections:
        """Where each section lies in the mapping: what the C helper reads in place."""
        t = self.totals
        return Sections(self._map, self._inodes, self._dirents, self._names, self._extents, t.inodes, t.dirents,
                        t.names_size, t.extents, self._chunks, t.chunks)

    def _bad(self, what: str) -> CorruptData:
        return CorruptData(f"index {self.path}: {what}")

    def inode(self, ino: int) -> Inode:
        return Inode(ino, *self.inode_fields(ino))

    def inode_fields(self, ino: int) -> tuple[int, ...]:
        """(mode, uid, gid, nlink, size, mtime_ns, ref, count, parent), without building an Inode."""
        if not 1 <= ino <= self.totals.inodes:
            raise self._bad(f"inode {ino} out of range")
        return INODE.unpack_from(self._map, self._inodes + (ino - 1) * INODE.size)

    def name(self, off: int, n: int) -> bytes:
        if off + n > self.totals.names_size:
            raise self._bad("name runs past the names section")
        return self._map[self._names + off : self._names + off + n]

    def entries(self, dir_ino: int, start: int = 0) -> Iterator[tuple[int, bytes, int]]:
        """(position, name, inode) of a directory's entries from position `start`."""
        node = self.inode(dir_ino)
        if node.ref + node.count > self.totals.dirents:
            raise self._bad(f"directory inode {dir_ino} points past the dirents")
        # Locals and one unpack per entry: a listing is the hot path of a dataset walk.
        m, names, limit = self._map, self._names, self.totals.names_size
        base, unpack = self._dirents + node.ref * DIRENT.size, DIRENT.unpack_from
        for pos in range(start, node.count):
            off, n, ino = unpack(m, base + pos * DIRENT.size)
            if off + n > limit:
                raise self._bad("name runs past the names section")
            yield pos, m[names + off : names + off + n], ino

    def lookup(self, dir_ino: int, name: bytes) -> int:
        """The inode of `name` in a directory (> 0), or -errno: ENOENT (absent), ENOTDIR (not a
        directory), ENAMETOOLONG (over NAME_MAX bytes). CorruptData where the index is damaged.
        The C lookup (native/indexview.c) answers where the helper is built, lookup_in elsewhere."""
        if self._view is None:
            self._view = self._native_view()
        found: int = self._view.lookup(dir_ino, name) if self._view else lookup_in(self, dir_ino, name)
        if found == -errno.EIO:
            raise self._bad(f"directory inode {dir_ino}: out of range, or an entry lies outside the index")
        return found

    def bulk_file_size(self) -> int:
        """Half or more of the regular files' bytes are in files of at least this size, a power of two (0
        for no bytes): the files a reader of the dataset mostly reads, which the mean misses where a few
        small files (a manifest beside big shards) outnumber the big ones. One pass over the inodes, in C
        where the helper is built (10 million inodes in well under a second)."""
        if self._view is None:
            self._view = self._native_view()
        if self._view:
            return int(self._view.bulk_file_size())
        by_power = [0] * 64
        for ino in range(1, self.totals.inodes + 1):
            fields = self.inode_fields(ino)
            mode, size = fields[0], fields[4]
            if stat.S_ISREG(mode) and size > 0:
                by_power[size.bit_length() - 1] += size
        total, seen = sum(by_power), 0
        for power in range(63, -1, -1):
            seen += by_power[power]
            if total and 2 * seen >= total:
                return 1 << power
        return 0

    def _native_view(self) -> Any:
        """The C lookup over this mapping, or False where the helper is not built."""
        from dlfs.native import native  # here, not at the top: dlfs.native imports this module

        return False if native is None else native.IndexView(self.sections())

    def extent(self, i: int) -> Extent:
        if not 0 <= i < self.totals.extents:
            raise self._bad(f"extent {i} out of range")
        chunk, off, stored, raw, checksum, flags, _ = EXTENT.unpack_from(
            self._map, self._extents + i * EXTENT.size
        )
        return Extent(chunk, Record(off, stored, raw, checksum, flags))

    def chunk(self, i: int) -> ChunkRef:
        if not 0 <= i < self.totals.chunks:
            raise self._bad(f"chunk {i} out of range")
        return ChunkRef(*CHUNK.unpack_from(self._map, self._chunks + i * CHUNK.size))

    def chunk_ids(self) -> list[bytes]:
        return [self.chunk(i).id for i in range(self.totals.chunks)]

    def readlink(self, ino: int) -> bytes:
        node = self.inode(ino)
        return self.name(node.ref, node.count)

    def walk(self) -> Iterator[tuple[bytes, Inode]]:
        """(path relative to the root, inode) of every entry, the root first as b"" (for tools)."""
        stack: list[tuple[bytes, int]] = [(b"", ROOT_INO)]
        seen_dirs: set[int] = set()
        while stack:
            path, ino = stack.pop()
            node = self.inode(ino)
            yield path, node
            if stat.S_ISDIR(node.mode):
                # A directory reached twice means a cycle: the walk would never end.
                if ino in seen_dirs:
                    raise self._bad(f"directory cycle at inode {ino} ({path!r})")
                seen_dirs.add(ino)
                for _, name, child in self.entries(ino):
                    stack.append((path + b"/" + name if path else name, child))


def lookup_in(index: Index, dir_ino: int, name: bytes) -> int:
    """Index.lookup in Python, for where the C helper is not built: the same answers, -EIO included,
    as dlfs_ix_lookup (native/indexview.c), step for step."""
    if not 1 <= dir_ino <= index.totals.inodes:
        return -errno.EIO
    mode, *_, ref, count, _ = index.inode_fields(dir_ino)
    if not stat.S_ISDIR(mode):
        return -errno.ENOTDIR
    if len(name) > NAME_MAX:  # refused, never cut to a prefix: a name that long is in no index
        return -errno.ENAMETOOLONG
    if ref + count > index.totals.dirents:
        return -errno.EIO
    m, base, names, limit = index._map, index._dirents, index._names, index.totals.names_size
    lo, hi = ref, ref + count
    while lo < hi:
        mid = (lo + hi) // 2
        off, n, ino = DIRENT.unpack_from(m, base + mid * DIRENT.size)
        if off + n > limit:
            return -errno.EIO
        probe = m[names + off : names + off + n]
        if probe == name:
            return ino if 1 <= ino <= index.totals.inodes else -errno.EIO
        if probe < name:
            lo = mid + 1
        else:
            hi = mid
    return -errno.ENOENT
