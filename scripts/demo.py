#!/usr/bin/env python3
"""`make demo`: the main job end to end on the embedded one-node cluster.

Generates an ImageNet-like sample, starts a local node, ingests the sample, mounts it, reads every
file in random order from 2 reader processes twice, then twice through dlfs.direct, checking every
byte against the source, prints files/s and MB/s beside the same read of the source directory in the
same state (cold with cold: the page cache dropped, as root; warm with warm), then unmounts and stops.
Everything lives under .demo/ in the repository (DEMO_DIR overrides it); the sample is kept between
runs, the node's state is not.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import xxhash
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dlfs.bench.baselines import drop_caches
from dlfs.bench.epoch import EpochResult, format_row, list_files, read_epoch
from dlfs.bench.sample import make_sample
from dlfs.direct import connect

console = Console(stderr=True)
DATASET = "imagenet-sample"


def dlfs(env: dict[str, str], *args: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "dlfs", *args], env=env, text=True,
                          capture_output=capture, timeout=1800)
    if proc.returncode != 0:
        if capture:
            sys.stderr.write(proc.stderr)
        raise SystemExit(f"demo: `dlfs {' '.join(args)}` failed with exit code {proc.returncode}")
    return proc


def direct_epoch(mnt: Path, sample: Path, relpaths: list[str], seed: int) -> EpochResult:
    """Every file once in random order through dlfs.direct (one process, batches of 256), each hashed
    as it is read; the hashes are checked against the source's afterwards (untimed)."""
    order = list(relpaths)
    random.Random(seed).shuffle(order)
    reader = connect(mnt)
    if not reader.direct:
        raise SystemExit(f"demo: dlfs.direct did not attach to {mnt}: {getattr(reader, 'reason', '')}")
    digests, nbytes = [], 0
    t0 = time.perf_counter()
    for i in range(0, len(order), 256):
        for view in reader.read_many([str(mnt / r) for r in order[i : i + 256]]):
            digests.append(xxhash.xxh3_128_digest(view))
            nbytes += len(view)
    seconds = time.perf_counter() - t0
    reader.close()
    errors = [f"{r}: content differs from source" for r, d in zip(order, digests)
              if xxhash.xxh3_128_digest((sample / r).read_bytes()) != d]
    return EpochResult(len(order), nbytes, seconds, errors[:20], len(errors))


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache (root, with /proc/sys/vm writable)."""
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def _cold(cold: bool) -> None:
    """Drop the page cache where `cold` (can_drop_caches)."""
    if cold:
        drop_caches()


def step(text: str) -> None:
    console.print(f"[bold]==>[/bold] {text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20000, help="files in the sample (default 20000)")
    ap.add_argument("--readers", type=int, default=2, help="reader processes (default 2)")
    ap.add_argument("--dir", default=os.environ.get("DEMO_DIR", str(Path(__file__).resolve().parent.parent / ".demo")))
    args = ap.parse_args()

    base = Path(args.dir).absolute()
    sample, home, mnt = base / "sample", base / "home", base / "mnt"
    env = dict(os.environ, DLFS_HOME=str(home))
    env.pop("DLFS_CLUSTER", None)

    step(f"sample: {args.files} ImageNet-like files in {sample}")
    with Progress(TextColumn("generate"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("gen", total=args.files * 110_000)
        info = make_sample(sample, n_files=args.files, progress=lambda n: bar.update(task, advance=n))
    console.print(f"    {info.n_files} files in {info.n_classes} classes, {info.total_bytes / 1e9:.2f} GB")

    if mnt.exists() and os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    shutil.rmtree(home, ignore_errors=True)
    mnt.mkdir(parents=True, exist_ok=True)

    step(f"starting a local node (state in {home})")
    home.mkdir(parents=True)
    node_log = open(home / "node.log", "w")
    node = subprocess.Popen([sys.executable, "-m", "dlfs", "node"], env=env, stdout=node_log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([sys.executable, "-m", "dlfs", "status"], env=env,
                             capture_output=True).returncode != 0:
            if node.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"demo: the node did not start; see {home / 'node.log'}")
            time.sleep(0.2)

        step(f"ingest {sample} as {DATASET}")
        dlfs(env, "ingest", str(sample), "--name", DATASET)
        dlfs(env, "datasets")

        step(f"mount {DATASET} at {mnt}")
        dlfs(env, "mount", DATASET, str(mnt))
        try:
            relpaths = list_files(str(sample))
            # Each dlfs read beside the source read in the same state: cold with cold (the page cache dropped,
            # where this user may drop it), warm with warm.
            cold = can_drop_caches()
            step(f"reading all {len(relpaths)} files in random order with {args.readers} readers, checking every byte"
                 + ("" if cold else " (not root: the page cache cannot be dropped, so first reads are not compared)"))
            source_cold: EpochResult | None = None
            if cold:
                drop_caches()
                source_cold = read_epoch(str(sample), relpaths, readers=args.readers, seed=1, verify_root=str(sample))
            _cold(cold)
            first = read_epoch(str(mnt), relpaths, readers=args.readers, seed=1, verify_root=str(sample))
            source_warm = read_epoch(str(sample), relpaths, readers=args.readers, seed=2, verify_root=str(sample))
            second = read_epoch(str(mnt), relpaths, readers=args.readers, seed=2, verify_root=str(sample))
            step("and twice through dlfs.direct (one process, zero-copy views of the mount's shared cache)")
            _cold(cold)
            direct = [direct_epoch(mnt, sample, relpaths, seed) for seed in (3, 4)]
            print()
            if source_cold:
                print(format_row("source, cold", source_cold))
            print(format_row("dlfs 1st read", first, source_cold))
            print(format_row("direct 1st", direct[0], source_cold))
            print(format_row("source, warm", source_warm))
            print(format_row("dlfs 2nd read", second, source_warm))
            print(format_row("direct 2nd", direct[1], source_warm))
            print()
            if source_cold:
                print(f"source, cold: local disk, the page cache dropped first ({args.readers} readers)")
            print("dlfs 1st read: the page cache dropped, nothing in the mount's cache (chunks read from the node's "
                  "chunk files, short-circuit)" + (": against the source, cold" if source_cold else ""))
            print("direct 1st: dlfs.direct read_many (one process), the page cache dropped, the mount's shared cache "
                  "cold" + (": against the source, cold" if source_cold else ""))
            print(f"source, warm: the source again, from the page cache ({args.readers} readers)")
            print("dlfs 2nd read: the same files again, the kernel's page cache of the mount warm: against the source, warm")
            print("direct 2nd: the same files again through dlfs.direct, from the mount's shared cache: against the "
                  "source, warm")
            runs = [first, second, *direct]
            bad = sum(r.n_errors for r in runs)
            for err in [e for r in runs for e in r.errors][:10]:
                print(f"ERROR {err}", file=sys.stderr)
            if bad or any(r.files != len(relpaths) for r in runs):
                raise SystemExit(f"demo: {bad} files read wrong through the mount")
            print(f"all {len(relpaths)} files matched the source byte for byte, through FUSE twice and dlfs.direct twice")
        finally:
            step("unmount")
            dlfs(env, "umount", str(mnt))
    finally:
        step("stop the node")
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
        node_log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
