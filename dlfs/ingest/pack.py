"""Packing files into chunks: runs in one worker thread, reading straight into chunk buffers.

A file is kept in one chunk when it fits in one, and is cut into records of at most
MAX_RECORD_BYTES (format/chunk.py) either way, so that a reader of a piece of a big file never
has to fetch, or check, more than one such record (and, through its block sums, far less).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

from dlfs.errors import SourceError
from dlfs.format.chunk import BLOCK_SIZE, HEADER, ChunkBuffer, ChunkWriter, records_span
from dlfs.format.index import IndexWriter
from dlfs.ingest.source import FileReader, Source
from dlfs.ingest.walk import Node, Tree

# A file is split across chunks only when it could never fit in one, or when this much of the
# current chunk would otherwise go unused.
SPLIT_MIN_ROOM = 256 << 10


@dataclass
class Packed:
    """A sealed chunk, on its way to the data daemons; `buf` goes back to the pool after."""

    number: int
    cid: bytes
    data: memoryview
    buf: ChunkBuffer


class Packer:
    """Fills chunks with the tree's files in inode order and records every extent in the index."""

    def __init__(self, source: Source, tree: Tree, writer: IndexWriter, chunk_size: int, compress: bool,
                 pool: queue.Queue[ChunkBuffer], emit: Callable[[Packed], None],
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.source = source
        self.tree = tree
        self.writer = writer
        self.compress = compress
        self.pool = pool
        self.emit = emit
        self.progress = progress
        self.chunk = ChunkWriter(chunk_size, pool.get())
        self.number = 0
        self.first_extent = 0
        self.extents: dict[int, tuple[int, int]] = {}  # ino -> (first extent, count)

    def _seal(self) -> None:
        if not self.chunk.records:
            return
        cid, data = self.chunk.finish()
        n_ext = len(self.chunk.records)
        self.writer.add_chunk(cid, len(data), self.first_extent, n_ext)
        self.emit(Packed(self.number, cid, data, self.chunk.buf))
        self.number += 1
        self.first_extent += n_ext
        self.chunk.reset(self.pool.get())

    def add_file(self, node: Node, f: FileReader) -> None:
        first = self.writer.extents_count()
        left = node.size
        while left:
            room = self.chunk.room()
            fits_whole = records_span(left) <= self.chunk.capacity - HEADER.size
            # An empty chunk always takes a piece: sealing it would seal nothing, forever.
            if not self.chunk.fits(left) and self.chunk.records and (fits_whole or room < SPLIT_MIN_ROOM):
                self._seal()
                continue
            # A piece that does not end the file ends on a block boundary: file offsets then map to
            # whole 4 KiB blocks of each record, and a random 4 KiB read checks one block, not two.
            piece = left if left <= room else (room - room % BLOCK_SIZE or room)
            try:
                rec = self.chunk.add_from(f.readinto, piece, self.compress)
            except EOFError:
                raise SourceError(f"{f.name} shrank while being ingested; nothing was published") from None
            self.writer.add_extent(self.number, rec)
            left -= piece
            if self.progress:  # a big file moves the progress as it goes, not only once done
                self.progress(0, piece)
        f.finish()
        self.extents[node.ino] = (first, self.writer.extents_count() - first)
        if self.progress:
            self.progress(1, 0)

    def run(self) -> dict[int, tuple[int, int]]:
        """Pack every regular file; returns each file inode's extent run."""
        for node, f in self.source.files(self.tree):
            try:
                self.add_file(node, f)
            finally:
                f.close()
        self._seal()
        return self.extents
