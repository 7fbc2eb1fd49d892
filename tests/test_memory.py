"""Memory within a container's limit (issue 13): the node, the mount and the readers in one real memory
cgroup, a dataset 2.3x its limit, read through FUSE and through dlfs.direct; the cache sized from the
limit, no OOM kill, every byte right, and the mount's memory within its cache and the documented
overhead."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from conftest import CLI_TIMEOUT, DLFS, REPO, Node, dlfs_env, force_unmount, mount_pids, needs_fuse, run_dlfs, stop_node

from dlfs.bench.memory import PeakMemory
from dlfs.cgroup import MemoryGroup, memory_limit
from dlfs.mount.cache import MIN_AUTO_CACHE, auto_cache_size
from dlfs.pagecache import cached_pages
from dlfs.units import human_bytes

pytestmark = pytest.mark.drops_caches  # drop_caches; memory measured in cgroups of its own (dlfs-test-*), which no other test makes

LIMIT = 256 << 20
FILE_SIZE = 256 << 10
N_FILES = int(2.3 * LIMIT) // FILE_SIZE
OVERHEAD = 64 << 20  # what the README promises beyond the cache and the index

READER = """
import json, os, random, sys, xxhash
root, want, mode, seed = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], int(sys.argv[4])
names = sorted(want)
random.Random(seed).shuffle(names)
bad = []
if mode == "fuse":
    for n in names:
        with open(os.path.join(root, n), "rb") as f:  # default buffering: the framework way
            if xxhash.xxh3_64_hexdigest(f.read()) != want[n]:
                bad.append(n)
else:
    from dlfs.direct import connect
    r = connect(root)
    assert r.direct, getattr(r, "reason", "")
    for i in range(0, len(names), 64):
        part = names[i:i + 64]
        for n, v in zip(part, r.read_many([os.path.join(root, n) for n in part])):
            if xxhash.xxh3_64_hexdigest(v) != want[n]:
                bad.append(n)
    r.close()
print(json.dumps({"files": len(names), "bad": bad[:5], "n_bad": len(bad)}))
"""


def _group(name: str, limit: int) -> MemoryGroup:
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    try:
        return MemoryGroup.create(name, limit)
    except OSError as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")


def test_the_limit_a_process_lives_under_sizes_the_cache() -> None:
    g = _group("dlfs-test-limit", 300 << 20)
    try:
        code = ("import json; from dlfs.cgroup import memory_limit; from dlfs.mount.cache import auto_cache_size; "
                "l = memory_limit(); print(json.dumps([l.effective, l.limited, auto_cache_size(l), l.describe()]))")
        out = subprocess.run(g.command([sys.executable, "-c", code]), capture_output=True, text=True, cwd=REPO,
                             env=dlfs_env(Path("/nonexistent")), timeout=60, check=True).stdout
        effective, limited, cache, text = json.loads(out)
        assert effective == 300 << 20 and limited
        assert cache == (300 << 20) // 4
        assert str(g.path) in text
        doctor = subprocess.run(g.command([*DLFS, "doctor"]), capture_output=True, text=True, cwd=REPO,
                                env=dlfs_env(Path("/nonexistent")), timeout=CLI_TIMEOUT)
        assert f"memory cgroup limit {human_bytes(300 << 20)}" in re.sub(r"\s*│\s*", " ", doctor.stdout), doctor.stdout
    finally:
        g.remove()
    here = memory_limit()  # outside the group: physical memory unless this job has a limit itself
    assert auto_cache_size(here) == max(MIN_AUTO_CACHE, here.effective // 4)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Incompressible files 2.3x the group's limit (lz4 would keep them small otherwise), and their digests."""
    src = tmp_path_factory.mktemp("memsrc")
    rng = random.Random(13)
    want = {}
    for i in range(N_FILES):
        name = f"d{i % 16:02d}/f{i:05d}.bin"
        data = rng.randbytes(FILE_SIZE - rng.randrange(0, 4096))
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes(data)
        want[name] = xxhash.xxh3_64_hexdigest(data)
    digests = src.parent / f"{src.name}.json"
    digests.write_text(json.dumps(want))
    return src, digests


