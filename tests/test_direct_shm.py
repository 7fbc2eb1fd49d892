"""The shared cache's pin table in C (native/shm.h; the mount's half native/cacheowner.c, a client's
native/direct.c), without a mount: each half does its own job only, rows handed out under epochs,
releases of an earlier attachment and below zero refused, slab numbers from shared memory range-checked;
a client's request cut short ends its stream; populate never writes."""

from __future__ import annotations

import errno
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from test_services import make_chunk, make_index

from dlfs.direct import DirectReader
from dlfs.format.index import Index
from dlfs.native import native
from dlfs.wire.protocol import HEADER, RESPONSE, Frame, Msg, encode_frame

pytestmark = pytest.mark.skipif(native is None, reason="needs dlfs's C helper")
SLAB = 64 << 10
NSLABS = 4
ROWS = 3
HEAD = struct.Struct("<8sII10Q")  # struct dlfs_shm_header, up to its total


class Region:
    """A mount's shared cache over one chunk's index (files f2..f5, one record each), its record of
    file f3 published at the start of slab 0."""

    def __init__(self, tmp_path: Path) -> None:
        cid, data, recs, self.payloads = make_chunk(1, records=4)
        (tmp_path / "t.idx").write_bytes(make_index([(cid, data, recs)]))
        self.index = Index(tmp_path / "t.idx")
        size = native.shared_size(SLAB, NSLABS, self.index.totals.extents, ROWS)
        self.ctl_fd = os.memfd_create("dlfs-cache-control")
        self.arena_fd = os.memfd_create("dlfs-cache")
        os.ftruncate(self.ctl_fd, size)
        os.ftruncate(self.arena_fd, NSLABS * SLAB)
        self.ctl = mmap.mmap(self.ctl_fd, size)
        self.arena = mmap.mmap(self.arena_fd, NSLABS * SLAB)
        self.mount = native.CacheOwner(self.ctl, self.arena, slab_size=SLAB, nslabs=NSLABS,
                                       n_extents=self.index.totals.extents, n_rows=ROWS)
        self.arena[: len(self.payloads[1])] = self.payloads[1]  # f3: extent 1, not compressed
        self.mount.publish(1, 0, 0)

    def client(self, row: int) -> Any:
        """A client's CacheView on `row`, mapped as dlfs.direct maps it: read-only."""
        return native.CacheView(mmap.mmap(self.ctl_fd, 0, prot=mmap.PROT_READ),
                                mmap.mmap(self.arena_fd, 0, prot=mmap.PROT_READ), row=row,
                                sections=self.index.sections())

    def close(self) -> None:
        os.close(self.ctl_fd)
        os.close(self.arena_fd)


@pytest.fixture
def region(tmp_path: Path) -> Any:
    r = Region(tmp_path)
    yield r
    r.close()


def test_a_release_from_an_earlier_attachment_is_refused(region: Region) -> None:
    """Row 0 handed to client 1, then (its owner gone) to client 2: client 1's late release must not
    take client 2's pin, and no count goes below zero."""
    mount = region.mount
    first = mount.hand_out(0)
    one = region.client(0)
    assert one.epoch == first
    view = one.read_many([b"f3"])[0]
    assert view == region.payloads[1] and mount.pinned(0) == 1

    assert mount.clear_row(0) == 1  # client 1 counted as gone: its row taken back, handed on
    assert mount.hand_out(0) == first + 1
    two = region.client(0)
    kept = two.read_many([b"f3"])[0]
    assert mount.pinned(0) == 1
    assert isinstance(one.read_many([b"f3"])[0], int)  # no new pin through a row no longer its own
    view.release()  # client 1's late release: refused
    assert mount.pinned(0) == 1 and mount.refused_releases == 2
    kept.release()
    assert mount.pinned(0) == 0
    assert mount.unpin_for(0, 0) is False  # below zero: refused, not wrapped to 4294967295
    assert mount.row_pins(0) == 0 and mount.refused_releases == 3


def test_a_client_marks_its_row_released_once_its_last_view_goes(region: Region) -> None:
    mount = region.mount
    mount.hand_out(1)
    client = region.client(1)
    view = client.read_many([b"f3"])[0]
    client.detach()
    assert not mount.released(1)  # a view still pins through it
    with pytest.raises(RuntimeError, match="detached"):
        client.read_many([b"f3"])
    view.release()
    assert mount.released(1) and mount.row_pins(1) == 0
    assert mount.clear_row(1) == 0 and not mount.released(1)
    mount.hand_out(1)
    assert not mount.released(1)  # a mark is the epoch's it was made in


