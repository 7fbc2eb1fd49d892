"""`dlfs stats` against a real mount: totals after real reads, live rates, and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import DLFS, REPO, Node, needs_fuse, run_dlfs

from dlfs.mount.statsfile import stats_file
from dlfs.stats import rates
from dlfs.units import human_bytes


def views(out: str) -> list[dict[str, list[str]]]:
    """Each printed view as {row label: [cells]} (columns are two or more spaces apart)."""
    found: list[dict[str, list[str]]] = []
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if line.startswith("pid "):
            found.append({})
        elif found and len(cells) > 1:
            found[-1][cells[0]] = cells[1:]
    return found


def _sample(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "time": 100.0, "reads": 0, "read_bytes": 0, "read_seconds": {"counts": [0], "sum": 0.0},
        "cache_hits": 0, "cache_misses": 0, "cache_evictions": 0, "fetched_bytes": 0, "read_errors": 0,
        "failovers": 0, "checksum_failures": 0, "by_node": {}}
    base.update(changes)
    return base


def test_rates_between_two_samples() -> None:
    prev = _sample(by_node={"n1": {"bytes": 1000, "fetches": 1}})
    cur = _sample(time=102.0, reads=400, read_bytes=8_000_000, read_seconds={"counts": [400], "sum": 0.2},
                  cache_hits=300, cache_misses=100, fetched_bytes=4_000_000, read_errors=3, failovers=2,
                  by_node={"n1": {"bytes": 2_001_000, "fetches": 5}, "n2": {"bytes": 2_000_000, "fetches": 4}})
    r = rates(prev, cur)
    assert r.seconds == 2.0 and r.reads == 200 and r.read_bytes == 4_000_000
    assert r.latency == pytest.approx(0.0005) and r.hit_rate == 0.75
    assert r.fetched_bytes == 2_000_000 and r.node_bytes == {"n1": 1_000_000, "n2": 1_000_000}
    assert (r.errors, r.failovers, r.checksum_failures) == (3, 2, 0)
    assert rates(cur, cur).hit_rate is None and rates(cur, cur).latency is None


@needs_fuse
@pytest.mark.timeout(120)
def test_stats_of_a_real_mount(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    n_files, size = 120, 20_000
    for i in range(n_files):
        (src / f"f{i:03}").write_bytes(os.urandom(size))
    node.ingest(src, "pics")
    mnt = node.mount("pics", tmp_path / "mnt")

    first = node.run("stats", mnt)
    assert first.stdout.startswith(f"pics@1 at {mnt}\npid ")
    (view,) = views(first.stdout)
    assert view["reads"][-1] == "0" and view["cache hit rate"] == ["-", "-"]

    for i in range(40):
        assert (mnt / f"f{i:03}").read_bytes() == (src / f"f{i:03}").read_bytes()
    (view,) = views(node.run("stats", mnt).stdout)
    doc = json.loads(stats_file(node.home, mnt).read_text())
    assert view["reads"][-1] == f"{doc['reads']:,}" and doc["reads"] >= 40
    assert view["read"][-1] == human_bytes(40 * size) and doc["read_bytes"] == 40 * size
    hits, misses = doc["cache_hits"], doc["cache_misses"]
    assert misses >= 1 and hits + misses >= 40
    assert view["cache hits / misses"][-1] == f"{hits:,} / {misses:,}"
    assert view["cache hit rate"][-1] == f"{100 * hits / (hits + misses):.1f} %"
    assert view["local"][1:] == [human_bytes(doc["fetched_bytes"]), f"{doc['fetches']:,}", "100 %"]
    assert view["read errors"] == ["0", "0"] and view["failovers"] == ["0", "0"]

    # Live: a reader keeps reading new files while --watch shows two views, one a second.
    def reader() -> None:
        for i in range(40, n_files):
            (mnt / f"f{i:03}").read_bytes()
            time.sleep(0.03)

    t = threading.Thread(target=reader)
    t.start()
    try:
        watch = subprocess.run([*DLFS, "stats", str(mnt), "--watch", "--count", "2"], env=node.env, cwd=REPO,
                               capture_output=True, text=True, timeout=60)
    finally:
        t.join()
    assert watch.returncode == 0, watch.stderr
    shown = views(watch.stdout)
    assert len(shown) == 2
    per_second = [float(v["reads"][0].removesuffix("/s").replace(",", "")) for v in shown]
    assert max(per_second) > 0, watch.stdout
    assert all(float(v["read"][0].removesuffix(" MB/s")) > 0 for v, r in zip(shown, per_second) if r > 0)

    # A watch whose mount ends under it says so (it said there was no mount there, another --home's perhaps).
    watching = subprocess.Popen([*DLFS, "stats", str(mnt), "--watch", "--interval", "0.2"], env=node.env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        node.umount(mnt)
        _, err = watching.communicate(timeout=30)
    finally:
        if watching.poll() is None:
            watching.kill()
            watching.wait()
    assert watching.returncode == 4 and err == f"dlfs: error: the mount at {mnt} has ended (unmounted, or its " \
        "process exited)\n", err
    assert not stats_file(node.home, mnt).exists()
    gone = node.run("stats", mnt, check=False)
    assert gone.returncode == 4
    assert gone.stderr.strip() == f"dlfs: error: no dlfs mount at {mnt} under {node.home} (mounts made with " \
        "another --home or $DLFS_HOME are listed under that one)"


@pytest.mark.timeout(60)
def test_stats_usage_errors(tmp_path: Path) -> None:
    bad = run_dlfs(tmp_path, "stats", tmp_path, "--interval", "0", check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "dlfs: error: --interval must be more than 0 seconds"


def test_the_disk_cache_row_says_what_bounds_it() -> None:
    from dlfs.metrics import MountCollector
    from dlfs.stats import disk_cache_line

    dc = {"dir": "/c", "held_bytes": 2_000_000, "size_bytes": 64 << 20, "room_bytes": None, "free_share": 0.1,
          "written": 3, "written_bytes": 1_500_000, "evicted_chunks": 2, "evicted_bytes": 9, "dropped_writes": 1,
          "full": 0, "errors": 0}
    assert disk_cache_line(dc).startswith("2.0 MB held of its --cache-dir-size 64 MiB; this mount wrote 1.5 MB, "
                                          "evicted 2 chunks, left 1 writes unkept")
    free = dict(dc, size_bytes=None, room_bytes=5_000_000_000)
    assert "room for 5.0 GB more (it keeps 10% of its file system free)" in disk_cache_line(free)
    # With no size, a file system under its free share keeps nothing: the row says so, and what to do.
    full = dict(dc, size_bytes=None, room_bytes=-1)
    assert "under 10% free, so it keeps next to nothing (free space there, or give --cache-dir-size)" in \
        disk_cache_line(full)
    broken = dict(dc, broken="its catalogue was damaged (file is not a database)", held_bytes=None)
    assert disk_cache_line(broken).startswith("not used since its catalogue was damaged (file is not a database): "
                                              "the next mount or warmup starts it over")
    snap = _sample(dataset="d@1", fetch_seconds={"counts": [0], "sum": 0.0}, cache_bytes=0, cache_capacity=1,
                   failing_nodes=[], disk_cache=dc)
    names = {s.name: s.value for m in MountCollector(lambda: snap).collect() for s in m.samples}
    assert names["dlfs_disk_cache_bytes"] == 2_000_000 and names["dlfs_disk_cache_size_bytes"] == 64 << 20
    assert names["dlfs_disk_cache_written_bytes_total"] == 1_500_000
    assert names["dlfs_disk_cache_dropped_writes_total"] == 1
