"""Tests for the sample-tree generators, the epoch read workload (both ways of reading), the CPU and
storage accounting of serving processes, and the big-file workloads on local disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lz4.frame
import pytest
from conftest import REPO

from dlfs.bench.baselines import LocalDisk, cpu_seconds, io_read_bytes, process_tree
from dlfs.bench.bigfiles import PREAD_SIZE, block_device, pick_preads, pread_pass, sequential_pass
from dlfs.bench.epoch import READS, EpochResult, cpu_cost, format_row, list_files, read_epoch, timed_epoch
from dlfs.bench.sample import SampleInfo, make_sample, make_shards, shard_name
from dlfs.errors import CorruptData

N = 200
MEAN = 20_000


def _sample(dest: Path, seed: int = 0) -> SampleInfo:
    return make_sample(dest, n_files=N, mean_size=MEAN, n_classes=10, seed=seed)


@pytest.mark.timeout(60)
def test_sample_layout_sizes_and_content(tmp_path: Path) -> None:
    seen: list[int] = []
    info = make_sample(tmp_path / "s", n_files=N, mean_size=MEAN, n_classes=10, progress=seen.append)
    rels = list_files(info.root)
    assert len(rels) == N == info.n_files == len(seen)
    assert sum(seen) == info.total_bytes
    assert ".dlfs-sample.json" not in rels
    classes = {Path(r).parts[1] for r in rels}
    assert len(classes) == info.n_classes == 10
    total = 0
    for rel in rels:
        parts = Path(rel).parts
        assert parts[0] == "train" and len(parts) == 3
        assert parts[1].startswith("n0") and len(parts[1]) == 9
        assert parts[2].startswith(parts[1] + "_") and parts[2].endswith(".JPEG")
        data = (Path(info.root) / rel).read_bytes()
        assert 2 << 10 <= len(data) <= 2 << 20
        assert data[:4] == b"\xff\xd8\xff\xe0" and data[-2:] == b"\xff\xd9"
        total += len(data)
    assert total == info.total_bytes
    # Sizes spread around the requested mean (log-normal, sigma 0.6).
    assert 0.7 * MEAN < total / N < 1.3 * MEAN
    assert len({len((Path(info.root) / r).read_bytes()) for r in rels}) > N // 2


@pytest.mark.timeout(60)
def test_sample_is_idempotent(tmp_path: Path) -> None:
    dest = tmp_path / "s"
    first = _sample(dest)
    marker = dest / ".dlfs-sample.json"
    assert marker.is_file()
    paths = [dest / r for r in list_files(str(dest))] + [marker]
    before = {p: p.stat().st_mtime_ns for p in paths}
    second = _sample(dest)
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in paths} == before  # nothing rewritten

    # Different parameters: train/ is rebuilt, unrelated files in dest are left alone.
    (dest / "keep.txt").write_text("x")
    third = make_sample(dest, n_files=N // 2, mean_size=MEAN, n_classes=10)
    assert third.n_files == N // 2
    assert len([r for r in list_files(str(dest)) if r.startswith("train")]) == N // 2
    assert (dest / "keep.txt").read_text() == "x"


@pytest.mark.timeout(60)
def test_sample_is_deterministic(tmp_path: Path) -> None:
    a, b, c = _sample(tmp_path / "a"), _sample(tmp_path / "b"), _sample(tmp_path / "c", seed=1)
    rels = list_files(a.root)
    assert rels == list_files(b.root)
    assert a.total_bytes == b.total_bytes
    for rel in rels:
        assert (Path(a.root) / rel).read_bytes() == (Path(b.root) / rel).read_bytes()
    assert list_files(c.root) != rels


@pytest.mark.timeout(60)
def test_read_epoch_verifies_identical_copy(tmp_path: Path) -> None:
    info = _sample(tmp_path / "src")
    shutil.copytree(info.root, tmp_path / "copy")
    rels = list_files(info.root)
    r = read_epoch(str(tmp_path / "copy"), rels, readers=2, verify_root=info.root, buf_size=8192)
    assert (r.files, r.bytes, r.n_errors, r.errors) == (N, info.total_bytes, 0, [])
    assert r.seconds > 0 and r.files_per_s > 0 and r.mb_per_s > 0
    plain = read_epoch(info.root, rels, readers=3, seed=5)
    assert (plain.files, plain.bytes, plain.n_errors) == (N, info.total_bytes, 0)


@pytest.mark.timeout(60)
def test_read_epoch_reports_corruption_and_missing(tmp_path: Path) -> None:
    info = _sample(tmp_path / "src")
    copy = tmp_path / "copy"
    shutil.copytree(info.root, copy)
    rels = list_files(info.root)
    bad = rels[17]
    with open(copy / bad, "r+b") as f:  # flip one byte in the middle, size unchanged
        f.seek(os.path.getsize(copy / bad) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = read_epoch(str(copy), rels, readers=2, verify_root=info.root)
    assert (r.files, r.bytes, r.n_errors) == (N, info.total_bytes, 1)
    assert r.errors == [f"{bad}: content differs from source"]

    os.remove(copy / rels[3])
    r = read_epoch(str(copy), rels, readers=2, verify_root=info.root)
    assert r.files == N - 1 and r.n_errors == 2
    assert [e.split(":")[0] for e in r.errors] == sorted([bad, rels[3]])


@pytest.mark.timeout(60)
def test_format_row() -> None:
    base = EpochResult(files=20000, bytes=2_214_300_000, seconds=1.67)
    r = EpochResult(files=20000, bytes=2_214_300_000, seconds=3.21)
    row = format_row("dlfs mount", r, base)
    assert row.startswith("dlfs mount      20000 files  2214.3 MB  3.21 s   6231 files/s   689.8 MB/s")
    assert row.endswith("   0.52x source")
    assert "source" not in format_row("source", base).removeprefix("source")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def _on_tmpfs(path: Path) -> bool:
    """Whether path lies on a memory file system (nothing of it is ever read from storage)."""
    best, fstype = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mnt, kind = line.split()[1:3]
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
            best, fstype = mnt, kind
    return fstype in ("tmpfs", "ramfs")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache: needs root")


@pytest.mark.timeout(60)
def test_read_epoch_reads_and_verifies_both_ways(tmp_path: Path) -> None:
    info = _sample(tmp_path / "src")
    rels = list_files(info.root)
    assert set(READS) == {"open", "raw"}
    for read in READS:
        r = read_epoch(info.root, rels, readers=2, verify_root=info.root, read=read, buf_size=4096)
        assert (r.files, r.bytes, r.n_errors) == (N, info.total_bytes, 0), read
    with pytest.raises(ValueError, match="open, raw"):
        read_epoch(info.root, rels, read="mmap")


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.timeout(60)
def test_open_read_calls_isatty_on_every_file_as_frameworks_do_and_raw_does_not(tmp_path: Path) -> None:
    # What a FUSE mount receives as one FUSE_IOCTL request per file (CPython <= 3.13).
    info = _sample(tmp_path / "src")
    rels = list_files(info.root)[:40]
    counts = {}
    for read in READS:
        trace = tmp_path / f"{read}.strace"
        code = (f"from dlfs.bench.epoch import read_epoch; r = read_epoch({info.root!r}, {rels!r}, readers=2, "
                f"read={read!r}); assert r.files == {len(rels)}, r")
        subprocess.run(["strace", "-f", "-y", "-e", "trace=ioctl", "-o", str(trace), sys.executable, "-c", code],
                       env=_env(), check=True, timeout=50, capture_output=True)
        counts[read] = sum("TCGETS" in line and info.root in line for line in trace.read_text().splitlines())
    assert counts == {"open": len(rels), "raw": 0}


_BURNER = """
import os, threading, time
def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
t = threading.Thread(target=burn, args=(0.4,))
t.start()
t.join()
child = os.fork()
if child == 0:
    burn(0.4)
    os._exit(0)
