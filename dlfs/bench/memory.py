"""`dlfs bench`'s bigger-than-memory section (issue 13): a dataset 2-3 times a memory cgroup's limit,
read every way in that group, in one run.

The bench makes a memory cgroup (root only; DEFAULT_LIMIT unless --memory-limit) and starts in it a
dlfs node of its own, each `dlfs mount` (its background process inherits the group), squashfuse_ll,
and every reader: all of them are charged to the group, and the kernel OOM-kills within it. Then, each
after the page cache was dropped and on a fresh mount, one epoch of every file in a random order:
local disk, squashfuse_ll and dlfs through FUSE (READERS reader processes, `open(p, "rb").read()`),
then dlfs.direct (one process, read_many by BATCH) in a random order and in the chunk-local sampler's.
Each epoch's bytes are checked against xxh3 digests of the source taken beforehand (hashing is left
out of the timed part); the mount's anonymous and shared memory is sampled every SAMPLE_PERIOD against
its bound (cache size + MOUNT_SLACK + index size), and the group's OOM kills are counted.

A reader or mount the kernel kills is a row that says so, not an exception: the section returns its
figures whatever happened, with a reason instead where it could not run ("skipped": no cgroup here;
"error": the set-up failed). Whatever it mounted or started is unmounted, stopped and removed on the
way out.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import xxhash

from dlfs.bench.baselines import (
    DlfsMount,
    DlfsNode,
    LocalDisk,
    SquashfuseLL,
    System,
    build_squashfs,
    cpu_seconds,
    drop_caches,
    unmount_all_under,
)
from dlfs.bench.epoch import list_files
from dlfs.bench.sample import MARKER, make_sample
from dlfs.cgroup import MemoryGroup
from dlfs.errors import DlfsError, StorageFull
from dlfs.mount.cache import MOUNT_SLACK
from dlfs.procs import running

log = logging.getLogger(__name__)
DEFAULT_LIMIT = 1 << 30
QUICK_LIMIT = 256 << 20
MIN_LIMIT = 128 << 20  # below this a node, a mount and two Python readers do not fit at all
DATASET_RATIO = 2.3  # a generated dataset's size over the limit (issue 13's table)
REUSE_RATIOS = (2.0, 3.0)  # the bench's own sample is used instead where its size over the limit is within these
DATASET = "bench-memory"
GROUP = "dlfs-bench-memory"
READERS = 2
BATCH = 256  # files per dlfs.direct read_many
SAMPLE_PERIOD = 0.05
SPACE_FACTOR = 3.2  # the sample (if generated), its squashfs image and the node's chunks
ROWS = {
    "local": "local disk",
    "squashfuse_ll": "squashfuse_ll",
    "fuse": "dlfs FUSE",
    "direct_random": "dlfs.direct random",
    "direct_chunk": "dlfs.direct chunk-local",
}
HOW = {  # short: a column of the report
    "local": f'open(p, "rb"), {READERS} readers',
    "squashfuse_ll": f'open(p, "rb"), {READERS} readers',
    "fuse": f'open(p, "rb"), {READERS} readers',
    "direct_random": f"read_many({BATCH}), 1 process",
    "direct_chunk": f"read_many({BATCH}), 1 process",
}
DLFS_ROWS = ("fuse", "direct_random", "direct_chunk")
_START_TIMEOUT = 120.0
_MP = mp.get_context("fork")
Say = Callable[[str], None]


def size_text(n: int) -> str:
    """1073741824 -> "1 GiB", 201326592 -> "192 MiB" (binary units, whole where they are)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


# --- the systems, started inside the group -------------------------------------------------------------
class GroupNode(DlfsNode):
    """The one-node dlfs of DlfsNode, started inside a memory group; `dlfs mount` run through it
    starts there too (so its background process, the mount, lives there). Other commands (ingest,
    umount) run outside: they are not what the section measures."""

    def __init__(self, home: Path, group: MemoryGroup, transport: str | None = None,
                 io_uring: str | None = None) -> None:
        super().__init__(home, transport, io_uring)
        self.group = group

    def wrap(self, argv: list[str]) -> list[str]:
        return self.group.command(argv)


