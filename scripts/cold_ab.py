#!/usr/bin/env python3
"""Two builds of dlfs (or one build with two sets of mount options) on the cold path, in alternated rounds.

On a shared, noisy machine one bench run against another compares the machine's moods, not the code.
This runs the cold bench's own files (`dlfs bench`'s cold section: 16 MiB and 40 MB files, or ~110 KB
ones) through local disk and each variant in turn, a fresh mount and the page cache dropped before each
pass, and changes the order every round (rotated, and reversed every other round): on a VM the pass right
after another process freed its memory faults that memory in again from the host, and whichever variant
always came second would win. Each variant's figure is the median over rounds of its ratio to local disk
in the same round.

A variant is NAME=CHECKOUT[:OPTIONS]: the mount runs the dlfs of CHECKOUT (a git worktree of another
commit, its native module built there: `python setup.py build_ext --inplace`), with OPTIONS (space
separated) added to `dlfs mount`; the node and the ingest are this checkout's, so both must read the same
chunk format. For example, the head against the commit before it, and --direct-io against the default:

    git worktree add /tmp/base HEAD~1 && (cd /tmp/base && ../path/to/.venv/bin/python setup.py build_ext --inplace)
    sudo .venv/bin/python scripts/cold_ab.py --variant head=. --variant base=/tmp/base [--files small] [--readers 2]
    sudo .venv/bin/python scripts/cold_ab.py --variant page=. --variant dio=.:"--direct-io on"

Each pass reads every file once, shuffled, with `open(path, "rb").read()` in --readers processes. Printed
per pass: MB/s, files/s, the mount's CPU per file, the readers' CPU per GB, READs that reached the mount's
Python, MB read from the block device that holds --dir, and the cache memory the mount touched (fresh
memory, which a VM that hands freed memory back to its host makes costly to fault in). Needs root and /dev/fuse.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlfs.bench.baselines import DlfsMount, DlfsNode, LocalDisk, System, fresh_start, unmount_all_under  # noqa: E402
from dlfs.bench.bigfiles import block_device  # noqa: E402
from dlfs.bench.cold import DATASETS, make_dataset  # noqa: E402
from dlfs.bench.epoch import timed_epoch  # noqa: E402
from dlfs.errors import DlfsError  # noqa: E402


@dataclass
class Variant:
    name: str
    code: Path
    options: list[str]
    passes: list[dict[str, Any]] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """NAME=CHECKOUT[:OPTIONS] -> a Variant; SystemExit with one line if it names no built checkout."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        raise SystemExit(f"cold_ab.py: --variant {text!r}: expected NAME=CHECKOUT[:OPTIONS]")
    where, _, options = rest.partition(":")
    code = Path(where).resolve()
    if not (code / "dlfs" / "__init__.py").is_file():
        raise SystemExit(f"cold_ab.py: --variant {name}: {code} is not a dlfs checkout (no dlfs/__init__.py)")
    if not any((code / "dlfs").glob("_native*.so")):
        raise SystemExit(f"cold_ab.py: --variant {name}: {code} has no built native module: run "
                         "`python setup.py build_ext --inplace` there")
    if name == "local":
        raise SystemExit("cold_ab.py: --variant local: that name is the baseline's")
    return Variant(name, code, options.split())


def mount_figures(s: System) -> dict[str, int] | None:
    """The mount's READs answered by its Python handlers and the cache memory it has touched, once it
    fetches nothing more (None: not a mount)."""
    if not isinstance(s, DlfsMount):
        return None
    from dlfs.stats import read_sample

    s.mount_counters(time.time())
    doc = read_sample(s.node.home, s.root.absolute())
    return {"python_reads": int(doc["python_reads"]), "touched": int(doc["cache_touched"])}


def one_pass(s: System, files: Sequence[str], readers: int, seed: int, disk: Any) -> dict[str, Any]:
    fresh_start(s)
    before, read0 = mount_figures(s), disk.read_bytes() if disk else 0
    e = timed_epoch(s, files, readers, seed=seed, read="open")
    e["device_mb"] = (disk.read_bytes() - read0) / 1e6 if disk else None
    after = mount_figures(s)
    e["python_reads"] = after["python_reads"] - before["python_reads"] if after and before else None
    # fresh memory the pass faulted in (a fresh mount: all of what its cache touched)
    e["touched_mb"] = after["touched"] / 1e6 if after else None
    s.unmount()
    return e


