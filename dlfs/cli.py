"""The `dlfs` command: one small function per subcommand."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from dlfs import __version__
from dlfs.config import ROLES, check_dataset_name, home_dir, load_cluster, parse_cluster_file
from dlfs.errors import CommandFailed, Conflict, DlfsError, MountError, Unreachable, UsageError
from dlfs.private import UMASK as PRIVATE_UMASK
from dlfs.private import private_dirs
from dlfs.procs import give_freed_memory_back
from dlfs.tasks import leaves, open_nursery
from dlfs.units import human_bytes, human_duration, parse_size
from dlfs.wire.budget import MIN_NODE_MEMORY, NODE_MEMORY, auto_node_memory

if TYPE_CHECKING:
    from dlfs.ingest.source import Source
    from dlfs.ingest.walk import Selection

log = logging.getLogger("dlfs")
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
        self.done = self.total = 0
        self.bytes_done = self.bytes_total = 0
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

    def start(self, items: int, nbytes: int) -> None:
        self.total, self.bytes_total = items, nbytes
        self.t0 = self.said = time.monotonic()
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=nbytes, items=f"0/{items} {self.unit}")
        else:
            self.bar.update(self.task, total=nbytes, items=f"0/{items} {self.unit}")

    def advance(self, items: int, nbytes: int) -> None:
        """`items` more done, and `nbytes` more of their bytes (a big item moves the bar as it goes)."""
        self.done += items
        self.bytes_done += nbytes
        self.bar.update(self.task, advance=nbytes, items=f"{self.done}/{self.total} {self.unit}")
        now = time.monotonic()
        if self.plain and now - self.said >= self.every:
            self.said = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        """The plain progress line: items, bytes, share, rate, time left."""
        rate = self.bytes_done / max(now - self.t0, 1e-9)
        share = f" ({100 * self.bytes_done / self.bytes_total:.0f}%)" if self.bytes_total else ""
        left = f", {human_duration((self.bytes_total - self.bytes_done) / rate)} left" if rate > 0 else ""
        return (f"{self.label}: {self.done}/{self.total} {self.unit}, {human_bytes(self.bytes_done)} of "
                f"{human_bytes(self.bytes_total)}{share}, {human_bytes(rate)}/s{left}")


def _selection(args: argparse.Namespace) -> Selection:
    """What of the source the ingest takes (--files-from, --exclude); a bad list is a UsageError."""
    from dlfs.ingest.walk import Selection, read_list

    listed = None
    if args.files_from is not None:
        try:
            if args.files_from == "-":
                listed = read_list(sys.stdin.buffer, args.src[0])
            else:
                with open(args.files_from, "rb") as f:
                    listed = read_list(f, args.src[0])
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
    from dlfs.ingest.run import IngestReport, check_chunk_size, ingest
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

    async def run() -> IngestReport | None:
        # Ctrl-C cancels the ingest, which then gives its session up; a KeyboardInterrupt would
        # land in whichever task runs at that moment and could break the connection it needs.
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async with open_nursery() as nursery:
                async def on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal, name="dlfs-ingest-signals")
                report = await ingest(cluster, source, args.name, chunk_size, args.compress == "lz4", progress,
                                      home_dir(args.home), select, args.force)
                nursery.cancel_scope.cancel()
                return report
        return None  # cancelled by the signal

    with progress.bar:
        report = trio.run(run)
    if report is None:
        raise KeyboardInterrupt
    info = report.info
    if report.unchanged:
        print(f"{info.name} is unchanged: version {info.version} holds exactly these {info.files} files "
              f"({human_bytes(info.bytes)}); no new version made (--force makes one)")
        return 0
    for skipped in report.skipped[:10]:
        print(f"skipped {os.fsdecode(skipped)} (not a file, directory or symlink)", file=sys.stderr)
    if len(report.skipped) > 10:
        print(f"skipped {len(report.skipped) - 10} more special files", file=sys.stderr)
    print(f"ingested {info.name} version {info.version}: {info.files} files, {human_bytes(info.bytes)} "
          f"in {info.chunks} chunks ({report.chunks_sent} sent, {report.chunks_present} already stored) "
          f"in {report.seconds:.1f} s ({human_bytes(info.bytes / max(report.seconds, 1e-9))}/s)")
    return 0


# --- datasets, rm, status ---------------------------------------------------------------------
async def _meta_call(args: argparse.Namespace, msg: Any, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    from dlfs.client.cluster import ClusterClient

    cluster = _cluster(args)
    async with open_nursery() as nursery:
        client = ClusterClient(cluster, nursery)
        out, _ = await client.call_meta(msg, meta)
        nursery.cancel_scope.cancel()
    return out


def cmd_datasets(args: argparse.Namespace) -> int:
    from dlfs.wire.messages import META_DAEMON, DatasetList, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    rows = reply(DatasetList, trio.run(_meta_call, args, Msg.LIST_DATASETS), Msg.LIST_DATASETS, META_DAEMON).datasets
    if not rows:
        print("no datasets (add one with `dlfs ingest SRC --name NAME`)")
        return 0
    print(f"{'NAME':<24} {'VERSION':>7} {'FILES':>10} {'BYTES':>10} {'CHUNKS':>7}  CREATED")
    for v in rows:
        created = datetime.datetime.fromtimestamp(v.created).strftime("%Y-%m-%d %H:%M")
        print(f"{v.name:<24} {v.version:>7} {v.files:>10} {human_bytes(v.bytes):>10} {v.chunks:>7}  {created}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from dlfs.fuse.mount import local_mounts, parse_dataset_ref
    from dlfs.wire.messages import META_DAEMON, Removed, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    name, version = parse_dataset_ref(args.name)
    if _cluster(args).etcd is None:
        # Embedded: removal frees the chunks at once, and a mount of the version would fail every read
        # it has not cached. (A cluster's mounts hold leases in etcd, which keep their chunks.)
        for label, mountpoint in local_mounts(home_dir(args.home)):
            mounted_name, _, mounted_version = label.rpartition("@")
            if mounted_name == name and (version is None or mounted_version == str(version)):
                raise Conflict(f"{label} is mounted at {mountpoint}; unmount it first (dlfs umount {mountpoint})")
    out = reply(Removed, trio.run(_meta_call, args, Msg.REMOVE, {"name": name, "version": version}), Msg.REMOVE,
                META_DAEMON)
    versions = ", ".join(str(v.version) for v in out.removed)
    if out.mounts:
        print(f"removed {name} (version {versions}); {out.gc_deferred}")
        for m in out.mounts:
            print(f"  {name}@{m.version} mounted on {m.node} at {m.mountpoint}")
        return 0
    print(f"removed {name} (version {versions}); freed {out.freed_chunks} chunks")
    if out.gc_deferred:
        print(f"its chunks are freed later: {out.gc_deferred}", file=sys.stderr)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from dlfs.wire.messages import META_DAEMON, Collected, reply
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    out = reply(Collected, trio.run(_meta_call, args, Msg.COLLECT), Msg.COLLECT, META_DAEMON)
    if out.gc_deferred:
        raise Unreachable(f"garbage collection deferred: {out.gc_deferred}")
    print(f"freed {out.freed_chunks} chunks that no dataset or ingest needs")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import census
    from dlfs.wire.protocol import Msg

    _setup_logging(args)
    cluster = _cluster(args)
    home = home_dir(args.home)

    async def gather() -> tuple[list[tuple[str, dict[str, dict[str, Any] | str]]], Any]:
        rows: dict[str, dict[str, dict[str, Any] | str]] = {spec.name: {} for spec in cluster.nodes}

        async def ask(spec: Any, service: str) -> None:
            try:
                rows[spec.name][service] = (await client.call(spec, service, Msg.STATUS, timeout=5))[0]
            except DlfsError as exc:
                rows[spec.name][service] = str(exc)

        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            async with open_nursery() as asks:
                for spec in cluster.nodes:
                    for service in sorted(spec.roles):
                        asks.start_soon(ask, spec, service)
            out = [(spec.name, rows[spec.name]) for spec in cluster.nodes]
            up = [spec for spec in cluster.nodes if not any(isinstance(r, str) for r in rows[spec.name].values())]
            # A lone node that is down is the whole answer (one line); else what the rest can say.
            health = None if len(out) == 1 and not up else await census(client, up, home)
            nursery.cancel_scope.cancel()
        return out, health

    rows, health = trio.run(gather)
    control = trio.run(_control_view, cluster) if cluster.etcd is not None else None
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
            print(f"  datasets {meta['datasets']} ({meta['versions']} versions), ingests in progress {meta['ingests']}")
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
    print(f"datasets: {len({v.name for v in view.versions})} ({len(view.versions)} versions)")
    for v in view.versions:
        print(f"  {v.name}@{v.version}: {v.files} files, {human_bytes(v.bytes)}, {v.chunks} chunks")
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


def _n(count: int, thing: str) -> str:
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _verify_summary(report: Any, n_versions: int) -> str:
    head = (f"verified {_n(len(report.good), 'chunk')} of {_n(n_versions, 'dataset version')}: "
            f"{_n(report.replicas_checked, 'replica')} ({human_bytes(report.bytes_checked)}) read and checked")
    if report.healthy:
        down = f" (nodes {', '.join(sorted(report.unreachable))} unreachable)" if report.unreachable else ""
        return f"{head}; every chunk has {report.replicas} good replicas{down}"
    return (f"{head}; {_n(len(report.bad), 'bad replica')}, {_n(len(report.under_replicated), 'chunk')} "
            f"under-replicated, {_n(len(report.missing), 'chunk')} with no good copy, "
            f"{_n(len(report.unreachable), 'node')} unreachable")


def cmd_verify(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import check_indexes, dataset_chunks, live_versions, verify
    from dlfs.errors import CorruptData
    from dlfs.fuse.mount import parse_dataset_ref

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
            indexes = await check_indexes(client, versions)
            unreadable: dict[str, str] = {}  # one damaged index leaves its own chunks unchecked, not the rest
            chunks = await dataset_chunks(client, home, versions, unreadable)
            report = await verify(client, chunks, progress)
            nursery.cancel_scope.cancel()
        return len(versions), chunks, report, indexes, unreadable

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
        parts.append(f"{_n(len(healable), 'chunk')} {'lacks' if len(healable) == 1 else 'lack'} {report.replicas} "
                     "good replicas; `dlfs repair` restores them")
    if lost:
        labels = sorted({chunks[c].label() for c in lost})
        where = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        back = "bring back the unreachable nodes or " if report.unreachable else ""
        parts.append(f"{_n(len(lost), 'chunk')} {'has' if len(lost) == 1 else 'have'} no good copy on any reachable "
                     f"node, which repair cannot restore: {back}ingest again ({where})")
    return "; ".join(parts)


def cmd_repair(args: argparse.Namespace) -> int:
    from dlfs.client.cluster import ClusterClient
    from dlfs.client.repair import (
        READ_PIECE,
        REPAIR_IN_FLIGHT,
        check_indexes,
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
                indexes = await check_indexes(client, versions, restore=True)  # a peer's good copy where one exists
                unreadable: dict[str, str] = {}
                chunks = await dataset_chunks(client, home, versions, unreadable)
                report = await verify(client, chunks, _ProgressBar(bar, "verify", "replicas"))
                healed = await repair(client, chunks, report, _ProgressBar(bar, "repair", "chunks"))
            nursery.cancel_scope.cancel()
        return len(versions), chunks, report, healed, indexes, unreadable

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
    print(f"repair: copied {_n(len(healed.copied), 'chunk')} ({human_bytes(copied_bytes)}), removed "
          f"{_n(len(healed.removed), 'bad replica')}; {healed.healthy} of {_n(len(chunks), 'chunk')} of "
          f"{_n(n_versions - len(unreadable), 'dataset version')} {'has' if healed.healthy == 1 else 'have'} "
          f"{cluster.replicas} good replicas")
    parts = [_index_verdict(indexes, unreadable, repaired=True)]
    if healed.unhealed:
        ids = sorted(healed.unhealed)
        more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
        parts.append(f"could not heal {_n(len(ids), 'chunk')}: {', '.join(c.hex() for c in ids[:5])}{more}")
    if any(parts):  # everything it could do is done: now the exit status says what was left
        raise CorruptData("; ".join(filter(None, parts)))
    return 0


# --- mount, umount ------------------------------------------------------------------------------
def cmd_mount(args: argparse.Namespace) -> int:
    from dlfs.cgroup import memory_limit
    from dlfs.client.cache import auto_cache_size
    from dlfs.fuse.mount import MountOptions, check_mountpoint, parse_dataset_ref, serve_mount
    from dlfs.sdnotify import notify

    home = home_dir(args.home)
    name, version = parse_dataset_ref(args.dataset)
    mountpoint = Path(args.mountpoint).absolute()
    check_mountpoint(mountpoint)
    limit = memory_limit()
    cache_size = auto_cache_size(limit) if args.cache_size == "auto" else parse_size(args.cache_size)
    readahead = parse_size(args.readahead)
    metrics = _metrics_address(args)
    # Here, not in the background process: its errors would reach the user only through its log.
    cluster = _cluster(args)
    if not args.foreground:
        return _mount_background(args, home, name, mountpoint)
    _setup_logging(args, "INFO")
    give_freed_memory_back()
    how = "auto: a quarter of that" if args.cache_size == "auto" else "--cache-size"
    log.info("memory: %s; cache %s (%s)", limit.describe(), human_bytes(cache_size), how)
    if limit.limited and cache_size > limit.effective // 2:
        log.warning("--cache-size %s is over half the memory cgroup's limit (%s): the cache's pages cannot be "
                    "reclaimed, so the readers may be OOM-killed", human_bytes(cache_size), human_bytes(limit.effective))
    opts = MountOptions(home, cluster, name, version, mountpoint, cache_size, readahead, args.allow_other, metrics,
                        args.short_circuit, threads=args.threads, io_uring=args.io_uring, memory=limit)
    ready_fd = args.ready_fd

    def ready(message: str) -> None:
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


def _mount_background(args: argparse.Namespace, home: Path, name: str, mountpoint: Path) -> int:
    """Start `dlfs mount --foreground` detached, and return once it reports the mount ready."""
    logs = private_dirs(home / "logs")
    log_path = Path(args.log_file) if args.log_file else logs / f"mount-{name}.log"
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "dlfs", "--home", str(home), "mount", "--foreground", "--ready-fd", str(wfd),
           "--cache-size", args.cache_size, "--readahead", args.readahead, "--log-file", str(log_path),
           "--threads", str(args.threads), "--io-uring", args.io_uring, args.dataset, str(mountpoint)]
    if args.cluster:
        cmd[3:3] = ["--cluster", args.cluster]
    if args.transport:
        cmd.insert(cmd.index("--foreground") + 1, f"--transport={args.transport}")
    if args.log_level:
        cmd[3:3] = ["--log-level", args.log_level]
    if args.metrics:
        cmd.insert(cmd.index("--foreground") + 1, f"--metrics={args.metrics}")
    if not args.allow_other:
        cmd.insert(cmd.index("--foreground") + 1, "--no-allow-other")
    if not args.short_circuit:
        cmd.insert(cmd.index("--foreground") + 1, "--no-short-circuit")
    with open(os.devnull, "rb") as devnull, open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=logf, stderr=logf, pass_fds=(wfd,),
                                start_new_session=True)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        line = r.readline().decode(errors="replace").strip()
    if line.startswith("ok "):
        print(line[3:])
        return 0
    if line.startswith("error "):
        _, _kind, code, message = line.split(" ", 3)
        proc.wait(timeout=30)
        err = DlfsError(message)
        err.exit_code = int(code)
        raise err
    rc = proc.wait(timeout=30)
    raise MountError(f"mount process exited ({rc}) before the mount was ready; see {log_path}")


def cmd_umount(args: argparse.Namespace) -> int:
    from dlfs.fuse.mount import unmount

    _setup_logging(args)
    unmount(home_dir(args.home), Path(args.mountpoint))
    print(f"unmounted {Path(args.mountpoint).absolute()}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from dlfs.stats import show

    _setup_logging(args)
    return show(home_dir(args.home), Path(args.mountpoint).absolute(), args.interval, args.watch, args.count)


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
    rows = run_checks(home_dir(args.home), args.cluster, args.transport)
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

    from dlfs.bench.run import bench_options, check_plotting, format_report, run_bench, write_plot

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


# --- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
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

    add("datasets", cmd_datasets, "List datasets: version, files, bytes, chunks.")

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
    sp.add_argument("--readahead", default="4M", metavar="SIZE", help="bytes fetched per miss within a chunk (default 4M)")
    sp.add_argument("--allow-other", dest="allow_other", action="store_true", default=os.geteuid() == 0,
                    help="let other users read the mount (default when run as root)")
    sp.add_argument("--no-allow-other", dest="allow_other", action="store_false", help=argparse.SUPPRESS)
    sp.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (:PORT: every interface)")
    sp.add_argument("--no-short-circuit", dest="short_circuit", action="store_false",
                    help="read chunks this machine's node holds through its data daemon too, not from its "
                         "chunk files")
    sp.add_argument("--threads", type=_positive_int, default=os.cpu_count() or 1, metavar="N",
                    help="native threads serving the mount (default: one per CPU, here %(default)s)")
    sp.add_argument("--io-uring", choices=("auto", "on", "off"), default="auto",
                    help="serve through FUSE over io_uring, one queue per CPU (Linux 6.14+): auto uses it where the "
                         "kernel has it, turning /sys/module/fuse/parameters/enable_uring on as root; on fails in "
                         "one line where it cannot (default auto)")
    sp.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    add("gc", cmd_gc, "Free the chunks that no dataset version and no running ingest needs.")

    sp = add("umount", cmd_umount, "Unmount a dlfs mount and wait for its process to finish.")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")

    sp = add("stats", cmd_stats, "Show a mount's reads/s, MB/s, cache hit rate, bytes fetched by node and errors; "
             "--watch keeps the view live.")
    sp.add_argument("mountpoint", metavar="MOUNTPOINT")
    sp.add_argument("--watch", action="store_true", help="refresh the view until Ctrl-C")
    sp.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between views; rates are over this interval (default 1; the mount updates once a second)")
    sp.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N views")

    add("status", cmd_status, "Show the node's (or cluster's) state; exits non-zero when a node is unreachable.")

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
             "cluster file and key, every daemon's reachability, key and clock, free space); exits 1 if a check "
             "fails, printing a fix for each.", moves_chunks=True)
    sp.add_argument("--json", action="store_true", help="print the checks as JSON instead of a table")

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
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        raise
    finally:
        os.umask(umask)  # as it was, for a caller in this process (the tests)

