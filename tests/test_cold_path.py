"""The cold path through a real mount: big files streamed with READs parked in C until their window
lands, every byte checked (files across chunk boundaries, readers at different offsets, a reader that
stops halfway, a corrupt record: EIO for exactly its bytes, parked READs answered as the Python
handlers answer the same READs), and two cold epochs on one mount with the
page cache dropped between them, the second fetching as the first did."""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Node, mount_stats, mount_stats_from_now, needs_fuse, running_cluster, running_node
from damage import inode_of

from dlfs.bench.baselines import drop_caches
from dlfs.cgroup import memory_limit
from dlfs.format.index import Index
from dlfs.mount.planner import chunk_windows, window_size
from dlfs.procs import stat_fields

pytestmark = [needs_fuse, pytest.mark.serial]  # it drops the page cache between reads
MiB = 1 << 20
# Sizes across the record (4 MiB) and chunk (8 MiB) boundaries, 1 byte to 200 MB.
BIG_SIZES = {"one": 1, "page": 4096, "rec": 4 * MiB, "rec1": 4 * MiB + 1, "chunk": 8 * MiB - 3,
             "u16": 16 * MiB, "m40": 40_000_000, "m200": 200_000_003}


@dataclass
class Cold:
    node: Node
    src: Path
    mnt: Path  # the big files, at mnt/big
    small_mnt: Path  # the small files, a dataset and a mount of their own


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cold]:
    """Big files, and 300 small ones (~30 KB) as a dataset of their own, ingested with the default chunk
    size and mounted once each."""
    base = tmp_path_factory.mktemp("cold")
    src = base / "src"
    (src / "big").mkdir(parents=True)
    (src / "small").mkdir()
    rng = random.Random(21)
    for name, size in BIG_SIZES.items():
        (src / "big" / name).write_bytes(rng.randbytes(size))
    for i in range(300):
        (src / "small" / f"s{i:03d}").write_bytes(rng.randbytes(rng.randrange(20_000, 40_000)))
    with running_node(base / "home", base) as node:
        node.ingest(src / "big", "cold")
        node.ingest(src / "small", "small")
        mnt = base / "mnt"
        (mnt / "big").mkdir(parents=True)
        node.mount("cold", mnt / "big")
        small_mnt = node.mount("small", base / "small")
        yield Cold(node, src, mnt, small_mnt)
        node.umount(mnt / "big")
        node.umount(small_mnt)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:  # as frameworks read: default buffering, read to the end
        return f.read()


