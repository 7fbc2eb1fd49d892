"""The chunk format: many files' bytes packed back to back, each record checksummed.

A chunk is immutable and named by the xxh3-128 of its whole content. Layout (little-endian):

    header  32 B   magic "DLFSCHNK", version u16, flags u16, records u32, payload bytes u64,
                   xxh3-64 of the 24 bytes before it
    padding        version 3, before a record with FLAG_BLOCK_SUMS only: 0 to BLOCK_SIZE - 1 zero
                   bytes, as many as put that record's stored bytes on a BLOCK_SIZE boundary
    record  24 B   magic u32, flags u32, stored length u32, raw length u32, xxh3-64 of the stored bytes
            ...    the stored bytes
            ...    with FLAG_BLOCK_SUMS only: the block sums, one xxh3-64 u64 per BLOCK_SIZE bytes of
                   the stored bytes (the last block may be short), 8 * ceil(stored / BLOCK_SIZE) bytes
    (records repeat; the next header, or its padding, starts right after the record's stored bytes
    and sums; the payload length counts the padding, the record count does not)

Record flags (the index's extents carry the same value):
    FLAG_LZ4 = 1          the stored bytes are an lz4 block of the raw bytes
    FLAG_BLOCK_SUMS = 2   block sums follow the stored bytes; never with FLAG_LZ4 (stored == raw)

The writer cuts no record longer than MAX_RECORD_BYTES (a record always fits a 4 MiB cache slab
whole) and gives every uncompressed record of at least BLOCK_SUMS_MIN bytes its block sums, so a
reader can fetch and check any BLOCK_SIZE-aligned piece of a big record (`block_range`,
`verify_blocks`) without reading it all. The whole-record checksum covers the stored bytes only,
exactly as in version 1: whole-record readers never look at the sums.

Versions:
    1  records back to back, no block sums.
    2  version 1 plus FLAG_BLOCK_SUMS. Read, no longer written.
    3  version 2 plus alignment: a record with FLAG_BLOCK_SUMS has its stored bytes at a multiple of
       BLOCK_SIZE of the chunk (zero padding before its header), so that each block a random read
       fetches (`block_range`: offset + first * BLOCK_SIZE) is one page of the chunk file, not two.
A chunk is written as version 3 only when one of its records carries block sums; any other chunk
is written as version 1, in exactly the version-1 layout: a version-1 reader still reads it, and a
chunk of small files keeps the content id the version-1 writer gave it, so data ingested before is
found already stored. All three versions are read and verified; FLAG_BLOCK_SUMS in a version-1
chunk is corrupt.

Framing of version 3: where a record may start (after the chunk header or a record's last byte),
either the record magic is there and so is the header, or the padding starts there: zero bytes up
to the one offset p with (p + RECORD.size) % BLOCK_SIZE == 0, then a header with FLAG_BLOCK_SUMS.
The magic's first byte is not zero, so padding never looks like a header. Anything else is corrupt:
a non-zero byte in the padding, padding before a record without block sums, a record with block
sums that is not aligned, padding after the last record.

The index points straight at each record's stored bytes (offset, lengths, checksum, flags), so a
reader fetches and verifies one file without parsing the chunk; the record headers make a chunk
checkable on its own (`verify_chunk`), which the data daemon and repair use.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import lz4.block
import xxhash

from dlfs.errors import CorruptData

MAGIC = b"DLFSCHNK"
VERSION = 3  # written only for chunks with block sums (see above)
VERSION_PLAIN = 1  # written for every other chunk
VERSION_UNALIGNED = 2  # block sums, no padding: read, no longer written
HEADER = struct.Struct("<8sHHIQQ")
ChunkBuffer = bytearray | mmap.mmap  # what a chunk is packed into (an ingest's are mmap'd: page-aligned)
RECORD = struct.Struct("<IIIIQ")
RECORD_MAGIC = 0xD1F5C0DE
FLAG_LZ4 = 1
FLAG_BLOCK_SUMS = 2
ID_BYTES = 16
MAX_CHUNK_SIZE = 1 << 30
MAX_RECORD_BYTES = 4 << 20  # raw bytes of one record at most: it fits a 4 MiB cache slab whole
BLOCK_SIZE = 4096  # bytes checked by one block sum
BLOCK_SUMS_MIN = 256 << 10  # uncompressed records this big carry block sums
BLOCK_SUM = struct.Struct("<Q")
_FLAGS_OF_VERSION = {VERSION_PLAIN: FLAG_LZ4, VERSION_UNALIGNED: FLAG_LZ4 | FLAG_BLOCK_SUMS,
                     VERSION: FLAG_LZ4 | FLAG_BLOCK_SUMS}
_ALIGNED_VERSIONS = frozenset({VERSION})
_RECORD_MAGIC_BYTES = struct.pack("<I", RECORD_MAGIC)


def chunk_id(data: bytes | bytearray | memoryview) -> bytes:
    """The content hash that names a chunk."""
    return xxhash.xxh3_128_digest(data)


def record_checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def block_count(stored_len: int) -> int:
    """Blocks (and so block sums) of a record of `stored_len` stored bytes, the last one maybe short."""
    return -(-stored_len // BLOCK_SIZE)


def block_sums(data: bytes | bytearray | memoryview) -> list[int]:
    """The xxh3-64 of each BLOCK_SIZE piece of `data`, in order."""
    view, digest = memoryview(data), xxhash.xxh3_64_intdigest
    return [digest(view[i : i + BLOCK_SIZE]) for i in range(0, len(view), BLOCK_SIZE)]


def padding_before(pos: int) -> int:
    """Zero bytes a record with block sums is preceded by when its header would start at chunk
    offset `pos` (version 3): those that put its stored bytes on a BLOCK_SIZE boundary."""
    return -(pos + RECORD.size) % BLOCK_SIZE


def record_footprint(length: int) -> int:
    """Chunk bytes one record of `length` raw bytes takes at most, wherever it starts (stored as
    is, so with the block sums it then carries): its header, its bytes, its sums, and the most
    padding a record with sums may need."""
    if length < BLOCK_SUMS_MIN:
        return RECORD.size + length
    return BLOCK_SIZE - 1 + RECORD.size + length + block_count(length) * BLOCK_SUM.size


def records_span(length: int) -> int:
    """Chunk bytes that `length` bytes of one file take at most as records of MAX_RECORD_BYTES
    (the last one shorter): what the packer asks of a chunk to keep the file in it whole."""
    full, rest = divmod(length, MAX_RECORD_BYTES)
    return full * record_footprint(MAX_RECORD_BYTES) + (record_footprint(rest) if rest else 0)


@dataclass(frozen=True, slots=True)
class Record:
    """Where one record's stored bytes sit in its chunk, and how to check and decode them.
    With FLAG_BLOCK_SUMS its block sums follow at offset + stored_len, sums_len bytes."""

    offset: int
    stored_len: int
    raw_len: int
    checksum: int
    flags: int

    @property
    def has_block_sums(self) -> bool:
        return bool(self.flags & FLAG_BLOCK_SUMS)

    @property
    def sums_len(self) -> int:
        """Bytes of the block sums after the stored bytes (0 without them)."""
        return block_count(self.stored_len) * BLOCK_SUM.size if self.flags & FLAG_BLOCK_SUMS else 0

    @property
    def end(self) -> int:
        """Chunk offset just past the stored bytes and their block sums: a read that may check any
        block of the record, not just the whole record, reads up to here."""
        return self.offset + self.stored_len + self.sums_len


@dataclass(frozen=True, slots=True)
class BlockRange:
    """The whole blocks of one record that cover a byte range, and the block sums that check them.

    Blocks first .. first + count - 1 of the record: their stored bytes lie at chunk offset
    data_offset, data_len bytes (BLOCK_SIZE each but the record's last, which may be short), and
    their sums at chunk offset sums_offset, sums_len = 8 * count bytes. The asked range starts
    `off - first * BLOCK_SIZE` bytes into the data.
    """

    first: int
    count: int
    data_offset: int
    data_len: int
    sums_offset: int
    sums_len: int


def block_range(rec: Record, off: int, length: int) -> BlockRange:
    """The blocks of `rec` that cover its raw bytes [off, off + length), the end clamped to the
    record. ValueError if the record has no block sums, or the range is empty or starts outside
    the record; CorruptData if the record claims block sums on bytes that are not stored as is."""
    if not rec.flags & FLAG_BLOCK_SUMS:
        raise ValueError(f"record at chunk offset {rec.offset} has no block sums")
    if rec.raw_len != rec.stored_len:  # sums check stored bytes: they must be the raw ones
        raise CorruptData(f"record at chunk offset {rec.offset} has block sums but stores {rec.stored_len} "
                          f"bytes for {rec.raw_len} raw bytes")
    if length <= 0 or off < 0 or off >= rec.raw_len:
        raise ValueError(f"byte range [{off}, {off + length}) is empty or outside the record's {rec.raw_len} bytes")
    first = off // BLOCK_SIZE
    end = (min(off + length, rec.raw_len) - 1) // BLOCK_SIZE + 1  # one past the last block
    data_start = first * BLOCK_SIZE
    return BlockRange(first, end - first, rec.offset + data_start, min(end * BLOCK_SIZE, rec.raw_len) - data_start,
                      rec.offset + rec.stored_len + first * BLOCK_SUM.size, (end - first) * BLOCK_SUM.size)


def verify_blocks(data: bytes | bytearray | memoryview, sums: bytes | bytearray | memoryview, rng: BlockRange,
                  where: str) -> None:
    """Check the blocks of `rng` (data_len bytes) against their sums (sums_len bytes); CorruptData
    names `where` and the first bad block."""
    if len(data) != rng.data_len or len(sums) != rng.sums_len:
        raise CorruptData(f"{where}: blocks {rng.first}..{rng.first + rng.count - 1} truncated ({len(data)} of "
                          f"{rng.data_len} bytes, {len(sums)} of {rng.sums_len} bytes of sums)")
    want = struct.unpack(f"<{rng.count}Q", sums)
    got = block_sums(data)
    if got != list(want):
        bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        raise CorruptData(f"{where} block {rng.first + bad}: checksum mismatch")


class ChunkWriter:
    """Packs records into one chunk buffer that already exists; `finish` seals and names it.

    The buffer is reused chunk after chunk (`reset`): file bytes are read straight into it, and a
    record's block sums are written right after its bytes. Room is always kept for the sums, and
    the padding, a record would carry stored as is, whether or not it then compresses: a record
    big enough for sums is read in at the next aligned place, and moved back to the unpadded one
    only if it compresses.
    """

    def __init__(self, capacity: int, buf: ChunkBuffer | None = None) -> None:
        self.capacity = capacity
        self.buf = buf if buf is not None else bytearray(capacity)
        self.view = memoryview(self.buf)
        self.reset(self.buf)

    def reset(self, buf: ChunkBuffer) -> None:
        if len(buf) < self.capacity:
            raise ValueError("chunk buffer smaller than the chunk capacity")
        self.buf = buf
        self.view = memoryview(buf)
        self.pos = HEADER.size
        self.records: list[Record] = []
        self.has_block_sums = False

    def __len__(self) -> int:
        return self.pos

    def room(self) -> int:
        """Raw bytes one more record may take: at most MAX_RECORD_BYTES, and with its header and
        the padding and block sums it may carry, it fits in what is left of the chunk."""
        space = self.capacity - self.pos - RECORD.size
        if space <= 0:
            return 0
        # With sums, the padding comes first; then each whole block costs BLOCK_SIZE + 8 bytes, and
        # a short last block its length + 8.
        blocks, rest = divmod(max(0, space - padding_before(self.pos)), BLOCK_SIZE + BLOCK_SUM.size)
        with_sums = blocks * BLOCK_SIZE + max(0, rest - BLOCK_SUM.size)
        return min(MAX_RECORD_BYTES, with_sums if with_sums >= BLOCK_SUMS_MIN else min(space, BLOCK_SUMS_MIN - 1))

    def _data_start(self, length: int) -> int:
        """Where a record of `length` raw bytes is read in: past its padding if it may carry sums."""
        head = self.pos + (padding_before(self.pos) if length >= BLOCK_SUMS_MIN else 0)
        return head + RECORD.size

    def fits(self, length: int) -> bool:
        """Whether `length` bytes of one file, cut into records of MAX_RECORD_BYTES, fit in what is
        left of the chunk."""
        return records_span(length) <= self.capacity - self.pos

    def add(self, data: bytes | memoryview, compress: bool) -> Record:
        """Append one record from bytes; compression is kept only where it saves space."""
        if len(data) > self.room():
            raise ValueError("record does not fit in the chunk")
        start = self._data_start(len(data))
        self.view[start : start + len(data)] = data
        return self._seal(start, len(data), compress)

    def add_from(self, readinto: Callable[[memoryview], int], length: int, compress: bool) -> Record:
        """Append one record read by `readinto` (a file's, filling a prefix of the view it is given)
        straight into the buffer; returns it.

        Raises EOFError if the file ends before `length` bytes.
        """
        if length > self.room():
            raise ValueError("record does not fit in the chunk")
        start = self._data_start(length)
        dest = self.view[start : start + length]
        got = 0
        while got < length:
            n = readinto(dest[got:])
            if n == 0:
                raise EOFError(got)
            got += n
        return self._seal(start, length, compress)

    def _seal(self, start: int, length: int, compress: bool) -> Record:
        """Frame the record whose `length` raw bytes were read in at `start` (`_data_start`)."""
        raw = self.view[start : start + length]
        stored_len, flags = length, 0
        if compress and length > 64:
            packed = lz4.block.compress(raw, store_size=False)
            if len(packed) < length:
                start = self.pos + RECORD.size  # no sums, so no padding: right after the header
                self.view[start : start + len(packed)] = packed
                stored_len, flags = len(packed), FLAG_LZ4
        if not flags & FLAG_LZ4 and length >= BLOCK_SUMS_MIN:
            flags |= FLAG_BLOCK_SUMS
            self.view[self.pos : start - RECORD.size] = bytes(start - RECORD.size - self.pos)  # the padding
        stored = self.view[start : start + stored_len]
        checksum = record_checksum(stored)
        RECORD.pack_into(self.buf, start - RECORD.size, RECORD_MAGIC, flags, stored_len, length, checksum)
        rec = Record(start, stored_len, length, checksum, flags)
        if flags & FLAG_BLOCK_SUMS:
            sums = block_sums(stored)
            struct.pack_into(f"<{len(sums)}Q", self.buf, start + stored_len, *sums)
            self.has_block_sums = True
        self.pos = start + stored_len + rec.sums_len
        self.records.append(rec)
        return rec

    def finish(self) -> tuple[bytes, memoryview]:
        """Seal the header; returns (chunk id, chunk bytes as a view of the buffer)."""
        version = VERSION if self.has_block_sums else VERSION_PLAIN
        head = HEADER.pack(MAGIC, version, 0, len(self.records), self.pos - HEADER.size, 0)
        head = head[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(head[:-8]))
        self.view[: HEADER.size] = head
        data = self.view[: self.pos]
        return chunk_id(data), data


def decode_record(stored: bytes | memoryview, rec: Record, where: str) -> bytes | memoryview:
    """Verify a record's stored bytes and return its raw bytes; CorruptData names `where`."""
    if len(stored) != rec.stored_len:
        raise CorruptData(f"{where}: truncated record ({len(stored)} of {rec.stored_len} bytes)")
    if record_checksum(stored) != rec.checksum:
        raise CorruptData(f"{where}: checksum mismatch")
    if not rec.flags & FLAG_LZ4:
        if rec.raw_len != rec.stored_len:  # readers place bytes by raw length: they must agree
            raise CorruptData(f"{where}: stored record of {rec.stored_len} bytes claims {rec.raw_len} raw bytes")
        return stored
    try:
        raw = lz4.block.decompress(stored, uncompressed_size=rec.raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptData(f"{where}: lz4 data does not decode ({exc})") from None
    if len(raw) != rec.raw_len:
        raise CorruptData(f"{where}: decodes to {len(raw)} bytes, expected {rec.raw_len}")
    return raw


def check_header(head: bytes | bytearray | memoryview, size: int, name: str = "chunk") -> tuple[int, int]:
    """Check a chunk's header (its first HEADER.size bytes) against the chunk's `size`: magic, checksum,
    a known version, and a payload that ends where the chunk does. Returns (version, record count)."""
    if len(head) < HEADER.size or size < HEADER.size:
        raise CorruptData(f"{name}: truncated header ({min(len(head), size)} bytes)")
    magic, version, _flags, n_records, payload, hsum = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptData(f"{name}: not a dlfs chunk (bad magic)")
    if xxhash.xxh3_64_intdigest(head[: HEADER.size - 8]) != hsum:
        raise CorruptData(f"{name}: header checksum mismatch")
    if version not in _FLAGS_OF_VERSION:
        raise CorruptData(f"{name}: chunk format version {version} is not supported")
    if HEADER.size + payload > size:
        raise CorruptData(f"{name}: truncated ({size} bytes, header says {HEADER.size + payload})")
    # Too long is not truncation: say so, or repair hunts for a missing tail that is not missing.
    if HEADER.size + payload < size:
        raise CorruptData(f"{name}: {size - HEADER.size - payload} stray bytes after the payload")
    return version, n_records


def iter_records(data: bytes | bytearray | memoryview, name: str = "chunk") -> Iterator[Record]:
    """Walk a whole chunk's records, checking the framing (not the record checksums or block sums)."""
    view = memoryview(data)
    version, n_records = check_header(view[: HEADER.size], len(view), name)
    allowed = _FLAGS_OF_VERSION[version]
    aligned = version in _ALIGNED_VERSIONS
    pos = HEADER.size
    for i in range(n_records):
        padding = 0
        if aligned and view[pos : pos + 4] != _RECORD_MAGIC_BYTES:  # not a header: the padding starts here
            padding = padding_before(pos)
            pad = bytes(view[pos : pos + padding])
            if pad.count(0) != len(pad):
                at = pos + len(pad) - len(pad.lstrip(b"\0"))
                raise CorruptData(f"{name}: record {i}: a non-zero byte in the padding before it, at offset {at}")
            pos += padding
        if pos + RECORD.size > len(view):
            raise CorruptData(f"{name}: record {i} header runs past the end")
        rmagic, flags, stored_len, raw_len, checksum = RECORD.unpack_from(view, pos)
        if rmagic != RECORD_MAGIC:
            raise CorruptData(f"{name}: record {i} has a bad magic at offset {pos}")
        # The flags decide where the next record starts: one this version lacks would misframe the rest.
        if flags & ~allowed or (flags & FLAG_LZ4 and flags & FLAG_BLOCK_SUMS):
            raise CorruptData(f"{name}: record {i} has flags {flags:#x}, not valid in a version {version} chunk")
        if aligned and flags & FLAG_BLOCK_SUMS and padding_before(pos):
            raise CorruptData(f"{name}: record {i} has block sums but its bytes start at offset "
                              f"{pos + RECORD.size}, not on a {BLOCK_SIZE}-byte boundary")
        if padding and not flags & FLAG_BLOCK_SUMS:
            raise CorruptData(f"{name}: record {i} is padded but has no block sums (flags {flags:#x})")
        pos += RECORD.size
        rec = Record(pos, stored_len, raw_len, checksum, flags)
        if pos + stored_len + rec.sums_len > len(view):
            raise CorruptData(f"{name}: record {i} runs past the end")
        yield rec
        pos += stored_len + rec.sums_len
    if pos != len(view):
        raise CorruptData(f"{name}: {len(view) - pos} stray bytes after the last record")


def verify_chunk(data: bytes | bytearray | memoryview, expect_id: bytes | None = None) -> int:
    """Check a whole chunk: its framing, every record and block sum, and its name; returns the
    record count. The records are checked before the name, so damage is reported where it lies
    (record, block) rather than only as a chunk that does not match its id."""
    name = f"chunk {expect_id.hex()}" if expect_id else "chunk"
    view = memoryview(data)
    n = 0
    for rec in iter_records(view, name):
        where = f"{name}: record {n}"
        if rec.sums_len and rec.raw_len == rec.stored_len:  # a length mismatch is decode_record's to report
            rng = block_range(rec, 0, rec.raw_len)
            verify_blocks(view[rng.data_offset : rng.data_offset + rng.data_len],
                          view[rng.sums_offset : rng.sums_offset + rng.sums_len], rng, where)
        decode_record(view[rec.offset : rec.offset + rec.stored_len], rec, where)
        n += 1
    if expect_id is not None and chunk_id(data) != expect_id:
        raise CorruptData(f"{name}: content does not match its id")
    return n
