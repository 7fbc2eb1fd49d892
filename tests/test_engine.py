"""The mount's native serving engine under load, through real mounts: many threads, concurrent misses,
evictions in a tiny cache and dlfs.direct pins on the same slabs, every byte checked; a mount killed
under load and cleared by `dlfs umount`; FUSE over io_uring where the kernel has it."""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import (
    Node,
    mount_pids,
    mount_stats,
    mount_stats_from_now,
    needs_fuse,
    one_line_error,
    pid_alive,
    run_dlfs,
    wait_for,
)

from dlfs import direct
from dlfs.data.store import chunk_path
from dlfs.errors import MountError
from dlfs.format.index import Extent, Index
from dlfs.mount.lifecycle import DIRECT_IO_MIN, URING_BIG_FILES, want_direct_io, want_io_uring
from dlfs.native import native

pytestmark = [needs_fuse, pytest.mark.skipif(native is None, reason="dlfs's C helper is not built")]
URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


def make_tree(src: Path, n: int = 300, seed: int = 5) -> dict[str, bytes]:
    """n files of 1-40 kB in 10 folders (several per 64K chunk), and a 3 MB one (records over chunks)."""
    rng = random.Random(seed)
    files = {f"d{i % 10}/f{i:03d}": rng.randbytes(rng.randrange(1000, 40_000)) for i in range(n)}
    files["big.bin"] = rng.randbytes(3_000_000)
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return files


@pytest.fixture
def tree(node: Node, tmp_path: Path) -> Iterator[dict[str, bytes]]:
    files = make_tree(tmp_path / "src")
    node.ingest(tmp_path / "src", "t", "--chunk-size", "64K")
    yield files


def read_and_drop(path: Path) -> bytes:
    """Read a file as frameworks do, then drop its pages, so the next read reaches the mount again."""
    with open(path, "rb") as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


@contextmanager
def version_index(node: Node, dataset: str) -> Iterator[Index]:
    """The index of `dataset`'s version on the node, open while the block runs."""
    idx = Index(next((node.home / "meta" / "index" / dataset).glob("*.idx")))
    try:
        yield idx
    finally:
        idx.close()


def first_record(idx: Index, rel: str) -> Extent:
    """The extent of file `rel`'s first record."""
    ino = 1
    for part in rel.split("/"):
        ino = idx.lookup(ino, part.encode())
    return idx.extent(idx.inode(ino).ref)


def spoil(node: Node, chunk_id: bytes, at: int, mask: int = 0xFF) -> None:
    """Flip bits of byte `at` of this machine's chunk file `chunk_id`, as a failing disk would."""
    chunk = chunk_path(node.home / "data" / "chunks", chunk_id)
    blob = bytearray(chunk.read_bytes())
    blob[at] ^= mask
    os.chmod(chunk, 0o644)
    chunk.write_bytes(bytes(blob))


def spoiled_one(node: Node, tree: dict[str, bytes], seed: int, victim: int, at: int) -> tuple[list[str], int]:
    """The tree's small files in a random order, the `victim`th's record damaged at byte `at` on the node;
    and how many chunks the dataset ("t") has."""
    names = sorted(n for n in tree if n != "big.bin")
    random.Random(seed).shuffle(names)
    with version_index(node, "t") as idx:
        ext = first_record(idx, names[victim])
        spoil(node, idx.chunk(ext.chunk).id, ext.record.offset + at)
        return names, idx.totals.chunks