def _flip(path: Path, offset: int) -> None:
    """Flip one byte of a file in place (a chunk file: damage its checksum would catch)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


def _one_file(tmp_path: Path, seed: int, size: int) -> tuple[Path, bytes]:
    """A source directory holding one file "f" of `size` random bytes: the directory and the bytes."""
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(seed).randbytes(size)
    (src / "f").write_bytes(data)
    return src, data


def _cold_read_is_eio(path: Path) -> None:
    """Reading `path` whole, cold, fails with EIO (not wrong bytes)."""
    drop_caches()
    with pytest.raises(OSError) as exc:
        _read(path)
    assert exc.value.errno == errno.EIO


def _engine(c: Cold, mnt: Path | None = None) -> dict:
    return mount_stats(c.node.home, mnt or c.mnt / "big", timeout=3.0)


def _idle(c: Cold, mnt: Path, timeout: float = 30.0) -> dict:
    """The stats of the mount at `mnt` once it fetches nothing more (what earlier reads started has landed)."""
    prev = _engine(c, mnt)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        then = prev["time"]
        now = mount_stats(c.node.home, mnt, until=lambda s, then=then: s["time"] > then, timeout=3.0)
        if now["fetches"] == prev["fetches"]:
            return now
        prev = now
    raise AssertionError(f"the mount kept fetching for {timeout} s")


def _settled(c: Cold, key: str, at_least: int, mnt: Path | None = None) -> dict:
    """The mount's stats, written after this call, once `key` (a top-level counter) reaches `at_least`.
    (Written each second: the last one, taken during the reads, could already count `at_least`, a lower
    bound, while a READ still waited in C.)"""
    now = time.time()
    return mount_stats(c.node.home, mnt or c.mnt / "big", until=lambda s: s["time"] > now and s.get(key, 0) >= at_least,
                       timeout=5.0)


@pytest.mark.timeout(120)
def test_big_files_streamed_cold_are_byte_exact_and_wait_in_c(cold: Cold) -> None:
    # Whether a READ arrives while its window is on the way is a race (a busy machine may have every
    # window land first, or send every READ before the first claim): cold passes until one parks, and
    # three at least, since a parked READ sent to Python is a race too (one in ten passes, with the wake-up's
    # clock read before its lock: engine.c's dlfs_engine_wake).
    first = _engine(cold)
    for attempt in range(6):
        before = _engine(cold)
        drop_caches()
        for name in BIG_SIZES:
            assert _read(cold.mnt / "big" / name) == (cold.src / "big" / name).read_bytes(), name
        reads = sum(-(-size // MiB) for size in BIG_SIZES.values())  # 1 MiB READs at least
        after = _settled(cold, "reads", before["reads"] + reads)
        eng, eng0 = after["engine"], first["engine"]
        parked = eng["parked"] - eng0["parked"]
        python = after["python_reads"] - before["python_reads"]
        if parked > 0 and attempt >= 2:
            break
    assert parked > 0, "READs that arrived before their window waited in C (in 6 cold passes)"
    # Its windows landed in slabs on 2 MiB pages (a private huge tmpfs: the mount runs as root here),
    # and its index stays in memory whatever the page cache does (mlock: nothing else is locked).
    huge = os.path.isdir("/sys/kernel/mm/transparent_hugepage") and not memory_limit().limited
    assert after["cache_huge_pages"] is huge  # (on 4 KiB pages where memory is limited: see cache.py)
    with open(f"/proc/{after['pid']}/maps") as f:
        index = next(Path(line.split()[-1]) for line in f if line.rstrip().endswith(".idx"))
    with open(f"/proc/{after['pid']}/status") as f:
        locked = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmLck:"))
    assert locked >= index.stat().st_size > 0, (locked, index)
    assert eng["parked_answered"] - eng0["parked_answered"] == parked and eng["parked_forwarded"] == eng0["parked_forwarded"]
    # Its windows were read, checked and published in C as they landed (cache.py's _land), a window at
    # least for each file of more than a READ.
    assert after["windows_landed"] - before["windows_landed"] >= sum(size > MiB for size in BIG_SIZES.values())
    # The first READ of each file reaches Python (nothing is coming yet); most of the rest do not.
    assert python < (after["reads"] - before["reads"]) / 2, (python, after["reads"] - before["reads"])


@pytest.mark.timeout(120)
def test_big_files_through_a_data_daemon_land_their_windows_in_c(cold: Cold, tmp_path: Path) -> None:
    # A mount that reads no chunk file in place (a compute node without the data): read-ahead's windows
    # come on the serving threads' connections to the daemon, checked and published by a thread, not
    # received by the event loop (cache.py's _land_remote).
    mnt = cold.node.mount("cold", tmp_path / "vd", "--no-short-circuit")
    try:
        before = _engine(cold, mnt)
        drop_caches()
        for name in BIG_SIZES:
            assert _read(mnt / name) == (cold.src / "big" / name).read_bytes(), name
        windows = sum(-(-size // (4 * MiB)) for size in BIG_SIZES.values())
        after = _settled(cold, "reads", before["reads"] + sum(-(-size // MiB) for size in BIG_SIZES.values()), mnt)
        assert after["in_place_bytes"] == 0
        # Every window but each file's first (Python fetches what its first READ waits for) at least.
        assert after["windows_landed_remote"] - before["windows_landed_remote"] >= windows - len(BIG_SIZES), after
        assert after["thread_connections"], after
        assert after["checksum_failures"] == before["checksum_failures"]
    finally:
        cold.node.umount(mnt)


def _serving_threads(pid: int) -> list[tuple[int, set[int]]]:
    """(scheduling policy, CPUs it may run on) of each of process `pid`'s /dev/fuse serving threads."""
    out = []
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if not f.read().startswith("dlfs-serve-"):
                continue
        policy = int(stat_fields(tid)[38])  # field 41 of proc(5)
        out.append((policy, os.sched_getaffinity(tid)))
    return out


