"""The `dlfs` command: one small function per subcommand."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from dlfs import __version__
from dlfs.client.replicas import RETRY_TIMEOUT
from dlfs.config import ROLES, check_dataset_name, home_dir, load_cluster, parse_cluster_file
from dlfs.errors import (
    NO_ROOM,
    CommandFailed,
    Conflict,
    DlfsError,
    MountError,
    StorageFull,
    Unreachable,
    UsageError,
)
from dlfs.private import UMASK as PRIVATE_UMASK
from dlfs.private import private_dirs
from dlfs.procs import give_freed_memory_back
from dlfs.tasks import leaves, open_nursery
from dlfs.units import counted, human_bytes, human_duration, human_mib, iso_time, parse_size
from dlfs.wire.budget import MIN_NODE_MEMORY, NODE_MEMORY, auto_node_memory

if TYPE_CHECKING:
    from dlfs.cgroup import MemoryLimit
    from dlfs.ingest.source import Source
    from dlfs.ingest.walk import Selection
    from dlfs.mount.records import StartLock

log = logging.getLogger("dlfs")
MOUNT_EXIT_WAIT = 30.0  # seconds a mount process that failed to start has to exit
SWEEP_CALL = 300.0  # seconds `dlfs rm` and `dlfs gc` wait for their daemon's answer: a collection sweeps the data nodes
EPILOG = "State lives under $DLFS_HOME (default ~/.dlfs); --cluster FILE (or $DLFS_CLUSTER) names a cluster."


def _setup_logging(args: argparse.Namespace, default: str = "WARNING") -> None:
    from dlfs.logs import setup_logging

    setup_logging(args.log_level or default, args.log_file)


def _positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (threads and the like)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return n


def _thread_count(text: str) -> int:
    """argparse type: --threads, 1 to what the serving engine takes."""
    from dlfs.native import engine_max_threads

    n = _positive_int(text)
    if n > engine_max_threads():
        raise argparse.ArgumentTypeError(f"expected at most {engine_max_threads()} (the serving engine's bound), "
                                         f"got {n}")
    return n


def _seconds(text: str) -> float:
    """argparse type: a number of seconds, 0 or more."""
    try:
        n = float(text)
    except ValueError:
        n = -1.0
    if not 0 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 or more), got {text!r}")
    return n


def _metrics_address(args: argparse.Namespace) -> Any:
    """--metrics as an address, checked before anything starts; None without it."""
    if not args.metrics:
        return None
    from dlfs.metrics import parse_metrics_address  # prometheus_client only where metrics are served

    return parse_metrics_address(args.metrics)


def _cluster(args: argparse.Namespace) -> Any:
    cluster = load_cluster(args.cluster, home_dir(args.home))
    if getattr(args, "transport", None):
        cluster.transport = args.transport  # --transport overrides the cluster file's setting
    return cluster


def _check_transport(cluster: Any, what: str) -> None:
    """For commands whose chunks only travel to daemons (writes, checks done there): RDMA carries
    reads, so these use TCP; `--transport rdma` still fails here, early, where RDMA cannot work."""
    from dlfs.transport.verbs import choose_transport

    if cluster.transport != "rdma":
        return  # auto: TCP is what these use anyway
    choice = choose_transport(cluster.transport, 0, what, cluster.rdma_device, cluster.rdma_port)
    log.info("%s: chunk writes and replica checks travel over TCP (RDMA carries reads: %s)", what, choice.reason)


# --- node ---------------------------------------------------------------------------------------
def cmd_node(args: argparse.Namespace) -> int:
    from dlfs.node import NodeOptions, run_node

    _setup_logging(args, "INFO")
    give_freed_memory_back()
    home = home_dir(args.home)
    cluster_file = args.cluster or os.environ.get("DLFS_CLUSTER")
    cluster = parse_cluster_file(Path(cluster_file)) if cluster_file else None
    memory = auto_node_memory() if args.memory == "auto" else parse_size(args.memory)
    if memory < MIN_NODE_MEMORY:
        raise UsageError(f"--memory must be at least {MIN_NODE_MEMORY >> 20}M")
    opts = NodeOptions(home, cluster, args.name, args.host, args.meta_port, args.data_port,
                       ROLES[args.role] if args.role else None, args.transport, _metrics_address(args),
                       args.replica_check, memory)
    trio.run(run_node, opts)
    return 0


# --- ingest -------------------------------------------------------------------------------------
class _ProgressBar:
    """One bar of a progress display on stderr when stderr is a terminal; otherwise (a Slurm or
    Kubernetes log) one plain line every $DLFS_PROGRESS_EVERY seconds (default 5), with rate and time
    left."""

    def __init__(self, bar: Any, label: str, unit: str) -> None:
        self.bar, self.label, self.unit = bar, label, unit
        self.task: Any = None
        self.done = self.bytes_done = 0
        self.total: int | None = None  # until start(), or for good where the totals come only at the end
        self.bytes_total: int | None = None
        self.plain = not sys.stderr.isatty()
        every = os.environ.get("DLFS_PROGRESS_EVERY", "5")
        try:
            self.every = float(every)
        except ValueError:
            raise UsageError(f"DLFS_PROGRESS_EVERY must be a number of seconds, not {every!r}") from None
        self.t0 = self.said = time.monotonic()

    @staticmethod
    def display(transient: bool = True) -> Any:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[items]}"),
                        DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), transient=transient,
                        disable=not sys.stderr.isatty(), console=Console(stderr=True))

    def show(self) -> None:
        """Show the bar before the totals are known."""
        self.task = self.bar.add_task(self.label, total=None, items="")

    def start(self, items: int | None, nbytes: int | None) -> None:
        """The totals (None: known only at the end, as for tar shards listed while they are read)."""
        self.total, self.bytes_total = items, nbytes
        self.t0 = self.said = time.monotonic()
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=nbytes, items=self._items())
        else:
            self.bar.update(self.task, total=nbytes, items=self._items())

    def _items(self) -> str:
        return f"{self.done}/{self.total} {self.unit}" if self.total is not None else f"{self.done} {self.unit}"

    def note(self, text: str) -> None:
        """A line for the user on stderr, above the bar where there is one."""
        if self.plain:
            print(f"dlfs: {text}", file=sys.stderr, flush=True)
        else:
            self.bar.console.print(f"dlfs: {text}", markup=False, highlight=False)

    def advance(self, items: int, nbytes: int) -> None:
        """`items` more done, and `nbytes` more of their bytes (a big item moves the bar as it goes)."""
        self.done += items
        self.bytes_done += nbytes
        self.bar.update(self.task, advance=nbytes, items=self._items())
        now = time.monotonic()
        if self.plain and now - self.said >= self.every:
            self.said = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        """The plain progress line: items, bytes, share, rate, time left."""
        rate = self.bytes_done / max(now - self.t0, 1e-9)
        if self.bytes_total is None:
            return f"{self.label}: {self._items()}, {human_bytes(self.bytes_done)}, {human_bytes(rate)}/s"
        share = f" ({100 * self.bytes_done / self.bytes_total:.0f}%)" if self.bytes_total else ""
        left = f", {human_duration((self.bytes_total - self.bytes_done) / rate)} left" if rate > 0 else ""
        return (f"{self.label}: {self._items()}, {human_bytes(self.bytes_done)} of "
                f"{human_bytes(self.bytes_total)}{share}, {human_bytes(rate)}/s{left}")


def _selection(args: argparse.Namespace) -> Selection:
    """What of the source the ingest takes (--files-from, --exclude); a bad list is a UsageError."""
    from dlfs.ingest.walk import Selection, read_list

    listed = None
    # Absolute paths name places in a local tree; a bucket's keys and tar members have none.
    root = None if args.expand_tar or args.src[0].startswith("s3://") else args.src[0]
    if args.files_from is not None:
        try:
            if args.files_from == "-":
                listed = read_list(sys.stdin.buffer, root)
            else:
                with open(args.files_from, "rb") as f:
                    listed = read_list(f, root)
        except OSError as exc:
            raise UsageError(f"--files-from: cannot read {args.files_from}: {exc.strerror}") from None
    for pat in args.exclude:
        if not pat.strip("/"):
            raise UsageError(f"--exclude {pat!r} would exclude everything")
    return Selection(listed, tuple(args.exclude))


def _source(args: argparse.Namespace) -> Source:
    """What SRC names: a local tree, an s3:// prefix, or (--expand-tar) shards."""
    from dlfs.ingest.source import LocalTree

    if args.expand_tar:
        from dlfs.ingest.tar import TarShards

        return TarShards(args.src, flatten=args.flatten, endpoint_url=args.endpoint_url)
    if args.flatten:
        raise UsageError("--flatten goes with --expand-tar")
    if len(args.src) > 1:
        raise UsageError(f"ingest takes one SRC ({len(args.src)} given); several are for tar shards "
                         "(--expand-tar)")
    src = args.src[0]
    if src.startswith("s3://"):
        from dlfs.ingest.s3 import S3Prefix

        return S3Prefix(src, endpoint_url=args.endpoint_url)
    if args.endpoint_url:
        raise UsageError("--endpoint-url goes with an s3:// SRC")
    return LocalTree(src)


