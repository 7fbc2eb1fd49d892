"""Unit tests for the chunk format: packing, naming, whole-chunk verification, record decoding."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import lz4.block
import pytest
import xxhash

from dlfs.errors import CorruptData
from dlfs.format.chunk import (
    BLOCK_SIZE,
    BLOCK_SUMS_MIN,
    FLAG_BLOCK_SUMS,
    FLAG_LZ4,
    HEADER,
    MAX_RECORD_BYTES,
    RECORD,
    RECORD_MAGIC,
    BlockRange,
    ChunkWriter,
    Record,
    block_range,
    chunk_id,
    decode_record,
    iter_records,
    padding_before,
    record_checksum,
    verify_blocks,
    verify_chunk,
)

CAP = 4 << 20


def _payloads() -> list[bytes]:
    rng = random.Random(1)
    return [
        b"",
        b"hello dlfs",
        rng.randbytes(1 << 20),
    ]


def _chunk(records: list[bytes], compress: bool = False) -> tuple[bytes, bytes, list[Record]]:
    w = ChunkWriter(CAP)
    recs = [w.add(r, compress) for r in records]
    cid, view = w.finish()
    return cid, bytes(view), recs


def _stored(data: bytes, rec: Record) -> bytes:
    return data[rec.offset : rec.offset + rec.stored_len]


@pytest.mark.timeout(10)
def test_round_trip_plain_records() -> None:
    payloads = _payloads()
    cid, data, recs = _chunk(payloads)
    assert cid == chunk_id(data) and len(cid) == 16
    assert verify_chunk(data, cid) == len(payloads)
    for payload, rec in zip(payloads, recs):
        # Only the 1 MiB record is big enough for block sums.
        assert rec.flags == (FLAG_BLOCK_SUMS if len(payload) >= BLOCK_SUMS_MIN else 0)
        assert rec.stored_len == rec.raw_len == len(payload)
        assert bytes(decode_record(_stored(data, rec), rec, "test")) == payload
    # The framing walk finds the same records the writer reported.
    assert list(iter_records(data)) == recs
    # The 1 MiB record starts on a 4 KiB boundary, after zero padding; the small ones are back to back.
    end = recs[1].offset + recs[1].stored_len
    pad = recs[2].offset - RECORD.size - end
    assert recs[1].offset == recs[0].offset + RECORD.size and recs[2].offset % 4096 == 0 and 0 < pad < 4096
    assert data[end : end + pad] == bytes(pad)
    assert len(data) == HEADER.size + sum(RECORD.size + len(p) for p in payloads) + pad + 8 * (1 << 20) // 4096


@pytest.mark.timeout(10)
def test_compression_kept_only_where_it_saves_space() -> None:
    text = b"the quick brown fox jumps over the lazy dog. " * 20000
    noise = random.Random(2).randbytes(200_000)
    cid, data, (packed, raw) = _chunk([text, noise], compress=True)
    assert packed.flags & FLAG_LZ4 and packed.stored_len < len(text) // 10
    assert packed.raw_len == len(text)
    assert raw.flags == 0 and raw.stored_len == len(noise)
    assert len(data) < len(text)  # the chunk itself is smaller than its contents
    assert verify_chunk(data, cid) == 2
    assert bytes(decode_record(_stored(data, packed), packed, "t")) == text
    assert bytes(decode_record(_stored(data, raw), raw, "t")) == noise


@pytest.mark.timeout(10)
def test_add_from_reads_a_real_file(tmp_path: Path) -> None:
    content = random.Random(3).randbytes(700_000) + b"tail" * 50_000
    src = tmp_path / "f.bin"
    src.write_bytes(content)
    w = ChunkWriter(CAP)
    with open(src, "rb", buffering=0) as f:
        first = w.add_from(f.readinto, 700_000, compress=False)
        second = w.add_from(f.readinto, len(content) - 700_000, compress=True)
        with pytest.raises(EOFError):
            w.add_from(f.readinto, 10, compress=False)  # the file is used up
    cid, view = w.finish()
    data = bytes(view)
    assert verify_chunk(data, cid) == 2
    assert second.flags & FLAG_LZ4
    got = bytes(decode_record(_stored(data, first), first, "t")) + bytes(decode_record(_stored(data, second), second, "t"))
    assert got == content


@pytest.mark.timeout(10)
def test_writer_refuses_records_that_do_not_fit() -> None:
    w = ChunkWriter(1024)
    with pytest.raises(ValueError):
        w.add(b"x" * 1024, compress=False)
    w.add(b"y" * w.room(), compress=False)
    assert w.room() == 0
    cid, view = w.finish()
    assert len(view) == 1024 and verify_chunk(view, cid) == 1


@pytest.mark.timeout(10)
def test_chunk_id_changes_with_one_byte() -> None:
    payload = bytearray(random.Random(4).randbytes(10_000))
    cid1, _, _ = _chunk([bytes(payload)])
    payload[5000] ^= 1
    cid2, _, _ = _chunk([bytes(payload)])
    assert cid1 != cid2
    # And the same content always gets the same name (ingest relies on it to skip stored chunks).
    assert _chunk([bytes(payload)])[0] == cid2


def _good() -> tuple[bytes, bytes]:
    cid, data, _ = _chunk([b"a" * 1000, random.Random(5).randbytes(5000)])
    return cid, data


def _reseal_header(data: bytearray) -> None:
    """Recompute the header checksum, so a test reaches the checks after it."""
    body = bytes(data[: HEADER.size - 8])
    data[HEADER.size - 8 : HEADER.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.timeout(10)
def test_verify_flipped_payload_byte() -> None:
    cid, data = _good()
    bad = bytearray(data)
    bad[-10] ^= 0x40
    # The record checksum catches it and names the chunk and the record, with or without the id.
    with pytest.raises(CorruptData, match=f"^chunk {cid.hex()}: record 1: checksum mismatch"):
        verify_chunk(bad, cid)
    with pytest.raises(CorruptData, match="^chunk: record 1: checksum mismatch"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_verify_wrong_id() -> None:
    cid, data = _good()
    other = bytes(16)
    with pytest.raises(CorruptData, match=f"^chunk {other.hex()}: content does not match its id"):
        verify_chunk(data, other)
    assert verify_chunk(data, cid) == 2


@pytest.mark.timeout(10)
def test_verify_truncated_chunk() -> None:
    _, data = _good()
    with pytest.raises(CorruptData, match="truncated"):
        verify_chunk(data[:-100])
    with pytest.raises(CorruptData, match="truncated header"):
        verify_chunk(data[:10])


@pytest.mark.timeout(10)
def test_verify_bad_magic() -> None:
    _, data = _good()
    bad = bytearray(data)
    bad[0:8] = b"NOTCHUNK"
    with pytest.raises(CorruptData, match="bad magic"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_verify_header_checksum_mismatch() -> None:
    _, data = _good()
    bad = bytearray(data)
    bad[12] ^= 1  # the record count
    with pytest.raises(CorruptData, match="header checksum mismatch"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_verify_unsupported_version() -> None:
    _, data = _good()
    bad = bytearray(data)
    bad[8:10] = struct.pack("<H", 99)
    _reseal_header(bad)
    with pytest.raises(CorruptData, match="version 99 is not supported"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_verify_trailing_garbage() -> None:
    _, data = _good()
    with pytest.raises(CorruptData, match="stray bytes") as info:
        verify_chunk(data + b"garbage!")
    assert "truncated" not in str(info.value)  # too long is not "truncated"


@pytest.mark.timeout(10)
def test_verify_bad_record_magic_names_the_offset() -> None:
    _, data = _good()
    bad = bytearray(data)
    bad[HEADER.size] ^= 0xFF
    with pytest.raises(CorruptData, match=f"record 0 has a bad magic at offset {HEADER.size}"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_decode_record_checksum_mismatch() -> None:
    _, data, (rec,) = _chunk([b"payload bytes" * 10])
    stored = bytearray(_stored(data, rec))
    stored[3] ^= 1
    with pytest.raises(CorruptData, match="^file x: checksum mismatch"):
        decode_record(stored, rec, "file x")


@pytest.mark.timeout(10)
def test_decode_record_truncated() -> None:
    _, data, (rec,) = _chunk([b"payload bytes" * 10])
    with pytest.raises(CorruptData, match=r"file x: truncated record \(129 of 130 bytes\)"):
        decode_record(_stored(data, rec)[:-1], rec, "file x")


@pytest.mark.timeout(10)
def test_decode_record_corrupt_lz4_with_forged_checksum() -> None:
    text = b"compressible " * 1000
    _, _, (rec,) = _chunk([text], compress=True)
    assert rec.flags & FLAG_LZ4
    garbage = bytes([0xF0]) + b"\xff" * 40  # a literal run whose length runs past the input
    with pytest.raises(lz4.block.LZ4BlockError):
        lz4.block.decompress(garbage, uncompressed_size=rec.raw_len)
    forged = Record(rec.offset, len(garbage), rec.raw_len, record_checksum(garbage), rec.flags)
    with pytest.raises(CorruptData, match="file x: lz4 data does not decode"):
        decode_record(garbage, forged, "file x")


@pytest.mark.timeout(10)
def test_decode_record_lz4_that_decodes_short() -> None:
    text = b"compressible " * 1000
    _, _, (rec,) = _chunk([text], compress=True)
    # Valid lz4 of fewer bytes than the record claims: the length check must catch it.
    short = lz4.block.compress(text[:-13], store_size=False)
    forged = Record(rec.offset, len(short), rec.raw_len, record_checksum(short), rec.flags)
    with pytest.raises(CorruptData, match="file x: decodes to"):
        decode_record(short, forged, "file x")


# --- block sums -------------------------------------------------------------------------------
def _sums_of(payload: bytes) -> bytes:
    """The trailer a record of `payload` must carry, computed here from the definition."""
    return b"".join(struct.pack("<Q", xxhash.xxh3_64_intdigest(payload[i : i + 4096]))
                    for i in range(0, len(payload), 4096))


def _sums_chunk() -> tuple[bytes, bytes, list[Record], list[bytes]]:
    """Records of many kinds back to back: small, just under and at the sums threshold, a short
    last block, a compressible big one (lz4: no sums), and one of MAX_RECORD_BYTES."""
    rng = random.Random(21)
    payloads = [
        b"small",
        rng.randbytes(BLOCK_SUMS_MIN - 1),
        rng.randbytes(BLOCK_SUMS_MIN),
        rng.randbytes(300_000),
        b"compresses well " * 40_000,
        rng.randbytes(MAX_RECORD_BYTES),
    ]
    w = ChunkWriter(16 << 20)
    recs = [w.add(p, compress=True) for p in payloads]
    cid, view = w.finish()
    return cid, bytes(view), recs, payloads


@pytest.mark.timeout(20)
def test_round_trip_records_with_and_without_block_sums() -> None:
    cid, data, recs, payloads = _sums_chunk()
    assert [r.flags for r in recs] == [0, 0, FLAG_BLOCK_SUMS, FLAG_BLOCK_SUMS, FLAG_LZ4, FLAG_BLOCK_SUMS]
    assert [r.has_block_sums for r in recs] == [False, False, True, True, False, True]
    assert [r.sums_len for r in recs] == [0, 0, 8 * 64, 8 * 74, 0, 8 * 1024]  # 300_000 B: 73 blocks + 992 B
    assert struct.unpack_from("<H", data, 8)[0] == 3  # a chunk with block sums is version 3
    assert [r.offset % 4096 == 0 for r in recs if r.has_block_sums] == [True] * 3
    assert verify_chunk(data, cid) == len(payloads)
    for payload, rec in zip(payloads, recs):
        assert bytes(decode_record(_stored(data, rec), rec, "t")) == payload
        trailer = data[rec.offset + rec.stored_len : rec.offset + rec.stored_len + rec.sums_len]
        assert trailer == (_sums_of(payload) if rec.has_block_sums else b"")
    assert list(iter_records(data)) == recs


@pytest.mark.timeout(20)
def test_framing_with_block_sums() -> None:
    _, data, recs, _ = _sums_chunk()
    pos = HEADER.size
    for rec in recs:
        # Each header starts right after the previous record's stored bytes and sums, or, for a record
        # with block sums, after the zero bytes that put its stored bytes on a 4 KiB boundary.
        pad = -(pos + 24) % 4096 if rec.has_block_sums else 0
        assert data[pos : pos + pad] == bytes(pad)
        pos += pad
        magic, flags, stored, raw, checksum = RECORD.unpack_from(data, pos)
        assert (magic, flags, stored, raw, checksum) == (RECORD_MAGIC, rec.flags, rec.stored_len, rec.raw_len,
                                                         rec.checksum)
        assert rec.offset == pos + RECORD.size
        pos = rec.offset + rec.stored_len + rec.sums_len
    assert pos == len(data)
    # The whole-record checksum covers the stored bytes only, not the sums.
    big = recs[3]
    assert big.checksum == xxhash.xxh3_64_intdigest(_stored(data, big))


@pytest.mark.timeout(10)
def test_chunk_without_block_sums_is_version_1_byte_for_byte() -> None:
    payloads = [b"", b"hello", random.Random(22).randbytes(BLOCK_SUMS_MIN - 1)]
    # A version-1 chunk built here from the version-1 layout, not by the writer.
    body = b"".join(RECORD.pack(RECORD_MAGIC, 0, len(p), len(p), xxhash.xxh3_64_intdigest(p)) + p for p in payloads)
    head = HEADER.pack(b"DLFSCHNK", 1, 0, len(payloads), len(body), 0)[:-8]
    v1 = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body
    assert verify_chunk(v1, chunk_id(v1)) == 3
    recs = list(iter_records(v1))
    assert [bytes(decode_record(_stored(v1, r), r, "t")) for r in recs] == payloads
    assert all(r.sums_len == 0 for r in recs)
    # The writer still writes exactly that: same bytes, same id, for chunks without block sums.
    cid, data, _ = _chunk(payloads)
    assert data == v1 and cid == chunk_id(v1)


@pytest.mark.timeout(10)
def test_block_sums_in_a_version_1_chunk_are_corrupt() -> None:
    bad = _layout([random.Random(23).randbytes(BLOCK_SUMS_MIN)], version=1, aligned=False)
    with pytest.raises(CorruptData, match="record 0 has flags 0x2, not valid in a version 1 chunk"):
        verify_chunk(bad)


@pytest.mark.timeout(10)
def test_lz4_with_block_sums_is_corrupt() -> None:
    w = ChunkWriter(CAP)
    w.add(b"compresses well " * 20_000, compress=True)
    w.add(random.Random(24).randbytes(BLOCK_SUMS_MIN), compress=False)  # makes it version 3
    _, view = w.finish()
    bad = bytearray(view)
    struct.pack_into("<I", bad, HEADER.size + 4, FLAG_LZ4 | FLAG_BLOCK_SUMS)
    with pytest.raises(CorruptData, match="record 0 has flags 0x3"):
        verify_chunk(bad)
    with pytest.raises(CorruptData, match="record 0 has flags 0x3"):
        list(iter_records(bad))


def _expected_footprint(n: int, at: int = 32) -> int:
    """What a record of n incompressible bytes takes in a chunk when it starts at offset `at`, from the
    format's definition: with block sums, zero padding first, so that its bytes start on a 4 KiB boundary."""
    if n < 256 << 10:
        return 24 + n
    return -(at + 24) % 4096 + 24 + n + 8 * -(-n // 4096)


@pytest.mark.timeout(30)
def test_room_keeps_space_for_block_sums() -> None:
    zeros = bytes(MAX_RECORD_BYTES + 1)
    plain = HEADER.size + RECORD.size + BLOCK_SUMS_MIN  # the smallest record with sums, were it not padded
    base = 4096 + BLOCK_SUMS_MIN  # ...and padded (its header ends at 4096)
    for cap in [1024, plain - 1, plain, plain + 7, plain + 4039, base - 1, base, base + 7, base + 8, base + 9,
                base + 512, base + 520, base + 4103, base + 4104, base + 4105, base + 12_345,
                HEADER.size + RECORD.size + (3 << 20) + 17]:
        w = ChunkWriter(cap)
        room = w.room()
        assert _expected_footprint(room) <= cap - HEADER.size  # what room() promises fits...
        assert _expected_footprint(room + 1) > cap - HEADER.size  # ...and is the most that does
        w.add(zeros[:room], compress=False)
        assert len(w) == HEADER.size + _expected_footprint(room) <= cap
        cid, view = w.finish()
        assert verify_chunk(view, cid) == 1
    # Behind a first record of any length, so at every padding: the same promise.
    rng = random.Random(27)
    for first in [0, 1, 4040, 4041, 4095, 4096, 5000, *(rng.randrange(8192) for _ in range(20))]:
        for cap in [base + 4096 + first, base + 8192 + first + rng.randrange(8192), 3 << 20]:
            w = ChunkWriter(cap)
            w.add(zeros[:first], compress=False)
            room, at = w.room(), len(w)
            assert _expected_footprint(room, at) <= cap - at < _expected_footprint(room + 1, at), (first, cap)
            rec = w.add(zeros[:room], compress=False)
            assert len(w) == at + _expected_footprint(room, at) <= cap
            assert rec.offset % 4096 == 0 if rec.has_block_sums else rec.offset == at + 24
            cid, view = w.finish()
            assert verify_chunk(view, cid) == 2
    # No record is longer than MAX_RECORD_BYTES, however big the chunk.
    w = ChunkWriter(32 << 20)
    assert w.room() == MAX_RECORD_BYTES
    with pytest.raises(ValueError):
        w.add(zeros, compress=False)


@pytest.mark.timeout(10)
def test_fits_counts_every_record_and_its_sums() -> None:
    # 10 MiB as records of 4, 4 and 2 MiB: three headers, the most padding each may need (4095 bytes:
    # where a record starts depends on how its predecessors compress), and 8 bytes of sums per 4 KiB.
    need = 3 * (RECORD.size + 4095) + (10 << 20) + 8 * (10 << 20) // 4096
    for spare, fits in [(0, True), (-1, False)]:
        w = ChunkWriter(HEADER.size + RECORD.size + 1000 + need + spare)
        w.add(b"x" * 1000, compress=False)
        assert w.fits(10 << 20) is fits
        assert w.fits(0) and w.fits(MAX_RECORD_BYTES)


@pytest.mark.timeout(60)
def test_fits_is_a_promise_whatever_compresses() -> None:
    """Whatever fits() accepts, the packer's way of adding it (records of MAX_RECORD_BYTES, the
    last shorter, each as big as room() allows) fits: compressed pieces move the padding of the
    pieces after them, and the chunk still never grows past its capacity."""
    rng = random.Random(28)
    noise = rng.randbytes(3 * MAX_RECORD_BYTES)
    text = b"compressible text, over and over " * (MAX_RECORD_BYTES // 10)
    for trial in range(40):
        cap = rng.choice([1 << 20, 5 << 20, 9 << 20, 13 << 20]) + rng.randrange(1 << 16)
        w = ChunkWriter(cap)
        w.add(noise[: rng.randrange(300_000)], compress=False)
        length = rng.randrange(1, 3 * MAX_RECORD_BYTES)
        if not w.fits(length):
            continue
        left = length
        while left:
            piece = min(left, w.room())
            assert piece == min(left, MAX_RECORD_BYTES), (trial, cap, length, left)
            src = text if rng.random() < 0.5 and piece < len(text) else noise
            w.add(src[:piece], compress=rng.random() < 0.7)
            left -= piece
        assert len(w) <= cap
        cid, view = w.finish()
        verify_chunk(view, cid)


def _layout(payloads: list[bytes], version: int, aligned: bool) -> bytes:
    """A chunk of uncompressed records built here from the format's definition, not by the writer:
    records of 256 KiB or more carry block sums and, when `aligned` (version 3), zero padding before
    their header that puts their bytes on a 4 KiB boundary; unaligned, this is what the version-2
    writer wrote."""
    body = bytearray()
    for p in payloads:
        sums = len(p) >= 256 << 10
        if aligned and sums:
            body += bytes(-(32 + len(body) + 24) % 4096)
        body += RECORD.pack(RECORD_MAGIC, 2 if sums else 0, len(p), len(p), xxhash.xxh3_64_intdigest(p)) + p
        body += _sums_of(p) if sums else b""
    head = HEADER.pack(b"DLFSCHNK", version, 0, len(payloads), len(body), 0)[:-8]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + bytes(body)


def _one_big_record(aligned: bool, n: int = 300_000) -> tuple[bytes, Record, bytes]:
    """A chunk whose second record (n random bytes, block sums) follows a small one: written by the
    writer (version 3: its bytes 4 KiB-aligned) or, unaligned, as the version-2 writer wrote it:
    (chunk bytes, the record, its payload)."""
    payload = random.Random(25).randbytes(n)
    if aligned:
        w = ChunkWriter(CAP)
        w.add(b"first", compress=False)
        w.add(payload, compress=False)
        view = bytes(w.finish()[1])
    else:
        view = _layout([b"first", payload], version=2, aligned=False)
    rec = list(iter_records(view))[1]
    assert rec.has_block_sums and (rec.offset % 4096 == 0) == aligned
    return view, rec, payload


def _slices(data: bytes | bytearray, rng: BlockRange) -> tuple[bytes, bytes]:
    return (bytes(data[rng.data_offset : rng.data_offset + rng.data_len]),
            bytes(data[rng.sums_offset : rng.sums_offset + rng.sums_len]))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("aligned", [True, False], ids=["version-3", "version-2"])
def test_block_range_edges(aligned: bool) -> None:
    data, rec, payload = _one_big_record(aligned)  # 300_000 bytes: blocks 0..72 whole, block 73 of 992 bytes
    o, s = rec.offset, rec.offset + rec.stored_len
    cases = {
        (0, 1): BlockRange(0, 1, o, 4096, s, 8),  # the start
        (0, 4096): BlockRange(0, 1, o, 4096, s, 8),
        (4095, 2): BlockRange(0, 2, o, 8192, s, 16),  # unaligned, across a block edge
        (4096, 4096): BlockRange(1, 1, o + 4096, 4096, s + 8, 8),
        (10_000, 5_000): BlockRange(2, 2, o + 8192, 8192, s + 16, 16),
        (299_999, 1): BlockRange(73, 1, o + 73 * 4096, 992, s + 73 * 8, 8),  # the short last block
        (73 * 4096, 992): BlockRange(73, 1, o + 73 * 4096, 992, s + 73 * 8, 8),
        (299_000, 10_000): BlockRange(72, 2, o + 72 * 4096, 300_000 - 72 * 4096, s + 72 * 8, 16),  # clamped
        (0, 300_000): BlockRange(0, 74, o, 300_000, s, 74 * 8),  # the whole record
        (0, 1 << 40): BlockRange(0, 74, o, 300_000, s, 74 * 8),
    }
    for (off, length), want in cases.items():
        got = block_range(rec, off, length)
        assert got == want, (off, length)
        # The range covers what was asked, and its blocks check against the real trailer.
        block, sums = _slices(data, got)
        start = off - got.first * 4096
        assert block[start : start + length] == payload[off : off + length]
        verify_blocks(block, sums, got, "t")
    for off, length in [(0, 0), (5, -1), (300_000, 1), (400_000, 10), (-1, 10)]:
        with pytest.raises(ValueError):
            block_range(rec, off, length)
    small = list(iter_records(data))[0]
    with pytest.raises(ValueError, match="no block sums"):
        block_range(small, 0, 1)


@pytest.mark.timeout(10)
def test_block_range_of_whole_blocks_only() -> None:
    w = ChunkWriter(CAP)
    rec = w.add(random.Random(26).randbytes(BLOCK_SUMS_MIN), compress=False)  # 64 whole blocks
    assert block_range(rec, BLOCK_SUMS_MIN - 1, 1) == BlockRange(
        63, 1, rec.offset + 63 * BLOCK_SIZE, BLOCK_SIZE, rec.offset + rec.stored_len + 63 * 8, 8)
    assert block_range(rec, 0, BLOCK_SUMS_MIN).sums_len == rec.sums_len == 64 * 8


@pytest.mark.timeout(10)
def test_verify_blocks_catches_a_flipped_data_or_sum_byte() -> None:
    data, rec, _ = _one_big_record(aligned=True)
    rng = block_range(rec, 5 * 4096 + 100, 3 * 4096)  # blocks 5..8
    block, sums = _slices(data, rng)
    verify_blocks(block, sums, rng, "t")
    for i in range(1234, len(block), 4096):  # a byte in each block
        bad = bytearray(block)
        bad[i] ^= 0x01
        with pytest.raises(CorruptData, match=f"^file f at 123 block {5 + i // 4096}: checksum mismatch$"):
            verify_blocks(bad, sums, rng, "file f at 123")
    for i in range(0, len(sums), 3):
        bad_sums = bytearray(sums)
        bad_sums[i] ^= 0x80
        with pytest.raises(CorruptData, match=f"^w block {5 + i // 8}: checksum mismatch$"):
            verify_blocks(block, bad_sums, rng, "w")
    with pytest.raises(CorruptData, match="truncated"):
        verify_blocks(block[:-1], sums, rng, "w")
    with pytest.raises(CorruptData, match="truncated"):
        verify_blocks(block, sums[:-8], rng, "w")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("aligned", [True, False], ids=["version-3", "version-2"])
def test_verify_chunk_checks_every_block_sum(aligned: bool) -> None:
    data, rec, _ = _one_big_record(aligned)
    cid = chunk_id(data)
    assert verify_chunk(data, cid) == 2
    sums_at = rec.offset + rec.stored_len
    for block in (0, 41, 73):
        bad = bytearray(data)
        bad[sums_at + 8 * block + 5] ^= 0x10  # a sum: outside the whole-record checksum
        assert decode_record(_stored(bytes(bad), rec), rec, "t")  # which still passes
        with pytest.raises(CorruptData, match=f"^chunk {cid.hex()}: record 1 block {block}: checksum mismatch$"):
            verify_chunk(bad, cid)
        bad = bytearray(data)
        bad[rec.offset + block * 4096 + 7] ^= 0x10  # the data the sum checks
        with pytest.raises(CorruptData, match=f"^chunk: record 1 block {block}: checksum mismatch$"):
            verify_chunk(bad)


# --- alignment (version 3) ----------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_block_sum_records_start_on_a_block_boundary() -> None:
    """Every record with block sums has its stored bytes at a multiple of 4096 of the chunk, after
    zero padding; every other record follows its predecessor directly."""
    rng = random.Random(29)
    text = b"compressible text, over and over " * 40_000
    for _ in range(15):
        w = ChunkWriter(24 << 20)
        end = HEADER.size
        while True:
            n = rng.choice([0, 1, 4095, 4096, BLOCK_SUMS_MIN - 1, BLOCK_SUMS_MIN, rng.randrange(MAX_RECORD_BYTES)])
            if n > w.room():
                break
            payload = text[:n] if rng.random() < 0.3 else rng.randbytes(n)
            rec = w.add(payload, compress=rng.random() < 0.5)
            if rec.has_block_sums:
                assert rec.offset % 4096 == 0 and rec.offset - 24 - end == padding_before(end) < 4096
            else:
                assert rec.offset == end + 24
            end = rec.offset + rec.stored_len + rec.sums_len
        cid, view = w.finish()
        data = bytes(view)
        assert verify_chunk(data, cid) == len(w.records) and list(iter_records(data)) == w.records
        assert struct.unpack_from("<H", data, 8)[0] == (3 if any(r.has_block_sums for r in w.records) else 1)


@pytest.mark.timeout(10)
def test_writer_writes_the_version_3_layout_byte_for_byte() -> None:
    rng = random.Random(30)
    payloads = [b"a", rng.randbytes(BLOCK_SUMS_MIN), rng.randbytes(5000), rng.randbytes(300_000), b"",
                rng.randbytes(4096 * 70)]
    cid, data, _ = _chunk(payloads)
    assert data == _layout(payloads, version=3, aligned=True) and cid == chunk_id(data)
    # A reused buffer full of old bytes writes the same: the padding is zeroed, not left as found.
    w = ChunkWriter(CAP, bytearray(b"\xff" * CAP))
    for p in payloads:
        w.add(p, compress=False)
    assert w.finish()[0] == cid


@pytest.mark.timeout(10)
def test_version_2_chunk_still_reads_and_verifies() -> None:
    rng = random.Random(31)
    payloads = [b"small", rng.randbytes(BLOCK_SUMS_MIN + 1234), rng.randbytes(7), rng.randbytes(MAX_RECORD_BYTES)]
    v2 = _layout(payloads, version=2, aligned=False)
    assert verify_chunk(v2, chunk_id(v2)) == 4
    recs = list(iter_records(v2))
    assert [r.has_block_sums for r in recs] == [False, True, False, True]
    assert all(r.offset % 4096 for r in recs)  # back to back, as the version-2 writer put them
    for payload, rec in zip(payloads, recs):
        assert bytes(decode_record(_stored(v2, rec), rec, "t")) == payload
        if rec.has_block_sums:
            rng_ = block_range(rec, 5000, 9000)
            block, sums = _slices(v2, rng_)
            verify_blocks(block, sums, rng_, "t")
            assert block[5000 - rng_.first * 4096 :][:9000] == payload[5000:14000]
    # A flipped byte in a block of it is still found, and named.
    bad = bytearray(v2)
    bad[recs[3].offset + 3 * 4096 + 1] ^= 1
    with pytest.raises(CorruptData, match="^chunk: record 3 block 3: checksum mismatch$"):
        verify_chunk(bad)


def _padded() -> tuple[bytes, Record, int]:
    """A version-3 chunk whose second record has block sums: (bytes, that record, where its padding starts)."""
    data, rec, _ = _one_big_record(aligned=True)
    start = HEADER.size + RECORD.size + len(b"first")
    assert rec.offset - RECORD.size - start == 4096 - start - 24
    return data, rec, start


@pytest.mark.timeout(10)
def test_a_non_zero_byte_in_the_padding_is_corrupt() -> None:
    data, rec, start = _padded()
    cid = chunk_id(data)
    assert verify_chunk(data, cid) == 2
    for at in (start, start + 1, start + 2000, rec.offset - RECORD.size - 1):  # first byte, ..., last byte
        for value in (0x01, 0xDE, 0xFF):
            bad = bytearray(data)
            bad[at] = value
            with pytest.raises(CorruptData, match=f"^chunk {cid.hex()}: record 1: a non-zero byte in the padding "
                                                  f"before it, at offset {at}$"):
                verify_chunk(bad, cid)
            with pytest.raises(CorruptData, match="non-zero byte in the padding"):
                list(iter_records(bad))


@pytest.mark.timeout(10)
def test_malformed_padding_is_corrupt() -> None:
    rng = random.Random(32)
    big, small = rng.randbytes(300_000), rng.randbytes(1000)
    # A record with block sums that is not aligned, in a version-3 chunk.
    bad = bytearray(_layout([b"first", big], version=2, aligned=False))
    bad[8:10] = struct.pack("<H", 3)
    _reseal_header(bad)
    with pytest.raises(CorruptData, match=r"^chunk: record 1 has block sums but its bytes start at offset 85, "
                                          r"not on a 4096-byte boundary$"):
        verify_chunk(bad)
    # Padding before a record without block sums.
    body = bytes(4096 - 32 - 24) + RECORD.pack(RECORD_MAGIC, 0, 1000, 1000, xxhash.xxh3_64_intdigest(small)) + small
    head = HEADER.pack(b"DLFSCHNK", 3, 0, 1, len(body), 0)[:-8]
    with pytest.raises(CorruptData, match=r"^chunk: record 0 is padded but has no block sums \(flags 0x0\)$"):
        verify_chunk(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body)
    # Padding in a version-2 chunk (which has none): the header is not where it must be.
    bad = bytearray(_layout([b"first", big], version=3, aligned=True))
    bad[8:10] = struct.pack("<H", 2)
    _reseal_header(bad)
    with pytest.raises(CorruptData, match="^chunk: record 1 has a bad magic at offset 61$"):
        verify_chunk(bad)
    # Zero bytes where no padding can be (the header already ends on a boundary), and after the last record.
    good = _layout([big], version=3, aligned=True)
    assert good[HEADER.size : HEADER.size + 4] == bytes(4)
    shifted = bytearray(good)
    shifted[HEADER.size + 4040 : HEADER.size + 4040 + 4] = bytes(4)  # the magic, wiped
    with pytest.raises(CorruptData, match="^chunk: record 0 has a bad magic at offset 4072$"):
        verify_chunk(shifted)
    with pytest.raises(CorruptData, match="^chunk: .*stray bytes"):
        verify_chunk(good + bytes(4096))
