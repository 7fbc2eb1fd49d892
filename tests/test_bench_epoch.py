"""Tests for the sample-tree generator and the epoch read workload."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dlfs.bench.epoch import EpochResult, format_row, list_files, read_epoch
from dlfs.bench.sample import SampleInfo, make_sample

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