def test_a_slab_number_out_of_range_is_refused(region: Region) -> None:
    """An entry of the control region naming a slab past the arena: no place to pin or read."""
    mount = region.mount
    mount.hand_out(0)
    client = region.client(0)
    assert mount.where(1) == (0, 0)
    entries = HEAD.unpack_from(region.ctl)[7]
    gen_and_slab = struct.unpack_from("<Q", region.ctl, entries + 8)[0]
    struct.pack_into("<Q", region.ctl, entries + 8, (gen_and_slab >> 24 << 24) | (NSLABS + 1))
    assert mount.where(1) is None
    assert isinstance(client.read_many([b"f3"])[0], int) and mount.row_pins(0) == 0


def test_a_client_maps_only_its_own_row_writable(region: Region) -> None:
    region.mount.hand_out(0)
    with pytest.raises(ValueError, match="read-only"):
        native.CacheView(mmap.mmap(region.ctl_fd, 0), region.arena, row=0, sections=region.index.sections())
    with pytest.raises(ValueError, match="not handed out"):
        region.client(1)


OWNER_ONLY = ("publish", "unpublish", "retire", "pinned", "pin_for", "unpin_for", "hand_out", "released", "clear_row",
              "where", "served", "reset_served", "set_pending", "take_consumed", "consumed_fd", "consumed_dropped",
              "refused_releases")
VIEW_ONLY = ("read_many", "take", "detach", "row", "epoch", "live_pins")


def test_each_half_does_its_own_job_only(region: Region) -> None:
    """A client's CacheView has none of the mount's methods (it cannot publish, retire or hand rows out),
    the mount's CacheOwner none of a client's, and the serving engine takes the owner alone."""
    mount = region.mount
    mount.hand_out(1)
    client = region.client(1)
    for name in OWNER_ONLY:
        assert hasattr(mount, name) and not hasattr(client, name), name
    for name in VIEW_ONLY:
        assert hasattr(client, name) and not hasattr(mount, name), name
    with pytest.raises(AttributeError):
        client.publish(2, 1, 0)
    with pytest.raises(AttributeError):
        client.retire(0)
    assert mount.where(2) is None and mount.where(1) == (0, 0)  # nothing the client did reached the table
    with pytest.raises(AttributeError):
        mount.read_many([b"f3"])
    # The mount lays the region out, so it needs it writable; a client refuses a writable one (above).
    with pytest.raises(BufferError):
        native.CacheOwner(mmap.mmap(region.ctl_fd, 0, prot=mmap.PROT_READ), region.arena, slab_size=SLAB,
                          nslabs=NSLABS, n_extents=region.index.totals.extents, n_rows=ROWS)
    with pytest.raises(TypeError, match="CacheOwner"):
        native.engine_start(region.index.sections(), client, row=0)
    # Made whole or not at all: neither half exists without what it stands on.
    with pytest.raises(TypeError):
        native.CacheOwner()
    with pytest.raises(TypeError):
        native.CacheView.__new__(native.CacheView)


def test_named_getters_say_what_the_numbered_ones_did(region: Region) -> None:
    """Each attribute once picked by a number (0..9 of the one SharedCache) against what the control region
    itself holds, on the half that has it."""
    mount = region.mount
    for _ in range(3):  # an epoch that is no other number here
        epoch = mount.hand_out(2)
    client = region.client(2)
    (_, version, n_rows, slab_size, nslabs, n_extents, _, _, _, epochs, *_) = HEAD.unpack_from(region.ctl)
    assert version == 2 and (slab_size, nslabs, n_extents, n_rows) == (SLAB, NSLABS, region.index.totals.extents, ROWS)
    for half in (mount, client):  # 0..3: the layout's sizes, on both
        assert (half.slab_size, half.nslabs, half.n_extents, half.n_rows) == (slab_size, nslabs, n_extents, n_rows)
    # 6, 7: the client's row and the epoch it was handed out under, as the epochs section says.
    assert client.row == 2 and client.epoch == epoch == struct.unpack_from("<Q", region.ctl, epochs + 16)[0] == 3
    # 8: pins its views hold, the same count its row holds in shared memory.
    assert client.live_pins == 0
    view = client.read_many([b"f3"])[0]
    assert client.live_pins == 1 == client.row_pins(2) == mount.row_pins(2)
    view.release()
    assert client.live_pins == 0 == mount.row_pins(2)
    # 4, 5: the mount's consumed queue: an eventfd, not readable while nothing waits in it.
    assert os.readlink(f"/proc/self/fd/{mount.consumed_fd}") == "anon_inode:[eventfd]"
    assert select.select([mount.consumed_fd], [], [], 0)[0] == [] and mount.take_consumed() == []
    assert mount.consumed_dropped == 0
    # 9: refused releases, one per release below zero.
    assert mount.refused_releases == 0
    assert mount.unpin_for(2, 0) is False and mount.refused_releases == 1


