#!/usr/bin/env python3
"""The disk cache of a compute-only node against its targets (issue 23), measured on two hosts.

Two network namespaces on one machine (tests/netlab.py): n1 runs `dlfs node` (the data node), c1 is
a compute-only machine (in no cluster file) whose link from n1 is shaped to --link (tc tbf, default
1 Gbit/s). A generated ImageNet-like dataset (--mb, default 300 MB) is ingested on n1, then:

  data node     mount on n1 (its chunk files are local): epoch 1, then --repeat cold epochs
  compute node  mount on c1 with --cache-dir: epoch 1 (over the link: fills the cache), then
                --repeat cold epochs (from the disk cache)           target >= 0.9x the data node's
                (the later epochs of the two mounts are taken in turn)
  warmup        `dlfs warmup` on c1 into an empty cache dir          target >= 0.8x the link

Epochs read every file once, shuffled, `open(path, "rb").read()` in --readers processes, after
`echo 3 > /proc/sys/vm/drop_caches`; a figure is the median of the --repeat epochs. With --cache-size
both mounts get that cache (e.g. a quarter of the dataset: a dataset bigger than the memory a job may
use, whose every miss is one file read alone: in place on the data node, from the disk cache on the
compute node, by the mounts' native threads). Needs root, ip, nsenter, tc and /dev/fuse.

    sudo .venv/bin/python scripts/bench_diskcache.py [--mb 300] [--readers 2] [--link 1gbit] [--cache-size 75M]
                                                     [--dir .bench-diskcache]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from netlab import NetLab, netns_available  # noqa: E402

from dlfs.bench.epoch import list_files, read_epoch  # noqa: E402
from dlfs.bench.sample import make_sample  # noqa: E402

DLFS = [sys.executable, "-m", "dlfs"]
UP_TIMEOUT = 30.0


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def link_bytes_per_s(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", text.lower())
    if not m:
        raise SystemExit(f"--link {text!r}: use e.g. 1gbit, 500mbit")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


class Bench:
    def __init__(self, lab: NetLab, work: Path) -> None:
        self.lab, self.work = lab, work
        self.cluster = work / "cluster.toml"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mounts: list[Path] = []

    def env(self, host: str) -> dict[str, str]:
        env = dict(os.environ, DLFS_HOME=str(self.work / f"home-{host}"), DLFS_PROGRESS_EVERY="86400")
        env["PYTHONPATH"] = str(REPO)
        return env

    def dlfs(self, host: str, *args: str | os.PathLike[str], timeout: float = 600) -> str:
        cmd = self.lab.hosts[host].cmd(*DLFS, "--cluster", str(self.cluster), *map(str, args))
        proc = subprocess.run(cmd, env=self.env(host), capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"on {host}: dlfs {' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def start_node(self) -> None:
        (self.work / "cluster.key").unlink(missing_ok=True)
        subprocess.run([*DLFS, "keygen", str(self.work / "cluster.key")], check=True, env=self.env("n1"), cwd=REPO,
                       capture_output=True)
        n1 = self.lab.hosts["n1"]
        self.cluster.write_text(f'key_file = "cluster.key"\n[[node]]\nname = "n1"\naddress = "{n1.address}"\n')
        log = open(self.work / "n1-node.log", "ab")  # noqa: SIM115 (the node's for its life)
        self.procs.append(subprocess.Popen(n1.cmd(*DLFS, "--cluster", str(self.cluster), "node", "--name", "n1"),
                                           env=self.env("n1"), stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        deadline = time.monotonic() + UP_TIMEOUT
        while time.monotonic() < deadline:
            cmd = n1.cmd(*DLFS, "--cluster", str(self.cluster), "status")
            if subprocess.run(cmd, env=self.env("n1"), capture_output=True, cwd=REPO).returncode == 0:
                return
            time.sleep(0.2)
        raise SystemExit(f"the data node did not come up: see {self.work / 'n1-node.log'}")

    def shape(self, rate: str) -> None:
        """Traffic into c1 (what it fetches) through a token bucket of `rate` on the switch's side of its veth."""
        port = f"p{self.lab.names.index('c1')}"
        subprocess.run(["ip", "netns", "exec", self.lab.switch, "tc", "qdisc", "add", "dev", port, "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "50ms"], check=True)

    def mount(self, host: str, name: str, *extra: str) -> Path:
        mnt = self.work / f"mnt-{name}"
        mnt.mkdir(exist_ok=True)
        self.dlfs(host, "mount", "ds", mnt, *extra)
        self.mounts.append(mnt)
        return mnt

    def umount(self, host: str, mnt: Path) -> None:
        self.dlfs(host, "umount", mnt)
        self.mounts.remove(mnt)

    def close(self) -> None:
        for mnt in self.mounts:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def epoch(mnt: Path, files: list[str], readers: int, seed: int) -> tuple[float, int]:
    """(seconds, bytes) of one epoch over `mnt`, caches dropped first."""
    drop_caches()
    r = read_epoch(str(mnt), files, readers, seed=seed)
    assert r.n_errors == 0, r
    return r.seconds, r.bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=300, help="dataset size in MB (default 300)")
    p.add_argument("--readers", type=int, default=2, help="reader processes per epoch (default 2)")
    p.add_argument("--repeat", type=int, default=5,
                   help="cold epochs after the first, of which the median is taken (default 5)")
    p.add_argument("--link", default="1gbit", help="the compute node's link (tc rate; default 1gbit)")
    p.add_argument("--cache-size", metavar="SIZE",
                   help="both mounts' --cache-size (e.g. a quarter of the dataset; default: theirs)")
    p.add_argument("--dir", default=".bench-diskcache", help="work dir (the sample is kept; default .bench-diskcache)")
    p.add_argument("--json", metavar="FILE", help="write the figures here")
    args = p.parse_args()
    why = netns_available()
    if why or not shutil.which("tc") or not os.path.exists("/dev/fuse"):
        raise SystemExit(f"cannot run here: {why or 'needs tc (iproute2) and /dev/fuse'}")
    work = Path(args.dir).absolute()
    for stale in ("home-n1", "home-c1", "cache-epochs", "cache-warm"):
        shutil.rmtree(work / stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    info = make_sample(work / "sample", n_files=args.mb * 1_000_000 // 110_000, mean_size=110_000, n_classes=30)
    src = work / "sample" / "train"
    files = list_files(str(src))
    link = link_bytes_per_s(args.link)
    print(f"dataset: {len(files)} files, {info.total_bytes / 1e6:.0f} MB; compute node link {args.link} "
          f"({link / 1e6:.0f} MB/s); {args.readers} readers, caches dropped before every epoch"
          + (f"; both mounts' cache {args.cache_size}" if args.cache_size else ""), flush=True)
    out: dict[str, float] = {}
    with NetLab(["n1", "c1"]) as lab:
        bench = Bench(lab, work)
        try:
            bench.start_node()
            bench.shape(args.link)
            bench.dlfs("n1", "ingest", src, "--name", "ds")

            sized = ["--cache-size", args.cache_size] if args.cache_size else []
            data = bench.mount("n1", "data", *sized)
            # The disk caches bounded by size, so the free space of a shared machine does not decide
            # whether they keep anything (with none given they keep 10% of their file system free).
            disk_size = ["--cache-dir-size", f"{2 * info.total_bytes >> 20}M"]
            compute = bench.mount("c1", "compute", "--cache-dir", work / "cache-epochs", *disk_size, *sized)
            d1, nbytes = epoch(data, files, args.readers, 0)
            c1, _ = epoch(compute, files, args.readers, 0)  # over the link: fills the disk cache
            # Then the two in turn, so that whatever else the machine does weighs on both alike.
            later: dict[str, list[float]] = {"data": [], "compute": []}
            for i in range(args.repeat):
                later["data"].append(epoch(data, files, args.readers, 1 + i)[0])
                later["compute"].append(epoch(compute, files, args.readers, 1 + i)[0])
            d2, c2 = statistics.median(later["data"]), statistics.median(later["compute"])
            bench.umount("n1", data)
            bench.umount("c1", compute)
            print(f"data node      epoch 1 {d1:6.2f} s   later {d2:6.2f} s  ({nbytes / d2 / 1e6:.0f} MB/s)", flush=True)
            print(f"compute node   epoch 1 {c1:6.2f} s   later {c2:6.2f} s  ({nbytes / c2 / 1e6:.0f} MB/s)  "
                  "with --cache-dir", flush=True)

            drop_caches()
            t0 = time.monotonic()
            said = bench.dlfs("c1", "warmup", "ds", "--cache-dir", work / "cache-warm", *disk_size).strip()
            warm = time.monotonic() - t0  # the whole command: start-up and index fetch included
            m = re.search(r"; ([\d.]+) s at", said)  # its own time: from its first fetch to its last write
            moving = float(m.group(1)) if m else warm
            print(f"warmup         {warm:6.2f} s  ({nbytes / warm / 1e6:.0f} MB/s): {said}", flush=True)
        finally:
            bench.close()
    out = {"files": len(files), "bytes": nbytes, "link_bytes_per_s": link, "data_epoch1_s": d1, "data_epoch2_s": d2,
           "compute_epoch1_s": c1, "compute_epoch2_s": c2, "warmup_s": warm, "warmup_fetch_s": moving,
           "epoch2_ratio": d2 / c2, "warmup_link_ratio": nbytes / moving / link,
           "warmup_command_link_ratio": nbytes / warm / link}
    print(f"later epochs, compute node with disk cache vs data node: {out['epoch2_ratio']:.2f}x  (target >= 0.9x)")
    print(f"warmup vs the shaped link:                              {out['warmup_link_ratio']:.2f}x  (target >= 0.8x; "
          f"{out['warmup_command_link_ratio']:.2f}x with the command's start-up and index fetch)")
    print(f"(epoch 1 over the link, for reference: {nbytes / c1 / 1e6:.0f} MB/s, {nbytes / c1 / link:.2f}x the link)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