def test_io_uring_setting(tmp_path: Path) -> None:
    # auto: used where the kernel has it, switched on (root) if it is off; on: the same or one line; off: never.
    param = tmp_path / "enable_uring"
    assert want_io_uring("auto", param) is False and want_io_uring("off", param) is False  # no such kernel
    with pytest.raises(MountError, match=r"--io-uring on: cannot enable FUSE over io_uring .*Linux 6.14"):
        want_io_uring("on", param)
    param.write_text("N\n")
    assert want_io_uring("off", param) is False and param.read_text() == "N\n"
    assert want_io_uring("auto", param) is True and param.read_text() == "Y"
    param.write_text("N\n")
    assert want_io_uring("on", param) is True and param.read_text() == "Y"
    # A dataset of big files: auto serves from /dev/fuse (and leaves the module's switch alone); on: a ring.
    param.write_text("N\n")
    assert want_io_uring("auto", param, bulk_file=URING_BIG_FILES) is False and param.read_text() == "N\n"
    assert want_io_uring("auto", param, bulk_file=URING_BIG_FILES - 1) is True
    param.write_text("N\n")
    assert want_io_uring("on", param, bulk_file=URING_BIG_FILES) is True and param.read_text() == "Y"


def test_direct_io_setting() -> None:
    # auto: for a dataset of big files bigger than the mount's memory (every epoch cold anyway); on, off: as said.
    gib = 1 << 30
    assert want_direct_io("auto", 5 * gib, DIRECT_IO_MIN, 4 * gib) is True
    assert want_direct_io("auto", 3 * gib, DIRECT_IO_MIN, 4 * gib) is False  # the page cache can hold it
    assert want_direct_io("auto", 5 * gib, DIRECT_IO_MIN - 1, 4 * gib) is False  # small files: no_open is worth more
    assert want_direct_io("auto", 0, None, 4 * gib) is False  # an empty dataset
    assert want_direct_io("on", 1, 1, 4 * gib) is True and want_direct_io("off", 5 * gib, 64 << 20, gib) is False


EVICTIONS = 10_000  # windows the tiny cache below evicts while it is read (an idle run of 8 s here: ~38,000)
ROUNDS = 200  # files each reader reads and checks meanwhile, and batches the dlfs.direct client pins


@pytest.mark.timeout(180)
@pytest.mark.parametrize("io_uring", ["auto", "off"], ids=["default", "dev-fuse"])
def test_threads_misses_evictions_and_pins_in_a_tiny_cache(node: Node, tmp_path: Path, tree: dict[str, bytes],
                                                           io_uring: str) -> None:
    # 16 slabs of 64K for ~6 MB: windows are evicted again and again while the engine's threads
    # serve from the slabs, Python fetches into them, and a dlfs.direct client holds views on them. It
    # runs until that churn is done (EVICTIONS windows evicted, every reader and the client well past
    # their first rounds), not for a time: as much is checked on a busy machine as on an idle one.
    mnt = node.mount("t", tmp_path / "mnt", "--cache-size", "1M", "--readahead", "64K", "--threads", "4",
                     "--io-uring", io_uring)
    names = sorted(tree)
    bad: list[str] = []
    done = threading.Event()
    rounds = [0] * 9  # files read and checked by each reader; batches by the direct client (the last)
    barrier = threading.Barrier(10)

    def reader(seed: int) -> None:
        try:
            read_and_check(seed)
        except Exception as exc:
            bad.append(f"reader {seed}: {exc!r}")

    def read_and_check(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait(timeout=10)
        while not done.is_set():
            rel = rng.choice(names)
            try:
                if rel == "big.bin" and rng.random() < 0.5:
                    with open(mnt / rel, "rb", buffering=0) as f:
                        off = rng.randrange(len(tree[rel]))
                        got, want = os.pread(f.fileno(), 100_000, off), tree[rel][off : off + 100_000]
                else:
                    got, want = read_and_drop(mnt / rel), tree[rel]
            except OSError as exc:
                bad.append(f"{rel}: {exc}")
                continue
            if got != want:
                bad.append(f"{rel}: {len(got)} bytes differ")
            rounds[seed] += 1

    def direct_client() -> None:
        try:
            pin_and_check()
        except Exception as exc:  # a dead thread must fail the test, not vanish
            bad.append(f"direct client: {exc!r}")

    def pin_and_check() -> None:
        rng = random.Random(99)
        held: list[tuple[str, memoryview]] = []
        with direct.connect(mnt) as reader_:
            barrier.wait(timeout=10)
            while not done.is_set():
                batch = rng.sample(names, 16)
                for rel, view in zip(batch, reader_.read_many([mnt / rel for rel in batch])):
                    held.append((rel, view))
                # Views held across later batches pin their slabs while the cache evicts around them.
                while len(held) > 40:
                    rel, view = held.pop(0)
                    if bytes(view) != tree[rel]:
                        bad.append(f"direct {rel}: bytes changed under a pin")
                    view.release()
                rounds[8] += 1
            for rel, view in held:
                if bytes(view) != tree[rel]:
                    bad.append(f"direct {rel}: bytes changed under a pin")
                view.release()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=direct_client))
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=10)
        mount_stats(node.home, mnt, lambda s: (s["cache_evictions"] >= EVICTIONS and min(rounds) >= ROUNDS) or bool(bad)
                    or not all(t.is_alive() for t in threads), timeout=120)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert bad == []
    assert min(rounds) >= ROUNDS, rounds
    s = mount_stats(node.home, mnt)
    node.umount(mnt)
    assert s["cache_evictions"] >= EVICTIONS and s["direct_requests"] >= ROUNDS, s
    assert s["engine"]["threads"] == 4 and s["engine"]["reads"] > 0 and s["engine"]["read_misses"] > 0
    assert s["python_reads"] > 0 and s["engine"]["corrupt"] == 0 and s["engine"]["write_errors"] == 0
    if io_uring == "off":
        assert s["engine"]["io_uring"] == "off" and s["engine"]["uring_queues"] == 0
    last = [line for line in node.mount_log("t").read_text().splitlines() if "unmounted from" in line][-1]
    assert int(re.search(r"'evictions': (\d+)", last).group(1)) >= EVICTIONS, last


