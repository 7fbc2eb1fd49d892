"""What to fetch: the cache's read-ahead policy, with no I/O and no memory of its own to manage.

  - windows: each chunk is cut into fixed windows of up to a slab (records packed from the chunk's
    start); whatever order misses come in, each window is fetched once into one slab;
  - streams: a READ bigger than RANDOM_READ_MAX (the kernel's read-ahead), a read of a file from its
    start, or the third read in a row continuing the one before (across records too) is sequential;
  - how far ahead: a file read in order keeps its next windows (its depth) here or queued, the depth
    doubling whenever a read finds its window still in flight (the reader outran them);
  - what the kernel holds: records sent whole to the kernel are passed over by read-ahead until the
    kernel asks again for one, which shows that it drops pages (memory pressure, a dataset bigger than
    memory); that starts a new *generation*, in which no earlier note holds, so every cold epoch reads
    ahead as the first did.

The planner answers questions and keeps these notes; the cache (cache.py) owns what is in memory and
in flight, and says so through the `present` predicate it passes in.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from collections.abc import Callable

from dlfs.format.chunk import BLOCK_SUM, BLOCK_SUMS_MIN, block_count
from dlfs.format.index import Index
from dlfs.native import native

STREAMS = 4096  # records whose last read is remembered, to tell sequential reads from random ones
SEQUENTIAL_AFTER = 2  # reads continuing the one before, after which a stream fetches whole records
# READs bigger than this are the kernel's read-ahead, so part of a sequential read, in whatever order
# they arrive (several are in flight at once); smaller ones are an application's random reads. The
# serving threads draw the same line (native/answer.h).
RANDOM_READ_MAX = getattr(native, "RANDOM_READ_MAX", 64 << 10)
# Windows kept ahead of a file read in order: from the first, doubled whenever a read that reaches
# Python finds its window still in flight (the reader outran them), up to the most (a slab each).
STREAM_WINDOWS, STREAM_WINDOWS_MAX = 8, 16
MIN_WINDOW = 64 << 10  # a smaller --readahead reads windows of this: each fetch is a round trip
Present = Callable[[int], bool]  # whether an extent is cached or being fetched


def window_size(index: Index, readahead: int) -> int:
    """Bytes of a chunk fetched per miss at most (a slab's worth). No fetch spans chunks: a window
    bigger than the dataset's chunks would be memory never used."""
    return max(min(readahead, index.totals.chunk_size or readahead), MIN_WINDOW)


def window_reach(window: int) -> int:
    """Chunk bytes one window of at most `window` bytes of records spans at most: those and the block
    sums of its last record (those of the others lie between them). A record with sums is at least
    BLOCK_SUMS_MIN, so below that size a window holding one is that record alone, and never fits."""
    return window + block_count(window) * BLOCK_SUM.size if window >= BLOCK_SUMS_MIN else window


def window_span(index: Index, first: int, end: int) -> tuple[int, int, int]:
    """(offset in the chunk, length, least) of the one range that holds the records [first, end) of
    one chunk with their block sums: what the mount and `dlfs warmup` fetch for a window, so that a
    block read of any of its records finds its sums in the disk cache too. `least`: the length without
    the last record's sums, enough to serve every record whole (what a disk cache filled before
    2026-12-06 holds of a window)."""
    a, b = index.extent(first).record, index.extent(end - 1).record
    return a.offset, b.end - a.offset, b.offset + b.stored_len - a.offset


def chunk_windows(index: Index, ci: int, window: int) -> list[int]:
    """The first extent of each window of chunk `ci`, then its extents' end: records packed from the
    chunk's start, each window at most `window` bytes (or one record). The mount fetches these, and
    `dlfs warmup` the same ones, so that what it leaves on disk is what the mount asks for."""
    chunk = index.chunk(ci)
    starts, base = [], -1
    for i in range(chunk.first_extent, chunk.first_extent + chunk.n_extents):
        rec = index.extent(i).record
        if base < 0 or rec.offset + rec.stored_len - base > window:
            starts.append(i)
            base = rec.offset
    starts.append(chunk.first_extent + chunk.n_extents)
    return starts


class Planner:
    def __init__(self, index: Index, window: int) -> None:
        self.index = index
        self.window = window
        self._windows: dict[int, list[int]] = {}  # chunk -> first extent of each of its windows, then its end
        self._streams: OrderedDict[int, tuple[int, int]] = OrderedDict()  # ext -> (end of last read, run)
        self._depth: OrderedDict[int, int] = OrderedDict()  # a streamed file's first extent -> windows ahead
        # Windows read ahead of a file read in order (their first extent) -> (the file's first extent,
        # its extents' end): the consumption of one of their records moves the stream on.
        self._streaming: dict[int, tuple[int, int]] = {}
        self._sent = array("H", bytes(2 * max(index.totals.extents, 1)))  # generation each was sent whole in
        self._generation = 1
        self.generations = 1
        self.stream_waits = 0  # reads that found their window still being fetched: the stream then deepens

    # --- windows ---

    def window_of(self, ext: int) -> tuple[int, int]:
        """[first, end) extents of the window of ext's chunk that holds it."""
        ci = self.index.extent(ext).chunk
        starts = self._windows.get(ci)
        if starts is None:
            starts = self._windows[ci] = chunk_windows(self.index, ci, self.window)
        k = bisect.bisect_right(starts, ext) - 1
        return starts[k], starts[k + 1]

    def needed(self, i: int, present: Present, sent: bool = True) -> bool:
        """Whether extent i needs a fetch: not cached nor being fetched, nor (with `sent`) sent whole to
        the kernel in this generation."""
        return not ((sent and self._sent[i] == self._generation) or present(i))

    def run(self, ext: int, present: Present, sent: bool = True) -> list[int]:
        """`ext` and the other extents of its window that need a fetch (one range covers them); with
        `sent=False` those the kernel was sent too (a dlfs.direct client reads them again)."""
        lo, hi = self.window_of(ext)
        return [i for i in range(lo, hi) if i == ext or self.needed(i, present, sent)]

    def span(self, run: list[int]) -> tuple[int, int, int]:
        """(offset in the chunk, length, least) of the one range that covers the records of `run`, and
        the block sums of its last (window_span)."""
        return window_span(self.index, run[0], run[-1] + 1)

    # --- streams ---

    def sequential(self, ext: int, lo: int, hi: int, first: int, size: int = 0) -> bool:
        """Note a read of [lo, hi) of extent `ext` (of a file starting at extent `first`; `size`: the
        READ's size); True if it is part of a sequential read."""
        last = self._streams.pop(ext, None)
        if last is not None and last[0] == lo:
            run = last[1] + 1
        elif lo == 0 and ext > first:  # the stream may go on from the file's previous record
            prev = self._streams.get(ext - 1)
            run = prev[1] + 1 if prev is not None and prev[0] == self.index.extent(ext - 1).record.raw_len else 0
        else:
            run = 0
        self._streams[ext] = (hi, run)
        if len(self._streams) > STREAMS:
            self._streams.popitem(last=False)
        return (lo == 0 and ext == first) or run >= SEQUENTIAL_AFTER or size > RANDOM_READ_MAX

    def ahead(self, ext: int, first: int, file_end: int, present: Present,
              room: Callable[[], bool]) -> list[tuple[int, int]]:
        """The file of extents [first, file_end) is read in order, now at extent `ext`: the windows
        (their first extents) to queue so that as many as its depth are here or coming, while `room()`
        says read-ahead may grow; each with how many windows come before it from the reader's next one
        (0: that one), the order a reader wants them in."""
        depth = self._depth.get(first, STREAM_WINDOWS)
        nxt = self.window_of(ext)[1]
        out = []
        for k in range(depth):
            if nxt >= file_end:
                break
            if self.needed(nxt, present):
                if not room():  # asked only for a window to fetch: making room may drop another
                    break
                out.append((nxt, k))
            self._streaming[nxt] = (first, file_end)
            nxt = self.window_of(nxt)[1]
        return out

    def rest_of_chunk(self, ext: int, present: Present) -> list[int]:
        """The windows of extent `ext`'s chunk that need a fetch, but its own (a small file's
        neighbours: an epoch reads them too, in whatever order)."""
        mine = self.window_of(ext)[0]
        chunk = self.index.chunk(self.index.extent(ext).chunk)
        start, end = chunk.first_extent, chunk.first_extent + chunk.n_extents
        out = []
        while start < end:
            if start != mine and self.needed(start, present):
                out.append(start)
            start = self.window_of(start)[1]
        return out

    def deepen(self, first: int) -> None:
        """A read of the file starting at extent `first` waited for its window: keep more ahead."""
        self.stream_waits += 1
        self._depth[first] = min(self._depth.get(first, STREAM_WINDOWS) * 2, STREAM_WINDOWS_MAX)
        self._depth.move_to_end(first)
        if len(self._depth) > STREAMS:
            self._depth.popitem(last=False)

    # --- what the kernel holds ---

    def sent(self, ext: int) -> tuple[int, int] | None:
        """Every byte of extent `ext` went to the kernel: noted, and the stream to move on if its window
        was read ahead of a file read in order ((first, end) of that file), else None."""
        self._sent[ext] = self._generation
        if not self._streaming:
            return None
        return self._streaming.pop(self.window_of(ext)[0], None)

    def asked_again(self, ext: int) -> bool:
        """A miss of extent `ext`: if the kernel was sent it whole in this generation, it drops pages,
        and a new generation starts (True)."""
        if self._sent[ext] != self._generation:
            return False
        self._generation += 1
        self.generations += 1
        if self._generation > 0xFFFF:
            self._sent = array("H", bytes(len(self._sent) * 2))
            self._generation = 1
        return True