def test_a_region_that_does_not_add_up_is_refused(region: Region) -> None:
    """The layout code both halves share (native/shm.c): a client recomputes the layout from the header's
    sizes and trusts nothing else; the mount refuses a region or an arena too small for its sizes."""
    region.mount.hand_out(0)
    ctl = mmap.mmap(region.ctl_fd, 0)
    with pytest.raises(ValueError, match="the layout needs"):
        native.CacheOwner(memoryview(ctl)[:4096], region.arena, slab_size=SLAB, nslabs=NSLABS,
                          n_extents=region.index.totals.extents, n_rows=ROWS)
    with pytest.raises(ValueError, match="arena smaller than its slabs"):
        native.CacheOwner(bytearray(len(ctl)), bytearray(SLAB), slab_size=SLAB, nslabs=NSLABS,
                          n_extents=region.index.totals.extents, n_rows=ROWS)
    with pytest.raises(ValueError, match="sizes out of range"):
        native.CacheOwner(bytearray(len(ctl)), region.arena, slab_size=0, nslabs=NSLABS, n_extents=1, n_rows=ROWS)
    struct.pack_into("<I", ctl, 8, 3)  # another layout version
    with pytest.raises(ValueError, match="layout version"):
        region.client(0)
    struct.pack_into("<I", ctl, 8, 2)
    region.client(0).detach()  # the header as it was: attached
    offsets = HEAD.unpack_from(ctl)[8]  # the header's offset of the offsets section, at byte 56
    struct.pack_into("<Q", ctl, 56, offsets + 8)  # moved: not where the sizes put it
    with pytest.raises(ValueError, match="inconsistent"):
        region.client(0)
    struct.pack_into("<Q", ctl, 56, offsets)
    region.client(0).detach()
    with pytest.raises(ValueError, match="arena smaller than its slabs"):
        native.CacheView(mmap.mmap(region.ctl_fd, 0, prot=mmap.PROT_READ), bytes(SLAB), row=0,
                         sections=region.index.sections())
    with pytest.raises(ValueError, match=f"row {ROWS} outside 0..{ROWS - 1}"):
        region.client(ROWS)


class _NoPins:
    """A client's CacheView, holding no pins."""

    detached = False

    def detach(self) -> None:
        self.detached = True


def test_a_request_cut_short_ends_the_stream(tmp_path: Path) -> None:
    """The mount sends half an answer, then nothing: the client's timeout ends the stream (what would
    come next belongs to the old answer), and its next request attaches anew."""
    ours, mounts = socket.socketpair()
    mounts.settimeout(10)
    reader = DirectReader.__new__(DirectReader)
    reader.root, reader.control = str(tmp_path), str(tmp_path / "no.sock")
    reader._lock, reader._pid, reader._broken = threading.Lock(), os.getpid(), False
    shared = _NoPins()
    reader._req, reader._pending, reader._sock, reader._shared = 0, bytearray(), ours, shared
    ours.settimeout(0.2)
    answer = encode_frame(Frame(RESPONSE, Msg.DIRECT_STATS, 1, 0, {"hits": 1}))

    def half_an_answer() -> None:
        mounts.recv(1 << 16)
        mounts.sendall(answer[: HEADER.size + 2])

    t = threading.Thread(target=half_an_answer)
    t.start()
    with pytest.raises(TimeoutError):
        reader.stats()
    t.join()
    assert mounts.recv(1 << 16) == b""  # the client closed its end
    assert shared.detached  # its views (none here) keep their pins; it takes no new ones
    with pytest.raises(OSError) as info:
        reader.stats()  # attaches anew: no socket there
    assert info.value.errno in (errno.ENOENT, errno.ECONNREFUSED)
    mounts.close()


