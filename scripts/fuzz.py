#!/usr/bin/env python3
"""A long fuzzing round against a real node and a real mount (the suite's tests/test_fuzz.py is the short one).

Starts a node under a temporary DLFS_HOME, ingests a check dataset and mounts it (where FUSE is
available), then sends fuzzed frames (tests/fuzzlab.py) to the metadata daemon, the data daemon and the
mount's control socket at once, and checks afterwards that every process lives, the dataset reads byte
for byte (over the protocol, through the mount and through dlfs.direct), no exchange hung and no log
holds a traceback. Prints what was sent and how the daemons answered; exits 1 on any finding, keeping
the directory (logs included) for a look.

    .venv/bin/python scripts/fuzz.py                      # 10,000 frames, a random seed
    .venv/bin/python scripts/fuzz.py --seed 42 --frames 50000 --seconds 600
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import HAVE_FUSE, Node, force_unmount, mount_pids, pid_alive, running_node  # noqa: E402
from fuzzlab import (  # noqa: E402
    CHECK_NAME,
    EXCHANGE_TIMEOUT,
    INGEST_ARGS,
    TARGETS,
    Target,
    daemon_targets,
    fuzz_round,
    hostile_datasets,
    log_marks,
    log_problems,
    make_source,
    problems_after,
)

from dlfs.direct import CONTROL_XATTR  # noqa: E402

SHARE = {"meta": 0.4, "data": 0.4, "control": 0.2}  # of the frames, by target
READ_ALL = """
import os, sys
for d, _, names in os.walk(sys.argv[1]):
    for name in names:
        try:
            with open(os.path.join(d, name), "rb") as f:
                while f.read(1 << 20):
                    pass
        except OSError:
            pass  # EIO is what a file of a lying index should give
"""
READ_TIMEOUT = 120.0


def peak_rss(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def hostile_mounts(node: Node, base: Path, meta: Target, limit: int) -> tuple[int, int, list[str]]:
    """Mount up to `limit` of the datasets the round committed with hostile indexes and read every file
    through each: a mount may refuse, or answer EIO, but must not hang, die or log a traceback.
    Returns (mounted, refused, problems)."""
    mounted = refused = 0
    problems: list[str] = []
    for name in trio.run(hostile_datasets, meta)[:limit]:
        mnt = base / f"mnt-{name}"
        mnt.mkdir()
        if node.run("mount", name, mnt, check=False).returncode != 0:
            refused += 1
            continue
        mounted += 1
        try:
            subprocess.run([sys.executable, "-c", READ_ALL, str(mnt)], capture_output=True, timeout=READ_TIMEOUT)
        except subprocess.TimeoutExpired:
            problems.append(f"{name}: reading every file through its mount took over {READ_TIMEOUT:g} s")
        try:
            gone = not os.path.ismount(mnt)  # a dead mount's process is unmounted by fusermount3
            os.listdir(mnt)
        except OSError as exc:  # EIO is a lying root directory's answer; ENOTCONN, a dead mount's
            gone = exc.errno == errno.ENOTCONN
        if gone:
            problems.append(f"{name}: its mount died while read")
        problems += [f"{name}: {line}" for line in log_problems({node.mount_log(name, mnt): 0})[:3]]
        if node.run("umount", mnt, check=False).returncode != 0:
            force_unmount(mnt)
    return mounted, refused, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=10_000, help="frames in all (default 10000)")
    ap.add_argument("--seed", type=int, default=None, help="replays a round (default: random)")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="stop fuzzing after this long")
    ap.add_argument("--workers", type=int, default=2, help="concurrent connections per target (default 2)")
    ap.add_argument("--timeout", type=float, default=EXCHANGE_TIMEOUT,
                    help=f"seconds an exchange may take before it counts as a hang (default {EXCHANGE_TIMEOUT:g})")
    ap.add_argument("--targets", default=",".join(TARGETS), help="of meta,data,control (default all)")
    ap.add_argument("--by-message", action="store_true", help="also print the replies by message and status")
    ap.add_argument("--hostile-mounts", type=int, default=0, metavar="N",
                    help="then mount N of the datasets committed with hostile indexes and read them (default 0)")
    ap.add_argument("--dir", type=Path, default=None, help="work here (kept) instead of a temporary directory")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    wanted = [t for t in args.targets.split(",") if t]
    if unknown := set(wanted) - set(TARGETS):
        ap.error(f"unknown targets {sorted(unknown)}")
    if "control" in wanted and not HAVE_FUSE:
        print("fuzz: no /dev/fuse or fusermount3: the control socket is left out", file=sys.stderr)
        wanted.remove("control")
    share = sum(SHARE[t] for t in wanted)
    frames = {t: round(args.frames * SHARE[t] / share) for t in wanted}

    base = args.dir or Path(tempfile.mkdtemp(prefix="dlfs-fuzz-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"fuzz: seed {seed}, {sum(frames.values())} frames ({frames}), in {base}", flush=True)
    problems: list[str] = []
    files = make_source(base / "src", seed)
    try:
        with running_node(base / "home", base) as node:
            node.ingest(base / "src", CHECK_NAME, *INGEST_ARGS)
            meta, data, pools = daemon_targets(node.home, base / "index")
            targets = [t for t in (meta, data) if t.name in wanted]
            mnt = None
            if "control" in wanted:
                mnt = node.mount(CHECK_NAME, base / "mnt")
                targets.append(Target("control", os.fsdecode(os.getxattr(mnt, CONTROL_XATTR))))
            pids = {"node": node.proc.pid} | {f"mount #{i}": p for i, p in enumerate(mount_pids(node.home), 1)}
            marks = log_marks([node.log, node.mount_log(CHECK_NAME)])

            tally = fuzz_round(targets, frames, seed, pools, workers=args.workers, timeout=args.timeout,
                               seconds=args.seconds)
            print("\n".join(tally.lines()), flush=True)
            if args.by_message:
                for (target, msg, status), n in sorted(tally.by_message.items()):
                    print(f"    {target:8} {msg:16} status {status:2}: {n}")

            problems += problems_after(tally, pids, pid_alive, marks, meta, data, files, mnt)
            print(f"  node peak RSS {peak_rss(node.proc.pid)}"
                  + "".join(f", mount peak RSS {peak_rss(p)}" for p in mount_pids(node.home)))
            if mnt is not None:
                node.umount(mnt)
            if args.hostile_mounts and HAVE_FUSE:
                mounted, refused, bad = hostile_mounts(node, base, meta, args.hostile_mounts)
                print(f"  hostile indexes: {mounted} mounted and read, {refused} refused, {len(bad)} problems")
                problems += bad
    except AssertionError as exc:  # the node did not start, or did not stop cleanly
        problems.append(str(exc))
    checked = "processes alive, dataset byte-exact over the protocol" + (
        ", the mount and dlfs.direct" if "control" in wanted else "") + ", no hang, no traceback in the logs"
    if problems:
        print(f"final check FAILED (seed {seed}; replay with --seed {seed}); logs kept in {base}:")
        for p in problems[:50]:
            print(f"  {p}")
        return 1
    print(f"final check passed: {checked}")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