@pytest.mark.timeout(90)
def test_a_mount_killed_under_load_is_cleared_by_umount(node: Node, tmp_path: Path, tree: dict[str, bytes]) -> None:
    mnt = node.mount("t", tmp_path / "mnt")
    (pid,) = mount_pids(node.home)
    names = sorted(tree)
    errors: list[int] = []
    reads = [0] * 4  # files read whole by each reader
    stop = threading.Event()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                rel = rng.choice(names)
                assert read_and_drop(mnt / rel) == tree[rel], rel
                reads[seed] += 1
            except OSError as exc:
                errors.append(exc.errno or 0)
                return

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # Under load: every reader has read whole files (and all of them right) before the kill.
    wait_for(lambda: min(reads) >= 5 or errors or not all(t.is_alive() for t in threads), 60,
             "each reader to read 5 files through the mount")
    assert errors == [] and all(t.is_alive() for t in threads), errors
    os.kill(pid, signal.SIGKILL)
    for t in threads:  # every reader gets an error at once; none hangs on the dead mount
        t.join(timeout=20)
    stop.set()
    assert not any(t.is_alive() for t in threads) and min(reads) >= 5
    # ECANCELED: a request the kernel had queued on a ring of the killed process (FUSE over io_uring).
    assert set(errors) <= {errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED, errno.EIO} and len(errors) == 4, errors
    wait_for(lambda: not pid_alive(pid), 10, f"the killed mount process {pid} to be gone")
    with pytest.raises(OSError) as dead:
        os.statvfs(mnt)
    assert dead.value.errno == errno.ENOTCONN
    out = node.run("umount", mnt)
    assert out.returncode == 0 and not os.path.ismount(mnt) and str(mnt) in out.stdout
    one_line_error(node.run("umount", mnt, check=False), 4)  # nothing left to unmount: not found
    node.mounts.remove(mnt)
    again = node.mount("t", mnt)
    assert read_and_drop(again / "big.bin") == tree["big.bin"]