def test_a_big_file_datasets_threads_take_any_cpu_and_never_preempt_its_readers(cold: Cold) -> None:
    """A dataset of big files: its serving threads are SCHED_BATCH (a READ's wake-up does not stop the
    reader's copy on its CPU) and may run on any CPU (not pinned to the reader's); a dataset of small
    files keeps them pinned, one per CPU (the warm round trip), at the usual policy."""
    allowed = os.sched_getaffinity(0)
    big = _serving_threads(_idle(cold, cold.mnt / "big")["pid"])
    small = _serving_threads(_idle(cold, cold.small_mnt)["pid"])
    assert big and all(policy == os.SCHED_BATCH and cpus == allowed for policy, cpus in big), big
    assert small and all(policy == os.SCHED_OTHER for policy, _ in small), small
    if len(small) >= len(allowed):
        assert all(len(cpus) == 1 for _, cpus in small), small


@pytest.mark.timeout(120)
def test_a_files_first_reads_wait_in_c_for_the_one_python_fetches(cold: Cold) -> None:
    """With a 4 MiB kernel read-ahead (an admin's choice) the kernel sends a file's first four READs at
    once, before Python has asked for any window: the first goes to Python, which asks for the file's
    windows, and the rest wait in C for them rather than reach Python as misses of their own (they did:
    118 READs to Python a cold pass of the bench's 32 big files, 32 now). Every byte checked."""
    dev = os.stat(cold.mnt / "big").st_dev
    knob = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    if not os.access(knob, os.W_OK):
        pytest.skip(f"{knob} cannot be written here (root sets a mount's kernel read-ahead)")
    was = knob.read_text().strip()
    knob.write_text("4096")
    try:
        big = [name for name, size in BIG_SIZES.items() if size > MiB]  # more than one READ each
        for _attempt in range(3):  # a busy machine may send a READ past the wait's bound: up to 3 passes
            before = _idle(cold, cold.mnt / "big")
            drop_caches()
            for name in big:
                assert _read(cold.mnt / "big" / name) == (cold.src / "big" / name).read_bytes(), name
            reads = sum(-(-BIG_SIZES[name] // MiB) for name in big)
            after = _settled(cold, "reads", before["reads"] + reads)
            python = after["python_reads"] - before["python_reads"]
            parked = after["engine"]["parked"] - before["engine"]["parked"]
            if python <= len(big):
                break
        # Each file's first READ, and no more (a file's window may have come with another's: fewer).
        assert python <= len(big) and parked >= len(big), (python, parked, len(big))
    finally:
        knob.write_text(was)


# READ sizes of the comparison below: whole READs, a page, odd sizes across record boundaries.
READ_SIZES = (MiB, 4096, 3 * MiB + 17, 1, 131_071, 2 * MiB)


@pytest.mark.timeout(240)
def test_parked_reads_answer_as_the_python_path_read_by_read(cold: Cold, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file read in order with O_DIRECT preads (each reaches the mount as it is, at most 1 MiB a
    READ), cold, all files at once, through the engine (READs that come before their window wait in C),
    then the same preads through a mount of the same dataset without the C helper (DLFS_NO_NATIVE:
    Python answers every READ): each answer the same bytes, and the source's."""
    monkeypatch.setenv("DLFS_NO_NATIVE", "1")
    py_mnt = cold.node.mount("cold", cold.mnt.parent / "py-big")
    monkeypatch.delenv("DLFS_NO_NATIVE")
    plan = {}  # name -> its preads, in order: one past the end too (both answer it empty)
    for name, size in BIG_SIZES.items():
        off, k, plan[name] = 0, 0, []
        while off <= size:
            n = READ_SIZES[k % len(READ_SIZES)]
            plan[name].append((off, n))
            off, k = off + n, k + 1
    answers: dict[str, list[bytes]] = {}

    def stream(name: str) -> None:
        fd = os.open(cold.mnt / "big" / name, os.O_RDONLY | os.O_DIRECT)
        try:
            answers[name] = [os.pread(fd, n, off) for off, n in plan[name]]
        finally:
            os.close(fd)

    try:
        for _attempt in range(5):  # parking is a race (see above): cold passes until READs park
            before = _engine(cold)
            drop_caches()
            answers.clear()
            threads = [threading.Thread(target=stream, args=(name,)) for name in plan]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            after = mount_stats_from_now(cold.node.home, cold.mnt / "big")
            if after["engine"]["parked"] > before["engine"]["parked"]:
                break
        assert after["engine"]["parked"] > before["engine"]["parked"], "no READ waited in C (in 5 cold passes)"
        assert answers.keys() == plan.keys()
        for name in plan:
            want = (cold.src / "big" / name).read_bytes()
            fd = os.open(py_mnt / name, os.O_RDONLY | os.O_DIRECT)
            try:
                for (off, n), got in zip(plan[name], answers[name], strict=True):
                    assert got == os.pread(fd, n, off) == want[off : off + n], (name, off, n)
            finally:
                os.close(fd)
    finally:
        cold.node.umount(py_mnt)


@pytest.mark.timeout(120)
def test_concurrent_readers_at_different_offsets_and_one_that_stops_halfway(cold: Cold) -> None:
    drop_caches()
    path, want = cold.mnt / "big" / "m40", (cold.src / "big" / "m40").read_bytes()
    with open(path, "rb") as f:  # stops halfway: what it leaves in flight must not disturb the others
        assert f.read(len(want) // 2) == want[: len(want) // 2]
    got: dict[int, bytes] = {}

    def reader(start: int) -> None:
        with open(path, "rb") as f:
            f.seek(start)
            got[start] = f.read()

    starts = [0, 7 * MiB + 123, len(want) // 2, len(want) - 5 * MiB]
    threads = [threading.Thread(target=reader, args=(s,)) for s in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in starts:
        assert got[s] == want[s:], f"from offset {s}"


@pytest.mark.timeout(120)
def test_a_file_whose_first_record_came_with_a_neighbour_streams_from_its_first_read(cold: Cold,
                                                                                     tmp_path: Path) -> None:
    """File b's first record shares a window with the end of file a, so reading a brings it; b's first
    READs are then answered in C and none reaches Python. The serving threads tell the cache that b's next
    record is neither here nor coming, and b's stream starts at once: its next windows are fetched while
    the reader is still in its first record (they were not, until a READ across that record's end missed
    and waited in Python for the window)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(7)
    (src / "a").write_bytes(rng.randbytes(4 * MiB + MiB // 2))
    (src / "b").write_bytes(b_bytes := rng.randbytes(14 * MiB))
    cold.node.ingest(src, "neighbours")
    idx = Index(cold.node.home / "meta/index/neighbours/1.idx")
    try:
        a, b = (idx.inode(inode_of(idx, name)) for name in ("a", "b"))
        b0 = idx.extent(b.ref)
        windows = chunk_windows(idx, b0.chunk, window_size(idx, 4 * MiB))
        # The premise: a's last record and b's first are one window (a chunk's last 4 MiB hold both).
        assert idx.extent(a.ref + a.count - 1).chunk == b0.chunk and not set(windows) & {b.ref}, windows
        first_len = b0.record.raw_len
    finally:
        idx.close()
    mnt = cold.node.mount("neighbours", tmp_path / "mnt")
    try:
        drop_caches()
        assert _read(mnt / "a") == (src / "a").read_bytes()
        before = _idle(cold, mnt)
        with open(mnt / "b", "rb") as f:
            assert f.read(MiB) == b_bytes[:MiB]  # inside b's first record, which is here
            after = mount_stats(cold.node.home, mnt, until=lambda s: s["fetches"] > before["fetches"], timeout=10.0)
            assert after["python_reads"] == before["python_reads"], "b's first READs were answered in C"
            assert after["fetches"] > before["fetches"] and after["streams_hinted"] > before["streams_hinted"], (
                f"b's next windows were not fetched while its reader was in its first record ({first_len} bytes)")
            assert f.read() == b_bytes[MiB:]
    finally:
        cold.node.umount(mnt)


@pytest.mark.timeout(120)
def test_two_cold_epochs_on_one_mount_fetch_alike(cold: Cold) -> None:
    """The page cache dropped between them: the second epoch fetches windows as the first did, not
    one record at a time (it did before: a note that a record had been sent once kept read-ahead off)."""
    files = sorted((cold.src / "small").iterdir())
    fetched, python = [], []
    for epoch in range(2):
        drop_caches()
        before = _idle(cold, cold.small_mnt)
        order = list(files)
        random.Random(epoch).shuffle(order)
        for p in order:
            assert _read(cold.small_mnt / p.name) == p.read_bytes(), p.name
        _settled(cold, "reads", before["reads"] + len(files), cold.small_mnt)
        after = _idle(cold, cold.small_mnt)
        fetched.append(after["fetches"] - before["fetches"])
        python.append(after["python_reads"] - before["python_reads"])
    assert fetched[1] == fetched[0] and python[1] == python[0], (fetched, python)
    assert fetched[0] < len(files) / 4, "a miss brings its window: most files are then hits"


@pytest.mark.timeout(120)
def test_two_readers_at_random_latch_scan_mode_within_a_few_windows_and_eight_in_order_never(
        cold: Cold, tmp_path: Path) -> None:
    """The serving engine counts the processes (FUSE gives thread ids) behind the READs it sends to Python,
    and the cache latches scan mode past two partly read windows a reader (cache.py, latch_at). Two readers
    at random, cold: latched within a few windows (past 16 before, each an 8 MiB read for one file), and
    the stats say 2 readers. Eight readers each through its own run in order, cold, on a fresh mount:
    never latched, by window."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(23)
    tree = {f"f{i:04d}": rng.randbytes(rng.randrange(50_000, 90_000)) for i in range(1200)}  # ~25 windows
    for name, data in tree.items():
        (src / name).write_bytes(data)
    cold.node.ingest(src, "latch")
    names = sorted(tree)

    def epoch(mnt: Path, runs: list[list[str]]) -> dict:
        drop_caches()
        bad: list[str] = []

        def work(run: list[str]) -> None:
            bad.extend(n for n in run if _read(mnt / n) != tree[n])

        threads = [threading.Thread(target=work, args=(run,)) for run in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not bad and not any(t.is_alive() for t in threads), bad[:3]
        return _idle(cold, mnt)

    shuffled = random.Random(2).sample(names, len(names))
    mnt = cold.node.mount("latch", tmp_path / "random")
    try:
        stats = epoch(mnt, [shuffled[0::2], shuffled[1::2]])
        assert stats["scan_kept"] and stats["engine"]["miss_readers"] == 2, stats["engine"]
        said = re.search(r"(\d+) windows are partly read, \d+ records of them, by 2 readers \(a random order\)",
                         cold.node.mount_log("latch", mnt).read_text())
        assert said and int(said.group(1)) <= 8, said
        shown = " ".join(cold.node.run("stats", mnt).stdout.split())  # what a user sees of it (unwrapped)
        assert re.search(r"scan mode kept .*; 2 readers behind the latest misses", shown), shown
    finally:
        cold.node.umount(mnt)
    mnt = cold.node.mount("latch", tmp_path / "in-order")
    try:
        stats = epoch(mnt, [names[i * 150:(i + 1) * 150] for i in range(8)])
        assert not stats["scan_kept"], cold.node.mount_log("latch", mnt).read_text()[-2000:]
        assert stats["fetches"] < len(names) // 4, stats["fetches"]  # by window
    finally:
        cold.node.umount(mnt)


@pytest.mark.timeout(120)
def test_a_mount_says_how_much_cache_memory_it_faulted_in(cold: Cold, tmp_path: Path) -> None:
    """The mount says how much of its cache's memory it has faulted in (`cache_touched`): none while
    nothing was read (an idle mount costs no memory), then about what read-ahead fetched."""
    mnt = cold.node.mount("small", tmp_path / "fresh")
    try:
        idle = _idle(cold, mnt)
        assert idle["cache_touched"] == 0, idle["cache_touched"]
        drop_caches()
        name = sorted((cold.src / "small").iterdir())[0].name
        assert _read(mnt / name) == (cold.src / "small" / name).read_bytes()
        _idle(cold, mnt)
        time.sleep(1.5)  # the prefault thread's work, if any is left, lands
        after = mount_stats_from_now(cold.node.home, mnt)
        slab = (4 << 20) + 8192  # a 4 MiB window and O_DIRECT's page of slack each side (cache.py)
        # The small files' dataset is a chunk or two: their windows, and a few slabs past them.
        windows = -(-sum(p.stat().st_size for p in (cold.src / "small").iterdir()) // (4 << 20)) + 1
        assert 0 < after["cache_touched"] <= (windows + 4) * slab, (after["cache_touched"], slab, windows)
        assert "of memory faulted in so far" in cold.node.run("stats", mnt).stdout  # `dlfs stats` says it too
    finally:
        cold.node.umount(mnt)


@pytest.mark.timeout(120)
def test_a_corrupt_record_fails_exactly_its_bytes(tmp_path: Path) -> None:
    """One replica, one flipped byte in the second record of a 12 MiB file: a read of that record is
    EIO (after every source was tried), and every byte before and after it reads right."""
    src, data = _one_file(tmp_path, 5, 12 * MiB)
    with running_node(tmp_path / "home", tmp_path) as node:
        node.ingest(src, "bad")
        idx = Index(node.home / "meta/index/bad/1.idx")
        try:
            inode = idx.inode(inode_of(idx, "f"))
            recs = [idx.extent(inode.ref + k) for k in range(inode.count)]
            cid = idx.chunk(recs[1].chunk).id
        finally:
            idx.close()
        lo = recs[0].record.raw_len
        hi = lo + recs[1].record.raw_len
        _flip(node.home / "data/chunks" / cid.hex()[:2] / cid.hex(), recs[1].record.offset + 5000)
        mnt = node.mount("bad", tmp_path / "mnt")
        try:
            _cold_read_is_eio(mnt / "f")
            fd = os.open(mnt / "f", os.O_RDONLY)
            try:
                assert os.pread(fd, lo, 0) == data[:lo]
                assert os.pread(fd, len(data) - hi, hi) == data[hi:]
                with pytest.raises(OSError) as exc:
                    os.pread(fd, 4096, lo + 4096)
                assert exc.value.errno == errno.EIO
            finally:
                os.close(fd)
        finally:
            node.umount(mnt)


@pytest.mark.timeout(180)
def test_a_stream_through_the_daemons_whose_copies_go_bad_goes_on_from_the_other_replica(tmp_path: Path) -> None:
    """Two replicas, read through the data daemons (no chunk file read in place): every other chunk of a
    40 MB file is damaged on n1, the rest on n2, so each window the serving threads' route names a bad copy
    of fails its check where it lands in C; Python then fetches it from the other replica, every byte right."""
    src, data = _one_file(tmp_path, 9, 40_000_000)
    with running_cluster(tmp_path / "cluster", 2) as (n1, n2):
        n1.ingest(src, "twice")
        for k, path in enumerate(sorted(p for p in (n1.home / "data/chunks").rglob("*") if p.is_file())):
            other = n2.home / path.relative_to(n1.home)
            _flip(path if k % 2 else other, path.stat().st_size // 2)
        mnt = n1.mount("twice", tmp_path / "mnt", "--no-short-circuit")
        try:
            drop_caches()
            assert _read(mnt / "f") == data
            now = time.time()
            stats = mount_stats(n1.home, mnt, until=lambda s: s["time"] > now, timeout=5.0)
            assert stats["windows_landed_remote"] > 0 and stats["checksum_failures"] > 0, stats
            assert stats["in_place_bytes"] == 0
        finally:
            n1.umount(mnt)


@pytest.mark.timeout(180)
def test_a_stream_whose_local_copy_goes_bad_midway_goes_on_from_the_other_replica(tmp_path: Path) -> None:
    """Two replicas; on the mount's own node every other chunk of a 40 MB file is damaged (a flipped
    byte, or cut short) part way through the file: the stream reads the rest from the other node,
    every byte right; with that node down too, exactly the damaged records are EIO."""
    src, data = _one_file(tmp_path, 8, 40_000_000)
    with running_cluster(tmp_path / "cluster", 2) as (n1, n2):
        n1.ingest(src, "twice")
        chunks = sorted(p for p in (n1.home / "data/chunks").rglob("*") if p.is_file())
        assert len(chunks) >= 4
        for k, path in enumerate(chunks):
            if k % 2 == 0:
                continue
            if k % 4 == 1:
                os.truncate(path, path.stat().st_size // 2)
            else:
                _flip(path, path.stat().st_size // 2)
        mnt = n1.mount("twice", tmp_path / "mnt")
        try:
            drop_caches()
            assert _read(mnt / "f") == data
            log = n1.mount_log("twice").read_text()
            assert "(local copy of n1)" in log or "(from n1)" in log, log[-2000:]
        finally:
            n1.umount(mnt)
        n2.stop()
        mnt = n1.mount("twice", tmp_path / "mnt", "--retry-timeout", "0")  # no waiting for n2 to come back
        try:
            _cold_read_is_eio(mnt / "f")
        finally:
            n1.umount(mnt)
        n2.start()
