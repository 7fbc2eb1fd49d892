"""The index layout is stated once, in dlfs/format/index.py's LAYOUT; native/indexview.h restates it
as C structs. These tests parse that header and hold it to LAYOUT field by field (names, types, order,
so offsets and sizes), with its magic, version, name limit and record flags, and hold the built helper
(dlfs._native) to the same sizes, so a stale build is caught too."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import pytest

from dlfs.format import chunk, index
from dlfs.native import native

HEADER_FILE = Path(__file__).resolve().parent.parent / "native" / "indexview.h"
C_STRUCT = {"header": "dlfs_index_header", "chunk": "dlfs_chunk", "inode": "dlfs_inode", "dirent": "dlfs_dirent",
            "extent": "dlfs_extent"}
C_CODE = {"uint32_t": "I", "int32_t": "i", "uint64_t": "Q", "int64_t": "q"}


def c_defines(text: str) -> dict[str, int | bytes]:
    out: dict[str, int | bytes] = {}
    for name, value in re.findall(r"^#define (DLFS_\w+) (\S+)", text, re.M):
        out[name] = value.strip('"').encode() if value.startswith('"') else int(value.rstrip("u"), 0)
    return out


def c_fields(text: str, name: str, defines: dict[str, int | bytes]) -> tuple[tuple[str, str], ...]:
    """The fields of `struct name { ... };` as (name, struct code), in declaration order."""
    found = re.search(r"^struct " + name + r" \{(.*?)^\};", text, re.M | re.S)
    assert found, f"struct {name} is not in {HEADER_FILE}"
    fields = []
    for decl in re.sub(r"/\*.*?\*/", "", found[1], flags=re.S).split(";"):
        if not decl.strip():
            continue
        ctype, names = decl.split(None, 1)
        for one in names.split(","):
            m = re.fullmatch(r"(\w+)(?:\[(\w+)\])?", one.strip())
            assert m, f"struct {name}: cannot read {one!r}"
            if m[2] is not None:  # a byte array: the id and the magic
                assert ctype == "uint8_t", f"struct {name}.{m[1]}: arrays are of bytes"
                fields.append((m[1], f"{int(defines.get(m[2], m[2]))}s"))
            else:
                fields.append((m[1], C_CODE[ctype]))
    return tuple(fields)


def test_the_c_header_restates_the_python_layout() -> None:
    text = HEADER_FILE.read_text()
    defines = c_defines(text)
    for kind, c_name in C_STRUCT.items():
        fields = c_fields(text, c_name, defines)
        assert fields == index.LAYOUT[kind], kind
        # Natural alignment throughout: a C compiler then adds no padding, so offsets are the same.
        offset = 0
        for field, code in fields:
            size = struct.calcsize("<" + code)
            assert code.endswith("s") or offset % size == 0, f"{c_name}.{field} at {offset} is unaligned"
            offset += size
        assert offset % 8 == 0, c_name
    assert index.HEADER.size == struct.calcsize("<" + "".join(c for _, c in index.LAYOUT["header"]))
    assert defines["DLFS_INDEX_MAGIC"] == index.MAGIC and defines["DLFS_INDEX_VERSION"] == index.VERSION
    assert defines["DLFS_NAME_MAX"] == index.NAME_MAX == 255
    assert (defines["DLFS_CHUNK_ID"], defines["DLFS_RECORD_LZ4"], defines["DLFS_RECORD_BLOCK_SUMS"],
            defines["DLFS_BLOCK_SIZE"]) == (chunk.ID_BYTES, chunk.FLAG_LZ4, chunk.FLAG_BLOCK_SUMS, chunk.BLOCK_SIZE)


def test_the_python_readers_follow_the_layout() -> None:
    # The records are packed and unpacked by position: the dataclasses read back must be in LAYOUT's order.
    assert [f.name for f in dataclasses.fields(index.Inode)][1:] == [n for n, _ in index.LAYOUT["inode"]]
    assert [f.name for f in dataclasses.fields(index.ChunkRef)] == [n for n, _ in index.LAYOUT["chunk"]]


@pytest.mark.skipif(native is None, reason="dlfs's C helper is not built (or DLFS_NO_NATIVE is set)")
def test_the_built_helper_reads_this_layout() -> None:
    assert native is not None
    assert native.INDEX_LAYOUT == {
        "magic": index.MAGIC, "version": index.VERSION, "name_max": index.NAME_MAX, "header": index.HEADER.size,
        "chunk": index.CHUNK.size, "chunk_id": chunk.ID_BYTES, "inode": index.INODE.size,
        "dirent": index.DIRENT.size, "extent": index.EXTENT.size, "flag_lz4": chunk.FLAG_LZ4,
        "flag_block_sums": chunk.FLAG_BLOCK_SUMS, "block_size": chunk.BLOCK_SIZE}
