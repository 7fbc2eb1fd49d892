#!/usr/bin/env python3
"""`make demo`: the main job end to end on the embedded one-node cluster.

Generates an ImageNet-like sample, starts a local node, ingests the sample, mounts it, reads every
file once in random order from 2 reader processes while checking every byte against the source,
prints files/s and MB/s beside the same read of the source directory, then unmounts and stops.
Everything lives under .demo/ in the repository (DEMO_DIR overrides it); the sample is kept between
runs, the node's state is not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dlfs.bench.epoch import format_row, list_files, read_epoch
from dlfs.bench.sample import make_sample

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
            step(f"reading all {len(relpaths)} files in random order with {args.readers} readers, checking every byte")
            source = read_epoch(str(sample), relpaths, readers=args.readers, seed=1, verify_root=str(sample))
            first = read_epoch(str(mnt), relpaths, readers=args.readers, seed=1, verify_root=str(sample))
            second = read_epoch(str(mnt), relpaths, readers=args.readers, seed=2, verify_root=str(sample))
            print()
            print(format_row("source dir", source))
            print(format_row("dlfs 1st read", first, source))
            print(format_row("dlfs 2nd read", second, source))
            print()
            print("source dir: local disk, page cache warm from generation and ingest")
            print("dlfs 1st read: nothing cached in the mount (chunks read from the node's chunk files, short-circuit)")
            print("dlfs 2nd read: the same files again (kernel page cache of the mount warm)")
            bad = first.n_errors + second.n_errors
            for err in (first.errors + second.errors)[:10]:
                print(f"ERROR {err}", file=sys.stderr)
            if bad or first.files != len(relpaths) or second.files != len(relpaths):
                raise SystemExit(f"demo: {bad} files read wrong through the mount")
            print(f"all {len(relpaths)} files matched the source byte for byte, twice")
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
