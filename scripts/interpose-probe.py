#!/usr/bin/env python3
"""Would a library that serves read() of mount files from the mount's shared cache (as DAOS's libioil does
for dfuse) beat the kernel's page cache? Issue 21, item 6: this measures its best case.

Such a library leaves open(), fstat() and close() to the kernel and answers read() by copying the
file's bytes out of the shared cache (a miss asks the mount for them): those calls, with `dlfs.direct`'s
read() of one file and a copy of its view, are what runs here, against `open(p, "rb").read()` through the mount
(warm: under `dlfs run`, whose preload library answers isatty() in the process: the kernel's best), and
local disk in the same state. Cold: page cache dropped and a fresh mount before each pass; warm: the
same reads again at once. Two reader processes, every file once in a random order, rounds rotated.

    scripts/interpose-probe.py [--files N] [--rounds R] [--cache-size SIZE] [--work DIR]   (root: drops the page cache)

--cache-size is the mount's (default: its own, a quarter of memory); one well below the dataset is the
bigger-than-memory case, where misses are most of the reads.

The files are the bench's ~110 KB ones (made once under --work, default .bench). Prints files/s, the
ratio to local disk and the mount's CPU per file for each pass, and the medians.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dlfs.bench.baselines import (
    DlfsMount,
    DlfsNode,
    LocalDisk,
    cpu_seconds,
    drop_caches,
    fresh_start,
    unmount_all_under,
)
from dlfs.bench.cold import make_dataset
from dlfs.bench.epoch import read_epoch, read_epoch_preloaded

READERS = 2
_MP = mp.get_context("fork")


def _shared_worker(root: str, share: list[str], barrier: Any, out: Any) -> None:
    """One reader of the shared cache: per file, its bytes copied out of the cache (read()'s copy)."""
    from dlfs import direct

    reader = direct.connect(Path(root))
    if not isinstance(reader, direct.DirectReader):
        out.put(("error", f"dlfs.direct cannot attach: {reader.reason}"))
        return
    barrier.wait(60)
    n = nbytes = 0
    for rel in share:
        path = Path(root) / rel
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # the library leaves open() to the kernel
        try:
            os.fstat(fd)  # as open(p, "rb") does; isatty() the library answers itself, as dlfs run's
            view = reader.read(path)
            nbytes += len(bytes(view))  # read()'s copy into the caller's buffer
            view.release()
        finally:
            os.close(fd)
        n += 1
    out.put(("done", n, nbytes))
    reader.close()


def shared_epoch(root: str, relpaths: list[str], seed: int) -> float:
    """Files/s of one epoch through the shared cache, READERS processes."""
    order = list(relpaths)
    random.Random(seed).shuffle(order)
    barrier, out = _MP.Barrier(READERS + 1), _MP.Queue()
    procs = [_MP.Process(target=_shared_worker, args=(root, order[w::READERS], barrier, out)) for w in range(READERS)]
    for p in procs:
        p.start()
    barrier.wait(60)
    t0 = time.perf_counter()
    got = [out.get(timeout=600) for _ in procs]
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    bad = [g for g in got if g[0] != "done"]
    if bad:
        raise SystemExit(f"interpose-probe: {bad[0][1]}")
    return sum(g[1] for g in got) / seconds


def fuse_epoch(root: str, relpaths: list[str], seed: int, preload: bool) -> float:
    run = read_epoch_preloaded if preload else read_epoch
    r = run(root, relpaths, readers=READERS, seed=seed)
    if r.n_errors or r.files != len(relpaths):
        raise SystemExit(f"interpose-probe: an epoch read {r.files} of {len(relpaths)} files: {r.errors[:2]}")
    return r.files_per_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-size", default=None, help="the mount's --cache-size (default: its own)")
    ap.add_argument("--work", type=Path, default=Path(".bench"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("interpose-probe: run as root (it drops the page cache)", file=sys.stderr)
        return 2
    work = args.work.absolute()
    src, mnt = work / "cold-sample", work / "probe-mnt"
    node = DlfsNode(work / "cold-home")
    if args.cache_size:
        base_args = node.mount_args
        node.mount_args = lambda: [*base_args(), "--cache-size", args.cache_size]  # type: ignore[method-assign]
    unmount_all_under(mnt)
    node.stop_leftover()
    _, smalls, _ = make_dataset(src, 16, args.files)
    node.start()
    res: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        node.cli("ingest", str(src), "--name", "bench-cold-small", "--exclude", "/big/")
        d = DlfsMount(node, "bench-cold-small", mnt / "dlfs")
        d.root.mkdir(parents=True, exist_ok=True)
        loc = LocalDisk(src)
        for r in range(args.rounds):
            kinds = ["local", "kernel", "shared"]
            kinds = kinds[r % 3:] + kinds[:r % 3]
            for kind in kinds:
                s = loc if kind == "local" else d
                fresh_start(s)  # a fresh mount, page cache dropped
                pid = s.pid
                c0 = cpu_seconds(pid) if pid else 0.0
                if kind == "shared":
                    cold = shared_epoch(str(s.root), smalls, seed=r)
                    c1 = cpu_seconds(pid) if pid else 0.0
                    warm = shared_epoch(str(s.root), smalls, seed=r + 100)
                else:
                    cold = fuse_epoch(str(s.root), smalls, seed=r, preload=False)
                    c1 = cpu_seconds(pid) if pid else 0.0
                    warm = fuse_epoch(str(s.root), smalls, seed=r + 100, preload=kind == "kernel")
                res.setdefault(f"cold {kind}", []).append(cold)
                res.setdefault(f"warm {kind}", []).append(warm)
                if pid:
                    cpu.setdefault(kind, []).append((c1 - c0) * 1e6 / len(smalls))
                print(f"round {r} {kind:6s}: cold {cold:8,.0f} files/s, warm {warm:8,.0f} files/s"
                      + (f", mount CPU {cpu[kind][-1]:.0f} us per cold file" if pid else ""), flush=True)
        d.unmount()
    finally:
        node.stop()
        drop_caches()
    print(f"\n{len(smalls):,} files of ~110 KB, {READERS} readers, medians of {args.rounds} rounds "
          "(each pass's ratio to local disk in the same round):")
    for state in ("cold", "warm"):
        base = res[f"{state} local"]
        for kind, what in (("kernel", 'open(p, "rb").read() through the mount' + (" under dlfs run" if state == "warm" else "")),
                           ("shared", "read() served from the shared cache (dlfs.direct, one file a call, copied)")):
            ratios = [a / b for a, b in zip(res[f"{state} {kind}"], base)]
            print(f"  {state}: {what:<76} {statistics.median(res[f'{state} {kind}']):>8,.0f} files/s "
                  f"{statistics.median(ratios):.2f}x local disk ({min(ratios):.2f}-{max(ratios):.2f})")
    for kind in ("kernel", "shared"):
        print(f"  mount CPU per cold file, {kind}: {statistics.median(cpu[kind]):.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