# Not serial: every mount in the default `--io-uring auto` switches the fuse module's enable_uring on as
# root (want_io_uring), as this one does, so other tests' mounts meet the same setting either way.
@pytest.mark.timeout(90)
@pytest.mark.skipif(not URING_PARAM.exists(), reason="this kernel has no FUSE over io_uring (Linux 6.14+)")
def test_io_uring_serves_the_same_tree_and_bytes(node: Node, tmp_path: Path, tree: dict[str, bytes]) -> None:
    before = URING_PARAM.read_text().strip()
    try:
        mnt = node.mount("t", tmp_path / "mnt", "--io-uring", "on")
        assert URING_PARAM.read_text().strip() == "Y"
        for rel, data in tree.items():
            assert read_and_drop(mnt / rel) == data, rel
        assert sorted(os.listdir(mnt)) == sorted({rel.split("/")[0] for rel in tree})
        s = mount_stats(node.home, mnt, lambda s: s["engine"]["io_uring"] == "serving")
        assert s["engine"]["io_uring"] == "serving" and s["engine"]["uring_queues"] >= 1, s["engine"]
        node.umount(mnt)
        assert "with FUSE over io_uring" in node.mount_log("t").read_text()
    finally:
        URING_PARAM.write_text(before)


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.timeout(90)
@pytest.mark.skipif(not URING_PARAM.exists(), reason="this kernel has no FUSE over io_uring (Linux 6.14+)")
def test_big_shards_with_a_small_manifest_are_served_from_dev_fuse(node: Node, tmp_path: Path) -> None:
    # The serving path follows where the bytes are: two shards of 16 MiB and a manifest average under 16
    # MiB, yet every byte a reader wants is a shard's (FUSE over io_uring answers big reads on the
    # reader's own CPU, slower for them: want_io_uring).
    src = tmp_path / "src"
    src.mkdir()
    shards = {f"shard-{i}.bin": random.Random(i).randbytes(URING_BIG_FILES) for i in range(2)}
    for rel, data in {**shards, "manifest.json": b'{"shards": 2}'}.items():
        (src / rel).write_bytes(data)
    node.ingest(src, "shards")
    mnt = node.mount("shards", tmp_path / "mnt")
    for rel, data in shards.items():
        assert read_and_drop(mnt / rel) == data, rel
    assert mount_stats(node.home, mnt)["engine"]["io_uring"] == "off"
    assert "half the dataset's bytes are in files of 16 MiB or more" in node.mount_log("shards").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_uring", ["on", "off"], ids=["io-uring", "dev-fuse"])
