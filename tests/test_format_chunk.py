"""Unit tests for the chunk format: packing, naming, whole-chunk verification, record decoding."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import lz4.block
import pytest

from dlfs.errors import CorruptData
from dlfs.format.chunk import (
    FLAG_LZ4,
    HEADER,
    RECORD,
    ChunkWriter,
    Record,
    chunk_id,
    decode_record,
    iter_records,
    record_checksum,
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
        assert rec.flags == 0 and rec.stored_len == rec.raw_len == len(payload)
        assert bytes(decode_record(_stored(data, rec), rec, "test")) == payload
    # The framing walk finds the same records the writer reported.
    assert list(iter_records(data)) == recs
    assert len(data) == HEADER.size + sum(RECORD.size + len(p) for p in payloads)


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
    fd = os.open(src, os.O_RDONLY)
    try:
        first = w.add_from(fd, 700_000, compress=False)
        second = w.add_from(fd, len(content) - 700_000, compress=True)
        with pytest.raises(EOFError):
            w.add_from(fd, 10, compress=False)  # the file is used up
    finally:
        os.close(fd)
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
    import xxhash

    data[HEADER.size - 8 : HEADER.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.timeout(10)
def test_verify_flipped_payload_byte() -> None:
    cid, data = _good()
    bad = bytearray(data)
    bad[-10] ^= 0x40
    with pytest.raises(CorruptData, match="does not match its id"):
        verify_chunk(bad, cid)
    # Without the id to compare, the record checksum catches it and names the record.
    with pytest.raises(CorruptData, match="record 1: checksum mismatch"):
        verify_chunk(bad)


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
