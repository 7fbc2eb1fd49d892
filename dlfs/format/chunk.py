"""The chunk format: many files' bytes packed back to back, each record checksummed.

A chunk is immutable and named by the xxh3-128 of its whole content. Layout (little-endian):

    header  32 B   magic "DLFSCHNK", version u16, flags u16, records u32, payload bytes u64,
                   xxh3-64 of the 24 bytes before it
    record  24 B   magic u32, flags u32 (bit 0: lz4), stored length u32, raw length u32,
                   xxh3-64 of the stored bytes
            ...    the stored bytes
    (records repeat)

The index points straight at each record's stored bytes (offset, lengths, checksum, flags), so a
reader fetches and verifies one file without parsing the chunk; the record headers make a chunk
checkable on its own (`verify_chunk`), which the data daemon and repair use.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lz4.block
import xxhash

from dlfs.errors import CorruptData

MAGIC = b"DLFSCHNK"
VERSION = 1
HEADER = struct.Struct("<8sHHIQQ")
RECORD = struct.Struct("<IIIIQ")
RECORD_MAGIC = 0xD1F5C0DE
FLAG_LZ4 = 1
ID_BYTES = 16
MAX_CHUNK_SIZE = 1 << 30
MAX_RECORD = (1 << 32) - 1


def chunk_id(data: bytes | bytearray | memoryview) -> bytes:
    """The content hash that names a chunk."""
    return xxhash.xxh3_128_digest(data)


def record_checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class Record:
    """Where one record's stored bytes sit in its chunk, and how to check and decode them."""

    offset: int
    stored_len: int
    raw_len: int
    checksum: int
    flags: int


class ChunkWriter:
    """Packs records into one chunk buffer that already exists; `finish` seals and names it.

    The buffer is reused chunk after chunk (`reset`): file bytes are read straight into it.
    """

    def __init__(self, capacity: int, buf: bytearray | None = None) -> None:
        self.capacity = capacity
        self.buf = buf if buf is not None else bytearray(capacity)
        self.view = memoryview(self.buf)
        self.reset(self.buf)

    def reset(self, buf: bytearray) -> None:
        if len(buf) < self.capacity:
            raise ValueError("chunk buffer smaller than the chunk capacity")
        self.buf = buf
        self.view = memoryview(buf)
        self.pos = HEADER.size
        self.records: list[Record] = []

    def __len__(self) -> int:
        return self.pos

    def room(self) -> int:
        """Payload bytes that still fit in one more record."""
        return max(0, self.capacity - self.pos - RECORD.size)

    def add(self, data: bytes | memoryview, compress: bool) -> Record:
        """Append one record from bytes; compression is kept only where it saves space."""
        if len(data) > self.room():
            raise ValueError("record does not fit in the chunk")
        start = self.pos + RECORD.size
        self.view[start : start + len(data)] = data
        return self._seal(len(data), compress)

    def add_from(self, fd: int, length: int, compress: bool) -> Record:
        """Append one record read from `fd` straight into the buffer; returns it.

        Raises EOFError if the file ends before `length` bytes.
        """
        if length > self.room():
            raise ValueError("record does not fit in the chunk")
        start = self.pos + RECORD.size
        dest = self.view[start : start + length]
        got = 0
        while got < length:
            n = os.readv(fd, [dest[got:]])
            if n == 0:
                raise EOFError(got)
            got += n
        return self._seal(length, compress)

    def _seal(self, length: int, compress: bool) -> Record:
        start = self.pos + RECORD.size
        raw = self.view[start : start + length]
        stored_len, flags = length, 0
        if compress and length > 64:
            packed = lz4.block.compress(raw, store_size=False)
            if len(packed) < length:
                self.view[start : start + len(packed)] = packed
                stored_len, flags = len(packed), FLAG_LZ4
        stored = self.view[start : start + stored_len]
        checksum = record_checksum(stored)
        RECORD.pack_into(self.buf, self.pos, RECORD_MAGIC, flags, stored_len, length, checksum)
        rec = Record(start, stored_len, length, checksum, flags)
        self.pos = start + stored_len
        self.records.append(rec)
        return rec

    def finish(self) -> tuple[bytes, memoryview]:
        """Seal the header; returns (chunk id, chunk bytes as a view of the buffer)."""
        head = HEADER.pack(MAGIC, VERSION, 0, len(self.records), self.pos - HEADER.size, 0)
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


def iter_records(data: bytes | bytearray | memoryview, name: str = "chunk") -> Iterator[Record]:
    """Walk a whole chunk's records, checking the framing (not the record checksums)."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise CorruptData(f"{name}: truncated header ({len(view)} bytes)")
    magic, version, _flags, n_records, payload, hsum = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptData(f"{name}: not a dlfs chunk (bad magic)")
    if xxhash.xxh3_64_intdigest(view[: HEADER.size - 8]) != hsum:
        raise CorruptData(f"{name}: header checksum mismatch")
    if version != VERSION:
        raise CorruptData(f"{name}: chunk format version {version} is not supported")
    if HEADER.size + payload > len(view):
        raise CorruptData(f"{name}: truncated ({len(view)} bytes, header says {HEADER.size + payload})")
    # Too long is not truncation: say so, or repair hunts for a missing tail that is not missing.
    if HEADER.size + payload < len(view):
        raise CorruptData(f"{name}: {len(view) - HEADER.size - payload} stray bytes after the payload")
    pos = HEADER.size
    for i in range(n_records):
        if pos + RECORD.size > len(view):
            raise CorruptData(f"{name}: record {i} header runs past the end")
        rmagic, flags, stored_len, raw_len, checksum = RECORD.unpack_from(view, pos)
        if rmagic != RECORD_MAGIC:
            raise CorruptData(f"{name}: record {i} has a bad magic at offset {pos}")
        pos += RECORD.size
        if pos + stored_len > len(view):
            raise CorruptData(f"{name}: record {i} runs past the end")
        yield Record(pos, stored_len, raw_len, checksum, flags)
        pos += stored_len
    if pos != len(view):
        raise CorruptData(f"{name}: {len(view) - pos} stray bytes after the last record")


def verify_chunk(data: bytes | bytearray | memoryview, expect_id: bytes | None = None) -> int:
    """Check a whole chunk: its name, framing and every record; returns the record count."""
    name = f"chunk {expect_id.hex()}" if expect_id else "chunk"
    if expect_id is not None and chunk_id(data) != expect_id:
        raise CorruptData(f"{name}: content does not match its id")
    view = memoryview(data)
    n = 0
    for rec in iter_records(view, name):
        decode_record(view[rec.offset : rec.offset + rec.stored_len], rec, f"{name} record {n}")
        n += 1
    return n
