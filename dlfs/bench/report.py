"""`dlfs bench`'s report: the targets of issues 4, 5 and 12, the printed tables, and the plot.

Everything here reads the figures run_bench returned (the JSON report) and measures nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlfs.bench.cold import cold_targets, format_cold
from dlfs.bench.ingest import ingest_table, ingest_targets
from dlfs.bench.memory import DLFS_ROWS, size_text
from dlfs.errors import UsageError

BASELINES = ("local", "squashfuse_ll", "kernel_squashfs")
SHORT = {"local": "local", "squashfuse_ll": "sqfs-ll", "kernel_squashfs": "kernel"}
EPOCH_PASSES = {"cold": "cold", "warm": "warm", "warm_raw": "warm, raw", "warm_run": "warm, run"}
TESTS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<": operator.lt, "<=": operator.le,
                                                   "==": operator.eq}


# --- targets --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _readers(n: str) -> str:
    return f"{n} reader{'s' if n != '1' else ''}"


def target(name: str, value: float | None, goal: float, unit: str, op: str = ">=") -> dict[str, Any]:
    """One target: its measured value against its goal; met is None where the value was not measured."""
    return {"target": name, "value": value, "goal": goal, "unit": unit, "op": op,
            "met": None if value is None else TESTS[op](value, goal)}


def check(name: str, ok: bool | None) -> dict[str, Any]:
    """A yes-or-no target (it completed, say); None where it was not measured."""
    return target(name, ok, True, "", op="==")


def _pick(by: dict[str, Any] | None, name: str, key: str) -> float | None:
    return by[name][key] if by is not None else None


def epoch_targets(epoch: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's epoch targets, the framework way of reading (open(p, "rb"), default buffering), and
    issue 21's warm one under `dlfs run`."""
    warm2, run2 = epoch["warm"].get("2"), epoch.get("warm_run", {}).get("2")
    rows = [target('warm epoch, open(p, "rb"), 2 readers: dlfs / local disk (hot page cache)',
                   _ratio(_pick(warm2, "dlfs", "files_per_s"), _pick(warm2, "local", "files_per_s")), 0.8, "x"),
            # Issue 21's: both sides' readers under `dlfs run` (the preload library answers isatty()).
            target('warm epoch under dlfs run, open(p, "rb"), 2 readers: dlfs / local disk (hot page cache)',
                   _ratio(_pick(run2, "dlfs", "files_per_s"), _pick(run2, "local", "files_per_s")), 1.0, "x")]
    for n in ("2", "4"):
        cold = epoch["cold"].get(n)
        rows.append(target(f"cold epoch, {n} readers: dlfs / squashfuse_ll",
                           _ratio(_pick(cold, "dlfs", "files_per_s"), _pick(cold, "squashfuse_ll", "files_per_s")),
                           1.5, "x"))
    for n, by in epoch["cold"].items():
        rows.append(target(f"mount CPU per cold file, {_readers(n)}: dlfs / squashfuse_ll",
                           _ratio(by["dlfs"]["cpu_us_per_file"], by["squashfuse_ll"]["cpu_us_per_file"]),
                           1.0, "x", op="<="))
    return rows


def bigfile_targets(big: dict[str, Any]) -> list[dict[str, Any]]:
    """Issues 12 and 21's big-file targets: random 4 KiB preads and the cold sequential read."""
    pread, seq = big["pread"], big["sequential"]
    return [
        target("random 4 KiB preads in big files: bytes read by the mount / bytes served",
               pread["dlfs"]["mount_read_ratio"], 2.0, "x", op="<="),
        target("random 4 KiB preads in big files: preads/s dlfs / squashfuse_ll",
               _ratio(pread["dlfs"]["preads_per_s"], pread["squashfuse_ll"]["preads_per_s"]), 1.0, "x"),
        target("random 4 KiB preads in big files: block-device bytes / bytes served, dlfs",
               pread["dlfs"].get("blockdev_read_ratio"), 1.2, "x", op="<="),
        target("sequential read of big files, cold, open().read(): dlfs / local disk",
               _ratio(seq["dlfs"]["mb_per_s"], seq["local"]["mb_per_s"]), 0.9, "x"),
    ]


