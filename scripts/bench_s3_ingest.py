#!/usr/bin/env python3
"""Ingest throughput from S3 against the same bytes from a local tree.

Starts moto's S3 server on localhost, fills a bucket and a local directory with the same files
(sizes log-uniform between --min-size and --max-size, --total bytes in all), starts a one-node
cluster with `dlfs node`, then ingests both ways (alternately, --reps times each, the dataset
removed after each run so that no run finds the chunks of another already stored) and prints the
rates and their ratio. With --pin, moto runs on CPU 0 and everything else on the other CPUs,
so that on a small machine the server (remote, for a real bucket) does not take the ingest's CPUs; the
local-tree ingest gets the same CPUs. It also times dlfs's S3 reader alone (listing and ranged GETs, no packing,
no cluster), which is what moto, a Python server, can serve this client: where that is near the S3
ingest's rate, the server is the bottleneck and not the ingest.

    .venv/bin/python scripts/bench_s3_ingest.py --total 1G

With --shards N the same files are also packed into N tar shards (WebDataset's layout; --codec gzip or
zstd compresses them), kept on disk and in the bucket, and `dlfs ingest --expand-tar` of each is timed
the same way.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlfs.bench.baselines import DlfsNode, cpu_seconds  # noqa: E402
from dlfs.ingest.s3 import S3Prefix  # noqa: E402
from dlfs.units import parse_size  # noqa: E402

BUCKET = "bench"
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(ok: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {what} did not come up within {timeout:.0f} s")
        time.sleep(0.2)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def make_files(total: int, lo: int, hi: int, seed: int) -> dict[str, int]:
    """Relative path -> size, log-uniform in [lo, hi], `total` bytes in all."""
    rng = random.Random(seed)
    out, left, i = {}, total, 0
    while left > 0:
        size = min(left, int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        out[f"d{i % 16:02d}/f{i:06d}.bin"] = size
        left -= size
        i += 1
    return out


def fill(src: Path, s3: object, files: dict[str, int]) -> None:
    def one(item: tuple[str, int]) -> None:
        rel, size = item
        data = os.urandom(size)
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        s3.put_object(Bucket=BUCKET, Key=f"data/{rel}", Body=data)  # type: ignore[attr-defined]

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, files.items()))


SHARD_SUFFIX = {"tar": ".tar", "gzip": ".tar.gz", "zstd": ".tar.zst"}


def make_shards(src: Path, out: Path, s3: object, n: int, codec: str = "tar") -> int:
    """The files under src in `n` tars (in path order, about equal bytes each; plain, or gzip or zstd at
    their fastest levels), on disk under out and in the bucket under shards/; their bytes in all."""
    import gzip
    import tarfile

    import zstandard

    files = sorted(p for p in src.rglob("*") if p.is_file())
    out.mkdir()
    per = -(-len(files) // n)
    total = 0
    for k in range(n):
        path = out / f"train-{k:06d}{SHARD_SUFFIX[codec]}"
        with open(path, "wb") as raw:
            sink = (gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) if codec == "gzip" else
                    zstandard.ZstdCompressor(level=1).stream_writer(raw, closefd=False) if codec == "zstd" else raw)
            with sink, tarfile.open(fileobj=sink, mode="w", format=tarfile.GNU_FORMAT) as tf:  # type: ignore[arg-type]
                for p in files[k * per:(k + 1) * per]:
                    tf.add(p, str(p.relative_to(src)))
        with open(path, "rb") as f:
            s3.put_object(Bucket=BUCKET, Key=f"shards/{path.name}", Body=f)  # type: ignore[attr-defined]
        total += path.stat().st_size
    return total


def on_cpus(cpus: set[int] | None) -> object:
    """A preexec_fn that runs the child on `cpus` (None: wherever it likes)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


CLIENT_CPUS: set[int] | None = None  # with --pin: the CPUs of the node, the ingests and this process


class PinnedNode(DlfsNode):
    """The bench's node, on CLIENT_CPUS with --pin."""

    def wrap(self, argv: list[str]) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, sorted(CLIENT_CPUS))), *argv] if CLIENT_CPUS else argv