def test_scan_mode_reads_small_files_from_their_chunks_from_the_lookup_on(node: Node, tmp_path: Path,
                                                                         tree: dict[str, bytes], io_uring: str) -> None:
    # A tiny cache puts the mount in scan mode (read-ahead out of room): the serving threads read each
    # small file's record from its chunk file and check it themselves. Each chunk file is opened once for
    # the mount, in one table the threads share (~100 chunks here: a table of 16 per thread once opened
    # 1.5 files per READ). That read starts at the file's LOOKUP, before its READ comes (on a ring before
    # the LOOKUP's reply, from /dev/fuse right after it), while LOOKUPs foretell READs; a walk that only
    # stats files stops it (one LOOKUP in 16 still tries). A flipped byte costs its file EIO (one
    # replica), and nothing else.
    names, n_chunks = spoiled_one(node, tree, seed=11, victim=150, at=5)
    read_first, victim, walked, read_after = names[:150], names[150], names[151:250], names[250:]

    def engine() -> dict:
        return mount_stats_from_now(node.home, mnt)["engine"]

    mnt = node.mount("t", tmp_path / "mnt", "--cache-size", "1M", "--readahead", "64K", "--io-uring", io_uring)
    for rel in read_first:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    first = engine()
    assert first["scan"], first  # what follows is about scan mode: read-ahead is still out of room
    with pytest.raises(OSError) as bad:
        read_and_drop(mnt / victim)
    assert bad.value.errno == errno.EIO
    spoiled = engine()
    assert spoiled["record_failures"] == 1 and spoiled["scan"], spoiled  # the threads found it, then Python
    for rel in walked:
        os.stat(mnt / rel)
    walk = engine()
    for rel in read_after:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    after = engine()
    for rel in walked:  # their LOOKUPs are behind them
        assert read_and_drop(mnt / rel) == tree[rel], rel
    last = engine()
    assert last["record_reads"] >= len(names) // 2, last
    assert last["chunk_files_opened"] <= 2 * n_chunks, (last["chunk_files_opened"], n_chunks)
    shown = node.run("stats", mnt).stdout  # what a user sees of it
    assert re.search(r"read whole from chunk files .* [\d,]+ files, [\d,]+ started at their LOOKUP", shown), shown
    # A dataset bigger than this cache's read-ahead, read until it filled: scan mode stays, and says so.
    assert "scan mode kept" in shown and mount_stats_from_now(node.home, mnt)["scan_kept"], shown
    assert last["io_uring"] == ("serving" if io_uring == "on" else "off"), last
    if THP.exists() and "[never]" not in THP.read_text():
        # Those reads land on a 2 MiB page (native/hugebuf.h): a disk request of one segment, not one per
        # 4 KiB page. Nothing else in the mount asks for transparent huge pages (its cache is shmem).
        pid = mount_stats(node.home, mnt)["pid"]
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        assert int(re.search(r"AnonHugePages:\s+(\d+) kB", rollup).group(1)) >= 2048, rollup
    # On a ring or from /dev/fuse (native/ahead.h) alike.
    assert first["records_ahead_used"] >= max(50, 0.8 * first["records_ahead"]), first
    assert walk["records_ahead"] - spoiled["records_ahead"] <= len(walked) // 3, walk
    assert after["records_ahead_used"] - walk["records_ahead_used"] >= len(read_after) // 2, after  # READs again
    assert "checksum mismatch" in node.mount_log("t").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_uring", ["on", "off"], ids=["io-uring", "dev-fuse"])
def test_scan_mode_fetches_other_machines_small_files_in_the_serving_threads(node: Node, tmp_path: Path,
                                                                           tree: dict[str, bytes], io_uring: str) -> None:
    # A compute node without the data (--no-short-circuit: every record through the data daemon) in scan mode:
    # the serving threads fetch each small file's record on connections the mount opened for them, check it
    # and answer it; Python fetches only while the first connections open. A damaged replica costs its file
    # EIO (the one replica, tried by Python too) and nothing else; the stats count the fetches by node.
    names, _ = spoiled_one(node, tree, seed=12, victim=100, at=7)
    victim = names[100]
    mnt = node.mount("t", tmp_path / "mnt", "--cache-size", "1M", "--readahead", "64K", "--io-uring", io_uring,
                     "--no-short-circuit")
    for rel in names[:20]:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    opened = mount_stats(node.home, mnt, lambda s: bool(s["thread_connections"]))
    assert opened["engine"]["scan"] and opened["thread_connections"], opened
    for rel in names[20:100]:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    first = mount_stats_from_now(node.home, mnt)["engine"]
    # One reader: a connection is always idle. (Misses while read-ahead has room again go to Python.)
    assert first["remote_reads"] - opened["engine"]["remote_reads"] >= 60, first
    with pytest.raises(OSError) as bad:
        read_and_drop(mnt / victim)
    assert bad.value.errno == errno.EIO
    for rel in names[101:]:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    s = mount_stats_from_now(node.home, mnt)
    last = s["engine"]
    assert last["remote_failures"] == 1 and last["record_reads"] == 0, last
    assert last["remote_reads"] - first["remote_reads"] >= 0.75 * (len(names) - 101), last
    (fetched,) = s["by_node"].values()  # the one node's daemon
    assert s["in_place_bytes"] == 0 and fetched["fetches"] >= last["remote_reads"], s["by_node"]
    shown = node.run("stats", mnt).stdout
    assert re.search(r"fetched whole by the threads .* [\d,]+ files from data daemons; 1 failed", shown), shown
    assert "checksum mismatch" in node.mount_log("t").read_text()