def other_targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Issues 4 and 5's targets besides the epochs: metadata, ingest, dlfs.direct, torch, two jobs, scale."""
    md = out["metadata"]
    rows = [
        target("metadata walk: dlfs / squashfuse_ll",
               _ratio(md["dlfs"]["entries_per_s"], md["squashfuse_ll"]["entries_per_s"]), 5.0, "x"),
        target("metadata walk: dlfs / local disk", _ratio(md["dlfs"]["entries_per_s"], md["local"]["entries_per_s"]),
               0.5, "x"),
        target("ingest: dlfs / mksquashfs", out["ingest"]["ratio"], 1.0, "x"),
        target("dlfs.direct read_many, warm: files/s / local disk, hot page cache",
               out["direct"]["warm"]["batched"]["vs_local"], 3.0, "x"),
    ]
    if "skipped" not in out["torch"]:
        for kind, by_workers in out["torch"].items():
            for w, by in by_workers.items():
                rows.append(target(f"torch DirectDataset ({kind}), {w} workers: dlfs / open() on local disk",
                                   by["vs_local"], 1.5, "x"))
    rows.append(target("two concurrent jobs: bytes fetched / dataset size", out["two_jobs"]["fetched_ratio"], 1.1, "x",
                       op="<="))
    points = out["scale"]["points"]
    if points:
        big = max(points, key=lambda p: p["files"])
        rows.append(target(f"mount of a {big['files']:,}-file index (first mount)", big["mount_s"], 2.0, "s", op="<"))
        if out["scale"]["rss_bytes_per_file"] is not None:
            small = min(points, key=lambda p: p["files"])
            rows.append(target(f"mount's RSS per file beyond a base ({small['files']:,} to {big['files']:,})",
                               out["scale"]["rss_bytes_per_file"], 100.0, "B", op="<"))
    return rows