def cmd_ingest(args: argparse.Namespace) -> int:
    from dlfs.ingest.run import IngestReport, Interrupt, check_chunk_size, ingest
    from dlfs.logs import set_context

    _setup_logging(args)
    # Mistakes in the arguments are reported before the cluster is needed.
    check_dataset_name(args.name)
    set_context(f"dataset={args.name}")
    chunk_size = check_chunk_size(parse_size(args.chunk_size))
    if args.compress not in ("lz4", "none"):
        raise UsageError("--compress takes lz4 or none")
    source = _source(args)
    select = _selection(args)
    cluster = _cluster(args)
    _check_transport(cluster, "ingest")
    bar = _ProgressBar.display(transient=False)
    progress = _ProgressBar(bar, f"ingest {args.name}", "files")
    progress.show()  # at once: the walk before the totals can take a while on a big tree

    stopped_by: list[int] = []

    async def run() -> IngestReport | None:
        # Ctrl-C cancels the ingest, which then gives its session up; a KeyboardInterrupt would
        # land in whichever task runs at that moment and could break the connection it needs. SIGTERM
        # (a job's time limit, `kill`) and SIGHUP (its terminal closed) the same: else the session, and
        # the chunks it holds, wait out their TTL.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with open_nursery() as nursery:
                interrupt = Interrupt()

                async def on_signal() -> None:
                    async for signum in signals:
                        stopped_by.append(signum)
                        interrupt.fire()
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal, name="dlfs-ingest-signals")
                report = await ingest(cluster, source, args.name, chunk_size, args.compress == "lz4", progress,
                                      home_dir(args.home), select, args.force, interrupt)
                nursery.cancel_scope.cancel()
                return report
        return None  # cancelled by the signal

    with progress.bar:
        report = trio.run(run)
    if report is None:
        if stopped_by and stopped_by[0] != signal.SIGINT:
            print(f"dlfs: interrupted by {signal.Signals(stopped_by[0]).name}", file=sys.stderr)
            return 128 + stopped_by[0]
        raise KeyboardInterrupt
    info = report.info
    if report.unchanged:
        these = "this file" if info.files == 1 else f"these {info.files} files"
        print(f"{info.name} is unchanged: version {info.version} holds exactly {these} ({human_bytes(info.bytes)}); "
              "no new version made (--force makes one)")
        return 0
    for skipped in report.skipped[:10]:
        print(f"skipped {os.fsdecode(skipped)} (not a file, directory or symlink)", file=sys.stderr)
    if len(report.skipped) > 10:
        print(f"skipped {len(report.skipped) - 10} more special files", file=sys.stderr)
    rate = f" ({human_bytes(info.bytes / max(report.seconds, 1e-9))}/s)" if info.bytes else ""
    print(f"ingested {info.name} version {info.version}: {counted(info.files, 'file')}, {human_bytes(info.bytes)} "
          f"in {counted(info.chunks, 'chunk')} ({report.chunks_sent} sent, {report.chunks_present} already stored) "
          f"in {report.seconds:.1f} s{rate}")
    if not info.files:  # a wrong path or filter, most likely: said, though an empty version is a version
        given = [o for o, v in (("--files-from", args.files_from is not None), ("--exclude", bool(args.exclude))) if v]
        chosen = f" after {' and '.join(given)}" if given else ""
        print(f"dlfs: warning: no file to ingest in {' '.join(args.src)}{chosen}: version {info.version} of "
              f"{info.name} is empty", file=sys.stderr)
    if report.index_copies < report.index_wanted:
        print(f"dlfs: warning: the index of {info.name} version {info.version} is on {report.index_copies} of the "
              f"{report.index_wanted} metadata daemons it should be on; the others copy it once they reach a node "
              "that has it (until then, losing the nodes that hold it loses the version's namespace)", file=sys.stderr)
    return 0


# --- datasets, rm, status ---------------------------------------------------------------------
async def _meta_call(args: argparse.Namespace, msg: Any, meta: dict[str, Any] | None = None,
                     timeout: float | None = None) -> dict[str, Any]:
    from dlfs.client.cluster import ClusterClient
    from dlfs.wire.rpc import CALL_TIMEOUT

    cluster = _cluster(args)
    async with open_nursery() as nursery:
        client = ClusterClient(cluster, nursery)
        out, _ = await client.call_meta(msg, meta, timeout=timeout or CALL_TIMEOUT)
        nursery.cancel_scope.cancel()
    return out


