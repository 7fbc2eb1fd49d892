"""The cache's memory and what it holds, each on its own: slabs (reuse, retirement while pinned, giving
back) and held records (publication, consumption, bounds), over a real shared table and no node."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys

import pytest

from dlfs.mount.held import Held
from dlfs.mount.slabs import NO_SLAB, Slabs
from dlfs.native import native

SLAB = 64 << 10
needs_native = pytest.mark.skipif(native is None, reason="needs dlfs's C helper")


def _owner(slabs: Slabs, n_extents: int = 64, rows: int = 2) -> object:
    size = native.shared_size(slabs.slab_size, slabs.nslabs, n_extents, rows)
    fd = os.memfd_create("test-ctl", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    ctl = mmap.mmap(fd, size)
    os.close(fd)
    owner = native.CacheOwner(ctl, slabs.arena, slab_size=slabs.slab_size, nslabs=slabs.nslabs,
                              n_extents=n_extents, n_rows=rows)
    slabs.pins = owner
    return owner


def _held(nslabs: int) -> tuple[Slabs, object, Held]:
    """An arena of `nslabs` slabs, its shared table and what it holds."""
    slabs = Slabs(nslabs * SLAB, SLAB)
    owner = _owner(slabs)
    return slabs, owner, Held(slabs, owner)


def test_the_slab_freed_last_is_taken_first_and_fresh_ones_in_order() -> None:
    slabs = Slabs(8 * SLAB, SLAB)
    assert slabs.nslabs == 8 and slabs.capacity == 8 * SLAB
    taken = [slabs.take() for _ in range(3)]
    assert taken == [0, 1, 2]  # fresh slabs from the bottom, in order
    slabs.release(1)
    slabs.release(2)
    assert slabs.take() == 2 and slabs.take() == 1  # a stream keeps reusing the memory it just freed
    slabs.give(1)
    assert slabs.take() == 1
    while slabs.has_free():
        slabs.take()
    assert not slabs.has_free()
    slabs.close()


def test_only_free_slabs_that_were_touched_are_given_back() -> None:
    slabs = Slabs(8 * SLAB, SLAB)
    a, b = slabs.take(), slabs.take()
    slabs.view(a)[:] = b"x" * SLAB
    slabs.release(a)
    # Slab a was freed after use; b is still held; the six above were never touched.
    assert slabs.trim() == SLAB and slabs.given_back == SLAB
    assert slabs.trim() == 0  # given back once
    assert slabs.take() == a  # taken again: faulted in afresh, given back again once freed
    slabs.release(a)
    slabs.release(b)
    assert slabs.trim() == 2 * SLAB
    slabs.close()


@needs_native
def test_a_pinned_slab_is_retired_until_its_pin_goes() -> None:
    slabs, owner, held = _held(4)
    slab = slabs.take()
    data = bytes(range(256)) * 16
    slabs.view(slab)[: len(data)] = data
    held.add(slab, 0, {5: slabs.view(slab)[: len(data)]}, {5: 0})
    assert owner.where(5) == (slab, 0)
    owner.pin_for(0, slab)  # a client (row 0) pins record 5's slab
    assert held.evict_for_slab()  # dropped while pinned: the slab waits, retired
    assert owner.where(5) is None and 5 not in held
    assert slabs.retired == 1 and slabs.retired_pinned == 1
    free_before = len(slabs._free)
    owner.unpin_for(0, slab)
    assert slabs.retired == 0 and len(slabs._free) == free_before + 1
    slabs.close()


@needs_native
def test_a_slab_retired_for_a_moment_is_taken_again_before_fresh_memory() -> None:
    # A serving thread's pin outlives its record's drop by microseconds (it is still copying the last
    # bytes); once the pin is gone the slab is what the next window takes, not a fresh one: 16 retired
    # slabs stood idle through a pass of 2 streams while fresh memory was faulted in for their windows.
    slabs, owner, held = _held(8)
    slab = slabs.take()
    held.add(slab, 0, {5: slabs.view(slab)[:4096]}, {5: 0})
    owner.pin_for(0, slab)
    assert held.evict_for_slab() and slabs._retired == [slab]  # dropped while pinned
    owner.unpin_for(0, slab)  # the copy ends; nothing asks for the retired count meanwhile
    assert slabs.take() == slab and slabs._taken_high == slab  # no fresh slab touched
    slabs.close()


@needs_native
def test_records_fetched_alone_share_a_slab_which_is_free_again_with_its_last_part() -> None:
    from dlfs.mount.slabs import PART_ALIGN

    slabs, owner, held = _held(4)
    assert slabs.take_part(5000) is None  # nothing packed yet
    slab = slabs.take()
    slabs.start_packing(slab)
    parts = [slabs.take_part(5000) for _ in range(SLAB // 8192)]
    assert all(p is not None and p[0] == slab for p in parts)
    offsets = [p[1] for p in parts if p]
    assert offsets == [i * 8192 for i in range(len(offsets))]  # page-aligned, in order, none shared
    assert all(p and p[2] == 2 * PART_ALIGN for p in parts)
    assert slabs.take_part(5000) is None  # full
    for i, p in enumerate(parts):
        assert p is not None
        view = slabs.view(slab, p[1], p[2])
        view[:5000] = bytes([i]) * 5000
        held.add(slab, 0, {i: view[:5000]}, {i: p[1]}, part=p[2])
    assert held.cached_bytes == len(parts) * 8192 and owner.where(3) == (slab, 3 * 8192)
    nxt = slabs.take()
    slabs.start_packing(nxt)  # the full slab is no longer packed: free once its parts are
    owner.pin_for(0, slab)  # a client reads record 1
    for i in range(len(parts)):
        assert held.served(i, 5000) and held.take_consumed(i)
    assert slabs.retired == 1  # every part dropped, but pinned: retired, not free
    owner.unpin_for(0, slab)
    assert slabs.retired == 0 and slab in slabs._free
    # A packed slab whose parts are all dropped while it is still packed stays until packing moves on.
    p = slabs.take_part(5000)
    assert p is not None and p[0] == nxt
    slabs.release_part(nxt)  # a part never filled
    assert nxt not in slabs._free
    assert slabs.stop_packing() and nxt in slabs._free
    assert not slabs.stop_packing()
    slabs.close()


@needs_native
def test_a_record_is_dropped_once_every_byte_went_to_the_kernel_and_its_block_with_the_last() -> None:
    slabs, owner, held = _held(8)
    slab = slabs.take()
    view = slabs.view(slab)
    held.add(slab, 0, {1: view[:1000], 2: view[1000:3000]}, {1: 0, 2: 1000})
    assert held.cached_bytes == SLAB and held.hit(1) is not None
    assert not held.served(1, 600)
    assert held.served(1, 400)  # all 1000 bytes: consumed
    assert held.take_consumed(1) and owner.where(1) is None and 1 not in held
    assert owner.where(2) == (slab, 1000) and held.cached_bytes == SLAB  # the block still holds record 2
    assert held.served(2, 2000) and held.take_consumed(2)
    assert held.cached_bytes == 0 and held.consumed == 2 and held.evictions == 0
    assert not held.take_consumed(2)  # once
    assert slabs.take() == slab  # its slab is free again, and reused first
    slabs.close()


def test_records_outside_the_arena_and_the_scratch_area_stay_within_their_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import dlfs.mount.held as held_mod

    monkeypatch.setattr(held_mod, "OWN_MEMORY", 3000)
    slabs = Slabs(16 * SLAB, SLAB)
    held = Held(slabs)  # no shared table: served bytes counted here
    held.readahead_cap = 0  # read-ahead has no room: every block goes to the scratch area
    for ext in range(10):
        held.add(NO_SLAB, 1000, {ext: b"r" * 1000}, {})
        assert held.own_size <= 3000
    assert held.own_size == 3000 and sorted(held.records) == [7, 8, 9]  # least recently used dropped first
    assert held.evictions == 7
    for ext in range(10, 10 + 3):  # slabs into scratch: bounded by an eighth of the arena
        held.add(slabs.take(), 0, {ext: b"s"}, {})
    assert held.scratch_size <= held.scratch_cap
    slabs.close()


def _smaps_of(address: int) -> dict[str, int]:
    """The kB fields of this process's mapping that starts at `address`."""
    out: dict[str, int] = {}
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found:
                    break
                found = int(head.split("-")[0], 16) == address
            elif found and line.rstrip().endswith("kB"):
                out[head.rstrip(":")] = int(line.split()[1])
    return out