def _held_in(cache_dir: Path, cid: bytes, lo: int, hi: int) -> Path | None:
    """The disk cache's file of chunk `cid` if its catalogue lists all of [lo, hi) of it."""
    db = sqlite3.connect(cache_dir / "catalogue.db")
    try:
        row = db.execute("SELECT file FROM chunks WHERE cid=?", (cid,)).fetchone()
        covered = db.execute("SELECT 1 FROM ranges WHERE cid=? AND off<=? AND end>=?", (cid, lo, hi)).fetchone()
    finally:
        db.close()
    return cache_dir / "chunks" / row[0][:2] / row[0] if row and covered else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_uring", ["on", "off"], ids=["io-uring", "dev-fuse"])
def test_scan_mode_reads_the_disk_cache_in_the_serving_threads(node: Node, tmp_path: Path, tree: dict[str, bytes],
                                                               io_uring: str) -> None:
    # A compute node with a disk cache (--no-short-circuit --cache-dir) and a cache far smaller than the
    # dataset: the first mount's epoch is fetched from the data daemon, in scan mode by the serving threads,
    # and what they fetch is written to the disk cache as Python's own fetches are; the next mount's reads
    # in scan mode come from the disk cache's files, read, checked and answered by the serving threads. A
    # copy damaged there costs nothing: Python reads that file from the replica and drops the copy. The
    # stats count the threads' reads as the disk cache's.
    names = sorted(n for n in tree if n != "big.bin")
    random.Random(21).shuffle(names)
    dc = tmp_path / "dc"
    # Bounded by size: with the file system's free share (the default) a machine whose disk is over 90% full
    # keeps nothing there, and this test is about the threads reading what it keeps (CI: two bench work
    # folders of 23 GB each left 9% free, and every read came from the replica).
    args = ("--cache-size", "1M", "--readahead", "64K", "--io-uring", io_uring, "--no-short-circuit", "--cache-dir", str(dc),
            "--cache-dir-size", "64M")
    mnt = node.mount("t", tmp_path / "mnt", *args)
    for rel in names:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    fetched = mount_stats_from_now(node.home, mnt)["engine"]["remote_reads"]
    assert fetched >= len(names) // 2, fetched  # the threads fetched most of the first epoch themselves
    node.umount(mnt)  # its disk cache's writer finishes what is queued
    with version_index(node, "t") as idx:
        for victim in names[5:]:  # the first file kept whole (a write may be dropped when the disk falls behind)
            ext = first_record(idx, victim)
            cid = idx.chunk(ext.chunk).id
            held = _held_in(dc, cid, ext.record.offset, ext.record.offset + ext.record.stored_len)
            if held is not None:
                break
        assert held is not None, "the first epoch kept files in the disk cache"
    with open(held, "r+b") as f:
        f.seek(ext.record.offset + 7)
        b = f.read(1)
        f.seek(ext.record.offset + 7)
        f.write(bytes([b[0] ^ 0x21]))
    mnt = node.mount("t", tmp_path / "mnt", *args)
    for rel in names:
        assert read_and_drop(mnt / rel) == tree[rel], rel
    s = mount_stats_from_now(node.home, mnt)
    eng = s["engine"]
    assert eng["scan"] and eng["disk_cache_reads"] >= 0.75 * len(names), eng
    assert eng["record_failures"] >= 1 and eng["record_reads"] == 0, eng
    assert eng["remote_reads"] <= 0.1 * len(names), eng  # what the disk cache had not kept (a write dropped)
    assert s["python_reads"] <= 0.25 * len(names), s["python_reads"]
    assert s["by_node"]["disk-cache"]["fetches"] >= eng["disk_cache_reads"] and s["in_place_bytes"] == 0, s["by_node"]
    assert "dropped from the disk cache, reading it from the replicas" in node.mount_log("t").read_text()
    shown = node.run("stats", mnt).stdout
    assert re.search(r"read whole from the disk cache .* [\d,]+ files, .* by the serving threads", shown), shown
    assert read_and_drop(mnt / victim) == tree[victim]  # from the replica, and kept again: no harm done


