"""`dlfs bench`: the synthetic index of the scale workload, the option checks, and one tiny whole run."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import DLFS, REPO, dlfs_env

from dlfs.bench import baselines, scale
from dlfs.bench.baselines import mounts_under
from dlfs.bench.run import bench_options, check_space, parse_counts
from dlfs.errors import StorageFull, UsageError
from dlfs.format.index import ROOT_INO, Index
from dlfs.procs import running

CAN_BENCH = (os.geteuid() == 0 and os.path.exists("/dev/fuse")
             and all(shutil.which(t) for t in baselines.TOOLS))
needs_bench = pytest.mark.skipif(not CAN_BENCH, reason="needs root, /dev/fuse, mksquashfs, squashfuse_ll and fusermount3")
SYSTEMS = ("local", "squashfuse_ll", "kernel_squashfs", "dlfs")


@pytest.mark.timeout(30)
def test_synthetic_index_opens_with_every_file(tmp_path: Path) -> None:
    chunk = scale.fake_chunk()
    writer = scale.build_index(2500, chunk, per_dir=1000)
    path = tmp_path / "scale.idx"
    with open(path, "wb") as f:
        writer.write(f)
    index = Index(path)
    try:
        t = index.totals
        assert t.files == 2500 and t.extents == 2500 and t.chunks == 1
        assert t.bytes == 2500 * chunk.record.raw_len
        assert index.chunk_ids() == [chunk.id]
        entries = list(index.walk())
        assert len(entries) == 1 + 1 + 3 + 2500  # root, train/, three folders, the files
        # The deepest file resolves by name, one extent at the chunk's only record, of that record's size.
        ino = ROOT_INO
        for part in scale.deep_file(2500, per_dir=1000).split("/"):
            found = index.lookup(ino, part.encode())
            assert found is not None, part
            ino = found
        node = index.inode(ino)
        assert stat.S_ISREG(node.mode) and node.size == chunk.record.raw_len and node.count == 1
        assert index.extent(node.ref).record == chunk.record
        assert index.inode(index.lookup(ROOT_INO, b"train") or 0).count == 3  # 1000, 1000 and 500 files
    finally:
        index.close()


def test_options_and_their_errors() -> None:
    quick = bench_options(".bench", None, None, None, None, quick=True)
    assert (quick.files, quick.readers, quick.scale) == (4000, [1, 2], [10_000, 100_000])
    full = bench_options(".bench", None, None, None, None, quick=False)
    assert (full.files, full.readers, full.scale) == (35_000, [1, 2, 4], [100_000, 1_000_000])
    assert parse_counts("1, 2,4", "--readers") == [1, 2, 4]
    for bad in ("", "0", "two", "1,-2"):
        with pytest.raises(UsageError, match="--readers"):
            parse_counts(bad, "--readers")
    with pytest.raises(UsageError, match="--src"):
        bench_options(".bench", "/data", 100, None, None, quick=False)


def test_machine_checks_say_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UsageError, match="must run as root.*drop_caches"):
        baselines.check_machine()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "squashfuse_ll" else f"/usr/bin/{tool}")
    with pytest.raises(UsageError, match="needs squashfuse_ll: run scripts/install-system-deps.sh"):
        baselines.check_machine()
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(StorageFull, match="GB free; the bench needs"):
        check_space(tmp_path, free, 0)  # 3.5 times what is free
    check_space(tmp_path, free // 4, 0)


@needs_bench
@pytest.mark.timeout(60)
def test_tiny_bench_run_measures_every_workload_and_leaves_nothing_mounted(tmp_path: Path) -> None:
    work, report = tmp_path / "work", tmp_path / "out.json"
    proc = subprocess.run([*DLFS, "bench", "--quick", "--files", "300", "--readers", "1", "--scale", "2000,5000",
                           "--dir", str(work), "--json", str(report)], env=dlfs_env(tmp_path / "unused-home"),
                          capture_output=True, text=True, timeout=55, cwd=REPO, check=False)
    try:
        assert proc.returncode == 0, proc.stderr
        out = json.loads(report.read_text())
        assert out["dataset"]["files"] == 300 and out["dataset"]["generated"]
        assert out["verify"] == {"files": 300, "bytes": out["dataset"]["bytes"], "errors": 0}
        assert set(out["systems"]) == set(SYSTEMS)
        for kind in ("cold", "warm"):
            for name in SYSTEMS:
                r = out["epoch"][kind]["1"][name]
                assert r["files"] == 300 and r["bytes"] == out["dataset"]["bytes"], (kind, name)
                assert r["files_per_s"] > 0 and r["mb_per_s"] > 0 and r["seconds"] > 0, (kind, name)
                # CPU is charged to the FUSE daemons only (a tiny warm pass may take under one clock tick).
                assert (r["cpu_s_per_gb"] is not None) == (name in ("squashfuse_ll", "dlfs")), (kind, name)
        entries = {out["metadata"][name]["entries"] for name in SYSTEMS}
        assert entries == {300 + 100 + 2}  # files, class folders, train/ and the sample's marker
        assert all(out["metadata"][name]["entries_per_s"] > 0 for name in SYSTEMS)
        ingest = out["ingest"]
        assert ingest["dlfs"]["mb_per_s"] > 0 and ingest["mksquashfs"]["mb_per_s"] > 0 and ingest["ratio"] > 0
        points = out["scale"]["points"]
        assert [p["files"] for p in points] == [2000, 5000]
        assert all(p["mount_s"] > 0 and p["remount_s"] > 0 and p["rss_stat"] > 0 for p in points)
        assert out["scale"]["rss_bytes_per_file"] is not None
        assert out["targets"] and all(isinstance(t["met"], bool) for t in out["targets"])
        total = out["dataset"]["bytes"]
        for kind, modes in (("cold", ("local", "batched")), ("warm", ("local", "single", "batched")),
                            ("warm_hash", ("local", "single", "batched"))):
            for mode in modes:
                r = out["direct"][kind][mode]
                assert r["files"] == 300 and r["bytes"] == total and r["files_per_s"] > 0, (kind, mode)
        for kind, workers in ((k, w) for k in ("views", "tensor") for w in ("0", "2")):
            by = out["torch"][kind][workers]
            assert by["dlfs"]["direct"] and not by["local"]["direct"]
            # The whole directory, the sample's marker file included.
            assert by["dlfs"]["files"] == by["local"]["files"] == 301
            assert by["dlfs"]["bytes"] == by["local"]["bytes"] > total
        jobs = out["two_jobs"]
        assert [j["files"] for j in jobs["jobs"]] == [300, 300] and jobs["dataset_bytes"] == total
        assert 1.0 <= jobs["fetched_ratio"] <= 1.1, jobs  # each chunk fetched once for both jobs
        assert "TARGETS (issues 4, 5)" in proc.stdout and "EPOCH" in proc.stdout and "DIRECT" in proc.stdout
    finally:
        # Whatever happened: nothing of the run may stay mounted, looped or running.
        left = mounts_under(tmp_path)
        loops = subprocess.run(["losetup", "-j", str(work / "squash.img")], capture_output=True, text=True).stdout
        for mnt in left:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        node = work / "home" / "run" / "node.json"
        pid = json.loads(node.read_text())["pid"] if node.exists() else 0
    assert left == [] and loops.strip() == ""
    assert not running(pid)
