"""An index that is sane inside: check_index on indexes that lie, and a metadata daemon that
refuses to commit one, stages index bytes only in order, and commits a session once."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import xxhash
from test_services import make_chunk, make_index, node_with_clients, put_chunk

from dlfs.errors import Conflict, CorruptData, ProtocolError
from dlfs.format.check import check_index
from dlfs.format.index import DIRENT, HEADER, INODE, Index, IndexWriter, _align
from dlfs.wire.protocol import Msg

REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def tiny(tmp_path: Path, spoil: Callable[[IndexWriter, object], None] | None = None) -> Index:
    """Root with a file "a" (one record of a real chunk) and a directory "d" holding "b" (empty);
    `spoil(writer, record)` changes it before the inodes are set."""
    cid, data, recs, _ = make_chunk(7, records=1)
    w = IndexWriter(4, 1 << 20, created_ns=1)
    ext = w.add_extent(0, recs[0])
    w.add_chunk(cid, len(data), 0, 1)
    if spoil is not None:
        spoil(w, recs[0])
    if not w.dirents:
        ref_d, n_d = w.add_dirents([(b"b", 4)])
        ref_r, n_r = w.add_dirents([(b"a", 2), (b"d", 3)])
        w.set_inode(1, DIR, 0, 0, 3, 0, 0, ref_r, n_r, 1)
        w.set_inode(3, DIR, 0, 0, 2, 0, 0, ref_d, n_d, 1)
    if not any(w.inodes[48:96]):
        w.set_inode(2, REG, 0, 0, 1, recs[0].raw_len, 0, ext, 1, 1)
    if not any(w.inodes[144:192]):
        w.set_inode(4, REG, 0, 0, 1, 0, 0, 0, 0, 3)
    path = tmp_path / "i.idx"
    with open(path, "wb") as f:
        w.write(f)
    return Index(path)


def test_a_sane_index_passes(tmp_path: Path) -> None:
    check_index(tiny(tmp_path))
    idx_bytes = make_index([make_chunk(1)[:3], make_chunk(2)[:3]])
    (tmp_path / "m.idx").write_bytes(idx_bytes)
    check_index(Index(tmp_path / "m.idx"))


def _extent_past_chunk(w: IndexWriter, rec: object) -> None:
    w.chunks[16:24] = (10).to_bytes(8, "little")  # the chunk is 10 bytes long now


def _size_lies(w: IndexWriter, rec: object) -> None:
    w.set_inode(2, REG, 0, 0, 1, 1 << 40, 0, 0, 1, 1)


def _entry_out_of_range(w: IndexWriter, rec: object) -> None:
    ref_d, n_d = w.add_dirents([(b"b", 4)])
    ref, n = w.add_dirents([(b"a", 99), (b"d", 3)])
    w.set_inode(1, DIR, 0, 0, 3, 0, 0, ref, n, 1)
    w.set_inode(3, DIR, 0, 0, 2, 0, 0, ref_d, n_d, 1)


def _cycle(w: IndexWriter, rec: object) -> None:
    # d holds itself under another name: a walk would never end.
    ref_d, n_d = w.add_dirents([(b"b", 4), (b"loop", 3)])
    ref_r, n_r = w.add_dirents([(b"a", 2), (b"d", 3)])
    w.set_inode(1, DIR, 0, 0, 3, 0, 0, ref_r, n_r, 1)
    w.set_inode(3, DIR, 0, 0, 2, 0, 0, ref_d, n_d, 1)


def _unsorted(w: IndexWriter, rec: object) -> None:
    # Entries out of order: binary search would miss "a".
    for name, ino in ((b"d", 3), (b"a", 2)):
        off, n = w.add_name(name)
        w.dirents += DIRENT.pack(off, n, ino)
    ref_d, n_d = w.add_dirents([(b"b", 4)])
    w.set_inode(1, DIR, 0, 0, 3, 0, 0, 0, 2, 1)
    w.set_inode(3, DIR, 0, 0, 2, 0, 0, ref_d, n_d, 1)


def _device(w: IndexWriter, rec: object) -> None:
    w.set_inode(4, stat.S_IFCHR | 0o600, 0, 0, 1, 0, 0, 0, 0, 3)


def _chunk_too_big(w: IndexWriter, rec: object) -> None:
    w.chunks[16:24] = (1 << 63).to_bytes(8, "little")


@pytest.mark.parametrize(("spoil", "says"), [
    (_extent_past_chunk, "extent 0 runs past the end of chunk 0"),
    (_size_lies, "file inode 2: its extents do not add up"),
    (_entry_out_of_range, "entry b'a' names inode 99"),
    (_cycle, "directory inode 3 is reached twice"),
    (_unsorted, "out of order"),
    (_device, "inode 4 has mode 0o20600"),
    (_chunk_too_big, "chunk 0 out of range"),
])
def test_an_index_that_lies_inside_is_refused(tmp_path: Path, spoil: Callable[[IndexWriter, object], None],
                                              says: str) -> None:
    idx = tiny(tmp_path, spoil)  # its checksums are right: only the check can tell
    with pytest.raises(CorruptData, match=f"index {tmp_path}/i.idx: .*{says}"):
        check_index(idx)


async def _begin(meta: object, name: str) -> str:
    reply, _ = await meta.call(Msg.BEGIN_INGEST, {"name": name})  # type: ignore[attr-defined]
    return str(reply["session"])


@pytest.mark.timeout(60)
async def test_commit_refuses_an_index_that_lies_and_stages_in_order(tmp_path: Path) -> None:
    cid, data, recs, _ = make_chunk(3)
    good = make_index([(cid, data, recs)])
    async with node_with_clients(tmp_path) as (meta, dconn):
        await put_chunk(dconn, cid, data)
        # A file claiming 1 TiB over its one record, checksums made right.
        sid = await _begin(meta, "liar")
        await meta.call(Msg.PIN_CHUNKS, {"session": sid, "ids": [cid]})
        bad = _spoil_size(good)
        await meta.call(Msg.PUT_INDEX, {"session": sid, "offset": 0}, bad)
        with pytest.raises(CorruptData, match="its extents do not add up"):
            await meta.call(Msg.COMMIT, {"session": sid, "size": len(bad), "checksum": xxhash.xxh3_64_intdigest(bad)})
        listed, _ = await meta.call(Msg.LIST_DATASETS)
        assert "liar" not in str(listed)

        # Pieces in order only: one past what is staged (a hole a commit would hash) is refused.
        sid = await _begin(meta, "holes")
        with pytest.raises(ProtocolError, match="past the 0 bytes staged"):
            await meta.call(Msg.PUT_INDEX, {"session": sid, "offset": 1 << 20}, b"x")
        with pytest.raises(ProtocolError, match="would pass 8 GiB"):
            await meta.call(Msg.PUT_INDEX, {"session": sid, "offset": (8 << 30) - 1}, b"xy")

        # Two COMMITs of one session at once: one commits, the other is refused (no internal error).
        sid = await _begin(meta, "twice")
        await meta.call(Msg.PIN_CHUNKS, {"session": sid, "ids": [cid]})
        await meta.call(Msg.PUT_INDEX, {"session": sid, "offset": 0}, good)
        outcomes: list[object] = []

        async def commit() -> None:
            try:
                reply, _ = await meta.call(Msg.COMMIT, {"session": sid, "size": len(good),
                                                        "checksum": xxhash.xxh3_64_intdigest(good)})
                outcomes.append(reply["version"])
            except (Conflict, CorruptData) as exc:
                outcomes.append(type(exc).__name__)

        async with trio.open_nursery() as n:
            n.start_soon(commit)
            n.start_soon(commit)
        assert sorted(map(str, outcomes)) == ["1", "Conflict"], outcomes


def _spoil_size(raw: bytes) -> bytes:
    """The index with its first file's size made 1 TiB, both checksums made right again."""
    n_chunks = HEADER.unpack_from(raw)[3]
    at = HEADER.size + _align(n_chunks * 32) + INODE.size + 16  # inode 2's size field
    out = bytearray(raw)
    out[at : at + 8] = (1 << 40).to_bytes(8, "little")
    fields = list(HEADER.unpack_from(out))
    fields[-2] = xxhash.xxh3_64_intdigest(bytes(out[HEADER.size :]))
    head = HEADER.pack(*fields)
    out[: HEADER.size] = head[:-8] + xxhash.xxh3_64_intdigest(head[:-8]).to_bytes(8, "little")
    return bytes(out)