@pytest.mark.timeout(180)
def test_the_disk_cache_evicting_under_the_threads_reads_costs_no_byte(node: Node, tmp_path: Path,
                                                                       tree: dict[str, bytes]) -> None:
    # A disk cache bounded to a third of the dataset, read in scan mode by 4 readers at once: chunks are
    # evicted, fetched again under new names and read by the serving threads all the while (a file
    # unlinked under a thread's read, a name told late or early); every byte is right, every pass.
    names = sorted(tree)
    mnt = node.mount("t", tmp_path / "mnt", "--cache-size", "1M", "--readahead", "64K", "--no-short-circuit",
                     "--cache-dir", str(tmp_path / "dc"), "--cache-dir-size", str(sum(map(len, tree.values())) // 3))
    wrong: list[str] = []

    def reader(seed: int) -> None:
        order = list(names)
        random.Random(seed).shuffle(order)
        for rel in order:
            if read_and_drop(mnt / rel) != tree[rel]:
                wrong.append(rel)

    for rnd in range(3):
        threads = [threading.Thread(target=reader, args=(10 * rnd + k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert mount_stats_from_now(node.home, mnt)["engine"]["disk_cache_reads"] > 0
    node.umount(mnt)
    evicted = re.findall(r"'disk_cache_evicted_chunks': (\d+)", node.mount_log("t").read_text())
    assert evicted and int(evicted[-1]) > 0, evicted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io_uring", ["on", "off"], ids=["io-uring", "dev-fuse"])
def test_scan_mode_reads_files_of_one_big_record_straight_into_the_reply(node: Node, tmp_path: Path,
                                                                        io_uring: str) -> None:
    # Files of 256 KiB-1 MiB are one record each with block sums, page-aligned in their chunk: in scan mode
    # a queue of FUSE over io_uring reads such a file whole with O_DIRECT into the READ's own reply
    # buffer (a /dev/fuse thread into one of a few shared ones) and checks the record's checksum, with no
    # word to Python (4% of an epoch of ImageNet-like files, which Python once answered at ~1 ms of CPU
    # each). A flipped byte: EIO.
    rng = random.Random(4)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i:02d}.jpg": rng.randbytes(rng.randrange(260 << 10, 1000 << 10)) for i in range(60)}
    # Just under 256 KiB: no block sums, so anywhere in a page. Widened to whole pages, e1 is too big for a
    # queue's record buffer: it is read into the reply's buffer too, a little into it, and moved to its start.
    edge = {f"e{i}.jpg": random.Random(i).randbytes(n) for i, n in enumerate((254_000, 262_120))}
    for rel, data in {**files, **edge}.items():
        (src / rel).write_bytes(data)
    node.ingest(src, "b", "--chunk-size", "4M")
    names = sorted(files)
    rng.shuffle(names)
    victim = names[-1]
    with version_index(node, "b") as idx:
        assert idx.inode(idx.lookup(1, victim.encode())).count == 1  # one record: what this is about
        ext = first_record(idx, victim)
        assert ext.record.has_block_sums and ext.record.offset % 4096 == 0, ext
        spoil(node, idx.chunk(ext.chunk).id, ext.record.offset + 200_000, 0x10)
        e1 = first_record(idx, "e1.jpg").record
        assert not e1.has_block_sums and e1.offset % 4096 and e1.offset % 4096 + e1.stored_len > 256 << 10, e1
    mnt = node.mount("b", tmp_path / "mnt", "--cache-size", "1M", "--io-uring", io_uring)
    for rel in names[:30]:
        assert read_and_drop(mnt / rel) == files[rel], rel
    half = mount_stats_from_now(node.home, mnt)["engine"]  # read-ahead full of windows not yet read whole
    assert half["scan"] and half["record_reads"] >= 5, half
    for rel in edge:
        assert read_and_drop(mnt / rel) == edge[rel], rel
    for rel in names[30:-1]:
        assert read_and_drop(mnt / rel) == files[rel], rel
    read = mount_stats_from_now(node.home, mnt)
    assert read["engine"]["record_reads"] >= 10, read["engine"]
    assert read["engine"]["forwarded"] <= 59 + len(edge) - read["engine"]["record_reads"], read["engine"]
    with pytest.raises(OSError) as bad:
        read_and_drop(mnt / victim)
    assert bad.value.errno == errno.EIO
    assert mount_stats_from_now(node.home, mnt)["engine"]["record_failures"] == 1
    assert "checksum mismatch" in node.mount_log("b").read_text()


@pytest.mark.timeout(90)
def test_random_reads_in_a_big_file_read_their_blocks_from_local_chunks(node: Node, tmp_path: Path) -> None:
    # Random 4 KiB preads inside a big file: the engine reads their blocks from this machine's chunk
    # files and checks them against the block sums; the mount reads about what it serves. A flipped
    # byte costs the reads of its block EIO (one replica), and nothing else.
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(8).randbytes(12 << 20)
    (src / "big.npy").write_bytes(data)
    node.ingest(src, "big")
    mnt = node.mount("big", tmp_path / "mnt")
    rng = random.Random(2)
    offsets = [rng.randrange(len(data) // 4096) * 4096 for _ in range(400)]
    fd = os.open(mnt / "big.npy", os.O_RDONLY | os.O_DIRECT)  # every pread reaches the mount as it is
    buf = bytearray(4096)
    try:
        for off in offsets:
            assert os.preadv(fd, [buf], off) == 4096 and buf == data[off : off + 4096], off
    finally:
        os.close(fd)
    s = mount_stats(node.home, mnt, lambda s: s["engine"]["block_reads"] >= 400)
    assert s["engine"]["block_reads"] == 400 and s["python_reads"] == 0, s["engine"]
    assert s["fetched_bytes"] <= 2 * 400 * 4096 + (64 << 10), s["fetched_bytes"]  # blocks, and the sum tables
    # Damage: one byte of block 1000 of the file, in the chunk file itself.
    with version_index(node, "big") as idx:
        ext = first_record(idx, "big.npy")  # the first record holds the first 4 MiB
        spoil(node, idx.chunk(ext.chunk).id, ext.record.offset + 1000 * 4096 + 7)
    node.umount(mnt)
    mnt = node.mount("big", tmp_path / "mnt")
    fd = os.open(mnt / "big.npy", os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as bad:
            os.preadv(fd, [buf], 1000 * 4096)
        assert bad.value.errno == errno.EIO
        for off in (999 * 4096, 1001 * 4096, 5 << 20):
            assert os.preadv(fd, [buf], off) == 4096 and buf == data[off : off + 4096], off
    finally:
        os.close(fd)
    assert "block 1000: checksum mismatch" in node.mount_log("big").read_text()


def test_the_default_threads_follow_the_cpus_the_process_may_use_within_the_engines_bound(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One serving thread per CPU the mount may run on, at most the engine's bound (a 512-CPU machine's
    default, os.cpu_count(), was past it: every mount failed with `Invalid argument` in its log); more
    asked for is one line before anything starts."""
    from dlfs.native import engine_max_threads, engine_threads

    assert engine_max_threads() == 256  # native/engine.h's DLFS_ENGINE_MAX_THREADS, through the module
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(512)))
    assert engine_threads() == 256
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 7})  # a job's cpuset on a big machine
    assert engine_threads() == 2
    monkeypatch.undo()
    bad = run_dlfs(tmp_path, "mount", "x", str(tmp_path), "--threads", "257", check=False)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == (
        "dlfs mount: error: argument --threads: expected at most 256 (the serving engine's bound), got 257")
