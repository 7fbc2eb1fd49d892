"""`dlfs bench --only ingest`: how fast a tree becomes a dataset, beside the tools that do the same job.

Trees of ~110 KB files at two sizes (~1 GB and ~2.5 GB; --quick: a quarter of that), each ingested into
an empty one-node dlfs (the dataset removed and its chunks freed before each pass), packed by
`mksquashfs -comp lz4` into a new image, and copied by `cp -a` to a new directory on the same disk.
Every pass starts with the page cache dropped and ends when its data is on disk (`sync`), and the
three take turns in a rotating order, so that none always runs first on a quiet machine.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlfs.bench.baselines import DlfsNode, build_squashfs, cpu_seconds, drop_caches
from dlfs.bench.sample import make_sample
from dlfs.units import human_bytes

Say = Callable[[str], None]
DATASET = "bench-ingest"
MEAN = 110_000
SIZES = (1_000_000_000, 2_500_000_000)
QUICK_SIZES = (250_000_000, 600_000_000)
SYSTEMS = ("dlfs", "mksquashfs", "cp")


def _cpu(node: DlfsNode) -> float:
    """CPU seconds of the commands this process ran and waited for, and of the dlfs node (which does
    half of an ingest's work: receiving, checking and writing chunks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert node.proc is not None
    return r.ru_utime + r.ru_stime + cpu_seconds(node.proc.pid)


def run_ingest(work: Path, say: Say, quick: bool, passes: int, transport: str | None = None) -> dict[str, Any]:
    """The section's figures: per size, each system's seconds, MB/s and CPU seconds per pass."""
    node = DlfsNode(work / "ingest-home", transport)
    node.stop_leftover()
    node.check_unused()
    shutil.rmtree(node.home, ignore_errors=True)
    image, copy = work / "ingest.img", work / "ingest-copy"
    out: dict[str, Any] = {"passes": passes, "sizes": {}}
    node.start()
    try:
        for size in QUICK_SIZES if quick else SIZES:
            n = max(1, size // MEAN)
            say(f"ingest: making a tree of {n} files (~{size / 1e9:.2f} GB)")
            src = Path(make_sample(work / f"ingest-{n}", n_files=n, mean_size=MEAN).root)
            total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
            runs: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
            work_of: dict[str, Callable[[], object]] = {
                "dlfs": lambda src=src: node.cli("ingest", str(src), "--name", DATASET),
                "mksquashfs": lambda src=src: build_squashfs(src, image),
                "cp": lambda src=src: subprocess.run(["cp", "-a", str(src), str(copy)], check=True),
            }
            for k in range(passes):
                order = SYSTEMS[k % 3:] + SYSTEMS[: k % 3]
                for name in order:
                    say(f"ingest: {total / 1e9:.2f} GB, pass {k + 1} of {passes}: {name}")
                    _empty(node, image, copy)
                    drop_caches()
                    cpu0, t0 = _cpu(node), time.perf_counter()
                    work_of[name]()
                    os.sync()  # dlfs fsyncs every chunk; the others do not: each pays for durability
                    seconds = time.perf_counter() - t0
                    runs[name].append({"seconds": seconds, "mb_per_s": total / 1e6 / seconds,
                                       "cpu_s": _cpu(node) - cpu0})
            _empty(node, image, copy)
            out["sizes"][str(total)] = {"files": n, "bytes": total, "runs": runs}
    finally:
        node.stop()
        image.unlink(missing_ok=True)
        shutil.rmtree(copy, ignore_errors=True)
    return out


def _empty(node: DlfsNode, image: Path, copy: Path) -> None:
    """Every target as a first run finds it: no dataset (its chunks freed), no image, no copy."""
    if DATASET in node.cli("datasets"):
        node.cli("rm", DATASET)
    image.unlink(missing_ok=True)
    shutil.rmtree(copy, ignore_errors=True)


def ratios(by: dict[str, list[dict[str, float]]], other: str) -> list[float]:
    """dlfs's speed over `other`'s, pass by pass (the same pass ran both in the same minute)."""
    return [d["mb_per_s"] / o["mb_per_s"] for d, o in zip(by["dlfs"], by[other])]


def ingest_targets(section: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's target: at least 1.2x mksquashfs's speed at both sizes, every run (the worst pass)."""
    from dlfs.bench.report import target

    return [target(f"ingest of a local tree, {human_bytes(int(s['bytes']))}, worst of {section['passes']} passes: "
                   "dlfs / mksquashfs -comp lz4", min(ratios(s["runs"], "mksquashfs")), 1.2, "x")
            for s in section["sizes"].values()]


def ingest_table(section: dict[str, Any]) -> list[str]:
    """The section's table: per size and system, the median MB/s, CPU s per GB, and dlfs's ratios."""
    lines = [f"ingest: each pass from a dropped cache into an empty target, until synced "
             f"({section['passes']} passes, rotating order)",
             f"  {'tree':<10}{'system':<14}{'MB/s (median)':>15}{'CPU s/GB':>10}{'dlfs / it, each pass':>28}"]
    for s in section["sizes"].values():
        gb, tree = int(s["bytes"]) / 1e9, human_bytes(int(s["bytes"]))
        for name in SYSTEMS:
            runs = s["runs"][name]
            rate = sorted(r["mb_per_s"] for r in runs)[len(runs) // 2]
            cpu = sorted(r["cpu_s"] for r in runs)[len(runs) // 2] / gb
            each = "" if name == "dlfs" else " ".join(f"{x:.2f}x" for x in ratios(s["runs"], name))
            lines.append(f"  {tree:<10}{name:<14}{rate:>15.1f}{cpu:>10.2f}{each:>28}")
    return lines
