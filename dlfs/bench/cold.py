"""`dlfs bench --only cold`: the cold path, where a dataset bigger than memory puts every epoch.

Its own node and files (big files of 16 MiB and 40 MB, and ~110 KB files), read by local disk,
squashfuse_ll and dlfs, each figure beside local disk's in the same state, measured in the same run.
dlfs has them as two datasets, one of the big files and one of the small ones, as a user would have
them (a mount chooses how it serves by its dataset: see want_io_uring):

  - big files read whole (open(p, "rb").read()), cold: page cache dropped, a fresh mount; 1 and 2 readers;
    dlfs mounted as by default and with --direct-io (files of 1 MiB or more past the page cache);
  - two cold epochs of the small files on ONE mount, the page cache dropped between them (what a job
    whose dataset does not fit in memory gets from its second epoch on): files/s of each, the second
    over the first, and the READs each epoch sent to Python (the mount's published misses);
  - the mount's CPU per cold file beside squashfuse_ll's;
  - beside them, not a target: the same reads by a mount that fetches its chunks from the data daemon
    (--no-short-circuit), what a compute node that holds none of the data gets (here over loopback TCP),
    and the small files' two epochs again through a mount whose cache holds a quarter of them (a dataset
    bigger than the memory a job may use: each miss one record, fetched by the serving threads), and
    through such a mount with a disk cache (--cache-dir) that `dlfs warmup` filled first (a compute node's
    epochs after its first: each miss one record, read from the disk cache by the serving threads).

Each figure is the mean of ROUNDS passes (--quick: one), the systems' order reversed every other round:
on this VM a pass's figure moves with what ran just before it, and one pass of each swung 0.77-1.16x
local disk in three runs of one build (big files at 1 reader).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlfs.bench.baselines import (
    DlfsMount,
    DlfsNode,
    LocalDisk,
    SquashfuseLL,
    System,
    build_squashfs,
    drop_caches,
    fresh_start,
    unmount_all_under,
)
from dlfs.bench.epoch import cpu_cost, list_files, timed_epoch
from dlfs.bench.sample import make_sample

Say = Callable[[str], None]
DATASETS = {"big": "bench-cold-big", "small": "bench-cold-small"}  # each of the tree's two folders alone
BIG_SIZES = (16 << 20, 40_000_000)  # a 3D-U-Net-like sample (MLPerf Storage's unet3d) and a bigger shard
SMALL_MEAN = 110_000
SMALL_MAX = 8000  # small files at most: enough for a steady epoch, a dataset of ~0.9 GB
DLFS_LABELS = {"dlfs": DlfsMount.label, DlfsMount.DIRECT_IO[0]: DlfsMount.DIRECT_IO[1]}  # dlfs mounts' results by name
# Shown beside them, not targets: the chunks fetched from the data daemon over TCP, not read in place (one
# machine here, so loopback, the daemon sharing the CPUs with the readers)
SHOWN = {**DLFS_LABELS, **dict([DlfsMount.VIA_DAEMON, DlfsMount.VIA_DAEMON_SMALL_CACHE, DlfsMount.VIA_DISK_CACHE])}
MIN_CACHE = 16 << 20  # the smallest cache the quarter-cache mount gets (tiny runs)
ROUNDS = 2  # passes of each system, the order reversed every other round (see the module's docstring)


def section_size(files: int, big_files: int) -> tuple[int, int]:
    """(big files of each size, small files) for a run of `files` files and `big_files` big ones."""
    return max(2, min(big_files, files // 500)), min(files, SMALL_MAX)


def make_dataset(root: Path, n_big: int, n_small: int) -> tuple[list[str], list[str], int]:
    """root/big/* and root/small/...: (big relpaths, small relpaths, bytes), reused when already there."""
    big = root / "big"
    big.mkdir(parents=True, exist_ok=True)
    for size in BIG_SIZES:
        for i in range(n_big):
            p = big / f"{size}-{i:03d}.bin"
            if not p.exists() or p.stat().st_size != size:
                tmp = p.with_suffix(".tmp")
                with open(tmp, "wb", buffering=0) as f:
                    f.write(random.Random(size * 1000 + i).randbytes(size))
                os.replace(tmp, p)
    make_sample(root / "small", n_files=n_small, mean_size=SMALL_MEAN)
    for stale in big.glob("*.bin"):  # of an earlier run with more big files
        size, i = stale.stem.split("-")
        if int(i) >= n_big:
            stale.unlink()
    bigs = sorted(f"big/{p}" for p in os.listdir(big) if p.endswith(".bin"))
    smalls = [f"small/{r}" for r in list_files(str(root / "small"))]
    total = sum(os.path.getsize(root / r) for r in (*bigs, *smalls))
    return bigs, smalls, total


def mount_sample(s: System) -> dict[str, Any]:
    """The dlfs mount's published cache and engine counters once it is idle ({} for other systems)."""
    if not isinstance(s, DlfsMount):
        return {}
    from dlfs.stats import read_sample

    s.mount_counters(time.time())  # waits until nothing is fetched any more
    doc = read_sample(s.node.home, s.root.absolute())
    engine = doc.get("engine") or {}
    return {"python_reads": doc["python_reads"], "misses": doc["cache_misses"], "fetches": doc["fetches"],
            "read_misses": engine.get("read_misses", 0), "parked": engine.get("parked", 0),
            "in_place_bytes": doc["in_place_bytes"]}


def _spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: after[k] - before.get(k, 0) for k in after}


def mean_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's passes of one workload as one figure: the mean time (files/s and MB/s over it), the
    mean CPU and READs to Python; each pass under "rounds"."""
    first, n = passes[0], len(passes)
    seconds = sum(p["seconds"] for p in passes) / n
    cpus = [p["cpu_s"] for p in passes]
    cpu = None if None in cpus else sum(cpus) / n
    reader = sum(p["reader_cpu_s"] for p in passes) / n
    out = {**first, "seconds": seconds, "files_per_s": first["files"] / seconds, "mb_per_s": first["bytes"] / 1e6 / seconds,
           "cpu_s": cpu, **cpu_cost(cpu, first["files"], first["bytes"]), "reader_cpu_s": reader,
           "reader_cpu_s_per_gb": reader / (first["bytes"] / 1e9) if first["bytes"] else None, "rounds": passes}
    if "python" in first:
        out["python"] = {k: round(sum(p["python"][k] for p in passes) / n) for k in first["python"]}
    return out


def mean_epochs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """two_cold_epochs' results over the rounds as one (see mean_pass)."""
    out = {k: mean_pass([r[k] for r in runs]) for k in ("first", "second")}
    out["second_over_first"] = out["second"]["files_per_s"] / out["first"]["files_per_s"]
    return out


def in_round(systems: list[System], r: int) -> list[System]:
    """The systems in round `r`'s order: as given, reversed every other round."""
    return systems[::-1] if r % 2 else systems


def two_cold_epochs(s: System, relpaths: list[str], readers: int) -> dict[str, Any]:
    """Two cold epochs on one mount of `s`, the page cache dropped before each (a fresh mount first)."""
    fresh_start(s)
    out: dict[str, Any] = {}
    for k, seed in (("first", 1), ("second", 2)):
        if k == "second":
            drop_caches()
        before = mount_sample(s)
        out[k] = timed_epoch(s, relpaths, readers, seed=seed, read="open")
        out[k]["python"] = _spent(before, mount_sample(s))
    out["second_over_first"] = out["second"]["files_per_s"] / out["first"]["files_per_s"]
    return out


def run_cold(work: Path, say: Say, n_big: int, n_small: int, transport: str | None = None,
             io_uring: str | None = None, rounds: int = ROUNDS) -> dict[str, Any]:
    """The section's figures (see the module's docstring), each the mean of `rounds` passes; cleans up its
    node and mounts on any exit."""
    src, mnt = work / "cold-sample", work / "cold-mnt"
    node = DlfsNode(work / "cold-home", transport, io_uring)
    unmount_all_under(mnt)
    node.stop_leftover()
    node.check_unused()
    say("cold path: making the dataset (big files of 16 MiB and 40 MB, ~110 KB files)")
    bigs, smalls, total = make_dataset(src, n_big, n_small)
    image = work / "cold.img"
    out: dict[str, Any] = {"dataset": {"src": str(src), "big_files": len(bigs), "small_files": len(smalls),
                                       "bytes": total}, "rounds": rounds, "big": {}, "small": {}}
    node.start()
    try:
        say(f"cold path: dlfs ingest and mksquashfs of {len(bigs) + len(smalls)} files ({total / 1e9:.2f} GB), untimed")
        for folder, name in DATASETS.items():
            other = next(f for f in DATASETS if f != folder)
            node.cli("ingest", str(src), "--name", name, "--exclude", f"/{other}/")
        build_squashfs(src, image)
        base: list[System] = [LocalDisk(src), SquashfuseLL(image, mnt / "squashfuse_ll", work / "cold-squash.log")]
        dlfs = {folder: DlfsMount(node, name, mnt / f"dlfs-{folder}") for folder, name in DATASETS.items()}
        direct = DlfsMount(node, DATASETS["big"], mnt / "dlfs-big-direct-io", direct_io=True)
        remote = {folder: DlfsMount(node, name, mnt / f"dlfs-{folder}-via-daemon", short_circuit=False)
                  for folder, name in DATASETS.items()}
        small_bytes = sum((src / p).stat().st_size for p in smalls)
        quarter_size = max(MIN_CACHE, small_bytes // 4 >> 20 << 20)
        quarter = DlfsMount(node, DATASETS["small"], mnt / "dlfs-small-via-daemon-quarter-cache", short_circuit=False,
                            cache_size=quarter_size)
        disk_cache = work / "cold-disk-cache"
        shutil.rmtree(disk_cache, ignore_errors=True)
        on_disk = DlfsMount(node, DATASETS["small"], mnt / "dlfs-small-disk-cache", short_circuit=False,
                            cache_size=quarter_size, cache_dir=disk_cache)
        for s in [*base[1:], *dlfs.values(), direct, *remote.values(), quarter, on_disk]:
            s.root.mkdir(parents=True, exist_ok=True)
        try:

            def of(rnd: int) -> str:
                return f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""

            for readers in (1, 2):
                passes: dict[str, list[dict[str, Any]]] = {}
                for rnd in range(rounds):
                    for s in in_round([*base, dlfs["big"], direct, remote["big"]], rnd):
                        say(f"cold path: big files read whole, {readers} reader(s), cold: {s.label}{of(rnd)}")
                        fresh_start(s)
                        before = mount_sample(s)
                        r = timed_epoch(s, bigs, readers, seed=readers, read="open")
                        r["python"] = _spent(before, mount_sample(s))
                        passes.setdefault(s.name, []).append(r)
                out["big"][str(readers)] = {name: mean_pass(p) for name, p in passes.items()}
            runs: dict[str, list[dict[str, Any]]] = {}
            for rnd in range(rounds):
                for s in in_round([*base, dlfs["small"], remote["small"], quarter, on_disk], rnd):
                    if s is on_disk and rnd == 0:  # once, before its first pass
                        say(f"cold path: dlfs warmup of the small files into a disk cache ({disk_cache}), untimed")
                        # Bounded by size, not by the file system's free share: a shared machine's free space
                        # must not decide whether this row measures a disk cache at all.
                        node.cli("warmup", DATASETS["small"], "--cache-dir", str(disk_cache), "--no-short-circuit",
                                 "--cache-dir-size", f"{max(2 * small_bytes, MIN_CACHE) >> 20}M", timeout=600)
                    say(f"cold path: two cold epochs of the small files on one mount, 2 readers: {s.label}"
                        f"{of(rnd)}")
                    runs.setdefault(s.name, []).append(two_cold_epochs(s, smalls, 2))
            # In the order of the first round: the report's rows follow it.
            out["small"] = {name: mean_epochs(r) for name, r in runs.items()}
        finally:
            for s in [*base, *dlfs.values(), direct, *remote.values(), quarter, on_disk]:
                s.unmount()
            shutil.rmtree(disk_cache, ignore_errors=True)
    finally:
        node.stop()
        image.unlink(missing_ok=True)
    return out


def cold_targets(c: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 21's targets that this section measures."""
    from dlfs.bench.report import target

    rows = [target(f"big files (16 MiB, 40 MB) read whole, cold, {n} reader(s): {label} / local disk",
                   by[name]["mb_per_s"] / by["local"]["mb_per_s"], 1.0, "x")
            for n, by in c["big"].items() for name, label in DLFS_LABELS.items() if name in by]
    sm = c["small"]
    rows.append(target("second cold epoch on one mount (page cache dropped) / the first, dlfs",
                       sm["dlfs"]["second_over_first"], 0.95, "x"))
    for k in ("first", "second"):
        rows.append(target(f"cold epoch ({k} on its mount), ~110 KB files, 2 readers: dlfs / local disk",
                           sm["dlfs"][k]["files_per_s"] / sm["local"][k]["files_per_s"], 1.0, "x"))
    mine, theirs = sm["dlfs"]["first"]["cpu_us_per_file"], sm["squashfuse_ll"]["first"]["cpu_us_per_file"]
    rows.append(target("mount CPU per cold file, 2 readers (cold path section): dlfs / squashfuse_ll",
                       mine / theirs if mine is not None and theirs else None, 0.8, "x", op="<="))
    return rows


def format_cold(c: dict[str, Any]) -> list[str]:
    d = c["dataset"]
    rounds = c.get("rounds", 1)
    lines = ["", f"cold path ({d['big_files']} big files of 16 MiB and 40 MB, {d['small_files']} files of ~110 KB, "
                 f"{d['bytes'] / 1e9:.2f} GB; every pass cold: page cache dropped"
                 + (f"; each figure the mean of {rounds} passes, the order reversed every other round)" if rounds > 1
                    else ")"),
             f"  {'workload':<44}{'system':<29}{'MB/s':>9}{'files/s':>9}{'CPU us/file':>12}{'vs local':>10}"
             f"{'to Python':>10}{'reader s/GB':>12}" + ("  vs local, each round" if rounds > 1 else "")]

    def row(what: str, name: str, r: dict[str, Any], base: dict[str, Any], key: str) -> str:
        cpu = r.get("cpu_us_per_file")
        py = r.get("python", {}).get("python_reads")
        own = r.get("reader_cpu_s_per_gb")
        shown = SHOWN.get(name, name)
        each = ""  # each round's pass against local disk's in that round: how far one pass moves here
        if rounds > 1:  # (mean_pass keeps each row's passes under "rounds")
            each = "  " + ("-" if r is base else " ".join(f"{p[key] / b[key]:.2f}x"
                                                          for p, b in zip(r["rounds"], base["rounds"])))
        return (f"  {what:<44}{shown:<29}{r['mb_per_s']:>9.0f}{r['files_per_s']:>9.0f}"
                f"{'-' if cpu is None else f'{cpu:.0f}':>12}{r[key] / base[key]:>9.2f}x{'-' if py is None else py:>10}"
                f"{'-' if own is None else f'{own:.2f}':>12}{each}")

    for readers, by in c["big"].items():
        for name, r in by.items():
            lines.append(row(f"big files whole, {readers} reader(s)", name, r, by["local"], "mb_per_s"))
    for k in ("first", "second"):
        for name, by in c["small"].items():
            lines.append(row(f"small files, 2 readers, {k} cold epoch", name, by[k], c["small"]["local"][k],
                             "files_per_s"))
    lines.append("  second cold epoch / first on one mount: " + ", ".join(
        f"{SHOWN.get(name, 'local disk')} {by['second_over_first']:.2f}x"
        for name, by in c["small"].items() if name != "squashfuse_ll"))
    own = reader_cpu_ratios(c)
    if own:
        lines.append("  the readers' own CPU per GB (the kernel's page cache work and copies), dlfs / local disk: "
                     + ", ".join(f"{what} {x:.2f}x" for what, x in own.items()))
    return lines


def reader_cpu_ratios(c: dict[str, Any]) -> dict[str, float]:
    """The readers' own CPU per GB through dlfs over theirs on local disk, per workload: what a FUSE file
    costs the process reading it, which no server can change (measured on Linux 6.18: the page cache of a
    FUSE file is all 4 KiB pages, a local ext4 file's mostly large folios)."""
    out: dict[str, float] = {}
    pairs = [(f"big files, {n} reader(s){label.removeprefix('dlfs')}", by[name], by["local"])
             for n, by in c["big"].items() for name, label in DLFS_LABELS.items() if name in by]
    pairs.append(("small files, first epoch", c["small"]["dlfs"]["first"], c["small"]["local"]["first"]))
    for what, mine, theirs in pairs:
        if mine.get("reader_cpu_s_per_gb") and theirs.get("reader_cpu_s_per_gb"):
            out[what] = mine["reader_cpu_s_per_gb"] / theirs["reader_cpu_s_per_gb"]
    return out