def show(name: str, e: dict[str, Any], local: dict[str, Any] | None) -> str:
    ratio = f"{e['mb_per_s'] / local['mb_per_s']:5.2f}x" if local else "     -"
    cpu = f"{e['cpu_us_per_file']:8.0f}" if e.get("cpu_us_per_file") is not None else "       -"
    py = f"{e['python_reads']:6d}" if e.get("python_reads") is not None else "     -"
    dev = f"{e['device_mb']:7.0f}" if e.get("device_mb") is not None else "      -"
    touched = f"{e['touched_mb']:7.0f}" if e.get("touched_mb") is not None else "      -"
    return (f"  {name:<12} {e['mb_per_s']:8.0f} {e['files_per_s']:8.0f} {ratio} {cpu} "
            f"{e['reader_cpu_s_per_gb'] or 0:9.2f} {py} {dev} {touched}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=CHECKOUT[:OPTIONS]",
                    help="a dlfs to compare (repeat: two or more, or one against local disk alone)")
    ap.add_argument("--files", choices=("big", "small"), default="big",
                    help="the cold bench's big files (16 MiB, 40 MB) or its ~110 KB ones (default big)")
    ap.add_argument("--readers", type=int, default=1, help="reader processes (default 1)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds; each runs every variant and local disk once (default: twice the systems)")
    ap.add_argument("--big", type=int, default=16, help="big files of each size (default 16, as the bench)")
    ap.add_argument("--small", type=int, default=8000, help="small files (default 8000, as the bench)")
    ap.add_argument("--dir", type=Path, default=Path(".bench"),
                    help="work directory; its cold-sample/ is `dlfs bench --dir`'s, reused (default .bench)")
    opts = ap.parse_args(argv)
    variants = [parse_variant(v) for v in opts.variant]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("cold_ab.py: two variants have the same name")
    if opts.readers < 1 or opts.big < 1 or opts.small < 1 or opts.rounds < 0:
        raise SystemExit("cold_ab.py: --readers, --big and --small must be at least 1, --rounds at least 0")

    work = opts.dir.resolve()
    src, mnt = work / "cold-sample", work / "ab-mnt"
    print(f"making (or reusing) the dataset under {src}", flush=True)
    bigs, smalls, _ = make_dataset(src, opts.big, opts.small)
    files = bigs if opts.files == "big" else smalls
    disk, where = block_device(src)
    print(f"bytes read from the disk: {where}", flush=True)
    node = DlfsNode(work / "ab-home")
    unmount_all_under(mnt)
    node.stop_leftover()
    systems: dict[str, System] = {}
    node.start()
    try:
        dataset = DATASETS[opts.files]
        # Every run: a sample made again with other counts is a new version, an unchanged one none.
        print(f"ingesting {len(files)} files as {dataset} (a new version only if they changed), untimed", flush=True)
        other = next(f for f in DATASETS if f != opts.files)
        node.cli("ingest", str(src), "--name", dataset, "--exclude", f"/{other}/", timeout=1800)
        systems["local"] = LocalDisk(src)
        for v in variants:
            m = DlfsMount(node, dataset, mnt / v.name, options=v.options, code=v.code)
            m.root.mkdir(parents=True, exist_ok=True)
            systems[v.name] = m
        names = list(systems)
        rounds = opts.rounds or 2 * len(names)
        results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        head = f"  {'':<12} {'MB/s':>8} {'files/s':>8} {'/local':>6} {'us/file':>8} {'reader s/GB':>9} {'to Py':>6} {'disk MB':>7} {'cache MB':>7}"
        for r in range(rounds):
            # Each system in each place, and after each other one, in turn: rotated, and reversed every other round.
            k = r // 2 % len(names)
            order = names[k:] + names[:k]
            order = order[::-1] if r % 2 else order
            print(f"round {r + 1} of {rounds}: {', '.join(order)}\n{head}", flush=True)
            done: dict[str, dict[str, Any]] = {}
            for n in order:
                done[n] = one_pass(systems[n], files, opts.readers, r, disk)
            for n in names:
                results[n].append(done[n])
                print(show(n, done[n], None if n == "local" else done["local"]), flush=True)
    except DlfsError as exc:
        print(f"cold_ab.py: {exc}", file=sys.stderr)
        return 1
    finally:
        for s in systems.values():
            if s.mounted:
                s.unmount()
        node.stop()
    print(f"\nmedians over {rounds} rounds, {opts.readers} reader(s), {len(files)} {opts.files} files "
          "(the ratio: of each round's pass to local disk's in that round)")
    print(f"  {'':<12} {'MB/s':>8} {'/local':>6} {'us/file':>8} {'to Py':>6}   all MB/s")
    for n in names:
        es = results[n]
        mb = statistics.median(e["mb_per_s"] for e in es)
        ratio = "     -" if n == "local" else \
            f"{statistics.median(e['mb_per_s'] / lo['mb_per_s'] for e, lo in zip(es, results['local'])):5.2f}x"
        cpus = [e["cpu_us_per_file"] for e in es if e.get("cpu_us_per_file") is not None]
        pys = [e["python_reads"] for e in es if e.get("python_reads") is not None]
        cpu = f"{statistics.median(cpus):8.0f}" if cpus else "       -"
        py = f"{statistics.median(pys):6.0f}" if pys else "     -"
        print(f"  {n:<12} {mb:8.0f} {ratio} {cpu} {py}   {[round(e['mb_per_s']) for e in es]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