class GroupSquashfuseLL(SquashfuseLL):
    """squashfuse_ll started inside a memory group (in the foreground, so its pid is known)."""

    def __init__(self, image: Path, mountpoint: Path, log_path: Path, group: MemoryGroup) -> None:
        super().__init__(image, mountpoint, log_path)
        self.group = group

    def wrap(self, argv: list[str]) -> list[str]:
        return self.group.command(argv)


def fresh(s: System) -> None:
    """Unmount (clearing a mount whose process died), drop the page cache, mount again."""
    if s.mounted:
        try:
            s.unmount()
        except (DlfsError, OSError, subprocess.SubprocessError) as exc:
            log.warning("unmounting %s: %s", s.label, exc)
            s.mounted = False
    if s.root.is_dir() and not isinstance(s, LocalDisk):
        unmount_all_under(s.root)  # a dead FUSE mount is no mount to os.path.ismount, but is in the table
    drop_caches()
    s.mount()


# --- what the mount holds -----------------------------------------------------------------------------------
def rss_anon_shmem(pid: int) -> tuple[int, int] | None:
    """RssAnon and RssShmem of a process (bytes), None once it is gone."""
    anon = shmem = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return anon, shmem


class PeakMemory:
    """While in its `with` block, samples a process's RssAnon + RssShmem and the group's unreclaimable
    memory every SAMPLE_PERIOD in a thread, keeping the peaks (and whether the process outlived it)."""

    def __init__(self, pid: int | None, group: MemoryGroup, period: float = SAMPLE_PERIOD) -> None:
        self.pid, self.group, self.period = pid, group, period
        self.peak_anon = self.peak_shmem = self.peak_anon_shmem = self.peak_group = 0
        self.samples = 0
        self.gone = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler", daemon=True)

    def _sample(self) -> None:
        if self.pid is not None and not self.gone:
            got = rss_anon_shmem(self.pid)
            if got is None:
                self.gone = True
            else:
                anon, shmem = got
                self.peak_anon, self.peak_shmem = max(self.peak_anon, anon), max(self.peak_shmem, shmem)
                self.peak_anon_shmem = max(self.peak_anon_shmem, anon + shmem)
                self.samples += 1
        self.peak_group = max(self.peak_group, self.group.unreclaimable() or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "peak_anon": self.peak_anon, "peak_shmem": self.peak_shmem,
                "peak_anon_shmem": self.peak_anon_shmem, "samples": self.samples, "exited": self.gone}


# --- the readers, run inside the group (helper_main) -------------------------------------------------------
def _open_worker(wid: int, root: str, share: Sequence[str], expected: dict[str, int], barrier: Any,
                 results: Any) -> None:
    """Read this share the framework way; hash each file's bytes after its read (that time is reported
    apart, and taken off the epoch's)."""
    files = nbytes = bad = n_errors = 0
    hash_s = 0.0
    errors: list[str] = []
    bad_files: list[str] = []
    try:
        barrier.wait(_START_TIMEOUT)
    except Exception:
        return
    for rel in share:
        try:
            with open(os.path.join(root, rel), "rb") as f:  # default buffering, as frameworks read
                data = f.read()
        except OSError as e:
            n_errors += 1
            if len(errors) < 5:
                errors.append(f"{rel}: {e.strerror or e}")
            continue
        t = time.perf_counter()
        if xxhash.xxh3_64_intdigest(data) != expected[rel]:
            bad += 1
            if len(bad_files) < 5:
                bad_files.append(rel)
        hash_s += time.perf_counter() - t
        files += 1
        nbytes += len(data)
        del data
    results.put({"wid": wid, "files": files, "bytes": nbytes, "bad": bad, "bad_files": bad_files,
                 "errors": n_errors, "error_examples": errors, "end": time.perf_counter(), "hash_s": hash_s})