def cmd_datasets(args: argparse.Namespace) -> int:
    from dlfs.wire.messages import META_DAEMON, DatasetList, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    rows = reply(DatasetList, trio.run(_meta_call, args, Msg.LIST_DATASETS), Msg.LIST_DATASETS, META_DAEMON).datasets
    if args.json:  # the fields are documented in the README ("datasets --json"): keep them stable
        print(json.dumps({"datasets": [
            {"name": v.name, "version": v.version, "files": v.files, "bytes": v.bytes, "chunks": v.chunks,
             "chunk_size": v.chunk_size, "index_bytes": v.index_size, "created": iso_time(v.created),
             "created_unix": v.created} for v in rows]}, indent=2))
        return 0
    if not rows:
        print("no datasets (add one with `dlfs ingest SRC --name NAME`)")
        return 0
    print(f"{'NAME':<24} {'VERSION':>7} {'FILES':>10} {'BYTES':>10} {'CHUNKS':>7}  CREATED")
    for v in rows:
        created = datetime.datetime.fromtimestamp(v.created).strftime("%Y-%m-%d %H:%M")
        print(f"{v.name:<24} {v.version:>7} {v.files:>10} {human_bytes(v.bytes):>10} {v.chunks:>7}  {created}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from dlfs.mount.lifecycle import parse_dataset_ref
    from dlfs.mount.records import DETACHED, LIVE, mount_states
    from dlfs.wire.messages import META_DAEMON, Removed, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    name, version = parse_dataset_ref(args.name)
    if _cluster(args).etcd is None:
        # Embedded: removal frees the chunks at once, and a mount of the version would fail every read
        # it has not cached. (A cluster's mounts hold leases in etcd, which keep their chunks.)
        for here in mount_states(home_dir(args.home)):
            label, mountpoint = here.record.dataset, here.record.mountpoint
            mounted_name, _, mounted_version = label.rpartition("@")
            if mounted_name != name or (version is not None and mounted_version != str(version)):
                continue
            if here.state == LIVE:
                raise Conflict(f"{label} is mounted at {mountpoint}; unmount it first (dlfs umount {mountpoint})")
            if here.state == DETACHED:  # still serving files held open since `umount --lazy`
                raise Conflict(f"{label} is still read through its mount detached from {mountpoint} (process "
                               f"{here.record.pid}); remove it once that process ends (`dlfs mounts` shows it)")
    # Its collection sweeps the data nodes (each within SWEEP_NODE_BOUND): not asked of another daemon for
    # a call bound passed meanwhile (that one would answer "no dataset named ...": this one removed it).
    out = reply(Removed, trio.run(_meta_call, args, Msg.REMOVE, {"name": name, "version": version}, SWEEP_CALL),
                Msg.REMOVE, META_DAEMON)
    versions = ", ".join(str(v.version) for v in out.removed)
    if out.mounts:
        print(f"removed {name} (version {versions}); {out.gc_deferred}")
        for m in out.mounts:
            print(f"  {name}@{m.version} mounted on {m.node} at {m.mountpoint}")
        return 0
    print(f"removed {name} (version {versions}); freed {counted(out.freed_chunks, 'chunk')}")
    if out.gc_deferred:
        print(f"not all of its chunks are freed yet: {out.gc_deferred}", file=sys.stderr)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from dlfs.wire.messages import META_DAEMON, Collected, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    out = reply(Collected, trio.run(_meta_call, args, Msg.COLLECT, None, SWEEP_CALL), Msg.COLLECT, META_DAEMON)
    if out.gc_deferred:
        raise Unreachable(f"garbage collection deferred: {out.gc_deferred}")
    print(f"freed {counted(out.freed_chunks, 'chunk')} that no dataset or ingest needs")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import census
    from dlfs.mount.records import mount_states
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    cluster = _cluster(args)
    home = home_dir(args.home)

    async def gather() -> tuple[list[tuple[str, dict[str, dict[str, Any] | str]]], Any]:
        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            # Each daemon within ClusterClient's SILENT_AFTER: a frozen node is down, not a 10 s handshake wait.
            got = await client.ask_each([(spec, service) for spec in cluster.nodes for service in sorted(spec.roles)],
                                        Msg.STATUS)
            rows: dict[str, dict[str, dict[str, Any] | str]] = {spec.name: {} for spec in cluster.nodes}
            for (name, service), r in got.items():
                rows[name][service] = r if isinstance(r, str) else r[0]
            out = [(spec.name, rows[spec.name]) for spec in cluster.nodes]
            up = [spec for spec in cluster.nodes if not any(isinstance(r, str) for r in rows[spec.name].values())]
            # A lone node that is down is the whole answer (one line); else what the rest can say.
            health = None if len(out) == 1 and not up else await census(client, up, home)
            nursery.cancel_scope.cancel()
        return out, health

    rows, health = trio.run(gather)
    control = trio.run(_control_view, cluster) if cluster.etcd is not None else None
    mounts_here = mount_states(home)
    if args.json:
        return _status_json(cluster, rows, health, control, mounts_here)
    down = 0
    print(f"cluster: {cluster.source}")
    if control is not None:
        alive = control["nodes"]
        print(f"etcd: {control['etcd']}" + (f"; nodes with live leases: {', '.join(sorted(alive)) or 'none'}"
                                             if alive is not None else ""))
    for name, res in rows:
        spec = cluster.node(name)
        roles = "+".join(sorted(spec.roles))
        failed = [r for r in res.values() if isinstance(r, str)]
        # Liveness is the node's lease in etcd where etcd answers; its daemons' answers say the rest.
        leased = control is not None and control["nodes"] is not None
        if control is not None and control["nodes"] is not None and name not in control["nodes"]:
            down += 1
            print(f"node {name}: DOWN (no live lease in etcd{'; ' + failed[0] if failed else ''})  roles {roles}")
            continue
        if failed:
            down += 1
            print(f"node {name}: DOWN ({failed[0]}{'; its lease in etcd is still live' if leased else ''})  roles {roles}")
            continue
        addrs = "".join(f"  {s} {spec.meta if s == 'meta' else spec.data}" for s in ("meta", "data") if s in spec.roles)
        print(f"node {name}: up  roles {roles}{addrs}")
        meta, data = res.get("meta"), res.get("data")
        if isinstance(meta, dict):
            print(f"  datasets {meta['datasets']} ({counted(meta['versions'], 'version')}), ingests in progress {meta['ingests']}")
        if isinstance(data, dict):
            print(f"  chunks {data['chunks']} ({human_bytes(data['bytes'])}), disk free {human_bytes(data['disk_free'])} "
                  f"of {human_bytes(data['disk_total'])} at {data['root']}")
    if down and len(rows) == 1:
        name, res = rows[0]
        raise Unreachable(f"node {name} is not reachable: {next(r for r in res.values() if isinstance(r, str))}")
    if health is not None:
        _print_census(health, cluster.replicas)
    if control is not None and control["mounts"] is not None:
        mounts = control["mounts"]
        print(f"mounts (holding leases in etcd): {len(mounts)}")
        for m in mounts:
            print(f"  {m.name}@{m.version} on {m.node} at {m.mountpoint}")
    print(f"mounts on this machine from {home}: {len(mounts_here)}")
    for state in mounts_here:
        r = state.record
        print(f"  {r.dataset} at {r.mountpoint}: pid {r.pid}, {state.state}" +
              (f" ({state.problem})" if state.problem else f", since {_local_time(r.started)}, log {r.log or '(its stderr)'}"))
    if down:
        print(f"{down} of {len(rows)} nodes are down", file=sys.stderr)
        return 3
    return 0


def _status_json(cluster: Any, rows: list[tuple[str, dict[str, Any]]], health: Any, control: dict[str, Any] | None,
                 mounts_here: Any) -> int:
    """`dlfs status --json`: what status prints, as one object (README: "status --json")."""
    leases = control["nodes"] if control is not None else None
    nodes = []
    for name, res in rows:
        spec = cluster.node(name)
        failed = [r for r in res.values() if isinstance(r, str)]
        no_lease = leases is not None and name not in leases
        meta, data = res.get("meta"), res.get("data")
        nodes.append({
            "name": name, "roles": sorted(spec.roles),
            "meta": str(spec.meta) if "meta" in spec.roles else None,
            "data": str(spec.data) if "data" in spec.roles else None,
            "state": "down" if failed or no_lease else "up",
            "error": failed[0] if failed else ("no live lease in etcd" if no_lease else None),
            "lease": None if leases is None else name in leases,
            "datasets": {k: meta[k] for k in ("datasets", "versions", "ingests")} if isinstance(meta, dict) else None,
            "chunks": {k: data[k] for k in ("chunks", "bytes", "disk_free", "disk_total", "root")}
            if isinstance(data, dict) else None,
        })
    census = None
    if health is not None:
        census = {"error": health.error or None, "replicas": cluster.replicas,
                  "versions": [{"name": v.name, "version": v.version, "files": v.files, "bytes": v.bytes,
                                "chunks": v.chunks} for v in health.versions],
                  "short": [{"chunk": cid.hex(), "nodes": health.short[cid], "in": health.chunks[cid].label()}
                            for cid in sorted(health.short)]}
    etcd = None
    if control is not None:
        etcd = {"state": control["etcd"], "nodes": sorted(leases) if leases is not None else None,
                "mounts": None if control["mounts"] is None else
                [{"dataset": f"{m.name}@{m.version}", "node": m.node, "mountpoint": m.mountpoint, "pid": m.pid}
                 for m in control["mounts"]]}
    down = sum(n["state"] == "down" for n in nodes)
    print(json.dumps({"cluster": str(cluster.source), "nodes": nodes, "down": down, "census": census, "etcd": etcd,
                      "mounts": [m.as_json() for m in mounts_here]}, indent=2))
    if down:
        print(f"{down} of {len(rows)} nodes are down", file=sys.stderr)
        return 3
    return 0


async def _control_view(cluster: Any) -> dict[str, Any]:
    """What etcd says of the cluster: its endpoints' state, the nodes with live leases, the mounts."""
    from dlfs.control.plane import ControlPlane

    control = ControlPlane(cluster.etcd)
    try:
        nodes = await control.nodes()
        mounts = await control.mounts()
        return {"etcd": f"{control.etcd.describe()}: answering", "nodes": nodes, "mounts": mounts}
    except DlfsError as exc:
        return {"etcd": f"unavailable ({exc}); liveness from the daemons alone", "nodes": None, "mounts": None}
    finally:
        await control.aclose()


def _print_census(view: Any, replicas: int, shown: int = 10) -> None:
    """Status's view of the datasets: every live version, and the chunks short of replicas."""
    if view.error:
        print(f"datasets: unknown ({view.error})")
        return
    print(f"datasets: {len({v.name for v in view.versions})} ({counted(len(view.versions), 'version')})")
    for v in view.versions:
        print(f"  {v.name}@{v.version}: {counted(v.files, 'file')}, {human_bytes(v.bytes)}, {counted(v.chunks, 'chunk')}")
    # Parsed (deploy/slurm/dlfs-slurm greps "healthy replicas: 0$"): the same words whatever R, 1 included.
    print(f"chunks with fewer than {replicas} healthy replicas: {len(view.short)}")
    for cid in sorted(view.short)[:shown]:
        nodes = view.short[cid]
        where = f"on {', '.join(nodes)}" if nodes else "on no reachable node"
        print(f"  chunk {cid.hex()}: {len(nodes)} of {replicas}, {where} (in {view.chunks[cid].label()})")
    if len(view.short) > shown:
        print(f"  ... and {len(view.short) - shown} more (`dlfs repair` restores them)")


# --- verify, repair -----------------------------------------------------------------------------
def _print_verify(report: Any, chunks: dict[bytes, Any]) -> None:
    """One line per problem verify found."""
    r = report.replicas
    for name, why in sorted(report.unreachable.items()):
        print(f"node {name} is unreachable ({why})")
    for b in report.bad:
        print(f"bad replica of chunk {b.chunk.hex()} on {b.node}: {b.reason}")
    for cid in report.missing:
        print(f"chunk {cid.hex()} has only 0 of {r} replicas (no good copy on any reachable node; "
              f"in {chunks[cid].label()})")
    for cid in report.under_replicated:
        print(f"chunk {cid.hex()} has only {len(report.good[cid])} of {r} replicas "
              f"(good on {', '.join(report.good[cid])}; in {chunks[cid].label()})")


def _verify_summary(report: Any, n_versions: int) -> str:
    head = (f"verified {counted(len(report.good), 'chunk')} of {counted(n_versions, 'dataset version')}: "
            f"{counted(report.replicas_checked, 'replica')} ({human_bytes(report.bytes_checked)}) read and checked")
    if report.healthy:
        down = f" (nodes {', '.join(sorted(report.unreachable))} unreachable)" if report.unreachable else ""
        return f"{head}; every chunk has {counted(report.replicas, 'good replica')}{down}"
    return (f"{head}; {counted(len(report.bad), 'bad replica')}, {counted(len(report.under_replicated), 'chunk')} "
            f"under-replicated, {counted(len(report.missing), 'chunk')} with no good copy, "
            f"{counted(len(report.unreachable), 'node')} unreachable")


def _check_indexes_beside(nursery: trio.Nursery, client: Any, versions: list[Any], restore: bool = False) -> list[Any]:
    """The metadata daemons' check of their index files (check_indexes), run in `nursery` beside the
    chunks' checks, so that a silent node costs one wait for its answer, not two; its report lands in
    the list returned once the nursery is done."""
    from dlfs.client.repair import check_indexes

    out: list[Any] = []

    async def check() -> None:
        out.append(await check_indexes(client, versions, restore))

    nursery.start_soon(check)
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import dataset_chunks, live_versions, verify
    from dlfs.errors import CorruptData
    from dlfs.mount.lifecycle import parse_dataset_ref

    _setup_logging(args)
    if bool(args.name) == bool(args.all):
        raise UsageError("name one dataset (NAME or NAME@VERSION) or give --all")
    name, version = parse_dataset_ref(args.name) if args.name else (None, None)
    cluster = _cluster(args)
    _check_transport(cluster, "verify")
    home = home_dir(args.home)

    async def run(progress: _ProgressBar) -> tuple[int, dict[bytes, Any], Any, Any, dict[str, str]]:
        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            versions = await live_versions(client, name, version)
            async with open_nursery() as both:
                checked = _check_indexes_beside(both, client, versions)
                unreadable: dict[str, str] = {}  # one damaged index leaves its own chunks unchecked, not the rest
                chunks = await dataset_chunks(client, home, versions, unreadable)
                report = await verify(client, chunks, progress)
            nursery.cancel_scope.cancel()
        return len(versions), chunks, report, checked[0], unreadable

    with _ProgressBar.display() as bar:
        n_versions, chunks, report, indexes, unreadable = trio.run(run, _ProgressBar(bar, "verify", "replicas"))
    if not n_versions:
        print("no datasets to verify")
        return 0
    _print_indexes(indexes, unreadable)
    _print_verify(report, chunks)
    if n_versions > len(unreadable):  # else no chunk was checked: nothing to sum up
        print(_verify_summary(report, n_versions - len(unreadable)))
    # A node that is down but whose chunks all have R good copies elsewhere is no data problem.
    if not report.healthy or indexes.damaged or unreadable:
        raise CorruptData("; ".join(filter(None, [_index_verdict(indexes, unreadable), _verify_verdict(report, chunks)])))
    return 0


def _print_indexes(indexes: Any, unreadable: dict[str, str]) -> None:
    """A line per version whose index a metadata daemon holds damaged, or that none could send."""
    for label in sorted(set(indexes.damaged) | set(unreadable)):
        why = indexes.damaged.get(label) or f"no metadata daemon sent it intact ({unreadable[label]})"
        print(f"index of {label} is damaged: {why}{'; its chunks were not checked' if label in unreadable else ''}")
    for node, why in sorted(indexes.unchecked.items()):
        print(f"metadata daemon {node} did not check its index files: {why}")


def _index_verdict(indexes: Any, unreadable: dict[str, str], repaired: bool = False) -> str:
    """The damaged indexes in the one-line error: repair suggested only where a good copy exists."""
    labels = sorted(set(indexes.damaged) | set(unreadable))
    parts = []
    for restorable in (True, False):
        some = [x for x in labels if (x in indexes.intact_elsewhere and not repaired) == restorable]
        if not some:
            continue
        it = f"it (dlfs rm {some[0]})" if len(some) == 1 else "them (dlfs rm NAME@VERSION)"
        more = f" and {len(some) - 3} more" if len(some) > 3 else ""
        which = f"{len(some)} dataset {'index' if len(some) == 1 else 'indexes'} damaged ({', '.join(some[:3])}{more})"
        if restorable:
            parts.append(f"{which}; `dlfs repair` restores {'it' if len(some) == 1 else 'them'} from another "
                         "metadata daemon")
        else:
            parts.append(f"{which} with no good copy on any metadata daemon: remove {it} and ingest again")
    return "; ".join(parts)


def _verify_verdict(report: Any, chunks: dict[bytes, Any]) -> str:
    """The one-line error of a verify that found problems: `dlfs repair` suggested only for what it
    can restore (a chunk with a good copy somewhere reachable)."""
    lost = set(report.missing)
    healable = [c for c in report.needs_repair() if c not in lost]
    parts = []
    if healable:
        parts.append(f"{counted(len(healable), 'chunk')} {'lacks' if len(healable) == 1 else 'lack'} "
                     f"{counted(report.replicas, 'good replica')}; `dlfs repair` restores them")
    if lost:
        labels = sorted({chunks[c].label() for c in lost})
        where = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        back = "bring back the unreachable nodes or " if report.unreachable else ""
        parts.append(f"{counted(len(lost), 'chunk')} {'has' if len(lost) == 1 else 'have'} no good copy on any reachable "
                     f"node, which repair cannot restore: {back}ingest again ({where})")
    return "; ".join(parts)


def cmd_repair(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import (
        READ_PIECE,
        REPAIR_IN_FLIGHT,
        dataset_chunks,
        live_versions,
        repair,
        verify,
    )
    from dlfs.client.transport import choose_for, chunk_transport
    from dlfs.errors import CorruptData

    _setup_logging(args)
    cluster = _cluster(args)
    home = home_dir(args.home)
    arena = REPAIR_IN_FLIGHT * READ_PIECE  # the copies' reads land here, a piece at a time
    choice = choose_for(cluster, arena, "repair")

    async def run(bar: Any) -> tuple[int, dict[bytes, Any], Any, Any, Any, dict[str, str]]:
        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            async with chunk_transport(client, choice, arena):
                versions = await live_versions(client)
                async with open_nursery() as both:
                    # A damaged index is replaced by a peer's good copy where one exists; the chunks are
                    # read from whichever daemon has a good one meanwhile.
                    checked = _check_indexes_beside(both, client, versions, restore=True)
                    unreadable: dict[str, str] = {}
                    chunks = await dataset_chunks(client, home, versions, unreadable)
                    report = await verify(client, chunks, _ProgressBar(bar, "verify", "replicas"))
                    healed = await repair(client, chunks, report, _ProgressBar(bar, "repair", "chunks"))
            nursery.cancel_scope.cancel()
        return len(versions), chunks, report, healed, checked[0], unreadable

    with _ProgressBar.display() as bar:
        n_versions, chunks, report, healed, indexes, unreadable = trio.run(run, bar)
    for label in indexes.restored:
        print(f"restored the index of {label} from another metadata daemon's copy")
    _print_indexes(indexes, unreadable)
    _print_verify(report, chunks)
    for cid, node in healed.removed:
        print(f"removed bad replica of chunk {cid.hex()} on {node}")
    for cid, src, dst in healed.copied:
        print(f"copied chunk {cid.hex()} from {src} to {dst}")
    for cid, why in sorted(healed.unhealed.items()):
        print(f"cannot heal chunk {cid.hex()} (in {chunks[cid].label()}): {why}")
    copied_bytes = sum(chunks[cid].size for cid, _, _ in healed.copied)
    print(f"repair: copied {counted(len(healed.copied), 'chunk')} ({human_bytes(copied_bytes)}), removed "
          f"{counted(len(healed.removed), 'bad replica')}; {healed.healthy} of {counted(len(chunks), 'chunk')} of "
          f"{counted(n_versions - len(unreadable), 'dataset version')} {'has' if healed.healthy == 1 else 'have'} "
          f"{counted(cluster.replicas, 'good replica')}")
    parts = [_index_verdict(indexes, unreadable, repaired=True)]
    if healed.unhealed:
        ids = sorted(healed.unhealed)
        more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
        parts.append(f"could not heal {counted(len(ids), 'chunk')}: {', '.join(c.hex() for c in ids[:5])}{more}")
    if any(parts):  # everything it could do is done: now the exit status says what was left
        raise CorruptData("; ".join(filter(None, parts)))
    return 0


# --- mount, umount ------------------------------------------------------------------------------
def cmd_mount(args: argparse.Namespace) -> int:
    from dlfs.mount.lifecycle import MOUNT_PROCESS_NAME
    from dlfs.mount.records import StartLock
    from dlfs.procs import set_title

    home = home_dir(args.home)
    mountpoint = Path(args.mountpoint).absolute()
    if args.foreground:  # `ps` names the mount from the start (its version once it is known)
        set_title(f"dlfs mount {args.dataset} {mountpoint}", MOUNT_PROCESS_NAME)
    starting = StartLock(home, mountpoint)  # held until the mount is in place, or it failed
    try:
        return _mount(args, home, mountpoint, starting)
    finally:
        starting.done()  # (nothing, in a process that handed it to the forked mount)


def _cache_floor(cache_size: int, readahead: int, said_as: tuple[str, str]) -> tuple[int, list[str]]:
    """(the smallest cache a mount with `readahead` can have, what to say of the options it does not
    take as given, `said_as` the user wrote them): a few windows, each of 64 KiB at least (a window is
    `readahead`, or a chunk where chunks are smaller, so this is the most that least may be)."""
    from dlfs.mount.cache import slab_size
    from dlfs.mount.planner import MIN_WINDOW
    from dlfs.mount.slabs import MIN_SLABS

    said = []
    if readahead < MIN_WINDOW:
        said.append(f"--readahead {said_as[1]} is under the least window, {MIN_WINDOW >> 10} KiB: windows of "
                    f"{MIN_WINDOW >> 10} KiB are read")
    window = max(readahead, MIN_WINDOW)
    least = MIN_SLABS * slab_size(window)
    if cache_size < MIN_SLABS * window:  # (not for the slack of a few pages each slab has)
        said.append(f"--cache-size {said_as[0]} is less than the cache's least, {MIN_SLABS} windows of "
                    f"--readahead: it takes up to {least / (1 << 20):.1f} MiB")
    return least, said


def _memory_warning(limit: MemoryLimit, cache_size: int, least: int = 0) -> str | None:
    """What to say where a mount's memory bound does not fit its memory cgroup's limit (None: it fits):
    the cache's pages cannot be reclaimed, so under load the mount or its readers are killed for memory.
    `least`: the smallest cache the mount can have (what to suggest at most is not below it)."""
    from dlfs.mount.cache import MOUNT_SLACK

    if not limit.limited:  # the machine's memory: a cache bigger than it is a typo (1T for 1G)
        if cache_size + MOUNT_SLACK <= limit.effective:
            return None
        return (f"--cache-size {human_bytes(cache_size)} is more than this machine's memory "
                f"({human_bytes(limit.effective)}): the cache's pages cannot be reclaimed, so once it fills the "
                "machine runs out of memory")
    cache, cap = human_mib(cache_size), human_mib(limit.effective)
    if cache_size + MOUNT_SLACK > limit.effective:
        fits = (limit.effective - MOUNT_SLACK) >> 20 << 20  # the biggest cache that would
        smaller = f", or --cache-size {fits >> 20}M at most" if fits >= max(least, 1 << 20) else ""
        return (f"this mount may use {human_mib(cache_size + MOUNT_SLACK)} of memory (its cache, {cache}, and "
                f"{human_mib(MOUNT_SLACK)} for itself), more than its memory cgroup allows ({cap}, the job's own "
                f"included): under load it may be killed for memory; give the job more memory{smaller}")
    if cache_size > limit.effective // 2:
        return (f"--cache-size {cache} is over half the memory cgroup's limit ({cap}): the cache's pages cannot be "
                "reclaimed, so the readers may be killed for memory")
    return None


def _mount(args: argparse.Namespace, home: Path, mountpoint: Path, starting: StartLock) -> int:
    from dlfs.cgroup import memory_limit
    from dlfs.mount.cache import auto_cache_size
    from dlfs.mount.lifecycle import MOUNT_PROCESS_NAME, MountOptions, check_mountpoint, parse_dataset_ref, serve_mount
    from dlfs.procs import set_title
    from dlfs.sdnotify import notify

    name, version = parse_dataset_ref(args.dataset)
    check_mountpoint(mountpoint, args.nonempty, home)
    limit = memory_limit()
    cache_size = auto_cache_size(limit) if args.cache_size == "auto" else parse_size(args.cache_size)
    readahead = parse_size(args.readahead)
    least, warnings = _cache_floor(cache_size, readahead, (args.cache_size, args.readahead))
    too_big = _memory_warning(limit, max(cache_size, least), least)
    warnings += [too_big] if too_big else []
    for line in warnings:  # here, not in the background process, whose warnings reach only its log
        print(f"dlfs: warning: {line}", file=sys.stderr)
    metrics = _metrics_address(args)
    cache_dir, cache_dir_size = _cache_dir_options(args)
    # Here, not in the background process: its errors would reach the user only through its log.
    cluster = _cluster(args)
    if not args.foreground:
        code = _mount_background(args, home, mountpoint, starting)
        if code is not None:
            return code  # the mount is ready in its own process
        set_title(f"dlfs mount {args.dataset} {mountpoint}", MOUNT_PROCESS_NAME)  # the forked mount, from here on
    _setup_logging(args, "INFO")
    give_freed_memory_back()
    how = "auto: a quarter of that" if args.cache_size == "auto" else "--cache-size"
    log.info("memory: %s; cache %s (%s)", limit.describe(), human_bytes(cache_size), how)
    if args.log_file:  # (said on stderr above; to stderr again, without a log file, it would be twice)
        for line in warnings:
            log.warning("%s", line)
    opts = MountOptions(home, cluster, name, version, mountpoint, cache_size, readahead, args.allow_other, metrics,
                        args.short_circuit, threads=args.threads, io_uring=args.io_uring, memory=limit,
                        log_file=Path(args.log_file).absolute() if args.log_file else None,
                        cache_dir=cache_dir, cache_dir_size=cache_dir_size, retry_timeout=args.retry_timeout,
                        direct_io=args.direct_io)
    ready_fd = args.ready_fd

    def ready(message: str) -> None:
        starting.done()  # mounted: another `dlfs mount` here may look (and find this one)
        if ready_fd is not None:
            os.write(ready_fd, b"ok " + message.encode() + b"\n")
            os.close(ready_fd)
        else:
            print(message, flush=True)
            notify(f"READY=1\nSTATUS={message}")  # a Type=notify unit is up only now

    try:
        trio.run(serve_mount, opts, ready)
    except DlfsError as exc:
        if ready_fd is not None:
            os.write(ready_fd, f"error {type(exc).__name__} {exc.exit_code} {exc}\n".encode())
        raise
    return 0


def _cache_dir_size(args: argparse.Namespace) -> int | None:
    """--cache-dir-size, checked: at least 1M, and only beside --cache-dir."""
    size = parse_size(args.cache_dir_size) if args.cache_dir_size else None
    if size is not None and size < 1 << 20:
        raise UsageError("--cache-dir-size must be at least 1M")
    if size is not None and not args.cache_dir:
        raise UsageError("--cache-dir-size needs --cache-dir")
    return size


def _cache_dir_options(args: argparse.Namespace) -> tuple[Path | None, int | None]:
    """--cache-dir (made and checked here, where an error reaches the user) and --cache-dir-size."""
    from dlfs.mount.diskcache import check_cache_dir

    size = _cache_dir_size(args)
    if not args.cache_dir:
        return None, None
    return check_cache_dir(Path(args.cache_dir).absolute()), size


def _mount_background(args: argparse.Namespace, home: Path, mountpoint: Path, starting: StartLock) -> int | None:
    """Serve the mount detached, and return 0 once it reports the mount ready (or raise its error). In a
    process with one thread this one forks: the child gets None back and serves in the foreground, its
    output in the mount's log, with what this process imported and checked already (no second start
    of Python), and the start's lock (`starting`: this process lets go of its copy). Elsewhere it runs
    `dlfs mount --foreground` with the command line as the user gave it, which takes the lock anew."""
    from dlfs.mount.records import mount_log

    log_path = Path(args.log_file) if args.log_file else mount_log(home, args.dataset, mountpoint)
    private_dirs(log_path.parent)
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() == 1:  # a fork of a threaded process may hold a lock no thread will free
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            logfd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            for fd, to in ((devnull, 0), (logfd, 1), (logfd, 2)):
                os.dup2(fd, to)
            os.close(devnull)
            os.close(logfd)
            args.foreground, args.ready_fd, args.log_file = True, wfd, str(log_path)
            return None
        wait: Callable[[], int] = partial(_reap, pid)
        starting.close()  # the child holds it
    else:
        starting.close()  # the command takes it anew, and checks the mountpoint again
        # The command as the user gave it (same environment, same working directory: relative paths mean
        # the same), served in the foreground: no option is rebuilt here, so none can be lost on the way.
        cmd = [sys.executable, "-m", "dlfs", *args.argv, "--foreground", "--ready-fd", str(wfd), "--log-file",
               str(log_path)]
        with open(os.devnull, "rb") as devnull_f, open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdin=devnull_f, stdout=logf, stderr=logf, pass_fds=(wfd,),
                                    start_new_session=True)
        wait = partial(proc.wait, timeout=MOUNT_EXIT_WAIT)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        line = r.readline().decode(errors="replace").strip()
    if line.startswith("ok "):
        print(line[3:])
        return 0
    if line.startswith("error "):
        _, _kind, code, message = line.split(" ", 3)
        wait()
        err = DlfsError(message)
        err.exit_code = int(code)
        raise err
    rc = wait()
    raise MountError(f"mount process exited ({rc}) before the mount was ready; see {log_path}")


def _reap(pid: int, timeout: float = MOUNT_EXIT_WAIT) -> int:
    """The exit status of a child that said it is ending (negative: the signal that ended it); bounded."""
    fd = os.pidfd_open(pid)  # readable once the child has exited
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise MountError(f"mount process {pid} said it failed but had not exited {timeout:.0f} s later")
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def cmd_warmup(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.mount.diskcache import DiskCache
    from dlfs.mount.lifecycle import parse_dataset_ref
    from dlfs.mount.records import mount_states
    from dlfs.warmup import parse_rate, warmup

    _setup_logging(args)
    name, version = parse_dataset_ref(args.dataset)
    home = home_dir(args.home)
    rate = parse_rate(args.rate) if args.rate else None
    readahead = parse_size(args.readahead)
    cache_dir, cache_dir_size = _cache_dir_options(args)
    if cache_dir is None:  # the disk cache of this machine's mounts, where they agree on one
        dirs = {m.record.cache_dir for m in mount_states(home, clean=False) if m.record.cache_dir}
        if len(dirs) > 1:
            raise UsageError(f"this machine's mounts use {len(dirs)} disk caches ({', '.join(sorted(dirs))}): name "
                             "one with --cache-dir")
        cache_dir = Path(dirs.pop()) if dirs else None
    cluster = _cluster(args)
    _check_transport(cluster, "warmup")
    disk = DiskCache(cache_dir, cache_dir_size) if cache_dir is not None else None

    async def run(progress: _ProgressBar) -> Any:
        def tell(event: str, files: int, nbytes: int) -> None:
            (progress.start if event == "start" else progress.advance)(files, nbytes)

        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            report = await warmup(client, home, name, version, args.paths, disk, readahead, rate, tell,
                                  args.short_circuit, progress.note, args.retry_timeout)
            nursery.cancel_scope.cancel()
        return report

    try:
        with _ProgressBar.display(transient=False) as bar:
            report = trio.run(run, _ProgressBar(bar, f"warmup {args.dataset}", "files"))
    finally:
        if disk is not None:
            disk.close()
    moved = report.fetched + report.page_cached
    speed = f" at {human_bytes(moved / report.seconds)}/s" if report.seconds > 0 and moved else ""
    parts = [f"fetched {human_bytes(report.fetched)} into {disk.root}{_disk_cache_kept(disk)}" if disk is not None
             else "",
             f"{human_bytes(report.cached)} already there" if report.cached else "",
             f"read {human_bytes(report.page_cached)} of this node's chunks into the page cache" if report.page_cached else "",
             f"left {human_bytes(report.skipped)} held elsewhere (no --cache-dir)" if report.skipped else ""]
    print(f"warmed {report.label}: {counted(report.files, 'file')}, {human_bytes(report.bytes)} in {counted(report.windows, 'window')}; "
          f"{', '.join(p for p in parts if p)}; {report.seconds:.1f} s{speed}")
    return 0


def _disk_cache_kept(disk: Any) -> str:
    """What a disk cache that evicted while being warmed kept, and why: a warmup's aim is what stays."""
    from dlfs.mount.diskcache import FREE_SHARE

    if disk.broken:
        return f" (not kept there: {disk.broken} while it ran; the next mount or warmup starts it over)"
    if not disk.evicted_bytes:
        return ""
    bound = disk.size_bound()
    why = (f"to stay under --cache-dir-size {human_mib(bound)}" if bound is not None else
           f"to keep its file system {FREE_SHARE:.0%} free (free some space, or give --cache-dir-size)")
    return (f" (which holds {human_bytes(disk.held_bytes())} now: it evicted {human_bytes(disk.evicted_bytes)} "
            f"{why})")


def cmd_umount(args: argparse.Namespace) -> int:
    from dlfs.mount.lifecycle import unmount

    _setup_logging(args)
    mountpoint = Path(args.mountpoint).absolute()
    done = unmount(home_dir(args.home), mountpoint, lazy=args.lazy)
    if done.silent:
        print(f"dlfs: warning: the mount process of {mountpoint} does not answer ({done.silent}: stopped or stuck): "
              "detached without it; what waits on it there waits until it runs again or is killed", file=sys.stderr)
    if done.users:
        print(f"detached {mountpoint}; its mount process ends when the last of these closes its files there: "
              + ", ".join(h.describe() for h in done.users))
    else:
        print(f"{'detached' if done.silent else 'unmounted'} {mountpoint}")
    return 0


def _local_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "?"


def _mount_rows(states: Any) -> list[str]:
    """`dlfs mounts`' table: one row per mount, then a line for each that is not live or whose process is stopped."""
    head = ("DATASET", "MOUNTPOINT", "PID", "STATE", "CACHE", "SINCE", "LOG")
    rows = [head]
    for m in states:
        r = m.record
        cache = human_bytes(r.cache_size) if r.cache_size else "?"
        if r.cache_dir:
            cache += f" + disk {r.cache_dir}" + (f" ({human_bytes(r.cache_dir_size)})" if r.cache_dir_size else "")
        rows.append((r.dataset, r.mountpoint, str(r.pid), m.state, cache, _local_time(r.started), r.log or "(its stderr)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    out += [f"{m.record.dataset} at {m.record.mountpoint}: {m.state}: {m.problem}" for m in states if m.problem]
    return out


def cmd_mounts(args: argparse.Namespace) -> int:
    from dlfs.mount.records import mount_states

    _setup_logging(args)
    home = home_dir(args.home)
    states = mount_states(home)
    if args.json:
        print(json.dumps({"home": str(home), "mounts": [m.as_json() for m in states]}, indent=2))
    elif not states:
        print(f"no mounts from {home} on this machine (mount one with `dlfs mount NAME MOUNTPOINT`)")
    else:
        print("\n".join(_mount_rows(states)))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from dlfs.stats import show

    _setup_logging(args)
    return show(home_dir(args.home), Path(args.mountpoint).absolute(), args.interval, args.watch, args.count,
                args.json)


def cmd_keygen(args: argparse.Namespace) -> int:
    from dlfs.wire.auth import write_key

    _setup_logging(args)
    try:
        write_key(Path(args.file))
    except FileExistsError:
        raise UsageError(f"{args.file} exists; remove it first to make a new key") from None
    print(f"wrote a new cluster key to {args.file} (mode 0600); copy it to every node")
    return 0


# --- doctor -------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from dlfs.doctor import as_json, failed, render, run_checks, summary

    _setup_logging(args, "ERROR")  # the table says it all; the checks' own log lines would repeat it
    size = _cache_dir_size(args)  # (the directory itself is only looked at: doctor makes nothing)
    rows = run_checks(home_dir(args.home), args.cluster, args.transport,
                      Path(args.cache_dir) if args.cache_dir else None, size)
    if args.json:
        print(json.dumps(as_json(rows), indent=2))
    else:
        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(render(rows))
        console.print(summary(rows))
    return 1 if failed(rows) else 0


# --- bench --------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    import json
    import time

    from dlfs.bench.run import bench_options, check_plotting, format_report, kept_bytes, run_bench, write_plot

    _setup_logging(args)
    opts = bench_options(args.dir, args.src, args.files, args.readers, args.scale, args.quick, args.transport,
                         args.io_uring, args.memory_limit, args.memory, args.only)
    if args.plot and opts.only:
        raise UsageError("--plot draws the epochs and the metadata walk, which --only leaves out")
    if args.plot:
        check_plotting()
    t0 = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {message}", file=sys.stderr, flush=True)

    out = run_bench(opts, say)
    print(format_report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(out, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    # A full run keeps ~23 GB there: say so, since a disk it fills changes what runs beside it.
    print(f"{human_bytes(kept_bytes(opts.work_dir))} left in {opts.work_dir}: the samples, images and chunks, reused by "
          "the next run (remove the folder to free the space)", file=sys.stderr)
    return 0


# --- run ----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from dlfs.preload import environ_with_preload, library_path

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.print_preload:
        if command:
            raise UsageError("--print-preload prints the library's path and runs nothing: give it no command")
        print(library_path())
        return 0
    if not command:
        raise UsageError("dlfs run needs a command: dlfs run [--] CMD [ARGS...]")
    env = environ_with_preload(os.environ)
    # Python ignores these; an ignored signal stays ignored across exec, and `yes | head` should end.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        raise CommandFailed(f"{command[0]}: command not found", 127) from None
    except OSError as exc:
        raise CommandFailed(f"{command[0]}: cannot run it: {exc.strerror or exc}", 126) from None
    return 0  # not reached: exec replaced this process


# --- csi ----------------------------------------------------------------------------------------
def cmd_csi(args: argparse.Namespace) -> int:
    import socket

    from dlfs.csi.server import run_plugin

    _setup_logging(args, "INFO")
    home = home_dir(args.home)
    state = Path(args.state) if args.state else home / "csi"
    cache_dir, cache_dir_size = _cache_dir_options(args)
    run_plugin(home, args.cluster or os.environ.get("DLFS_CLUSTER"), args.endpoint, args.node_id or socket.gethostname(),
               state.absolute(), args.mount_timeout, cache_dir, cache_dir_size)
    return 0


# --- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from dlfs.native import engine_max_threads, engine_threads

    def common_options(default: Any) -> argparse.ArgumentParser:
        common = argparse.ArgumentParser(add_help=False)
        common.add_argument("--home", default=default, help="state directory (default: $DLFS_HOME or ~/.dlfs)")
        common.add_argument("--cluster", default=default, metavar="FILE",
                            help="cluster file (default: $DLFS_CLUSTER; none: the local node)")
        common.add_argument("--log-level", default=default,
                            choices=["DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error"])
        common.add_argument("--log-file", default=default, metavar="FILE",
                            help="write log lines here instead of stderr")
        return common

    # Accepted before and after the subcommand; after it, a default would overwrite the value
    # given before it (`dlfs --home H status`), so there the defaults are suppressed.
    common, sub_common = common_options(None), common_options(argparse.SUPPRESS)
    # The commands that move chunks (and doctor, which checks what they would use).
    transport_option = argparse.ArgumentParser(add_help=False)
    transport_option.add_argument("--transport", choices=["auto", "tcp", "rdma"],
                                  help="how chunks travel: auto (RDMA where it works, else TCP), tcp or rdma "
                                       "(default: the cluster file's transport, else auto)")

    p = argparse.ArgumentParser(prog="dlfs", description="dlfs: a distributed file system for deep-learning datasets.",
                                epilog=EPILOG, parents=[common])
    p.add_argument("--version", action="version", version=f"dlfs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str,
            moves_chunks: bool = False) -> argparse.ArgumentParser:
        parents = [sub_common, transport_option] if moves_chunks else [sub_common]
        sp = sub.add_parser(name, help=help, description=help, parents=parents, epilog=EPILOG)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("node", cmd_node, "Run this node's metadata and data daemons in the foreground until SIGINT/SIGTERM.", moves_chunks=True)
    sp.add_argument("--name", help="this node's name in the cluster file (default: the entry with a local address)")
    sp.add_argument("--role", choices=["data", "meta", "both"],
                    help="run the data daemon, the metadata daemon, or both (default: the cluster file's role, else both)")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on with no cluster file (default 127.0.0.1)")
    sp.add_argument("--meta-port", type=int, default=0,
                    help="metadata port with no cluster file (default: the last run's, else any free port)")
    sp.add_argument("--data-port", type=int, default=0,
                    help="data port with no cluster file (default: the last run's, else any free port)")
    sp.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (:PORT: every interface)")
    sp.add_argument("--replica-check", type=float, default=60.0, metavar="SECONDS",
                    help="with --metrics: count chunks short of replicas at most this often (default 60)")
    sp.add_argument("--memory", default="auto", metavar="SIZE",
                    help="most bytes the daemons hold for requests in flight, over all connections (default auto: "
                         f"an eighth of the memory the node may use, its memory cgroup's limit where there is one, "
                         f"between {MIN_NODE_MEMORY >> 20}M and {NODE_MEMORY >> 20}M); a request that does not fit "
                         "waits, and no chunk bigger than it can be stored")

    sp = add("ingest", cmd_ingest, "Pack a directory tree, an S3 bucket prefix or tar shards into chunks, store "
             "them, and commit it as a dataset version.", moves_chunks=True)
    sp.add_argument("src", metavar="SRC", nargs="+",
                    help="what to ingest: a directory, or s3://BUCKET[/PREFIX] (every object under the prefix, "
                         "keys split into directories at /); with --expand-tar, one or more tar or zip shards, "
                         "directories of shards or s3:// prefixes of shards")
    sp.add_argument("--expand-tar", action="store_true",
                    help="SRC are shards (.tar, .tar.gz/.tgz, .tar.zst, .zip): every member becomes a file, under "
                         "a directory named for its shard (--flatten: at the top when member names are unique)")
    sp.add_argument("--flatten", action="store_true",
                    help="with --expand-tar: put every member at the top of the dataset, not under its shard's "
                         "directory (an error if two shards hold the same member name)")
    sp.add_argument("--endpoint-url", metavar="URL",
                    help="S3-compatible endpoint for s3:// sources (MinIO, Ceph RGW...; default AWS_ENDPOINT_URL, "
                         "else AWS); credentials, region and profile are found the standard AWS way")
    sp.add_argument("--name", required=True, help="dataset name (letters, digits, . _ -)")
    sp.add_argument("--chunk-size", default="8M", metavar="SIZE", help="chunk size, e.g. 8M, 32MiB (default 8M)")
    sp.add_argument("--compress", default="none", choices=["lz4", "none"],
                    help="per-record lz4 compression (default none: JPEGs and the like do not compress)")
    sp.add_argument("--force", action="store_true",
                    help="make a new version even when the newest one already holds exactly this data")
    sp.add_argument("--files-from", metavar="LIST",
                    help="ingest only the paths in LIST, one a line, relative to SRC (a directory brings all "
                         "under it; - reads standard input); a path not in SRC is an error")
    sp.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                    help="leave out entries matching GLOB (repeatable): with a / it is matched against the "
                         "path from SRC, else against each name at any depth; a trailing / matches "
                         "directories only, e.g. --exclude '*.tmp' --exclude .git/")

    sp = add("datasets", cmd_datasets, "List datasets: version, files, bytes, chunks.")
    sp.add_argument("--json", action="store_true", help="print them as one JSON object (fields: README)")

    sp = add("rm", cmd_rm, "Remove a dataset (or NAME@VERSION, one version) and free its chunks.")
    sp.add_argument("name", metavar="NAME[@VERSION]")

    sp = add("mount", cmd_mount, "Mount a dataset read-only; returns once the mount is ready.", moves_chunks=True)
    sp.add_argument("dataset", metavar="NAME[@VERSION]", help="dataset to mount (default: its newest version)")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")
    sp.add_argument("--foreground", action="store_true", help="stay attached and serve until unmounted or interrupted")
    sp.add_argument("--cache-size", default="auto", metavar="SIZE",
                    help="most memory for file data fetched but not yet read (default auto: a quarter of the "
                         "memory the mount may use: its memory cgroup's limit where there is one, else physical "
                         "memory; at least 64M); data already read lives in the page cache")
    sp.add_argument("--readahead", default="4M", metavar="SIZE",
                    help="bytes fetched per miss within a chunk (default 4M; 64K at least)")
    sp.add_argument("--allow-other", dest="allow_other", action="store_true", default=os.geteuid() == 0,
                    help="let other users read the mount (default when run as root)")
    sp.add_argument("--no-allow-other", dest="allow_other", action="store_false", help=argparse.SUPPRESS)
    sp.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (:PORT: every interface)")
    sp.add_argument("--no-short-circuit", dest="short_circuit", action="store_false",
                    help="read chunks this machine's node holds through its data daemon too, not from its "
                         "chunk files")
    sp.add_argument("--threads", type=_thread_count, default=engine_threads(), metavar="N",
                    help=f"native threads serving the mount, 1 to {engine_max_threads()} (default: one per CPU it "
                         "may run on, here %(default)s)")
    sp.add_argument("--io-uring", choices=("auto", "on", "off"), default="auto",
                    help="serve through FUSE over io_uring, one queue per CPU (Linux 6.14+): auto uses it where the "
                         "kernel has it, turning /sys/module/fuse/parameters/enable_uring on as root, but for a "
                         "dataset with half its bytes in files of 16 MiB or more (big reads are faster from "
                         "/dev/fuse); on fails in one line where it cannot (default auto)")
    sp.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto",
                    help="read files of 1 MiB or more past the kernel's page cache: each read is answered from the "
                         "mount's cache, the one copy in memory (faster cold reads of big files; a file read again "
                         "is fetched again). auto: for a dataset with half its bytes in such files, bigger than the "
                         "memory the mount may use, whose every epoch is cold anyway (default auto)")
    sp.add_argument("--nonempty", action="store_true",
                    help="mount onto a directory that has entries (the mount hides them until it ends); without it, "
                         "such a mountpoint is refused")
    sp.add_argument("--cache-dir", metavar="DIR",
                    help="keep verified chunk data fetched over the network on local disk here (made 0700), shared "
                         "by every mount and `dlfs warmup` naming it, kept across remounts; reads try memory, then "
                         "it, then the data nodes")
    sp.add_argument("--cache-dir-size", metavar="SIZE",
                    help="most bytes the --cache-dir holds, least recently read out first (kept with it: the last "
                         "size given holds for all its users; default: use the file system but leave 10%% free)")
    sp.add_argument("--retry-timeout", type=_seconds, default=RETRY_TIMEOUT, metavar="SECONDS",
                    help="how long reads wait for a replica of their data to answer again (a node restarting, a "
                         "whole cluster restarting) before they fail with EIO, counted from when the last replica "
                         "stopped answering: past it, reads of that data fail at once until one is back; 0: fail at "
                         "once (default %(default)g)")
    sp.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    sp = add("warmup", cmd_warmup, "Fill the node's disk cache (--cache-dir) with a dataset version, or the files under "
             "some of its paths, as a mount would fetch them; on a data node, its own chunks go into the page cache.",
             moves_chunks=True)
    sp.add_argument("dataset", metavar="NAME[@VERSION]", help="dataset to warm (default: its newest version)")
    sp.add_argument("paths", nargs="*", metavar="PATH", help="files or directories of the dataset (default: all of it)")
    sp.add_argument("--cache-dir", metavar="DIR",
                    help="the disk cache to fill (default: the one this machine's mounts use)")
    sp.add_argument("--cache-dir-size", metavar="SIZE", help="as `dlfs mount --cache-dir-size`")
    sp.add_argument("--rate", metavar="LIMIT", help="most bytes a second it may read or fetch, e.g. 500MB/s "
                    "(binary units; default: as fast as it goes)")
    sp.add_argument("--readahead", default="4M", metavar="SIZE",
                    help="the mounts' --readahead: windows are cut as theirs are (default 4M)")
    sp.add_argument("--no-short-circuit", dest="short_circuit", action="store_false",
                    help="fetch the chunks this machine's node holds into the disk cache too, as for mounts with "
                         "--no-short-circuit (default: read them into the page cache)")
    sp.add_argument("--retry-timeout", type=_seconds, default=RETRY_TIMEOUT, metavar="SECONDS",
                    help="how long a window waits for a replica to answer again (a node restarting) before the "
                         "warmup fails, as `dlfs mount --retry-timeout`; 0: fail at once (default %(default)g)")

    add("gc", cmd_gc, "Free the chunks that no dataset version and no running ingest needs.")

    sp = add("umount", cmd_umount, "Unmount a dlfs mount and wait for its process to finish; a busy one is refused, "
             "naming the processes using it.")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")
    sp.add_argument("--lazy", action="store_true",
                    help="detach it now even if busy (fusermount3 -u -z): processes with files open there keep "
                         "reading them, and the mount process ends when the last is closed")

    sp = add("mounts", cmd_mounts, "List this machine's mounts made from this state directory: dataset@version, "
             "mountpoint, pid, state, cache, since, log file.")
    sp.add_argument("--json", action="store_true", help="print them as one JSON object")

    sp = add("stats", cmd_stats, "Show a mount's reads/s, MB/s, cache hit rate, bytes fetched by node and errors; "
             "--watch keeps the view live.")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")
    sp.add_argument("--watch", action="store_true", help="refresh the view until Ctrl-C")
    sp.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between views; rates are over this interval (default 1; the mount updates once a second)")
    sp.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N views")
    sp.add_argument("--json", action="store_true",
                    help="print each view as one JSON object on a line of its own (JSON Lines with --watch)")

    sp = add("status", cmd_status, "Show the node's (or cluster's) state and this machine's mounts; exits non-zero "
             "when a node is unreachable.")
    sp.add_argument("--json", action="store_true", help="print everything as one JSON object")

    sp = add("verify", cmd_verify, "Read and check every replica of every chunk of a dataset; exits 5 if any is bad, "
             "missing or short of the cluster's replicas.", moves_chunks=True)
    sp.add_argument("name", nargs="?", metavar="NAME[@VERSION]", help="dataset (all its versions) or one version")
    sp.add_argument("--all", action="store_true", help="every live dataset")

    add("repair", cmd_repair, "Verify every live dataset, then delete bad replicas and copy good ones until every "
        "chunk has the cluster's replicas; prints what it copied.", moves_chunks=True)

    sp = add("bench", cmd_bench, "Benchmark dlfs against local disk, squashfuse_ll and the kernel's squashfs: "
             "epochs cold and warm, metadata walk, ingest, namespace scale (needs root; starts its own node).",
             moves_chunks=True)
    sp.add_argument("--src", metavar="DIR", help="dataset to use (default: generate an ImageNet-like sample in --dir)")
    sp.add_argument("--files", type=int, metavar="N", help="files in the generated sample (default 35000; --quick 4000)")
    sp.add_argument("--dir", default=".bench", metavar="DIR",
                    help="work dir: sample (kept), node state, image, mounts (default .bench)")
    sp.add_argument("--quick", action="store_true", help="a run of about a minute: fewer files, readers and index sizes")
    sp.add_argument("--readers", metavar="N,N,...", help="reader processes of the epochs (default 1,2,4; --quick 1,2)")
    sp.add_argument("--scale", metavar="N,N,...",
                    help="files in the synthetic indexes (default 100000,1000000; --quick 10000,100000)")
    sp.add_argument("--json", metavar="FILE", help="write every raw figure here")
    sp.add_argument("--plot", metavar="FILE", help="draw a PNG bar chart here (needs matplotlib: dlfs[bench])")
    sp.add_argument("--io-uring", choices=("auto", "on", "off"),
                    help="the dlfs mounts' --io-uring (default: theirs, auto); off measures /dev/fuse alone")
    sp.add_argument("--memory-limit", metavar="SIZE",
                    help="the memory cgroup of the bigger-than-memory section, whose dataset is 2-3x this "
                         "(default 1G; --quick 256M)")
    sp.add_argument("--no-memory", dest="memory", action="store_false",
                    help="leave out the bigger-than-memory section")
    sp.add_argument("--only", metavar="SECTION", help="run only these sections, comma-separated: cold (the cold path), memory (bigger than "
                         "memory), ingest (ingest speed beside mksquashfs and cp)")

    sp = add("doctor", cmd_doctor, "Check this node and its cluster (FUSE, memlock, RDMA and the transport, the "
             "cluster file and key, every daemon's reachability, key and clock, free space, disk caches); exits 1 if a check "
             "fails, printing a fix for each.", moves_chunks=True)
    sp.add_argument("--json", action="store_true", help="print the checks as JSON instead of a table")
    sp.add_argument("--cache-dir", metavar="DIR", help="check this disk cache directory too, before a mount uses it "
                    "(the disk caches of this machine's mounts are always checked); nothing is made or changed")
    sp.add_argument("--cache-dir-size", metavar="SIZE", help="the --cache-dir-size the mounts will be given")

    sp = add("keygen", cmd_keygen, "Write a new random cluster key (mode 0600).")
    sp.add_argument("file", metavar="FILE")

    sp = add("run", cmd_run, "Run a command with dlfs's preload library (LD_PRELOAD), which the command and every "
             "process it starts (DataLoader workers, subprocesses) inherit: isatty() of a regular file answers "
             "in the process, so open(path, \"rb\") in Python <= 3.13 costs a warm mount no round trip. The exit "
             "status is the command's own; 127 if it is not found, 126 if it cannot be run.")
    sp.usage = "dlfs run [-h] [--print-preload] [--] CMD [ARGS...]"
    sp.add_argument("command", nargs=argparse.REMAINDER, metavar="[--] CMD [ARGS...]",
                    help="the command and its arguments (after --, nothing is read as dlfs's own option)")
    sp.add_argument("--print-preload", action="store_true",
                    help="print the library's path and exit (for LD_PRELOAD where no wrapper can be used)")

    sp = add("csi", cmd_csi, "Serve the Kubernetes CSI node plugin (Identity and Node services) on a Unix socket "
             "until SIGTERM: NodePublishVolume shows a dataset version read-only in a pod, the pods of this node "
             "that ask for one version sharing one mount.")
    sp.add_argument("--endpoint", default="unix:///csi/csi.sock", metavar="unix:///PATH",
                    help="the socket to serve (default unix:///csi/csi.sock, the node-driver-registrar's)")
    sp.add_argument("--node-id", metavar="NAME", help="this node's id for NodeGetInfo (default: the host name)")
    sp.add_argument("--state", metavar="DIR",
                    help="where the shared mounts go, one per dataset version (default $DLFS_HOME/csi)")
    sp.add_argument("--mount-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="how long a new mount may take to be ready (default 120)")
    sp.add_argument("--cache-dir", metavar="DIR", help="a disk cache on this node's local disk for every mount "
                    "the plugin makes (dlfs mount --cache-dir): the node's setting, not a volume's")
    sp.add_argument("--cache-dir-size", metavar="SIZE", help="the most the disk cache holds (default: it keeps "
                    "10%% of its file system free)")
    return p


def _os_error(exc: OSError) -> int:
    """What the system refused (a read-only or full disk, a permission), in one line; the traceback
    with --log-level debug."""
    log.debug("the system refused: %s", exc, exc_info=exc)
    where = f"{exc.filename}: " if exc.filename else ""
    print(f"dlfs: error: {where}{exc.strerror or exc}", file=sys.stderr)
    return StorageFull.exit_code if exc.errno in NO_ROOM else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `dlfs mount` runs it again, served in the foreground
    # What dlfs writes under $DLFS_HOME is its user's alone (dlfs/private.py), the node's and mounts' and
    # what any command adds; the bench's sample trees, mount points and reports are for its user to share.
    umask = os.umask(PRIVATE_UMASK)
    if args.fn in (cmd_bench, cmd_run):  # a command run keeps its caller's umask
        os.umask(umask)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, where a reader gone away (`| head`) is caught, not at exit
        return code
    except DlfsError as exc:
        print(f"dlfs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dlfs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`dlfs status | head`): stop quietly, as `ls | head` does, and keep
        # the interpreter's last flush of stdout from failing again on the way out.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except BaseExceptionGroup as group:  # trio wraps task errors; show the dlfs one
        errors = leaves(group)
        if any(isinstance(e, KeyboardInterrupt) for e in errors):
            print("dlfs: interrupted", file=sys.stderr)  # what broke on the way out is not news
            return 130
        for e in errors:
            if isinstance(e, DlfsError):
                print(f"dlfs: error: {e}", file=sys.stderr)
                return e.exit_code
        for e in errors:
            if isinstance(e, OSError) and not isinstance(e, BrokenPipeError):
                return _os_error(e)
        raise
    except OSError as exc:
        return _os_error(exc)
    finally:
        os.umask(umask)  # as it was, for a caller in this process (the tests)

