"""The cache's planner on its own: windows, streams, how far ahead, what the kernel holds. No node, no
cache, no I/O: an index file of real chunk records and the planner's answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from test_cache import _big_chunk
from test_services import make_index

from dlfs.format.index import Index
from dlfs.mount.planner import RANDOM_READ_MAX, STREAM_WINDOWS, STREAM_WINDOWS_MAX, Planner, chunk_windows

RECORD = 20_000
WINDOW = 64 << 10  # three 20 KB records a window


def _index(tmp_path: Path, chunks: int = 4, records: int = 8) -> Index:
    made = [_big_chunk(i, [RECORD] * records) for i in range(chunks)]
    path = tmp_path / "t.idx"
    path.write_bytes(make_index([(cid, data, recs) for cid, data, recs, _ in made]))
    return Index(path)


def _nothing(i: int) -> bool:
    return False


def test_windows_cover_each_chunk_once_within_the_window(tmp_path: Path) -> None:
    index = _index(tmp_path)
    p = Planner(index, WINDOW)
    for ci in range(index.totals.chunks):
        starts = chunk_windows(index, ci, WINDOW)
        chunk = index.chunk(ci)
        assert starts[0] == chunk.first_extent and starts[-1] == chunk.first_extent + chunk.n_extents
        for lo, hi in zip(starts, starts[1:]):
            assert p.span(list(range(lo, hi)))[1] <= WINDOW
            for ext in range(lo, hi):
                assert p.window_of(ext) == (lo, hi)
    assert [p.window_of(e)[0] for e in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]


def test_reads_become_sequential_as_the_kernel_or_a_reader_shows_it(tmp_path: Path) -> None:
    p = Planner(_index(tmp_path), WINDOW)
    # A file read from its start, or a READ bigger than an application's random read, is sequential.
    assert p.sequential(0, 0, 4096, first=0)
    assert p.sequential(5, 8192, 8192 + 4096, first=3, size=RANDOM_READ_MAX + 1)
    # Small reads in the middle: random, until the third in a row continues the one before.
    assert not p.sequential(9, 4096, 8192, first=8)
    assert not p.sequential(9, 8192, 12288, first=8)
    assert p.sequential(9, 12288, 16384, first=8)
    # ...and the run goes on into the file's next record from its start.
    assert not p.sequential(12, 100, 200, first=11)
    assert p.sequential(10, 0, 4096, first=8) is False  # record 9 was not read to its end
    for lo in range(16384, RECORD, 4096):
        p.sequential(9, lo, min(lo + 4096, RECORD), first=8)
    assert p.sequential(10, 0, 4096, first=8)


def _windows(p: Planner, ext: int, first: int, end: int, present: Callable[[int], bool],
             room: Callable[[], bool]) -> list[int]:
    """Planner.ahead's windows, without their distances."""
    return [w for w, _ in p.ahead(ext, first, end, present, room)]


def test_a_stream_keeps_its_depth_of_windows_ahead_within_its_file_and_room(tmp_path: Path) -> None:
    index = _index(tmp_path, chunks=12)
    p = Planner(index, WINDOW)
    file_end = index.totals.extents  # one file of every record
    ahead = _windows(p, 0, 0, file_end, _nothing, lambda: True)
    assert len(ahead) == STREAM_WINDOWS
    assert ahead[0] == p.window_of(0)[1] and all(p.window_of(w)[0] == w for w in ahead)
    # What is here or coming is not asked for again, but still counts toward the depth (and the distance).
    here = set(range(ahead[0], ahead[2]))
    again = p.ahead(0, 0, file_end, here.__contains__, lambda: True)
    assert again == [(w, k) for k, w in enumerate(ahead)][2:]
    # No room: nothing more. Near the file's end: only what is left of it.
    assert p.ahead(0, 0, file_end, _nothing, lambda: False) == []
    last = p.window_of(file_end - 1)[0]
    assert _windows(p, last - 1, 0, file_end, _nothing, lambda: True) == [last]
    # A reader that outran its windows gets more of them, up to the most.
    for _ in range(5):
        p.deepen(0)
    assert p.stream_waits == 5
    assert len(p.ahead(0, 0, file_end, _nothing, lambda: True)) == min(STREAM_WINDOWS_MAX, len(range(3, file_end, 3)))


def test_a_consumed_window_moves_its_stream_on(tmp_path: Path) -> None:
    index = _index(tmp_path, chunks=12)
    p = Planner(index, WINDOW)
    ahead = _windows(p, 0, 0, index.totals.extents, _nothing, lambda: True)
    assert p.sent(ahead[0]) == (0, index.totals.extents)  # read from a window read ahead: go on
    assert p.sent(ahead[0] + 1) is None  # that window's move was made
    assert p.sent(0) is None  # not read ahead of a stream


def test_records_sent_to_the_kernel_are_passed_over_until_it_asks_again(tmp_path: Path) -> None:
    p = Planner(_index(tmp_path), WINDOW)
    for ext in (1, 2):
        p.sent(ext)
    assert p.run(0, _nothing) == [0]  # the kernel holds 1 and 2: the window brings 0 alone
    assert p.run(0, _nothing, sent=False) == [0, 1, 2]  # a dlfs.direct client reads them again
    assert not p.asked_again(0)
    # The kernel asks for 1 again: it drops pages. A new generation, in which no earlier note holds.
    assert p.asked_again(1) and p.generations == 2
    assert p.run(0, _nothing) == [0, 1, 2]
    assert not p.asked_again(1)


def test_the_rest_of_a_chunk_is_its_other_windows_that_are_needed(tmp_path: Path) -> None:
    p = Planner(_index(tmp_path), WINDOW)
    assert p.rest_of_chunk(4, _nothing) == [0, 6]
    assert p.rest_of_chunk(4, {6, 7}.__contains__) == [0]
    assert p.rest_of_chunk(9, _nothing) == [11, 14]