def open_epoch(root: str, relpaths: Sequence[str], expected: dict[str, int], readers: int, seed: int) -> dict[str, Any]:
    """Every file once, shuffled, over `readers` processes; seconds from the start barrier to the last
    reader done, less each reader's hashing. A reader that dies ends the epoch ("died": exit codes)."""
    order = list(relpaths)
    random.Random(seed).shuffle(order)
    barrier, results = _MP.Barrier(readers + 1), _MP.Queue()
    procs = [_MP.Process(target=_open_worker, args=(w, root, order[w::readers], expected, barrier, results),
                         daemon=True) for w in range(readers)]
    for p in procs:
        p.start()
    done: list[dict[str, Any]] = []
    died: list[int] = []
    try:
        barrier.wait(_START_TIMEOUT)
        t0 = time.perf_counter()
        while len(done) < readers:
            try:
                done.append(results.get(timeout=0.5))
            except queue.Empty:
                died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if died:
                    break
    finally:
        for p in procs:
            if died:
                p.kill()
            p.join(timeout=10)
    out = _sum(done)
    out["died"] = died
    out["seconds"] = max((r["end"] - r["hash_s"] - t0 for r in done), default=0.0)
    out["hash_s"] = sum(r["hash_s"] for r in done)
    return out


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"files": sum(r["files"] for r in parts), "bytes": sum(r["bytes"] for r in parts),
            "bad": sum(r["bad"] for r in parts), "bad_files": [f for r in parts for f in r["bad_files"]][:5],
            "errors": sum(r["errors"] for r in parts), "error_examples": [e for r in parts for e in r["error_examples"]][:5]}


def direct_epoch(root: str, relpaths: Sequence[str], expected: dict[str, int], chunk_local: bool, seed: int,
                 batch: int = BATCH) -> dict[str, Any]:
    """Every file once through dlfs.direct, read_many by `batch`, in a random order or the chunk-local
    sampler's; seconds are those spent in read_many (hashing the views is left out)."""
    import dlfs.direct
    from dlfs.sampler import ChunkLocalSampler

    with dlfs.direct.connect(root) as reader:
        if not reader.direct:
            raise DlfsError(f"dlfs.direct did not attach to {root}: {getattr(reader, 'reason', '')}")
        if chunk_local:  # as DirectDataset does: the index says which chunk holds each file
            names, chunks = reader.files_under(root)  # type: ignore[union-attr]
            order = [names[i] for i in ChunkLocalSampler(chunks, seed=seed).order() if names[i] in expected]
        else:
            order = list(relpaths)
            random.Random(seed).shuffle(order)
        files = nbytes = bad = n_errors = 0
        seconds = hash_s = 0.0
        bad_files: list[str] = []
        errors: list[str] = []
        for i in range(0, len(order), batch):
            part = order[i : i + batch]
            t = time.perf_counter()
            try:
                views = reader.read_many([os.path.join(root, r) for r in part])
            except OSError as e:
                n_errors += 1
                errors.append(f"{part[0]}..: {e.strerror or e}")
                break  # the mount is gone or broken: the rest would fail the same way
            t1 = time.perf_counter()
            seconds += t1 - t
            for rel, v in zip(part, views):
                if xxhash.xxh3_64_intdigest(v) != expected[rel]:
                    bad += 1
                    if len(bad_files) < 5:
                        bad_files.append(rel)
                files += 1
                nbytes += len(v)
                v.release()
            hash_s += time.perf_counter() - t1
    return {"files": files, "bytes": nbytes, "bad": bad, "bad_files": bad_files, "errors": n_errors,
            "error_examples": errors, "died": [], "seconds": seconds, "hash_s": hash_s}