def memory_targets(mem: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's targets: a dataset 2.3 times a memory cgroup's limit, read in that group (n/a where
    the section could not run, or failed part-way). A ratio of a pass that did not complete is 0: it
    reached nothing."""
    rows = mem.get("rows") if "error" not in mem else None

    def ok(key: str, bytes_too: bool = False) -> bool | None:
        if rows is None:
            return None
        r = rows[key]
        return bool(r["completed"] and r["oom_kills"] == 0 and (r["bytes_ok"] is True or not bytes_too))

    def vs_local(key: str) -> float | None:
        if rows is None or not rows["local"]["completed"]:
            return None
        return rows[key]["vs_local"] if rows[key]["completed"] else 0.0

    def cpu_vs(key: str, base: str) -> float | None:
        if rows is None or not rows[key].get("cpu_us_per_file") or not rows[base].get("cpu_us_per_file"):
            return None
        return rows[key]["cpu_us_per_file"] / rows[base]["cpu_us_per_file"]

    peaks = [r["mount"]["vs_bound"] for k in DLFS_ROWS if rows is not None
             and (r := rows[k])["mount"] is not None and r["mount"]["vs_bound"] is not None]
    where = "bigger than memory"
    return [
        check(f"{where}: FUSE epoch, 2 readers: completes, no OOM kill", ok("fuse")),
        target(f"{where}: FUSE epoch, 2 readers: dlfs / local disk, same cgroup", vs_local("fuse"), 0.8, "x"),
        check(f"{where}: dlfs.direct random: completes, no OOM kill, bytes ok", ok("direct_random", bytes_too=True)),
        target(f"{where}: dlfs.direct + chunk-local sampler / local disk", vs_local("direct_chunk"), 2.0, "x"),
        target(f"{where}: mount's peak anon+shmem / (cache + 64 MiB + index)", max(peaks, default=None), 1.0,
               "x", op="<="),
        target(f"{where}: FUSE epoch / local disk, issue 21's goal", vs_local("fuse"), 1.0, "x"),
        target(f"{where}: mount CPU per file, FUSE epoch: dlfs / squashfuse_ll", cpu_vs("fuse", "squashfuse_ll"),
               0.8, "x", op="<="),
    ]


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Issues 4, 5, 12 and 13's targets: each a measured value, its goal, and whether it is met (those of
    the sections the run had)."""
    rows = []
    if "epoch" in out:
        rows += [*epoch_targets(out["epoch"]), *bigfile_targets(out["bigfiles"]), *other_targets(out)]
    if "cold" in out:
        rows += cold_targets(out["cold"])
    if "memory" in out:
        rows += memory_targets(out["memory"])
    if "ingest_trees" in out:
        rows += ingest_targets(out["ingest_trees"])
    return rows


# --- the printed report -----------------------------------------------------------------------------
def _num(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _vs_header() -> str:
    return "".join(f"{'vs ' + SHORT[b]:>11}" for b in BASELINES)


def _vs(by: dict[str, Any], r: dict[str, Any], key: str) -> str:
    """r's `key` over each baseline's, in columns."""
    return "".join(f"{_x(_ratio(r[key], by[b][key])):>11}" for b in BASELINES)


def format_report(out: dict[str, Any]) -> str:
    """The human report: header, figures with their ratios to each baseline, and the targets (of the
    sections the run had: all, or --only memory's)."""
    m = out["machine"]
    lines = [
        f"dlfs bench  {out['date']}{'  (--quick)' if out['quick'] else ''}"
        f"{'  (--only ' + ','.join(out['only']) + ')' if out.get('only') else ''}",
        f"machine:  {m['nproc']} CPUs ({m['cpu'] or 'unknown model'}), {m['memory_bytes'] / 2**30:.1f} GiB memory, "
        f"{m['system']} {m['kernel']}",
    ]
    if "epoch" in out:
        lines += format_main(out)
    else:
        lines += ["passes:", *(f"  {k:<15} {v}" for k, v in out["passes"].items())]
    if "cold" in out:
        lines += format_cold(out["cold"])
    if "memory" in out:
        lines += format_memory(out["memory"])
    if "ingest_trees" in out:
        lines += ["", *ingest_table(out["ingest_trees"])]
    lines += format_targets(out["targets"])
    lines += ["", f"wall time: {out['wall_s']:.0f} s"]
    return "\n".join(lines)


def format_main(out: dict[str, Any]) -> list[str]:
    """Every section but the memory one: the dataset, reads and passes, then each table."""
    d = out["dataset"]
    labels: dict[str, str] = out["systems"]
    where = "generated ImageNet-like sample" if d["generated"] else "given source"
    lines = [
        f"dataset:  {d['files']:,} files, {d['bytes'] / 1e9:.2f} GB ({where}: {d['src']})",
        *([f"dlfs:     {e['threads']} native serving threads, FUSE over io_uring {e['io_uring']}"]
          if (e := out.get("engine")) else ["dlfs:     served by Python alone (no native engine)"]),
        "reads:",
        *(f"  {k:<15} {v}" for k, v in out["reads"].items()),
        "passes:",
        *(f"  {k:<15} {v}" for k, v in out["passes"].items()),
        f"  verify          dlfs read all {out['verify']['files']:,} files byte-identical to the source "
        f"({out['verify']['errors']} errors; an untimed pass), and all {out['bigfiles']['verify']['files']} big files "
        f"({out['bigfiles']['verify']['errors']} errors)",
        "",
    ]
    lines += format_epoch(out)
    lines += ["", f"{'METADATA: walk + lstat':<41}{'entries/s':>9}{'entries':>9}{_vs_header()}"]
    md = out["metadata"]
    for name, r in md.items():
        lines.append(f"  {'':<22}{labels[name]:<17}{_num(r['entries_per_s']):>9}{r['entries']:>9,}"
                     f"{_vs(md, r, 'entries_per_s')}")
    ing = out["ingest"]
    lines += ["", f"{'INGEST':<41}{'MB/s':>9}{'seconds':>9}",
              f"  {'':<22}{'dlfs ingest':<17}{_num(ing['dlfs']['mb_per_s'], 1):>9}{_num(ing['dlfs']['seconds'], 1):>9}",
              f"  {'':<22}{'mksquashfs lz4':<17}{_num(ing['mksquashfs']['mb_per_s'], 1):>9}"
              f"{_num(ing['mksquashfs']['seconds'], 1):>9}",
              f"  {'':<22}{'dlfs / mksquashfs':<17}{_x(ing['ratio']):>9}"]
    lines += format_bigfiles(out)
    lines += format_direct(out)
    lines += format_scale(out)
    return lines


def format_epoch(out: dict[str, Any]) -> list[str]:
    """The epoch table: files/s, MB/s, ratios to each baseline and the serving process's CPU per file."""
    labels: dict[str, str] = out["systems"]
    lines = [f"{'EPOCH: every file once, random order':<41}{'files/s':>9}{'MB/s':>9}{_vs_header()}"
             f"{'CPU µs/file':>12}{'CPU s/GB':>10}"]
    for kind, title in EPOCH_PASSES.items():
        for readers, by in out["epoch"].get(kind, {}).items():
            for i, (name, r) in enumerate(by.items()):
                lines.append(_read_row(f"{title}, {_readers(readers)}" if i == 0 else "", labels[name], r, by,
                                       "files_per_s"))
    lines.append("  cold and warm read as frameworks do (reads: open); warm, raw: the same files unbuffered "
                 "(reads: raw);")
    lines.append("  warm, run: as frameworks do, the readers under `dlfs run` (isatty() answered in the process). "
                 "CPU: the FUSE daemon's")
    lines.append("  utime+stime (/proc/PID/stat: all its threads, and processes it started) per file read; '-' where "
                 "the kernel serves (its CPU is not charged).")
    return lines


def _read_row(first: str, label: str, r: dict[str, Any], by: dict[str, Any], vs_key: str, digits: int = 0) -> str:
    """A row of whole-file reads: files/s, MB/s, r's `vs_key` over each baseline's, CPU per file and per GB."""
    return (f"  {first:<22}{label:<17}{_num(r['files_per_s'], digits):>9}{_num(r['mb_per_s'], 1):>9}"
            f"{_vs(by, r, vs_key)}{_num(r['cpu_us_per_file']):>12}{_num(r['cpu_s_per_gb'], 2):>10}")


def format_bigfiles(out: dict[str, Any]) -> list[str]:
    """The big-file tables: random 4 KiB preads (rate, CPU, bytes read per byte served) and sequential reads."""
    labels: dict[str, str] = out["systems"]
    big = out["bigfiles"]
    d, pread = big["dataset"], big["pread"]
    n = next(iter(pread.values()))["preads"]
    lines = ["", f"BIG FILES: {d['files']} files of {d['file_bytes'] / 1e6:.1f} MB ({d['bytes'] / 1e9:.2f} GB of "
             f"{d['content']}), one reader; each pass on a fresh mount, page cache dropped",
             f"{f'  random 4 KiB preads ({n:,})':<41}{'preads/s':>9}{'MB/s':>9}{_vs_header()}{'CPU µs/pread':>13}"
             f"{'disk/served':>12}{'blkdev/served':>14}{'mount/served':>13}"]
    for name, r in pread.items():
        lines.append(f"  {'':<22}{labels[name]:<17}{_num(r['preads_per_s']):>9}{_num(r['mb_per_s'], 1):>9}"
                     f"{_vs(pread, r, 'preads_per_s')}{_num(r['cpu_us_per_pread']):>13}{_x(r['disk_read_ratio']):>12}"
                     f"{_x(r.get('blockdev_read_ratio')):>14}{_x(r['mount_read_ratio']):>13}")
    lines.append("  disk/served: bytes the reader and the serving processes read from storage (/proc/PID/io); "
                 "mount/served: the dlfs mount's fetched bytes (its stats)")
    first = next(iter(pread.values()))
    if first.get("blockdev_read_bytes") is not None:
        nulls = ", ".join(f"{labels[name]} {r['blockdev_null_bytes'] / 1e3:,.0f} kB in {r['blockdev_s']:.1f} s"
                          for name, r in pread.items())
        lines.append(f"  blkdev/served: bytes read from {first['blockdev']} during the pass, less those an idle run "
                     f"as long read right after ({nulls})")
    elif "blockdev" in first:
        lines.append(f"  blkdev/served: not measured: {first['blockdev']}")
    lines.append(f"{'  sequential: every file whole, cold':<41}{'files/s':>9}{'MB/s':>9}{_vs_header()}"
                 f"{'CPU µs/file':>12}{'CPU s/GB':>10}")
    for kind, title in (("sequential", "open().read()"), ("sequential_raw", "raw, 1 MiB readinto")):
        for i, (name, r) in enumerate(big[kind].items()):
            lines.append(_read_row(title if i == 0 else "", labels[name], r, big[kind], "mb_per_s", digits=1))
    return lines


def format_direct(out: dict[str, Any]) -> list[str]:
    """The zero-copy section: dlfs.direct, dlfs.torch and two jobs, each beside its baseline."""
    d = out["direct"]
    head = f"{'files/s':>11}{'MB/s':>10}{'vs local':>10}"
    lines = ["", f"{'DIRECT: dlfs.direct, one process':<46}{head}"]
    names = {"local": "local disk open()", "single": "dlfs.direct read()", "batched": "dlfs.direct read_many()"}

    def row(title: str, label: str, r: dict[str, Any], ratio: float | None) -> str:
        return (f"  {title:<20}{label:<24}{_num(r['files_per_s']):>11}{_num(r['mb_per_s'], 1):>10}"
                f"{_x(ratio) if ratio is not None else '':>10}")

    for kind, title in (("cold", "cold"), ("warm", "warm, views"), ("warm_hash", "warm, xxh3 of bytes")):
        for i, (mode, r) in enumerate(d[kind].items()):
            lines.append(row(title if i == 0 else "", names[mode], r, r.get("vs_local")))
    t = out["torch"]
    lines += ["", f"{'TORCH: DirectDataset + DataLoader':<46}{head}"]
    if "skipped" in t:
        lines.append(f"  skipped: {t['skipped']}")
    for kind, by_workers in t.items() if "skipped" not in t else ():
        for w, by in by_workers.items():
            lines.append(row(f"{kind}, {w} workers", "open() on local disk", by["local"], None))
            lines.append(row("", "dlfs.direct", by["dlfs"], by["vs_local"]))
    j = out["two_jobs"]
    rates = ", ".join(f"{_num(r['files_per_s'])} files/s" for r in j["jobs"])
    lines += ["", "TWO JOBS at once on a fresh mount (dlfs.direct read_many)",
              f"  each job: {rates}; fetched {j['fetched_bytes'] / 1e9:.3f} GB for a {j['dataset_bytes'] / 1e9:.3f} GB "
              f"dataset = {j['fetched_ratio']:.3f}x (one job alone needs 1x)"]
    return lines


def format_scale(out: dict[str, Any]) -> list[str]:
    """The namespace-scale table: mount time and resident memory of synthetic indexes."""
    sc = out["scale"]
    lines = ["", f"NAMESPACE SCALE: synthetic index, {sc['per_dir']} files a folder; `dlfs mount` wall time, "
             "mount process VmRSS",
             f"  {'files':>11}{'index MB':>10}{'mount s':>9}{'RSS MB':>8}{'+stat':>7}{'remount s':>11}{'RSS MB':>8}"
             f"{'+stat':>7}"]
    for p in sc["points"]:
        lines.append(f"  {p['files']:>11,}{p['index_bytes'] / 1e6:>10.1f}{p['mount_s']:>9.2f}"
                     f"{p['rss_mount'] / 1e6:>8.1f}{p['rss_stat'] / 1e6:>7.1f}{p['remount_s']:>11.2f}"
                     f"{p['rss_remount'] / 1e6:>8.1f}{p['rss_remount_stat'] / 1e6:>7.1f}")
    if sc["rss_bytes_per_file"] is not None:
        lines.append(f"  resident memory per file beyond a fixed base, after the stat: "
                     f"{sc['rss_bytes_per_file']:.0f} B (first mount), "
                     f"{sc['rss_bytes_per_file_remount']:.0f} B (remount)")
        if sc.get("index_bytes_per_file") is not None:
            lines.append(f"  of which the index file, pinned in memory (mlock: no LOOKUP waits for the disk): "
                         f"{sc['index_bytes_per_file']:.0f} B a file, its own size")
    lines.append("  mount: the first, which also fetches the index from the node; remount: the index is cached locally")
    return lines


def format_memory(mem: dict[str, Any]) -> list[str]:
    """The bigger-than-memory table: each epoch in the group, its rate, OOM kills, the mount's memory
    against its bound and whether the bytes were right; why a pass failed, or why none ran."""
    limit = size_text(mem["limit_bytes"])
    d = mem.get("dataset")
    if d is None:
        why = f"skipped: {mem['skipped']}" if "skipped" in mem else f"failed before measuring: {mem.get('error')}"
        return ["", f"BIGGER THAN MEMORY ({limit} cgroup)", f"  {why}"]
    lines = ["", f"BIGGER THAN MEMORY ({limit} cgroup, dataset {d['bytes'] / 1e9:.2f} GB = {d['ratio']:.2f}x the "
             f"limit: {d['files']:,} files, {'generated in' if d['generated'] else 'the bench sample'} {d['src']})",
             f"  in the group (cgroup v{mem['cgroup_version']}): the dlfs node, each mount (default options), "
             "squashfuse_ll and every reader; each epoch: page cache dropped, fresh mount"]
    if mem.get("bound_bytes") is not None:
        lines.append(f"  mount bound: cache {size_text(mem['cache_bytes'])} ({mem['cache_from']}) + "
                     f"{size_text(mem['mount_slack_bytes'])} + index {mem['index_bytes'] / 1e6:.1f} MB = "
                     f"{size_text(mem['bound_bytes'])}")
    if "error" in mem:
        lines.append(f"  failed: {mem['error']}")
    rows = mem.get("rows") or {}
    lines.append(f"  {'':<25}{'':<27}{'files/s':>9}{'MB/s':>9}{'vs local':>10}{'CPU us/file':>12}{'OOM kills':>11}"
                 f"{'mount anon+shmem peak':>26}{'group anon+shmem':>18}{'bytes ok':>10}")
    notes = []
    for r in rows.values():
        m = r["mount"]
        if m is None:
            peak = "-"
        elif m.get("bound_bytes"):
            peak = f"{m['peak_anon_shmem'] / 2**20:.0f} / {m['bound_bytes'] / 2**20:.0f} MiB ({m['vs_bound']:.2f}x)"
        else:
            peak = f"{m['peak_anon_shmem'] / 2**20:.0f} MiB"
        ok = "-" if r["bytes_ok"] is None else "yes" if r["bytes_ok"] else f"NO ({r['bad_files']})"
        group = r.get("group_peak_unreclaimable")
        cpu = r.get("cpu_us_per_file")
        lines.append(f"  {r['label']:<25}{r['how']:<27}{_num(r['files_per_s']):>9}{_num(r['mb_per_s'], 1):>9}"
                     f"{_x(r['vs_local']):>10}{'-' if cpu is None else f'{cpu:.0f}':>12}{r['oom_kills']:>11}{peak:>26}"
                     f"{'-' if group is None else f'{group / 2**20:.0f} MiB':>18}{ok:>10}")
        if r["status"] != "ok":
            notes.append(f"  {r['label']}: {r['status']}")
    lines += notes
    lines.append("  every file once in a random order (chunk-local: the ChunkLocalSampler's); bytes checked against "
                 "xxh3 of the source, the hashing left out of the time;")
    lines.append("  memory sampled every 50 ms: the mount's RssAnon + RssShmem (/proc/PID/status), the group's "
                 "anon + shmem (memory.stat); CPU: the serving process's user + system time over the files read")
    return lines


def format_targets(rows: list[dict[str, Any]]) -> list[str]:
    """The targets block: each target's value, goal and result (pass, FAIL, or n/a where not measured)."""
    lines = ["", f"{'TARGETS (issues 4, 5, 12, 13, 21, 22)':<76}{'measured':>10}{'goal':>9}  result"]
    for t in rows:
        if isinstance(t["goal"], bool):  # a yes-or-no target (check())
            value = "-" if t["value"] is None else ("yes" if t["value"] else "no")
            goal = "yes"
        else:
            value = "-" if t["value"] is None else f"{t['value']:.{0 if t['unit'] == 'B' else 2}f}{t['unit']}"
            goal = t["op"] + " " + format(t["goal"], "g") + t["unit"]
        result = {True: "pass", False: "FAIL", None: "n/a (not measured)"}[t["met"]]
        lines.append(f"  {t['target']:<74}{value:>10}{goal:>9}  {result}")
    measured = [t for t in rows if t["met"] is not None]
    unmeasured = len(rows) - len(measured)
    lines.append(f"  {sum(t['met'] for t in measured)} of {len(measured)} targets met"
                 + (f"; {unmeasured} not measured in this run (see --readers)" if unmeasured else ""))
    return lines


# --- the plot ---------------------------------------------------------------------------------------
def check_plotting() -> None:
    """A one-line UsageError if --plot cannot work (before the long run, not after it)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'dlfs[bench]' (or pip install matplotlib)")


def write_plot(out: dict[str, Any], path: Path) -> None:
    """A PNG: files/s per system for each epoch workload, and entries/s of the metadata walk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels: dict[str, str] = out["systems"]
    names = list(labels)
    width = 0.8 / len(names)
    n_readers = len(out["epoch"]["cold"])
    # Separate panels: warm figures are ten times the cold ones and would flatten them on one axis.
    fig, axes = plt.subplots(1, 3, figsize=(14, 5.5), width_ratios=[n_readers + 0.6, n_readers + 0.6, 1.8])
    for ax, kind in zip(axes[:2], ("cold", "warm")):
        groups = list(out["epoch"][kind].items())
        for i, name in enumerate(names):
            xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
            ys = [by[name]["files_per_s"] for _, by in groups]
            bars = ax.bar(xs, ys, width, label=labels[name], color=f"C{i}")
            ax.bar_label(bars, labels=[f"{y / 1000:.1f}k" for y in ys], fontsize=7, rotation=90, padding=2)
        ax.set_xticks(range(len(groups)), [f"{r} reader{'s' if r != '1' else ''}" for r, _ in groups])
        ax.set_title(f"Epoch, {kind}: every file once, random order", fontsize=10)
        ax.set_ylabel("files/s (higher is better)")
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    for i, name in enumerate(names):
        y = out["metadata"][name]["entries_per_s"]
        bar = axes[2].bar([i], [y], 0.8, color=f"C{i}")
        axes[2].bar_label(bar, labels=[f"{y / 1000:.1f}k"], fontsize=7, rotation=90, padding=2)
    axes[2].set_xticks(range(len(names)), [labels[n] for n in names], rotation=30, ha="right", fontsize=8)
    axes[2].set_ylabel("entries/s")
    axes[2].set_title("Metadata walk + lstat", fontsize=10)
    axes[2].margins(y=0.15)
    m, d = out["machine"], out["dataset"]
    fig.suptitle(f"dlfs bench {out['date'][:16].replace('T', ' ')}: {d['files']:,} files, {d['bytes'] / 1e9:.2f} GB; "
                 f"{m['nproc']} CPUs, {m['memory_bytes'] / 2**30:.0f} GiB, Linux {m['kernel']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
