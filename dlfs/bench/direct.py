"""`dlfs bench`'s zero-copy workloads: dlfs.direct, dlfs.torch, and two jobs sharing one mount.

Each is measured beside its baseline in the same run:
  - direct reads, one process, every file once in random order: dlfs.direct read() per file and
    read_many() by batch, against open()+readinto() of the same files on local disk with a hot page
    cache; once taking the bytes as they come (a view, a reused buffer), once hashing every byte
    (xxh3), which is what any consumer pays for touching them;
  - the torch Dataset (DirectDataset, the chunk-local sampler; each batch delivered to the training
    process as views, or copied into one tensor: TORCH_KINDS) through
    dlfs.direct against the same Dataset over the local directory (open()), with 0 and 2 workers;
  - two jobs reading whole epochs at once, in different orders, on a fresh mount with the page cache
    dropped: the bytes the mount fetched against the dataset's size (each chunk once, not twice).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from dlfs.bench.baselines import DlfsMount, drop_caches
from dlfs.errors import DlfsError

BATCH = 256
TORCH_BATCH = 64
_MP = mp.get_context("fork")
Say = Callable[[str], None]


def _rate(files: int, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"files": files, "bytes": nbytes, "seconds": seconds, "files_per_s": files / seconds,
            "mb_per_s": nbytes / 1e6 / seconds}


def local_pass(paths: Sequence[str], digest: bool) -> dict[str, Any]:
    """open() + readinto() of every file into one reused buffer (what a plain loader does)."""
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    nbytes, h = 0, 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            n = f.readinto(mv)
            while n == len(mv):  # a file bigger than the buffer: the rest in pieces
                nbytes += n
                if digest:
                    h ^= xxhash.xxh3_64_intdigest(mv)
                n = f.readinto(mv)
        nbytes += n
        if digest:
            h ^= xxhash.xxh3_64_intdigest(mv[:n])
    return _rate(len(paths), nbytes, time.perf_counter() - t0)


def direct_pass(reader: Any, paths: Sequence[str], batch: int, digest: bool) -> dict[str, Any]:
    """dlfs.direct: read() per file (batch 1) or read_many() per batch; views dropped as they are done."""
    nbytes, h = 0, 0
    t0 = time.perf_counter()
    if batch == 1:
        for p in paths:
            with reader.read(p) as v:
                nbytes += len(v)
                if digest:
                    h ^= xxhash.xxh3_64_intdigest(v)
    else:
        for i in range(0, len(paths), batch):
            for v in reader.read_many(paths[i : i + batch]):
                nbytes += len(v)
                if digest:
                    h ^= xxhash.xxh3_64_intdigest(v)
    return _rate(len(paths), nbytes, time.perf_counter() - t0)


def measure_direct(mnt: str, src: str, relpaths: Sequence[str], seed: int = 5) -> dict[str, Any]:
    """Cold then warm direct reads on a fresh mount, each beside local disk (cold, then hot)."""
    import dlfs.direct

    order = list(relpaths)
    random.Random(seed).shuffle(order)
    on_dlfs = [os.path.join(mnt, r) for r in order]
    on_disk = [os.path.join(src, r) for r in order]
    out: dict[str, Any] = {}
    with dlfs.direct.connect(mnt) as reader:
        if not reader.direct:
            raise DlfsError(f"dlfs.direct did not attach to {mnt}: {getattr(reader, 'reason', '')}")
        drop_caches()
        out["cold"] = {"local": local_pass(on_disk, False), "batched": direct_pass(reader, on_dlfs, BATCH, False)}
        local_pass(on_disk, False)  # both hot from here on
        for digest in (False, True):
            kind = "warm_hash" if digest else "warm"
            out[kind] = {"local": local_pass(on_disk, digest), "single": direct_pass(reader, on_dlfs, 1, digest),
                         "batched": direct_pass(reader, on_dlfs, BATCH, digest)}
        out["stats"] = reader.stats()
    for kind in ("cold", "warm", "warm_hash"):
        by = out[kind]
        for mode in ("single", "batched"):
            if mode in by:
                by[mode]["vs_local"] = by[mode]["files_per_s"] / by["local"]["files_per_s"]
    return out


def torch_epoch(root: str, workers: int, kind: str, seed: int = 3) -> dict[str, Any]:
    """The second epoch of DirectDataset under a DataLoader (the first warms workers and caches).
    kind "views": no transform, batches of views (collate_views); "tensor": as_tensor and
    collate_bytes, each batch's bytes copied into one tensor (shared memory from a worker)."""
    from torch.utils.data import DataLoader

    from dlfs.torch import DirectDataset, as_tensor, collate_bytes, collate_views

    collate: Callable[..., Any]
    if kind == "views":
        ds, collate = DirectDataset(root), collate_views
    else:
        ds, collate = DirectDataset(root, transform=as_tensor), collate_bytes
    sampler = ds.sampler(seed=seed)
    loader = DataLoader(ds, batch_size=TORCH_BATCH, sampler=sampler, num_workers=workers, collate_fn=collate,
                        persistent_workers=workers > 0)
    result: dict[str, Any] = {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        files = nbytes = 0
        t0 = time.perf_counter()
        for batch in loader:
            if kind == "views":
                files += len(batch)
                nbytes += sum(len(v) for v in batch)
            else:
                files += len(batch[1])
                nbytes += batch[0].numel()
        result = _rate(files, nbytes, time.perf_counter() - t0)
    result["direct"] = ds.direct
    del loader
    return result


TORCH_KINDS = {
    "views": "no transform: each file's bytes as a view (from a worker, dlfs sends paths and maps them again "
             "from the shared cache; local disk sends the bytes)",
    "tensor": "as_tensor + collate_bytes: each batch's bytes copied into one uint8 tensor (in shared memory "
              "from a worker, for both)",
}


def measure_torch(mnt: str, src: str, workers: Sequence[int] = (0, 2)) -> dict[str, Any]:
    """DirectDataset on dlfs and on the local directory; a reason instead where torch is missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"skipped": "torch is not installed (pip install 'dlfs[torch]')"}
    out: dict[str, Any] = {}
    for kind in TORCH_KINDS:
        out[kind] = {}
        for w in workers:
            local, dlfs = torch_epoch(src, w, kind), torch_epoch(mnt, w, kind)
            if not dlfs["direct"] or local["direct"]:
                raise DlfsError("the torch workload did not read dlfs through dlfs.direct and local disk with open()")
            out[kind][str(w)] = {"local": local, "dlfs": dlfs, "vs_local": dlfs["files_per_s"] / local["files_per_s"]}
    return out


def _job(mnt: str, relpaths: Sequence[str], seed: int, barrier: Any, results: Any) -> None:
    import dlfs.direct

    order = list(relpaths)
    random.Random(seed).shuffle(order)
    paths = [os.path.join(mnt, r) for r in order]
    reader = dlfs.direct.connect(mnt)
    barrier.wait(60)
    nbytes = 0
    t0 = time.perf_counter()
    for i in range(0, len(paths), BATCH):
        nbytes += sum(len(v) for v in reader.read_many(paths[i : i + BATCH]))
    results.put((len(paths), nbytes, time.perf_counter() - t0))


def measure_two_jobs(mnt: DlfsMount, relpaths: Sequence[str], total: int) -> dict[str, Any]:
    """Two processes, each a whole epoch in its own random order, at once on a fresh, cold mount."""
    import dlfs.direct

    mnt.remount()
    drop_caches()
    barrier, results = _MP.Barrier(2), _MP.Queue()
    procs = [_MP.Process(target=_job, args=(str(mnt.root), relpaths, seed, barrier, results), daemon=True)
             for seed in (11, 12)]
    for p in procs:
        p.start()
    try:
        jobs = [results.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if any(n != len(relpaths) or b != total for n, b, _ in jobs):
        raise DlfsError(f"a concurrent job read the wrong amount: {jobs} (expected {len(relpaths)} files, {total} B)")
    with dlfs.direct.connect(mnt.root) as reader:
        stats = reader.stats()
    return {"jobs": [_rate(*j) for j in jobs], "dataset_bytes": total, "fetched_bytes": stats["fetched_bytes"],
            "fetched_ratio": stats["fetched_bytes"] / total, "fetches": stats["fetches"]}


def run_direct(mnt: DlfsMount, src: str, relpaths: Sequence[str], total: int, say: Say) -> dict[str, Any]:
    say("dlfs.direct: cold then warm, read() and read_many(), beside local disk cold then hot")
    mnt.remount()
    out: dict[str, Any] = {"direct": measure_direct(str(mnt.root), src, relpaths)}
    say("dlfs.torch: DirectDataset with 0 and 2 workers, on dlfs and on the local directory")
    out["torch"] = measure_torch(str(mnt.root), src)
    say("two concurrent jobs on a fresh mount: bytes fetched against the dataset's size")
    out["two_jobs"] = measure_two_jobs(mnt, relpaths, total)
    mnt.unmount()
    return out