def helper_main(argv: list[str]) -> int:
    """The reader side of one epoch, run inside the group: `JOB RESULT` (JSON files). 0 when every
    reader finished (whatever it found), 3 when one died."""
    job = json.loads(Path(argv[0]).read_text())
    listing = json.loads(Path(job["list"]).read_text())
    relpaths: list[str] = listing["relpaths"]
    expected = dict(zip(relpaths, listing["digests"]))
    if job["mode"] == "open":
        out = open_epoch(job["root"], relpaths, expected, job["readers"], job["seed"])
    else:
        out = direct_epoch(job["root"], relpaths, expected, job["mode"] == "direct_chunk", job["seed"])
    Path(argv[1]).write_text(json.dumps(out))
    return 3 if out["died"] else 0


_HELPER = "import sys; from dlfs.bench.memory import helper_main; sys.exit(helper_main(sys.argv[1:]))"


# --- the section ----------------------------------------------------------------------------------------------
def source_digests(src: Path, relpaths: Sequence[str]) -> list[int]:
    """xxh3-64 of every source file (read here, outside the group and the timed parts)."""
    out = []
    for rel in relpaths:
        with open(src / rel, "rb") as f:
            out.append(xxhash.xxh3_64_intdigest(f.read()))
    return out


def epoch_timeout(nbytes: int) -> float:
    """Time an epoch may take before the section gives up on it: 10 MB/s, plus two minutes."""
    return 120.0 + nbytes / 10e6