@pytest.fixture
def confined(tmp_path: Path, dataset: tuple[Path, Path]) -> Iterator[tuple[MemoryGroup, Path, Path]]:
    """A node and a mount of the dataset, both started inside one memory cgroup of LIMIT bytes."""
    group = _group("dlfs-test-confined", LIMIT)
    home, mnt = tmp_path / "home", tmp_path / "mnt"
    home.mkdir()
    mnt.mkdir()
    log = tmp_path / "node.log"
    with open(log, "wb") as logf:
        node = subprocess.Popen(group.command([*DLFS, "node"]), env=dlfs_env(home), stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while run_dlfs(home, "status", check=False, timeout=10).returncode != 0:
            assert node.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        run_dlfs(home, "ingest", dataset[0], "--name", "big")
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False, timeout=60)
        subprocess.run(group.command([*DLFS, "mount", "big", str(mnt)]), env=dlfs_env(home), cwd=REPO,
                       check=True, capture_output=True, timeout=CLI_TIMEOUT)
        yield group, home, mnt
    finally:
        force_unmount(tmp_path)
        stop_node(node)
        group.remove()


def _epoch(group: MemoryGroup, mnt: Path, digests: Path, mode: str, readers: int) -> list[dict]:
    procs = [subprocess.Popen(group.command([sys.executable, "-c", READER, str(mnt), str(digests), mode, str(seed)]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=dlfs_env(Path("/nonexistent")))
             for seed in range(readers)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"{mode} reader exited {p.returncode} (-9: OOM-killed?): {stderr[-2000:]}"
        out.append(json.loads(stdout))
    return out


@needs_fuse
@pytest.mark.timeout(600)
def test_epochs_bigger_than_the_limit_stay_within_it(confined: tuple[MemoryGroup, Path, Path],
                                                      dataset: tuple[Path, Path]) -> None:
    group, home, mnt = confined
    (pid,) = mount_pids(home)
    mount_log = "\n".join(p.read_text() for p in (home / "logs").glob("*.log"))
    cache = LIMIT // 4
    said = f"memory: memory cgroup limit {human_bytes(LIMIT)} ({group.path}/"
    assert said in mount_log and f"; cache {human_bytes(cache)} (auto" in mount_log, mount_log[-3000:]
    index = sum(p.stat().st_size for p in home.rglob("*.idx"))
    with PeakMemory(pid, group, period=0.02) as peak:
        fuse = _epoch(group, mnt, dataset[1], "fuse", readers=2)
        direct = _epoch(group, mnt, dataset[1], "direct", readers=1)
    for r in fuse + direct:
        assert r["n_bad"] == 0, r
    assert [r["files"] for r in fuse + direct] == [N_FILES] * 3
    assert group.oom_kills() == 0
    assert peak.peak_anon_shmem <= cache + OVERHEAD + index, (
        f"mount held {peak.peak_anon_shmem >> 20} MiB (anon {peak.peak_anon >> 20}, shmem {peak.peak_shmem >> 20}) over a "
        f"{cache >> 20} MiB cache + {OVERHEAD >> 20} MiB + index {index >> 20} MiB")
    assert peak.peak_shmem <= cache + (16 << 20), "the shared cache is bounded by --cache-size (and control pages)"


def _chunk_pages_cached(home: Path) -> int:
    """Pages of the node's chunk files in the page cache now."""
    total = 0
    for path in (home / "data" / "chunks").rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                got = cached_pages(fd)
            finally:
                os.close(fd)
            if got is None:
                pytest.skip("this kernel cannot say what the page cache holds (cachestat, Linux 6.5+)")
            total += got
    return total


@needs_fuse
@pytest.mark.timeout(600)
def test_three_cold_epochs_cache_each_byte_once(confined: tuple[MemoryGroup, Path, Path],
                                               dataset: tuple[Path, Path]) -> None:
    """The kernel's copy of what it was sent for the FUSE files is the one it keeps: the mount reads the
    chunk files with O_DIRECT or RWF_DONTCACHE, so after each cold epoch they hold next to nothing in
    the page cache, and the mount's slabs stay within the cache through all three."""
    group, home, mnt = confined
    (pid,) = mount_pids(home)
    cache = LIMIT // 4
    dataset_pages = N_FILES * FILE_SIZE // 4096
    with PeakMemory(pid, group, period=0.02) as peak:
        for _ in range(3):
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False, timeout=60)
            for r in _epoch(group, mnt, dataset[1], "fuse", readers=2):
                assert r["n_bad"] == 0 and r["files"] == N_FILES, r
            cached = _chunk_pages_cached(home)
            assert cached <= dataset_pages // 100, f"{cached} of {dataset_pages} chunk file pages left in the page cache"
    assert group.oom_kills() == 0
    assert peak.peak_shmem <= cache + (16 << 20), "the mount's slabs are bounded by its cache"


@needs_fuse
@pytest.mark.timeout(120)
def test_a_mount_says_when_its_bound_does_not_fit_its_group(node: Node, tmp_path: Path) -> None:
    """The mount's bound (its cache and MOUNT_SLACK) over its group's limit: a warning on the command's
    stderr, with the cache that would fit (it was in the background mount's log alone, and left the mount's
    own memory out: a 48 MiB group's mount was OOM-killed at its first epoch without a word)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(10_000))
    node.ingest(src, "fits")
    said = {}
    for limit, extra in ((100, ()), (100, ("--cache-size", "32M")), (300, ("--cache-size", "200M"))):
        g = _group("dlfs-test-fits", limit << 20)
        mnt = tmp_path / f"m{limit}{len(extra)}"
        mnt.mkdir()
        try:
            proc = subprocess.run(g.command([*DLFS, "mount", "fits", str(mnt), *extra]), env=node.env, cwd=REPO,
                                  capture_output=True, text=True, timeout=CLI_TIMEOUT)
            assert proc.returncode == 0 and (mnt / "a").read_bytes() == (src / "a").read_bytes(), proc.stderr
            said[(limit, extra)] = proc.stderr
        finally:
            node.umount(mnt)
            g.remove()
    assert said[(100, ())] == ("dlfs: warning: this mount may use 128 MiB of memory (its cache, 64 MiB, and 64 MiB for "
                               "itself), more than its memory cgroup allows (100 MiB, the job's own included): under "
                               "load it may be killed for memory; give the job more memory, or --cache-size 36M at most\n")
    assert said[(100, ("--cache-size", "32M"))] == ""
    assert said[(300, ("--cache-size", "200M"))].startswith("dlfs: warning: --cache-size 200 MiB is over half the "
                                                            "memory cgroup's limit (300 MiB)")


@needs_fuse
@pytest.mark.timeout(120)
def test_a_cache_or_window_under_the_least_is_said(node: Node, tmp_path: Path) -> None:
    """`--cache-size` under 4 windows and `--readahead` under 64 KiB were raised to those without a word
    (a user who set 1M for a tight job got a cache of 16 MiB); now the mount says so, and serves."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(300_000))
    node.ingest(src, "least")
    said = {}
    for extra in (("--cache-size", "1M"), ("--cache-size", "1", "--readahead", "4K"), ("--cache-size", "16M")):
        mnt = tmp_path / f"m{len(said)}"
        mnt.mkdir()
        proc = subprocess.run([*DLFS, "mount", "least", str(mnt), *extra], env=node.env, cwd=REPO,
                              capture_output=True, text=True, timeout=CLI_TIMEOUT)
        try:
            assert proc.returncode == 0 and (mnt / "a").read_bytes() == (src / "a").read_bytes(), proc.stderr
            said[extra] = proc.stderr
        finally:
            node.umount(mnt)
    assert said[("--cache-size", "1M")] == ("dlfs: warning: --cache-size 1M is less than the cache's least, 4 windows "
                                            "of --readahead: it takes up to 16.1 MiB\n")
    assert said[("--cache-size", "1", "--readahead", "4K")] == (
        "dlfs: warning: --readahead 4K is under the least window, 64 KiB: windows of 64 KiB are read\n"
        "dlfs: warning: --cache-size 1 is less than the cache's least, 4 windows of --readahead: it takes up to "
        "0.3 MiB\n")
    assert said[("--cache-size", "16M")] == ""  # 4 windows of 4 MiB: the least, as asked


def test_a_cache_bigger_than_the_machine_is_warned_of() -> None:
    """No memory cgroup: a cache over the machine's memory (1T typed for 1G) is said, one that fits is not."""
    from dlfs.cgroup import MemoryLimit
    from dlfs.cli import _memory_warning

    machine = MemoryLimit(25_300_000_000, None, None)
    assert _memory_warning(machine, 1 << 30) is None
    assert _memory_warning(machine, 1 << 40) == (
        "--cache-size 1.1 TB is more than this machine's memory (25.3 GB): the cache's pages cannot be reclaimed, "
        "so once it fills the machine runs out of memory")
