"""`dlfs stats MOUNTPOINT`: a top-like view of one mount, from the counters it publishes.

The mount replaces its stats file once a second (mount/statsfile.py); rates are the difference of two
of its samples divided by the time between them, as the mount itself measured it. `--json` prints
the same figures as one StatsView object (one a line with --watch: JSON Lines), for scripts.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from dlfs.errors import NotFound, UsageError
from dlfs.mount.statsfile import STATS_FORMAT, stats_file
from dlfs.procs import running
from dlfs.units import human_bytes, human_mib, iso_time

NEW_SAMPLE_WAIT = 3.0  # the mount writes every second; a little more for a busy machine


def read_sample(home: Path, mountpoint: Path) -> dict[str, Any]:
    """The mount's latest sample; NotFound with a one-line reason when there is no live mount."""
    path = stats_file(home, mountpoint)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(f"no dlfs mount at {mountpoint} under {home} (mounts made with another "
                       "--home or $DLFS_HOME are listed under that one)") from None
    except (OSError, ValueError) as exc:
        raise NotFound(f"cannot read the stats of {mountpoint} ({path}): {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != STATS_FORMAT:
        raise UsageError(f"{path} was written by another version of dlfs; use that version's `dlfs stats`")
    if not running(int(doc.get("pid", 0))):
        raise NotFound(f"the mount at {mountpoint} is gone (its process {doc.get('pid')} exited)")
    return doc


def next_sample(home: Path, mountpoint: Path, after: dict[str, Any], wait: float) -> dict[str, Any]:
    """The first sample taken at least `wait` seconds after `after` (or the newest one there is)."""
    deadline = time.monotonic() + wait + NEW_SAMPLE_WAIT
    time.sleep(wait)
    while True:
        doc = read_sample(home, mountpoint)
        if doc["time"] >= after["time"] + wait * 0.9 or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


@dataclass
class Rates:
    """What changed between two samples, per second where that is the natural unit."""

    seconds: float
    reads: float
    read_bytes: float
    latency: float | None  # mean seconds per read in the interval
    hits: int
    misses: int
    evictions: int
    fetched_bytes: float
    errors: int
    failovers: int
    checksum_failures: int
    node_bytes: dict[str, float]

    @property
    def hit_rate(self) -> float | None:
        looked = self.hits + self.misses
        return self.hits / looked if looked else None


def _hist(doc: dict[str, Any]) -> tuple[int, float]:
    return sum(doc["counts"]), float(doc["sum"])


def rates(prev: dict[str, Any], cur: dict[str, Any]) -> Rates:
    dt = max(cur["time"] - prev["time"], 1e-9)
    n0, s0 = _hist(prev["read_seconds"])
    n1, s1 = _hist(cur["read_seconds"])
    nodes = {name: (n["bytes"] - prev["by_node"].get(name, {}).get("bytes", 0)) / dt
             for name, n in cur["by_node"].items()}
    return Rates(
        seconds=dt, reads=(cur["reads"] - prev["reads"]) / dt, read_bytes=(cur["read_bytes"] - prev["read_bytes"]) / dt,
        latency=(s1 - s0) / (n1 - n0) if n1 > n0 else None,
        hits=cur["cache_hits"] - prev["cache_hits"], misses=cur["cache_misses"] - prev["cache_misses"],
        evictions=cur["cache_evictions"] - prev["cache_evictions"],
        fetched_bytes=(cur["fetched_bytes"] - prev["fetched_bytes"]) / dt,
        errors=cur["read_errors"] - prev["read_errors"], failovers=cur["failovers"] - prev["failovers"],
        checksum_failures=cur["checksum_failures"] - prev["checksum_failures"], node_bytes=nodes)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.3f} ms"


def _mbs(x: float) -> str:
    return f"{x / 1e6:.1f} MB/s"