class Section:
    """One run of the section: the group, the node, the systems, and the rows measured so far."""

    def __init__(self, work: Path, group: MemoryGroup, limit: int, src: Path, relpaths: list[str],
                 total: int, say: Say, transport: str | None, io_uring: str | None) -> None:
        self.work, self.group, self.limit, self.say = work, group, limit, say
        self.src, self.relpaths, self.total = src, relpaths, total
        self.node = GroupNode(work / "home", group, transport, io_uring)
        self.rows: dict[str, dict[str, Any]] = {}
        self.bound: dict[str, Any] | None = None  # mount_bound's, once a dlfs mount was made
        self.seed = 13

    def run_epoch(self, key: str, s: System, mode: str) -> dict[str, Any]:
        """One epoch of `key`'s kind on `s`, on a fresh mount with the page cache dropped; its row."""
        row: dict[str, Any] = {"label": ROWS[key], "how": HOW[key], "completed": False, "status": "",
                               "files": 0, "bytes": 0, "seconds": None, "files_per_s": None, "mb_per_s": None,
                               "vs_local": None, "cpu_us_per_file": None, "oom_kills": 0, "bytes_ok": None,
                               "bad_files": 0,
                               "bad_examples": [], "errors": 0, "error_examples": [], "hash_s": None, "mount": None,
                               "group_peak_unreclaimable": None}
        oom0 = self.group.oom_kills()
        try:
            if isinstance(s, DlfsMount):
                self._node_up()
            fresh(s)
            if isinstance(s, DlfsMount) and self.bound is None:
                self.bound = mount_bound(self.node, s, self.limit)
        except (DlfsError, OSError, subprocess.SubprocessError) as exc:
            row["oom_kills"] = self.group.oom_kills() - oom0
            row["status"] = f"could not mount: {exc}{_oom_phrase(row['oom_kills'])}"
            return row
        pid = s.pid
        job, result = self.work / f"job-{key}.json", self.work / f"result-{key}.json"
        result.unlink(missing_ok=True)
        job.write_text(json.dumps({"mode": mode, "root": str(s.root), "list": str(self.work / "list.json"),
                                   "readers": READERS, "seed": self.seed}))
        timeout = epoch_timeout(self.total)
        cpu0 = cpu_seconds(pid) if pid is not None else None  # the serving process's (FUSE systems)
        with open(self.work / "readers.log", "ab") as logf, PeakMemory(pid, self.group) as mem:
            proc = subprocess.Popen(self.group.command([sys.executable, "-c", _HELPER, str(job), str(result)]),
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
                os.killpg(proc.pid, signal.SIGKILL)  # the readers too: they are in its session
                proc.wait()
            except BaseException:  # Ctrl-C, SIGTERM: no reader may keep the mounts busy
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        cpu = cpu_seconds(pid) - cpu0 if pid is not None and cpu0 is not None and running(pid) else None
        row["oom_kills"] = self.group.oom_kills() - oom0
        row["group_peak_unreclaimable"] = mem.peak_group
        if pid is not None:
            row["mount"] = mem.to_json()
            row["mount"]["alive"] = running(pid)
        got = json.loads(result.read_text()) if rc is not None and result.exists() else None
        if got is not None:
            for k in ("files", "bytes", "seconds", "errors", "error_examples", "bad_files", "hash_s"):
                row[k if k != "bad_files" else "bad_examples"] = got[k]
            row["bad_files"] = got["bad"]
            row["bytes_ok"] = got["bad"] == 0 if got["files"] else None  # None: nothing was read to check
        node_exit = self.node.proc.poll() if isinstance(s, DlfsMount) and self.node.proc is not None else None
        row["status"] = self._status(row, rc, got, timeout, node_exit)
        row["completed"] = (rc == 0 and got is not None and not got["died"] and not got["errors"]
                            and got["files"] == len(self.relpaths)
                            and (row["mount"] is None or row["mount"]["alive"]))
        if row["completed"] and row["seconds"]:
            row["files_per_s"] = row["files"] / row["seconds"]
            row["mb_per_s"] = row["bytes"] / 1e6 / row["seconds"]
            row["cpu_us_per_file"] = cpu * 1e6 / row["files"] if cpu is not None and row["files"] else None
        return row

    def _node_up(self) -> None:
        """Start the dlfs node again where an earlier epoch ended it (an OOM kill in the group), saying so:
        each epoch is measured on a node that runs."""
        proc = self.node.proc
        if proc is not None and proc.poll() is not None:
            self.say(f"memory: the dlfs node had exited ({proc.returncode}); starting it again in the group")
            self.node.start()

    def _status(self, row: dict[str, Any], rc: int | None, got: dict[str, Any] | None, timeout: float,
                node_exit: int | None = None) -> str:
        """What became of an epoch, in a few words, the group's OOM kills last; with node_exit, that the dlfs
        node is gone as well."""
        oom = _oom_phrase(row["oom_kills"])
        what = self._failure(row, rc, got, timeout)
        if what is None and got is not None and got["bad"] and not row["oom_kills"]:
            what = f"wrong bytes in {got['bad']} files, e.g. {got['bad_files'][0]}"
        if node_exit is not None:
            return f"{f'{what};' if what else 'completed, but'} the dlfs node died (exit {node_exit}){oom}"
        if what is not None:
            return what + oom
        return f"completed, but{oom}" if row["oom_kills"] else "ok"

    def _failure(self, row: dict[str, Any], rc: int | None, got: dict[str, Any] | None, timeout: float) -> str | None:
        """Why the epoch did not complete (without the group's OOM kills), or None where it did."""
        mount = row["mount"]
        if mount is not None and not mount["alive"]:
            return "the mount died"
        if rc is None:
            return f"timed out after {timeout:.0f} s"
        if rc < 0:
            return f"the readers' process was killed by signal {-rc}"
        if got is None:
            return f"the readers' process exited {rc} without a result (see {self.work / 'readers.log'})"
        if got["died"]:
            return f"a reader died (exit {', '.join(map(str, got['died']))})"
        if got["errors"]:
            return f"{got['errors']} read errors, e.g. {got['error_examples'][0]}"
        if got["files"] != len(self.relpaths):
            return f"read {got['files']} of {len(self.relpaths)} files"
        return None


def _oom_phrase(kills: int) -> str:
    return f" ({kills} OOM kill{'s' if kills != 1 else ''} in the group)" if kills else ""


def choose_dataset(work: Path, limit: int, mean_size: int, src: Path | None, total: int | None,
                   say: Say) -> tuple[Path, list[str], int, bool]:
    """The bench's own sample where its size is 2-3 times the limit, else one of DATASET_RATIO times
    the limit generated in <work>/memory-sample-<limit> (kept between runs: one for each limit, so that
    --quick and full runs do not rebuild each other's); (root, relpaths, bytes, generated)."""
    if src is not None and total is not None and REUSE_RATIOS[0] <= total / limit <= REUSE_RATIOS[1]:
        return src, list_files(str(src)), total, False
    root = work / f"memory-sample-{size_text(limit).replace(' ', '').lower()}"
    n_files = max(1, round(DATASET_RATIO * limit / mean_size))
    size = n_files * mean_size
    have = _kept_bytes(root)
    need = int(SPACE_FACTOR * size) - have
    free = shutil.disk_usage(work).free
    if free < need:
        raise StorageFull(f"{work} has {free / 1e9:.1f} GB free; the bigger-than-memory section needs "
                          f"{need / 1e9:.1f} GB (a {size / 1e9:.2f} GB sample, its image and chunks)")
    say(f"memory: sample of {n_files} ImageNet-like files (~{size / 1e9:.2f} GB, {DATASET_RATIO}x the "
        f"{size_text(limit)} limit) in {root} (kept between runs)")
    info = make_sample(root, n_files=n_files, mean_size=mean_size)
    return root, list_files(str(root)), info.total_bytes, True


def _kept_bytes(root: Path) -> int:
    try:
        return int(json.loads((root / MARKER).read_text())["total_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def run_bigger_than_memory(work_dir: Path, limit: int, say: Say, *, src: Path | None = None,
                           total: int | None = None, mean_size: int = 110_000, transport: str | None = None,
                           io_uring: str | None = None) -> dict[str, Any]:
    """The section's figures (see the module's docstring); never raises for what it measures or for a
    machine that cannot run it, and leaves nothing mounted, running or grouped."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"limit_bytes": limit, "readers": READERS, "batch": BATCH, "mount_slack_bytes": MOUNT_SLACK}
    if os.geteuid() != 0:
        return {**out, "skipped": "needs root to make a memory cgroup"}
    work = work_dir.absolute() / "memory"
    work.mkdir(parents=True, exist_ok=True)
    mnt = work / "mnt"
    unmount_all_under(mnt)  # what an interrupted earlier run left
    try:
        group = MemoryGroup.create(GROUP, limit)
    except OSError as exc:
        reason = f"no memory cgroup could be made here: {exc.strerror or exc}"
        say(f"memory: skipped, {reason}")
        return {**out, "skipped": reason}
    out["group"], out["cgroup_version"] = str(group.path), group.version
    with ExitStack() as stack:
        stack.callback(_remove_group, group)
        try:
            _run(out, work, work_dir.absolute(), group, limit, say, stack, src, total, mean_size, transport, io_uring)
        except (DlfsError, OSError, subprocess.SubprocessError) as exc:
            log.warning("the bigger-than-memory section failed: %s", exc)
            say(f"memory: failed: {exc}")
            out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall_s"] = time.monotonic() - t0
    return out


def _remove_group(group: MemoryGroup) -> None:
    try:
        group.remove()
    except OSError as exc:
        log.warning("could not remove the memory cgroup %s: %s", group.path, exc)


def _run(out: dict[str, Any], work: Path, bench_dir: Path, group: MemoryGroup, limit: int, say: Say,
         stack: ExitStack, src: Path | None, total: int | None, mean_size: int, transport: str | None,
         io_uring: str | None) -> None:
    """The section, its figures put in `out` as they come (so that a failure keeps what was measured)."""
    root, relpaths, nbytes, generated = choose_dataset(bench_dir, limit, mean_size, src, total, say)
    out["dataset"] = {"src": str(root), "files": len(relpaths), "bytes": nbytes, "ratio": nbytes / limit,
                      "generated": generated}
    sec = Section(work, group, limit, root, relpaths, nbytes, say, transport, io_uring)
    node = sec.node
    node.stop_leftover()
    node.check_unused()
    shutil.rmtree(node.home, ignore_errors=True)
    image = work / "squash.img"
    mnt = work / "mnt"

    say(f"memory: a {size_text(limit)} cgroup ({group.path}); dlfs node started in it; ingest and mksquashfs "
        f"of {len(relpaths)} files ({nbytes / 1e9:.2f} GB, {nbytes / limit:.2f}x the limit), untimed")
    node.start()
    stack.callback(node.stop)
    stack.callback(unmount_all_under, mnt)
    node.cli("ingest", str(root), "--name", DATASET)
    build_squashfs(root, image)
    say("memory: xxh3 of every source file (untimed, outside the group)")
    (work / "list.json").write_text(json.dumps({"relpaths": relpaths, "digests": source_digests(root, relpaths)}))

    local = LocalDisk(root)
    squash = GroupSquashfuseLL(image, mnt / "squashfuse_ll", work / "squashfuse_ll.log", group)
    dlfs = DlfsMount(node, DATASET, mnt / "dlfs")
    for fs in (squash, dlfs):
        fs.root.mkdir(parents=True, exist_ok=True)
        stack.callback(_quietly, fs.unmount)
    epochs: list[tuple[str, System, str]] = [
        ("local", local, "open"), ("squashfuse_ll", squash, "open"), ("fuse", dlfs, "open"),
        ("direct_random", dlfs, "direct_random"), ("direct_chunk", dlfs, "direct_chunk")]
    out["rows"] = sec.rows  # filled as the epochs go: an error part-way leaves those done
    for key, s, mode in epochs:
        say(f"memory: epoch, {ROWS[key]} ({HOW[key]}), page cache dropped, fresh mount")
        sec.rows[key] = row = sec.run_epoch(key, s, mode)
        if row["status"] != "ok":
            say(f"memory: {ROWS[key]}: {row['status']}")
        if s is squash:
            _quietly(squash.unmount)
    _quietly(dlfs.unmount)
    out.update(sec.bound or {"cache_bytes": None, "cache_from": None, "index_bytes": None, "bound_bytes": None})
    base = sec.rows["local"]["files_per_s"] if sec.rows["local"]["completed"] else None
    for row in sec.rows.values():
        row["vs_local"] = row["files_per_s"] / base if base and row["files_per_s"] else None
    bound = out.get("bound_bytes")
    for key in DLFS_ROWS:
        m = sec.rows[key]["mount"]
        if m is not None:
            m["bound_bytes"] = bound
            m["vs_bound"] = m["peak_anon_shmem"] / bound if bound else None


def mount_bound(node: DlfsNode, mount: DlfsMount, limit: int) -> dict[str, Any]:
    """The mount's memory bound: its cache's capacity (as its stats publish it; else what `--cache-size
    auto` gives in this group) + MOUNT_SLACK + the size of the index it mapped."""
    from dlfs.stats import read_sample

    cache: int | None = None
    how = "as the mount publishes it"
    deadline = time.monotonic() + 5
    while cache is None and time.monotonic() < deadline:
        try:
            cache = int(read_sample(node.home, mount.root.absolute())["cache_capacity"])
        except (DlfsError, OSError, KeyError, ValueError):
            time.sleep(0.1)
    if cache is None:
        from dlfs.cgroup import MemoryLimit, physical_memory
        from dlfs.mount.cache import auto_cache_size

        cache = auto_cache_size(MemoryLimit(physical_memory(), limit, None))
        how = "as --cache-size auto makes it in the group"
    indexes = sorted((node.home / "mounts" / "index").glob(f"{DATASET}.*.idx"), key=lambda p: p.stat().st_mtime)
    index = indexes[-1].stat().st_size if indexes else 0
    return {"cache_bytes": cache, "cache_from": how, "index_bytes": index,
            "bound_bytes": cache + MOUNT_SLACK + index}


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # cleanup goes on; the safety net unmounts what this left
        log.warning("cleanup: %s", exc)