os.waitpid(child, 0)
if os.fork() == 0:
    burn(0.4)
    print("ready", flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.timeout(30)
def test_cpu_seconds_counts_threads_reaped_children_and_live_descendants() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _BURNER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        tree = process_tree(proc.pid)
        assert len(tree) == 2 and tree[0] == proc.pid
        tick = os.sysconf("SC_CLK_TCK")

        def ticks(pid: int) -> list[int]:  # utime, stime, cutime, cstime
            return [int(f) for f in Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[11:15]]

        # CPU time, not wall time: each part burned 0.4 s of it (thread_time), however loaded the machine.
        # Both processes sleep now, so their counts hold still (read around cpu_seconds to be sure).
        before = [ticks(pid) for pid in tree]
        total = cpu_seconds(proc.pid)
        after = [ticks(pid) for pid in tree]
        own, reaped, live = before[0][:2], before[0][2:], before[1][:2]
        assert sum(own) / tick >= 0.39  # 0.4 s in a thread of its own
        assert sum(reaped) / tick >= 0.39  # 0.4 s in a child it reaped
        assert sum(live) / tick >= 0.39  # 0.4 s in a child still running
        # Exactly the sum of those counts over the tree: each counted once, nothing else added.
        assert sum(map(sum, before)) / tick <= total <= sum(map(sum, after)) / tick
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.page_cache  # the interpreter's own files stay cached: its reads are the file's
@pytest.mark.timeout(30)
def test_io_read_bytes_counts_storage_reads_of_a_process_and_its_children(tmp_path: Path) -> None:
    if _on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is in memory: nothing is read from storage")
    data = tmp_path / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())
    from dlfs.pagecache import cached_pages

    fd = os.open(data, os.O_RDONLY)
    try:
        for _ in range(50):  # this file's pages only, not the whole cache; asked until none is left
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if cached_pages(fd) in (0, None):
                break
            time.sleep(0.02)
        else:
            pytest.skip(f"the page cache keeps {data} whatever it is told")
    finally:
        os.close(fd)
    code = (f"import os, time\nif os.fork() == 0:\n    open({str(data)!r}, 'rb').read()\n"
            "    print('read', flush=True)\n    time.sleep(60)\nelse:\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "read\n"
        assert io_read_bytes([proc.pid]) >= 8 << 20  # the child's reads, charged to the parent's tree
        assert io_read_bytes([proc.pid], descendants=False) < 8 << 20  # the parent alone read none of it
        assert io_read_bytes([proc.pid, *process_tree(proc.pid)]) == io_read_bytes([proc.pid])  # each counted once
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_cpu_cost_spreads_cpu_over_files_and_bytes() -> None:
    assert cpu_cost(0.5, 1000, 2_000_000_000) == {"cpu_us_per_file": 500.0, "cpu_s_per_gb": 0.25}
    assert cpu_cost(None, 1000, 10) == {"cpu_us_per_file": None, "cpu_s_per_gb": None}
    assert cpu_cost(0.0, 0, 0) == {"cpu_us_per_file": None, "cpu_s_per_gb": None}


def test_readers_report_the_cpu_their_reads_cost_them(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(os.urandom(1 << 20) * 24)  # 24 MiB: copies no clock tick misses
    (tmp_path / "small").write_bytes(b"x")
    for read in READS:
        big = read_epoch(str(tmp_path), ["big"], readers=1, read=read)
        assert big.files == 1 and big.reader_cpu_s > 0, read
    # Two readers, a file each: the one that copied 24 MiB reports CPU, and the sum carries it.
    r = read_epoch(str(tmp_path), ["big", "small"], readers=2, seed=3)
    assert r.files == 2 and r.reader_cpu_s > 0


def test_reader_cpu_ratios_compare_dlfs_with_local_disk_per_workload() -> None:
    from dlfs.bench.cold import reader_cpu_ratios

    def row(per_gb: float | None) -> dict:
        return {"reader_cpu_s_per_gb": per_gb}

    c = {"big": {"1": {"local": row(0.6), "dlfs": row(0.75), "dlfs_direct_io": row(0.3)},
                 "2": {"local": row(0.5), "dlfs": row(None)}},
         "small": {"local": {"first": row(2.0)}, "dlfs": {"first": row(3.0)}}}
    assert reader_cpu_ratios(c) == {"big files, 1 reader(s)": pytest.approx(1.25),
                                    "big files, 1 reader(s) --direct-io": pytest.approx(0.5),
                                    "small files, first epoch": pytest.approx(1.5)}  # none without a figure


@pytest.mark.drops_caches
@pytest.mark.timeout(60)
def test_timed_epoch_on_local_disk_records_how_it_read(tmp_path: Path) -> None:
    info = _sample(tmp_path / "src")
    rels = list_files(info.root)
    for read in READS:
        r = timed_epoch(LocalDisk(Path(info.root)), rels, readers=2, seed=1, read=read)
        assert (r["read"], r["files"], r["bytes"]) == (read, N, info.total_bytes)
        assert r["files_per_s"] > 0 and r["mb_per_s"] > 0
        assert r["cpu_s"] is None and r["cpu_us_per_file"] is None  # the kernel serves: nothing to charge
        assert r["reader_cpu_s_per_gb"] == r["reader_cpu_s"] / (info.total_bytes / 1e9)


# --- big files ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_shards_are_random_deterministic_and_reused(tmp_path: Path) -> None:
    size = (1 << 20) + 100  # not a whole number of pages
    info = make_shards(tmp_path / "a", n_files=3, file_size=size, seed=4)
    rels = list_files(info.root)
    assert rels == [shard_name(i) for i in range(3)] == ["shards/shard-00000.bin", "shards/shard-00001.bin",
                                                           "shards/shard-00002.bin"]
    assert info.total_bytes == 3 * size == sum(os.path.getsize(Path(info.root) / r) for r in rels)
    first = (Path(info.root) / rels[0]).read_bytes()
    assert len(lz4.frame.compress(first)) > 0.99 * size  # incompressible
    assert first != (Path(info.root) / rels[1]).read_bytes()
    again = make_shards(tmp_path / "b", n_files=3, file_size=size, seed=4)
    assert all((Path(again.root) / r).read_bytes() == (Path(info.root) / r).read_bytes() for r in rels)
    before = {r: (Path(info.root) / r).stat().st_mtime_ns for r in rels}
    assert make_shards(tmp_path / "a", n_files=3, file_size=size, seed=4) == info
    assert {r: (Path(info.root) / r).stat().st_mtime_ns for r in rels} == before  # reused, not rewritten
    fewer = make_shards(tmp_path / "a", n_files=2, file_size=size, seed=4)
    assert list_files(fewer.root) == rels[:2]


def test_pick_preads_are_aligned_whole_and_deterministic() -> None:
    sizes = [100, PREAD_SIZE, 10 * PREAD_SIZE + 5, 1 << 20]
    picks = pick_preads(sizes, 5000, seed=1)
    assert len(picks) == 5000 and picks == pick_preads(sizes, 5000, seed=1) != pick_preads(sizes, 5000, seed=2)
    assert {i for i, _ in picks} == {1, 2, 3}  # never the file smaller than one pread
    assert all(off % PREAD_SIZE == 0 and off + PREAD_SIZE <= sizes[i] for i, off in picks)
    assert {off for i, off in picks if i == 1} == {0}
    assert {off for i, off in picks if i == 2} == {k * PREAD_SIZE for k in range(10)}
    with pytest.raises(ValueError, match="no file holds 4096 bytes"):
        pick_preads([10, 4095], 1)


@pytest.mark.drops_caches
@needs_root
@pytest.mark.timeout(60)
def test_pread_pass_on_local_disk_reads_checks_and_counts_storage(tmp_path: Path) -> None:
    info = make_shards(tmp_path / "src", n_files=3, file_size=1 << 20)
    rels = list_files(info.root)
    picks = pick_preads([info.file_size] * 3, 300)
    r = pread_pass(LocalDisk(Path(info.root)), rels, picks, info.root)
    assert (r["preads"], r["size"], r["bytes_served"]) == (300, PREAD_SIZE, 300 * PREAD_SIZE)
    assert r["preads_per_s"] > 0 and r["mb_per_s"] == pytest.approx(r["preads_per_s"] * PREAD_SIZE / 1e6)
    assert r["cpu_s"] is None and r["mount_read_bytes"] is None and r["mount_read_ratio"] is None
    if not _on_tmpfs(tmp_path):  # the page cache was dropped: every page read came from storage once
        assert r["disk_read_bytes"] >= len(set(picks)) * PREAD_SIZE
        assert r["disk_read_ratio"] == r["disk_read_bytes"] / r["bytes_served"]
    if block_device(tmp_path)[0] is not None:  # and reached the disk, whatever else the machine read meanwhile
        assert r["blockdev"] == block_device(info.root)[1]
        assert r["blockdev_read_bytes"] >= len(set(picks)) * PREAD_SIZE and r["blockdev_null_bytes"] >= 0
        assert r["blockdev_raw_ratio"] == r["blockdev_read_bytes"] / r["bytes_served"]
        assert r["blockdev_read_ratio"] == max(0, r["blockdev_read_bytes"] - r["blockdev_null_bytes"]) / (300 * 4096)
    else:
        assert r["blockdev"].startswith("no block device found for ") and r["blockdev_read_ratio"] is None

    copy = tmp_path / "copy"
    shutil.copytree(info.root, copy)
    i, off = picks[0]
    with open(copy / rels[i], "r+b") as f:  # one byte of the first pread's page, size unchanged
        f.seek(off + 7)
        byte = f.read(1)
        f.seek(off + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptData, match=f"preads differ from the source: {rels[i]} at offset {off}"):
        pread_pass(LocalDisk(copy), rels, picks, info.root)


@pytest.mark.timeout(10)
def test_block_device_is_the_disk_under_a_directory_or_said_missing(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    device, line = block_device(tmp_path)
    if os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"):
        assert device is not None and line == f"/dev/{device.name} (holds {tmp_path}; /sys/block/{device.name}/stat)"
        assert not os.path.exists(f"/sys/block/{device.name}/partition")  # the whole disk, not a partition
        first = device.read_bytes()
        assert first >= 0 and first % 512 == 0 and device.read_bytes() >= first
    # /proc is on no block device at all.
    assert block_device("/proc") == (None, f"no block device found for /proc (its file system is on device "
                                           f"0:{os.minor(os.stat('/proc').st_dev)}, not a block device)")


@pytest.mark.drops_caches
@needs_root
@pytest.mark.timeout(60)
def test_sequential_pass_on_local_disk_reads_every_file_whole_both_ways(tmp_path: Path) -> None:
    info = make_shards(tmp_path / "src", n_files=3, file_size=(2 << 20) + 1)
    rels = list_files(info.root)
    for read in READS:
        r = sequential_pass(LocalDisk(Path(info.root)), rels, read)
        assert (r["read"], r["files"], r["bytes"]) == (read, 3, info.total_bytes)
        assert r["mb_per_s"] > 0 and r["cpu_s"] is None