def disk_cache_line(dc: dict[str, Any]) -> str:
    """The disk cache's row: held against its bound, and this mount's writes and evictions."""
    held = "?" if dc["held_bytes"] is None else human_bytes(dc["held_bytes"])
    if dc.get("broken"):
        return (f"not used since {dc['broken']}: the next mount or warmup starts it over; this mount wrote "
                f"{human_bytes(dc['written_bytes'])} before")
    if dc["size_bytes"] is not None:
        bound = f"{held} held of its --cache-dir-size {human_mib(dc['size_bytes'])}"
    elif dc["room_bytes"] is not None and dc["room_bytes"] < 0:
        bound = (f"{held} held; its file system is under {dc['free_share']:.0%} free, so it keeps next to "
                 "nothing (free space there, or give --cache-dir-size)")
    else:
        room = "?" if dc["room_bytes"] is None else human_bytes(dc["room_bytes"])
        bound = f"{held} held, room for {room} more (it keeps {dc['free_share']:.0%} of its file system free)"
    return (f"{bound}; this mount wrote {human_bytes(dc['written_bytes'])}, evicted {dc['evicted_chunks']:,} "
            f"chunks, left {dc['dropped_writes']:,} writes unkept (the disk behind)")


def render(prev: dict[str, Any], cur: dict[str, Any]) -> Any:
    """The view of one interval: a header line, the mount's figures, and bytes fetched by node."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    r = rates(prev, cur)
    up = datetime.timedelta(seconds=int(cur["time"] - cur["started"]))
    where = f", metrics at http://{cur['metrics']}/metrics" if cur.get("metrics") else ""
    head = Text(f"{cur['dataset']} at {cur['mountpoint']}\npid {cur['pid']}, up {up}{where}", style="bold")
    looked = cur["cache_hits"] + cur["cache_misses"]
    n_reads, lat_sum = _hist(cur["read_seconds"])
    t = Table(box=None, pad_edge=False)
    t.add_column("")
    t.add_column(f"last {r.seconds:.1f} s", justify="right")
    t.add_column("since mounted", justify="right")
    t.add_row("reads", f"{r.reads:,.0f}/s", f"{cur['reads']:,}")
    t.add_row("read", _mbs(r.read_bytes), human_bytes(cur["read_bytes"]))
    t.add_row("read latency (mean, misses)", _ms(r.latency), _ms(lat_sum / n_reads if n_reads else None))
    eng = cur.get("engine") or {}
    if eng:  # the native engine: what it answered in C, and what went to Python
        was = (prev.get("engine") or {})
        answered, forwarded = eng["answered"] - was.get("answered", 0), eng["forwarded"] - was.get("forwarded", 0)
        t.add_row("answered natively", _pct(answered / (answered + forwarded) if answered + forwarded else None),
                  f"{eng['answered']:,} of {eng['requests']:,} requests, {eng['threads']} threads, "
                  f"io_uring {eng['io_uring']}"
                  + (f", files of {human_mib(cur['direct_io_min'])} or more past the page cache (--direct-io)"
                     if cur.get("direct_io_min") else ""))
        if eng.get("record_reads") or eng.get("scan"):  # read-ahead out of room: files read whole in C
            files = eng.get("record_reads", 0) - was.get("record_reads", 0)
            mode = ("scan mode kept (a random order, or read-ahead full with a dataset bigger than it)"
                    if cur.get("scan_kept") else f"read-ahead {'full now' if eng.get('scan') else 'has room now'}")
            if eng.get("miss_readers"):  # what the random-order latch is judged against (cache.py)
                mode += f"; {eng['miss_readers']} reader{'s' * (eng['miss_readers'] > 1)} behind the latest misses"
            t.add_row("read whole from chunk files", f"{files / r.seconds:,.0f}/s" if r.seconds else "",
                      f"{eng.get('record_reads', 0):,} files, {eng.get('records_ahead_used', 0):,} started at their "
                      f"LOOKUP; {mode}")
        if eng.get("remote_reads") or eng.get("remote_failures"):  # scan mode's misses of other nodes' chunks
            files = eng.get("remote_reads", 0) - was.get("remote_reads", 0)
            t.add_row("fetched whole by the threads", f"{files / r.seconds:,.0f}/s" if r.seconds else "",
                      f"{eng.get('remote_reads', 0):,} files from data daemons; {eng.get('remote_failures', 0):,} "
                      "failed (an error, a lost connection, a bad check) and were fetched by Python")
        if eng.get("disk_cache_reads"):  # scan mode's records read from the disk cache's files
            files = eng.get("disk_cache_reads", 0) - was.get("disk_cache_reads", 0)
            t.add_row("read whole from the disk cache", f"{files / r.seconds:,.0f}/s" if r.seconds else "",
                      f"{eng.get('disk_cache_reads', 0):,} files, {human_bytes(eng.get('disk_cache_bytes', 0))}, "
                      "by the serving threads")
    t.add_row("cache hit rate", _pct(r.hit_rate), _pct(cur["cache_hits"] / looked if looked else None))
    t.add_row("cache hits / misses", f"{r.hits:,} / {r.misses:,}", f"{cur['cache_hits']:,} / {cur['cache_misses']:,}")
    t.add_row("cache evictions", f"{r.evictions:,}", f"{cur['cache_evictions']:,}")
    touched = cur.get("cache_touched")  # (a mount of an older dlfs does not say)
    t.add_row("cache held", "", f"{human_bytes(cur['cache_bytes'])} of {human_bytes(cur['cache_capacity'])}"
              + (f"; {human_bytes(touched)} of memory faulted in so far" if touched is not None else ""))
    t.add_row("fetched", _mbs(r.fetched_bytes), f"{human_bytes(cur['fetched_bytes'])} in {cur['fetches']:,} fetches, "
              f"{human_bytes(cur.get('in_place_bytes', 0))} read in place")
    dc = cur.get("disk_cache")
    if dc:  # --cache-dir: what it holds, what bounds it, what this mount wrote and evicted
        t.add_row("disk cache", _mbs((dc["written_bytes"] - ((prev.get("disk_cache") or {}).get("written_bytes", 0)))
                                     / r.seconds) + " written" if r.seconds else "", disk_cache_line(dc))
    t.add_row("read errors", f"{r.errors:,}", f"{cur['read_errors']:,}")
    t.add_row("failovers", f"{r.failovers:,}", f"{cur['failovers']:,}")
    t.add_row("checksum failures", f"{r.checksum_failures:,}", f"{cur['checksum_failures']:,}")
    if "direct_clients" in cur:  # files read in place by dlfs.direct cost no request: only misses show
        t.add_row("dlfs.direct", f"{cur['direct_clients']} attached",
                  f"{cur['direct_requests']:,} requests, {cur['direct_pinned'] + cur['direct_inline']:,} files fetched")
    parts: list[Any] = [head, t]
    if cur["failing_nodes"]:
        parts.append(Text(f"failing nodes (read last): {', '.join(cur['failing_nodes'])}", style="red"))
    nodes = Table(box=None, pad_edge=False, title="fetched by node", title_justify="left")
    nodes.add_column("node")
    nodes.add_column("now", justify="right")
    nodes.add_column("bytes", justify="right")
    nodes.add_column("fetches", justify="right")
    nodes.add_column("share", justify="right")
    total = cur["fetched_bytes"] or 1
    for name, n in sorted(cur["by_node"].items(), key=lambda kv: -kv[1]["bytes"]):
        nodes.add_row(name, _mbs(r.node_bytes.get(name, 0.0)), human_bytes(n["bytes"]), f"{n['fetches']:,}",
                      f"{100 * n['bytes'] / total:.0f} %")
    if not cur["by_node"]:
        nodes.add_row("(nothing fetched yet)", "", "", "", "")
    parts.append(nodes)
    return Group(*parts)


# --- --json: the view as data; these Structs are its documented schema (README: dlfs stats --json) ---
class IntervalFigures(Struct, frozen=True):
    """What happened between the two samples a view compares."""

    seconds: float
    reads_per_second: float
    read_bytes_per_second: float
    read_latency_mean_seconds: float | None  # reads that went to Python (misses); None: there were none
    cache_hit_rate: float | None  # 0..1; None: nothing was looked up
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    fetched_bytes_per_second: float
    read_errors: int
    failovers: int
    checksum_failures: int


class TotalFigures(Struct, frozen=True):
    """Counts since the mount started."""

    reads: int
    read_bytes: int
    read_latency_mean_seconds: float | None
    cache_hit_rate: float | None
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_bytes: int  # file data the cache holds now
    cache_capacity: int
    fetches: int
    fetched_bytes: int
    read_errors: int
    failovers: int
    checksum_failures: int
    in_place_bytes: int = 0  # read from this machine's chunk files, not through a daemon (see the stats file)


class EngineFigures(Struct, frozen=True):
    """The native engine: requests it answered in C, and those it forwarded to Python."""

    requests: int
    answered: int
    forwarded: int
    threads: int
    io_uring: str  # off, registering or serving (or why it stopped)
    direct_io_min: int = 0  # --direct-io: files this big are read past the page cache (0: none)
    # Whole files read from this machine's chunk files by the serving threads (scan mode: read-ahead had no
    # room), and how many of them were started at their LOOKUP, ahead of the READ (FUSE over io_uring).
    chunk_file_reads: int = 0
    started_at_lookup: int = 0
    scan: bool = False  # read-ahead has no room now: misses are read whole from chunk files, not by window
    scan_kept: bool = False  # and stays so: an epoch in a random order, or a dataset bigger than read-ahead
    # Whole files of other machines' chunks the serving threads fetched from data daemons themselves (scan
    # mode), and fetches of theirs that failed (an error, a lost connection, a bad check: Python's then).
    remote_reads: int = 0
    remote_failures: int = 0
    # Whole files read from the disk cache's files by the serving threads (scan mode, --cache-dir).
    disk_cache_reads: int = 0
    # Distinct processes behind the latest READs that went to Python (the random-order latch counts windows
    # partly read per reader: cache.py).
    miss_readers: int = 0


class DirectFigures(Struct, frozen=True):
    """dlfs.direct readers of the mount (files read in place cost no request)."""

    clients: int
    requests: int
    files_fetched: int


class DiskCacheFigures(Struct, frozen=True):
    """The mount's disk cache (--cache-dir): what it holds now (every process of the directory's), what
    bounds it, and what this mount wrote to it and evicted from it."""

    dir: str
    held_bytes: int | None  # None: the catalogue did not answer this instant
    size_bytes: int | None  # --cache-dir-size; None: bounded by its file system's free share instead
    room_bytes: int | None  # with no size: what it may still take (negative: over, it keeps next to nothing)
    written: int
    written_bytes: int
    evicted_chunks: int
    evicted_bytes: int
    dropped_writes: int  # fetched bytes not kept: the writer was behind
    full: int  # writes that found the disk full (each evicts and tries again)
    errors: int
    broken: str | None = None  # why this mount stopped using it (its catalogue damaged or removed under it)


class NodeFigures(Struct, frozen=True):
    """Bytes fetched from one node (`local`: this machine's chunk files)."""

    node: str
    bytes_per_second: float
    bytes: int
    fetches: int
    share: float  # of all bytes fetched since mounted, 0..1


class StatsView(Struct, frozen=True):
    """One `dlfs stats --json` line."""

    dataset: str  # NAME@VERSION
    mountpoint: str
    pid: int
    started: str  # ISO-8601, UTC
    started_unix: float
    time: str  # when the newer sample was taken
    time_unix: float
    uptime_seconds: float
    metrics: str | None  # HOST:PORT of the mount's Prometheus endpoint, if it serves one
    interval: IntervalFigures
    total: TotalFigures
    engine: EngineFigures | None
    direct: DirectFigures | None
    failing_nodes: list[str]
    nodes: list[NodeFigures]  # most bytes first
    thread_connections: dict[str, int] = {}  # the serving threads' connections to each data node
    disk_cache: DiskCacheFigures | None = None  # None: the mount has no --cache-dir


def view(prev: dict[str, Any], cur: dict[str, Any]) -> StatsView:
    """The figures render() shows, as data."""
    r = rates(prev, cur)
    looked = cur["cache_hits"] + cur["cache_misses"]
    n_reads, lat_sum = _hist(cur["read_seconds"])
    eng = cur.get("engine") or {}
    total = cur["fetched_bytes"] or 1
    return StatsView(
        dataset=cur["dataset"], mountpoint=cur["mountpoint"], pid=cur["pid"],
        started=iso_time(cur["started"]), started_unix=cur["started"], time=iso_time(cur["time"]),
        time_unix=cur["time"], uptime_seconds=round(cur["time"] - cur["started"], 3), metrics=cur.get("metrics"),
        interval=IntervalFigures(
            seconds=r.seconds, reads_per_second=r.reads, read_bytes_per_second=r.read_bytes,
            read_latency_mean_seconds=r.latency, cache_hit_rate=r.hit_rate, cache_hits=r.hits, cache_misses=r.misses,
            cache_evictions=r.evictions, fetched_bytes_per_second=r.fetched_bytes, read_errors=r.errors,
            failovers=r.failovers, checksum_failures=r.checksum_failures),
        total=TotalFigures(
            reads=cur["reads"], read_bytes=cur["read_bytes"],
            read_latency_mean_seconds=lat_sum / n_reads if n_reads else None,
            cache_hit_rate=cur["cache_hits"] / looked if looked else None, cache_hits=cur["cache_hits"],
            cache_misses=cur["cache_misses"], cache_evictions=cur["cache_evictions"], cache_bytes=cur["cache_bytes"],
            cache_capacity=cur["cache_capacity"], fetches=cur["fetches"], fetched_bytes=cur["fetched_bytes"],
            read_errors=cur["read_errors"], failovers=cur["failovers"], checksum_failures=cur["checksum_failures"],
            in_place_bytes=int(cur.get("in_place_bytes", 0))),
        engine=EngineFigures(eng["requests"], eng["answered"], eng["forwarded"], eng["threads"],
                             str(eng["io_uring"]), int(cur.get("direct_io_min", 0)), int(eng.get("record_reads", 0)),
                             int(eng.get("records_ahead_used", 0)), bool(eng.get("scan", False)),
                             bool(cur.get("scan_kept", False)), int(eng.get("remote_reads", 0)),
                             int(eng.get("remote_failures", 0)), int(eng.get("disk_cache_reads", 0)),
                             int(eng.get("miss_readers", 0))) if eng else None,
        direct=DirectFigures(cur["direct_clients"], cur["direct_requests"],
                             cur["direct_pinned"] + cur["direct_inline"]) if "direct_clients" in cur else None,
        failing_nodes=list(cur["failing_nodes"]), thread_connections=dict(cur.get("thread_connections", {})),
        disk_cache=msgspec.convert({k: v for k, v in cur["disk_cache"].items() if k != "free_share"},
                                   DiskCacheFigures) if cur.get("disk_cache") else None,
        nodes=[NodeFigures(name, r.node_bytes.get(name, 0.0), n["bytes"], n["fetches"], n["bytes"] / total)
               for name, n in sorted(cur["by_node"].items(), key=lambda kv: -kv[1]["bytes"])])


def _print_json(prev: dict[str, Any], cur: dict[str, Any]) -> None:
    sys.stdout.write(msgspec.json.encode(view(prev, cur)).decode() + "\n")
    sys.stdout.flush()  # a line as soon as it is known: a pipe's reader acts on each


def show(home: Path, mountpoint: Path, interval: float, watch: bool, count: int | None,
         as_json: bool = False) -> int:
    """Print one view (rates over `interval`), or with `watch` refresh it until Ctrl-C or `count` views;
    `as_json`: each view one StatsView JSON object on a line of its own."""
    from rich.console import Console
    from rich.live import Live

    if interval <= 0:
        raise UsageError("--interval must be more than 0 seconds")
    if count is not None and count < 1:
        raise UsageError("--count must be at least 1")
    # Piped, a view is not wrapped at rich's default 80 columns (a long mountpoint would break its first line).
    console = Console(width=None if sys.stdout.isatty() else 160)
    prev = read_sample(home, mountpoint)
    if not watch:
        cur = next_sample(home, mountpoint, prev, interval)
        if as_json:
            _print_json(prev, cur)
        else:
            console.print(render(prev, cur))
        return 0
    shown = 0

    def next_one(prev: dict[str, Any]) -> dict[str, Any]:
        try:
            return next_sample(home, mountpoint, prev, interval)
        except NotFound:  # it was there a view ago: not "no dlfs mount at ... (another --home?)"
            raise NotFound(f"the mount at {mountpoint} has ended (unmounted, or its process exited)") from None

    try:
        if console.is_terminal and not as_json:
            with Live(console=console, auto_refresh=False) as live:
                while count is None or shown < count:
                    cur = next_one(prev)
                    live.update(render(prev, cur), refresh=True)
                    prev, shown = cur, shown + 1
        else:  # a log or a pipe: one view after the other, like vmstat
            while count is None or shown < count:
                cur = next_one(prev)
                if as_json:
                    _print_json(prev, cur)
                else:
                    console.print(render(prev, cur))
                    console.print()
                    sys.stdout.flush()
                prev, shown = cur, shown + 1
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends
    return 0
