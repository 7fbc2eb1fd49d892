"""One training-style epoch: read every file once, in random order, from N processes.

Files are read one of two ways (READS): "open", as frameworks read them (PIL, numpy, torchvision's
loaders, webdataset: `open(path, "rb")` with default buffering, whole), or "raw" (unbuffered,
readinto one reused buffer). With default buffering CPython <= 3.13 calls isatty() after each open,
an ioctl that a FUSE mount receives as a request of its own; the raw read skips it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import resource
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from dlfs.bench.baselines import System, cpu_seconds, fresh_start
from dlfs.errors import CorruptData, DlfsError

log = logging.getLogger(__name__)
READS = {
    "open": 'with open(path, "rb") as f: data = f.read()  (default buffering, the whole file into a new object: '
            "what PIL, numpy, torchvision's loaders and webdataset do; CPython <= 3.13 calls isatty(), an ioctl, "
            "after each open)",
    "raw": 'open(path, "rb", buffering=0), then readinto() a reused buffer (1 MiB) to EOF: no isatty, no new object',
}

MARKER = ".dlfs-sample.json"  # same name as dlfs.bench.sample.MARKER; kept local to avoid coupling
MAX_ERRORS = 20
_START_TIMEOUT_S = 120.0  # a worker that never reaches the barrier must not hang the caller
# fork: workers inherit relpaths without pickling and start fast (dlfs is Linux-only via FUSE).
_MP = mp.get_context("fork")


@dataclass
class EpochResult:
    files: int
    bytes: int
    seconds: float
    errors: list[str] = field(default_factory=list)
    n_errors: int = 0
    # The readers' own CPU (user + system) over their timed reads: the kernel's side of a read (page
    # cache lookups, copies, faults) is charged to the reader, however the file system serves it.
    reader_cpu_s: float = 0.0

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def list_files(root: str) -> list[str]:
    """Sorted relative paths of all regular files under root (symlinks neither followed nor listed)."""
    out: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        # os.walk lists symlinks-to-files among filenames; lstat keeps regular files only.
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if rel == MARKER:
                continue
            try:
                if stat.S_ISREG(os.lstat(full).st_mode):
                    out.append(rel)
            except FileNotFoundError:
                continue  # vanished between listing and lstat
    out.sort()
    return out


def _read_open(path: str, digest: bool) -> tuple[int, bytes]:
    """Read path whole as frameworks do; return (size, xxh3-128 digest or b'')."""
    with open(path, "rb") as f:  # default buffering: isatty() after the open, then one read to EOF
        data = f.read()
    return len(data), (xxhash.xxh3_128_digest(data) if digest else b"")


def _read_one(path: str, mv: memoryview, digest: bool, read: str = "raw") -> tuple[int, bytes]:
    """Read path to EOF the `read` way (READS; raw: through mv); return (size, xxh3-128 digest or b'')."""
    if read == "open":
        return _read_open(path, digest)
    h = xxhash.xxh3_128() if digest else None
    size = 0
    with open(path, "rb", buffering=0) as f:  # raw FileIO: readinto goes straight to read(2)
        while n := f.readinto(mv):
            size += n
            if h is not None:
                h.update(mv[:n])
    return size, (h.digest() if h is not None else b"")


def _worker(
    wid: int,
    root: str,
    share: Sequence[str],
    verify_root: str | None,
    buf_size: int,
    read: str,
    barrier: Any,
    results: Any,
) -> None:
    """Timed read of this worker's share, then (untimed) comparison against verify_root."""
    errors: list[str] = []
    n_errors = 0

    def err(rel: str, reason: str) -> None:
        nonlocal n_errors
        n_errors += 1
        if len(errors) < MAX_ERRORS:
            errors.append(f"{rel}: {reason}")

    mv = memoryview(bytearray(buf_size))
    digest = verify_root is not None
    seen: list[tuple[str, int, bytes]] = []
    files = nbytes = 0
    try:
        barrier.wait(_START_TIMEOUT_S)
    except Exception:  # broken barrier: parent already gave up
        return
    cpu0 = _own_cpu()
    try:
        for rel in share:
            try:
                size, dig = _read_one(os.path.join(root, rel), mv, digest, read)
            except OSError as e:
                err(rel, f"read failed: {e.strerror or e}")
                continue
            files += 1
            nbytes += size
            if digest:
                seen.append((rel, size, dig))
    except BaseException as e:  # report instead of leaving the parent waiting
        err("<worker>", repr(e))
    results.put(("timed", wid, files, nbytes, _own_cpu() - cpu0))

    if verify_root is not None:
        for rel, size, dig in seen:
            try:
                src_size, src_dig = _read_one(os.path.join(verify_root, rel), mv, True)
            except OSError as e:
                err(rel, f"source read failed: {e.strerror or e}")
                continue
            if src_size != size:
                err(rel, f"size {size} != source {src_size}")
            elif src_dig != dig:
                err(rel, "content differs from source")
    results.put(("verified", wid, errors, n_errors))


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _collect(results: Any, procs: list[Any], kind: str, inbox: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Wait until inbox holds one `kind` message per worker; fail fast if a worker dies."""
    # Messages of the other kind are kept in inbox: a fast worker may verify before a slow one is timed.
    while sum(m[0] == kind for m in inbox) < len(procs):
        try:
            inbox.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"epoch worker died (exit codes {dead})") from None
    return [m for m in inbox if m[0] == kind]


def read_epoch(
    root: str,
    relpaths: Sequence[str],
    readers: int = 2,
    seed: int = 0,
    verify_root: str | None = None,
    buf_size: int = 1 << 20,
    read: str = "open",
) -> EpochResult:
    """Read every relpath under root once, shuffled, across `readers` processes, the `read` way (READS).

    `seconds` covers only the read phase (from all workers ready to the last done).
    With verify_root, each read is also hashed (xxh3-128, inside the timed phase)
    and compared afterwards, untimed, against the same path under verify_root.
    """
    if readers < 1:
        raise ValueError("readers must be >= 1")
    if read not in READS:
        raise ValueError(f"read must be one of {', '.join(READS)}")
    order = list(relpaths)
    random.Random(seed).shuffle(order)
    barrier = _MP.Barrier(readers + 1)  # +1: the parent starts the clock on release
    results = _MP.Queue()
    procs = [
        _MP.Process(
            target=_worker,
            args=(w, root, order[w::readers], verify_root, buf_size, read, barrier, results),
            daemon=True,
        )
        for w in range(readers)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(_START_TIMEOUT_S)
        t0 = time.perf_counter()
        inbox: list[tuple[Any, ...]] = []
        timed = _collect(results, procs, "timed", inbox)
        seconds = time.perf_counter() - t0
        verified = _collect(results, procs, "verified", inbox)
    except BaseException:
        barrier.abort()
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
        results.close()

    errors = sorted(e for m in verified for e in m[2])[:MAX_ERRORS]
    n_errors = sum(m[3] for m in verified)
    res = EpochResult(
        files=sum(m[2] for m in timed),
        bytes=sum(m[3] for m in timed),
        seconds=seconds,
        errors=errors,
        n_errors=n_errors,
        reader_cpu_s=sum(m[4] for m in timed),
    )
    log.info("epoch over %s: %d files, %d bytes, %.2fs, %d errors", root, res.files, res.bytes, seconds, n_errors)
    return res


def read_epoch_preloaded(root: str, relpaths: Sequence[str], readers: int = 2, seed: int = 0,
                        read: str = "open") -> EpochResult:
    """read_epoch in a child process under `dlfs run`'s preload library (dlfs.preload), which its forked
    readers inherit: isatty() of a regular file then asks the file system nothing."""
    from dlfs.preload import environ_with_preload

    job = json.dumps({"root": root, "relpaths": list(relpaths), "readers": readers, "seed": seed, "read": read})
    proc = subprocess.run([sys.executable, "-c", "from dlfs.bench.epoch import _epoch_child; _epoch_child()"],
                          input=job, env=environ_with_preload(), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise DlfsError(f"an epoch under the preload library failed (exit {proc.returncode}): {why}")
    return EpochResult(**json.loads(proc.stdout))


def _epoch_child() -> None:
    """read_epoch_preloaded's child: the job from stdin, the result to stdout, both JSON."""
    json.dump(dataclasses.asdict(read_epoch(**json.load(sys.stdin))), sys.stdout)


def timed_epoch(s: System, relpaths: Sequence[str], readers: int, seed: int, read: str = "open",
                preload: bool = False) -> dict[str, Any]:
    """One epoch on `s` without checking content, the `read` way (with preload: the readers under
    `dlfs run`'s preload library); with the CPU time of the process serving it where there is one
    (FUSE daemons), in seconds per GB and microseconds per file."""
    pid = s.pid
    cpu0 = cpu_seconds(pid) if pid else 0.0
    epoch = read_epoch_preloaded if preload else read_epoch
    r = epoch(str(s.root), relpaths, readers=readers, seed=seed, read=read)
    if r.n_errors or r.files != len(relpaths):
        raise DlfsError(f"{s.label}: an epoch read {r.files} of {len(relpaths)} files, {r.n_errors} failed: "
                        f"{'; '.join(r.errors[:3])}")
    cpu = cpu_seconds(pid) - cpu0 if pid else None
    return {"read": read, "preload": preload, "files": r.files, "bytes": r.bytes, "seconds": r.seconds,
            "files_per_s": r.files_per_s, "mb_per_s": r.mb_per_s, "cpu_s": cpu, **cpu_cost(cpu, r.files, r.bytes),
            "reader_cpu_s": r.reader_cpu_s,
            "reader_cpu_s_per_gb": r.reader_cpu_s / (r.bytes / 1e9) if r.bytes else None}


def verify_system(s: System, src: str, relpaths: Sequence[str]) -> dict[str, Any]:
    """Read every file through `s` on a fresh mount and compare it with src, untimed; CorruptData if any differs."""
    fresh_start(s)
    r = read_epoch(str(s.root), relpaths, readers=2, seed=0, verify_root=src)
    if r.n_errors or r.files != len(relpaths):
        shown = "; ".join(r.errors[:3])
        raise CorruptData(f"{s.label} read {r.n_errors} of {len(relpaths)} files wrong ({r.files} read): {shown}")
    return {"files": r.files, "bytes": r.bytes, "errors": r.n_errors}


def cpu_cost(cpu_s: float | None, files: int, nbytes: int) -> dict[str, float | None]:
    """CPU seconds spread over what they served: microseconds per file and seconds per GB (None without a figure)."""
    if cpu_s is None:
        return {"cpu_us_per_file": None, "cpu_s_per_gb": None}
    return {"cpu_us_per_file": cpu_s * 1e6 / files if files else None,
            "cpu_s_per_gb": cpu_s / (nbytes / 1e9) if nbytes else None}


def format_row(label: str, r: EpochResult, baseline: EpochResult | None = None) -> str:
    """One aligned table line; throughput ratio vs baseline when given (>1 is faster)."""
    row = (
        f"{label:<14}{r.files:>7d} files {r.bytes / 1e6:>7.1f} MB {r.seconds:>5.2f} s "
        f"{r.files_per_s:>6.0f} files/s {r.mb_per_s:>7.1f} MB/s"
    )
    if baseline is not None and baseline.mb_per_s > 0:
        row += f" {r.mb_per_s / baseline.mb_per_s:>6.2f}x source"
    if r.n_errors:
        row += f"  {r.n_errors} ERRORS"
    return row