@needs_native
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="a private tmpfs on huge pages needs root and a kernel with transparent huge pages")
def test_the_arena_is_on_huge_pages_shared_by_its_fd_and_leaves_no_mount_behind() -> None:
    import ctypes

    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    slabs = Slabs(8 * (2 << 20), 2 << 20)
    assert slabs.huge
    with open("/proc/self/mountinfo") as f:
        assert f.read() == mounts  # the tmpfs was mounted in a namespace that is gone
    anchor = ctypes.c_char.from_buffer(slabs.arena)
    address = ctypes.addressof(anchor)
    del anchor
    assert address % (2 << 20) == 0  # mapped where 2 MiB pages fit
    native.populate(slabs.arena, 0, slabs.capacity)
    assert _smaps_of(address).get("ShmemPmdMapped", 0) >= 8 * 2048  # every slab on 2 MiB pages
    # What a dlfs.direct client maps from the descriptor is the same memory.
    assert slabs.fd is not None
    client = mmap.mmap(slabs.fd, slabs.capacity, prot=mmap.PROT_READ)
    slabs.view(3)[:5] = b"hello"
    assert client[3 * (2 << 20) : 3 * (2 << 20) + 5] == b"hello"
    client.close()
    used = os.fstat(slabs.fd).st_blocks
    for _ in range(4):
        slabs.release(slabs.take())
    assert slabs.trim() > 0 and os.fstat(slabs.fd).st_blocks < used  # free slabs' pages go back
    slabs.close()


@needs_native
def test_an_arena_that_cannot_be_made_on_huge_pages_says_why() -> None:
    with pytest.raises(OSError, match="no huge-page cache arena: mounting a tmpfs"):
        native.huge_arena("/nonexistent/dlfs-test", 1 << 20)


@needs_native
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="dropping CAP_SYS_ADMIN from a child needs root and setpriv (util-linux)")
def test_without_the_right_to_mount_the_arena_is_a_memfd_and_the_log_says_why() -> None:
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from dlfs.mount.slabs import Slabs\n"
            "s = Slabs(8 << 20, 2 << 20); s.view(1)[:2] = b'ok'; print('huge', s.huge, bytes(s.view(1)[:2])); s.close()")
    out = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "huge False b'ok'" in out
    assert "no huge-page cache arena: unshare(CLONE_NEWNS): Operation not permitted; the cache is a memfd" in out