def dlfs(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dlfs", *args], env=env, capture_output=True, text=True,
                          timeout=3600, cwd=REPO, preexec_fn=on_cpus(CLIENT_CPUS))  # type: ignore[arg-type]
    if proc.returncode != 0:
        raise SystemExit(f"bench: `dlfs {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def ingest_rate(env: dict[str, str], src: str, nbytes: int, pids: dict[str, int], *extra: str) -> float:
    """MB/s of one ingest, by the ingest's own clock (walk/listing to commit, no process start); prints
    the CPU time the ingest and the servers in `pids` used meanwhile (they share this machine's CPUs)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = dlfs(env, "ingest", src, "--name", "bench", *extra)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    seconds = float(re.search(r" in ([\d.]+) s \(", out).group(1))  # type: ignore[union-attr]
    cpu = ", ".join(f"{name} {t:.1f}" for name, t in
                    {"ingest": after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime, **used}.items())
    print(f"  {src}: {seconds:.1f} s; CPU seconds: {cpu} (of {os.cpu_count()} CPUs)", flush=True)
    dlfs(env, "rm", "bench")
    return nbytes / seconds / 1e6


def reader_rate(endpoint: str, nbytes: int) -> float:
    """MB/s of dlfs's S3 reader alone: listing and every byte through the read-ahead, nothing else."""
    src = S3Prefix(f"s3://{BUCKET}/data", endpoint_url=endpoint)
    t0 = time.perf_counter()
    buf = memoryview(bytearray(4 << 20))
    for node, f in src.files(src.walk(None)):
        left = node.size
        while left:
            left -= f.readinto(buf[:min(left, len(buf))])
        f.finish()
        f.close()
    return nbytes / (time.perf_counter() - t0) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="1G", help="bytes in all (default 1G)")
    ap.add_argument("--min-size", default="100K", help="smallest file (default 100K)")
    ap.add_argument("--max-size", default="10M", help="biggest file (default 10M)")
    ap.add_argument("--reps", type=int, default=2, help="ingests each way (default 2)")
    ap.add_argument("--pin", action="store_true", help="moto on CPU 0, the node and the ingests on the others")
    ap.add_argument("--shards", type=int, default=0, help="also time --expand-tar of N tar shards of the files")
    ap.add_argument("--codec", choices=sorted(SHARD_SUFFIX), default="tar",
                    help="the shards' compression (default tar: none; gzip and zstd at level 1)")
    ap.add_argument("--dir", help="scratch directory (default: a temporary one, removed after)")
    args = ap.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="dlfs-bench-s3-")).absolute()
    src, home = base / "src", base / "home"
    shutil.rmtree(base, ignore_errors=True)
    src.mkdir(parents=True)
    os.environ.update(AWS)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "DLFS_S3_PAGE_SIZE"):
        os.environ.pop(k, None)
    env = dict(os.environ, DLFS_HOME=str(home), DLFS_PROGRESS_EVERY="86400")
    env.pop("DLFS_CLUSTER", None)

    global CLIENT_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        if len(cpus) < 2:
            raise SystemExit("bench: --pin needs two CPUs at least")
        CLIENT_CPUS = set(cpus[1:])
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=on_cpus({cpus[0]} if args.pin else None))  # type: ignore[arg-type]
    node = None
    try:
        wait_until(lambda: answers(f"{endpoint}/moto-api/data.json"), "moto")
        import boto3
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=endpoint,
                          config=Config(max_pool_connections=16, request_checksum_calculation="when_required"))
        s3.create_bucket(Bucket=BUCKET)
        files = make_files(parse_size(args.total), parse_size(args.min_size), parse_size(args.max_size), seed=1)
        nbytes = sum(files.values())
        print(f"{len(files)} files, {nbytes / 1e6:.0f} MB, {parse_size(args.min_size) >> 10} KiB to "
              f"{parse_size(args.max_size) >> 20} MiB; filling {base} and s3://{BUCKET}/data ...", flush=True)
        fill(src, s3, files)
        if args.shards:
            make_shards(src, base / "shards", s3, args.shards, args.codec)

        node = PinnedNode(home)
        node.start()
        assert node.proc is not None

        local, remote, tars, s3tars = [], [], [], []
        for rep in range(args.reps):
            pids = {"node": node.proc.pid, "moto": moto.pid}
            local.append(ingest_rate(env, str(src), nbytes, pids))
            remote.append(ingest_rate(env, f"s3://{BUCKET}/data", nbytes, pids, "--endpoint-url", endpoint))
            print(f"rep {rep + 1}: local tree {local[-1]:.0f} MB/s, S3 {remote[-1]:.0f} MB/s", flush=True)
            if args.shards:
                tars.append(ingest_rate(env, str(base / "shards"), nbytes, pids, "--expand-tar"))
                s3tars.append(ingest_rate(env, f"s3://{BUCKET}/shards/", nbytes, pids, "--expand-tar",
                                          "--endpoint-url", endpoint))
                print(f"rep {rep + 1}: local shards {tars[-1]:.0f} MB/s, S3 shards {s3tars[-1]:.0f} MB/s", flush=True)
        if CLIENT_CPUS is not None:
            os.sched_setaffinity(0, CLIENT_CPUS)
        raw = reader_rate(endpoint, nbytes)
        lo, re_ = statistics.median(local), statistics.median(remote)
        where = f"moto on CPU {cpus[0]}, the rest on CPUs {sorted(CLIENT_CPUS)}" if CLIENT_CPUS else \
            f"all on {len(cpus)} CPUs"
        print(f"{where}; page cache warm for the local tree")
        print(f"local-tree ingest:          {lo:7.0f} MB/s (median of {args.reps})")
        print(f"S3 ingest (moto):           {re_:7.0f} MB/s (median of {args.reps})")
        print(f"ratio S3 / local:           {re_ / lo:7.2f}")
        print(f"dlfs S3 reader alone (moto): {raw:6.0f} MB/s: moto serving this client, no packing or storing")
        print(f"S3 ingest / reader alone:   {re_ / raw:7.2f}")
        if args.shards:
            ta, st = statistics.median(tars), statistics.median(s3tars)
            kind = {"tar": "tar", "gzip": "tar.gz", "zstd": "tar.zst"}[args.codec]
            print(f"{args.shards} {kind} shards on disk:  {ta:7.0f} MB/s of files (median of {args.reps})")
            print(f"{args.shards} {kind} shards in S3:    {st:7.0f} MB/s of files (median of {args.reps})")
            print(f"ratio S3 shards / local:    {st / ta:7.2f};  S3 shards / local tree: {st / lo:.2f}")
    finally:
        if node is not None:
            node.stop()
        moto.terminate()
        moto.wait(timeout=10)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