POPULATE_READ_ONLY = textwrap.dedent("""
    import ctypes, mmap, os, sys
    from dlfs.native import native
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fd = os.memfd_create("t")
    os.ftruncate(fd, 1 << 20)
    m = mmap.mmap(fd, 1 << 20)
    m[4096:8192] = b"k" * 4096
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    # A slab being filled meanwhile: any write of populate's would land in it. Here any write faults.
    assert libc.mprotect(base, 1 << 20, mmap.PROT_READ) == 0, ctypes.get_errno()
    native.populate(m, 0, 1 << 20)  # MADV_POPULATE_WRITE refuses a read-only mapping: the fallback runs
    native.populate(m, 0, 1 << 20, fallback=True)
    assert m[4096:8192] == b"k" * 4096
    print(os.fstat(fd).st_blocks * 512, flush=True)
""")


def test_land_publishes_a_window_only_if_every_record_checks(region: Region, tmp_path: Path) -> None:
    """owner.land reads a range of a chunk file into a slab and publishes its records where they lie,
    only if every one is whole and matches its checksum; otherwise it says which is bad and publishes
    none. Its arguments are held to the arena's bounds."""
    cid, data, recs, _ = make_chunk(1, records=4)
    path = tmp_path / "chunk"
    path.write_bytes(data)
    mount, at = region.mount, 512
    base = recs[0].offset
    n = recs[-1].offset + recs[-1].stored_len - base

    def records(sums: list[int]) -> list[tuple[int, int, int, int]]:
        return [(ext, at + r.offset - base, r.stored_len, s) for ext, (r, s) in enumerate(zip(recs, sums))]

    good = [r.checksum for r in recs]
    fd = os.open(path, os.O_RDONLY)
    try:
        bad = list(good)
        bad[2] ^= 1
        assert mount.land(fd, base, n, 2, at, records(bad)) == (n, 2)
        assert [mount.where(e) for e in (0, 2, 3)] == [None] * 3 and mount.where(1) == (0, 0)  # as it was
        short = len(data) - base - 10  # the file ends inside the last record: it is short, so bad
        assert mount.land(fd, base, n, 2, at, records(good)) == (n, -1)
        for ext, r in enumerate(recs):
            assert mount.where(ext) == (2, at + r.offset - base)
            start = 2 * SLAB + at + r.offset - base
            assert region.arena[start : start + r.stored_len] == data[r.offset : r.offset + r.stored_len]
        with open(path, "r+b") as f:
            f.truncate(base + short)
        assert mount.land(fd, base, n, 3, 0, [(0, recs[-1].offset - base, recs[-1].stored_len, good[-1])]) == (short, 0)
        with pytest.raises(IndexError):
            mount.land(fd, base, n, NSLABS, 0, records(good))
        with pytest.raises(ValueError):
            mount.land(fd, base, SLAB, 2, at, records(good))  # past the slab's end
        with pytest.raises(ValueError):
            mount.land(fd, base, n, 2, at, [(0, SLAB - 10, 20, 0)])
        with pytest.raises(ValueError):
            mount.land(fd, base, n, 2, at, [])
        with pytest.raises(IndexError):
            mount.land(fd, base, n, 2, at, [(region.index.totals.extents, at, 10, 0)])
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        mount.land(fd, base, n, 2, at, records(good))  # closed


def test_populate_never_writes() -> None:
    """Where MADV_POPULATE_WRITE is missing (before Linux 5.14; `fallback` forces that path) pages are
    faulted in by reading them: over memory mapped read-only it neither faults nor changes a byte, and
    the memfd holds every page after."""
    proc = subprocess.run([sys.executable, "-c", POPULATE_READ_ONLY], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.stderr)
    assert int(proc.stdout) == 1 << 20


@pytest.mark.parametrize("how", ["peer pidfd", "pidfd_open", "start time"])
def test_a_client_process_is_gone_once_it_exits(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However the mount watches a client (by kernel), it sees the process go, and not before."""
    from dlfs.mount import pinrows as rows

    if how == "start time":
        def no_pidfd(pid: int) -> int:
            raise OSError(errno.ENOSYS, "pidfd_open")

        monkeypatch.setattr(rows.os, "pidfd_open", no_pidfd)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "s"))
    listener.listen()
    child = subprocess.Popen([sys.executable, "-c", CONNECT_AND_WAIT, str(tmp_path / "s")], stdin=subprocess.PIPE)
    conn, _ = listener.accept()
    try:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        watched = rows.ClientProcess(pid, conn if how == "peer pidfd" else None)
        assert pid == child.pid and not watched.gone()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        conn.close()
        listener.close()
    assert watched.gone()
    watched.close()
    assert rows.ClientProcess(0).gone() is False  # hidden by its pid namespace: never known to be gone


CONNECT_AND_WAIT = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); sys.stdin.read()"
