"""`dlfs node`: this node's metadata daemon and data daemon, in the foreground until a signal."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.config import ROLES, Cluster, NodeSpec, ensure_home_key, last_ports, runtime_file, write_runtime
from dlfs.data.service import DataService
from dlfs.data.store import ChunkStore
from dlfs.errors import DlfsError, UsageError
from dlfs.logs import set_context
from dlfs.meta.engine import MetaEngine
from dlfs.meta.engine_sqlite import EmbeddedEngine
from dlfs.meta.service import MetaService
from dlfs.meta.store import MetaStore
from dlfs.private import private_dirs, tighten_home
from dlfs.procs import hold_lock, raise_open_files_limit
from dlfs.sdnotify import notify
from dlfs.tasks import open_nursery
from dlfs.transport.base import Address
from dlfs.transport.verbs import Memlock, TransportChoice, choose_transport
from dlfs.units import human_bytes
from dlfs.wire.budget import NODE_MEMORY, MemoryBudget
from dlfs.wire.rpc import Service, serve

if TYPE_CHECKING:
    from dlfs.control.plane import ControlPlane, Lease
    from dlfs.data.rdmaserve import RdmaResponder

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE = 10.0
PIN_MIN = 64 << 20  # registered chunk bytes the data daemon needs at least to serve RDMA
PIN_DEFAULT = 8 << 30  # and at most keeps registered, memlock permitting


async def _serve_metrics(nursery: trio.Nursery, opts: NodeOptions, name: str, services: list[Service],
                         cluster: Cluster, meta_store: MetaStore) -> None:
    from dlfs.meta.census import ReplicaCensus
    from dlfs.metrics import NodeCollector, registry_of, serve_metrics

    data = next((s for s in services if isinstance(s, DataService)), None)
    census = None
    refresh = None
    if any(isinstance(s, MetaService) for s in services):
        census = ReplicaCensus(meta_store, ClusterClient(cluster, nursery), cluster.replicas, name, opts.replica_check)
        refresh = census.refresh
    collector = NodeCollector(name, services, data.store if data else None, data, census)
    assert opts.metrics is not None
    bound = await nursery.start(serve_metrics, opts.metrics, registry_of(collector), refresh, name="dlfs-node-metrics")
    log.info("node %s: metrics on http://%s/metrics", name, bound)


@dataclass
class NodeOptions:
    home: Path
    cluster: Cluster | None = None
    name: str | None = None
    host: str = "127.0.0.1"
    meta_port: int = 0
    data_port: int = 0
    roles: frozenset[str] | None = None  # None: the cluster file's role for this node, else both
    transport: str | None = None  # auto | tcp | rdma; None: the cluster file's, else auto
    metrics: Address | None = None  # serve Prometheus metrics here
    replica_check: float = 60.0  # seconds between the metrics' counts of chunks short of replicas
    memory: int = NODE_MEMORY  # bytes both daemons together hold for requests in flight


def pin_budget(limits: Memlock) -> int:
    """How many chunk bytes the data daemon keeps registered: PIN_DEFAULT within the memlock limit."""
    if limits.ipc_lock or limits.soft is None:
        return PIN_DEFAULT
    return max(min(PIN_DEFAULT, limits.soft - (16 << 20)), 0)


def data_transport(opts: NodeOptions) -> TransportChoice:
    """How this node's data daemon serves chunks, checked (memlock included) and logged at start."""
    cluster = opts.cluster
    setting = opts.transport or (cluster.transport if cluster else "auto")
    choice = choose_transport(setting, PIN_MIN, "the data daemon",
                              cluster.rdma_device if cluster else None, cluster.rdma_port if cluster else None)
    log.info("data daemon: chunks served over %s (%s)", "RDMA and TCP" if choice.name == "rdma" else "TCP",
             choice.reason)
    return choice


def _lock_home(home: Path) -> int:
    """Hold $DLFS_HOME/run/node.lock: two nodes on one state directory would corrupt it."""
    path = home / "run" / "node.lock"
    private_dirs(path.parent)
    fd = hold_lock(path)
    if fd is None:
        raise UsageError(f"a dlfs node is already running under {home}")
    return fd


def _open_responder(choice: TransportChoice, chunks: ChunkStore) -> tuple[RdmaResponder | None, TransportChoice]:
    """The data daemon's RDMA resources; if the device cannot be set up, TCP (auto) or an error (rdma)."""
    from pyverbs.pyverbs_error import PyverbsError  # only where RDMA is used

    from dlfs.data.rdmaserve import RdmaResponder
    from dlfs.transport.verbs import memlock

    assert choice.port is not None
    try:
        rdma = RdmaResponder(choice.port, chunks, pin_budget(memlock()))
    except (PyverbsError, OSError, DlfsError) as exc:
        return None, choice.failed_to_start(str(exc))
    log.info("data daemon: RDMA on %s", rdma.describe())
    return rdma, choice


async def _listen(nursery: trio.Nursery, service: Service, address: Address, fallback: Address | None) -> Address:
    """Serve `service` on `address`, or on `fallback` if that is given and `address` is taken."""
    try:
        return (await nursery.start(serve, service, address))[0]
    except OSError as exc:
        if fallback is None:  # a port of the cluster file's (or --meta-port/--data-port): the user's to change
            daemon = "metadata" if service.name == "meta" else service.name
            raise UsageError(f"the {daemon} daemon cannot listen on {address}: {exc.strerror or exc} (another process "
                             "holds that port: stop it, or give this node another port)") from None
        log.info("%s daemon: %s is taken (%s); listening on %s", service.name, address, exc.strerror, fallback)
        return (await nursery.start(serve, service, fallback))[0]


async def run_node(opts: NodeOptions, *, task_status: trio.TaskStatus[NodeSpec] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled or signalled; reports this node's addresses once both listen."""
    home = opts.home
    private_dirs(home)
    lock_fd = _lock_home(home)
    try:
        tighten_home(home)  # once, before anything is served from it
        meta_fallback = data_fallback = None
        if opts.cluster is None:
            key = ensure_home_key(home)
            name = opts.name or "local"
            meta_addr, data_addr = Address(opts.host, opts.meta_port), Address(opts.host, opts.data_port)
            # Listen where the last run did, so that mounts made before a restart reconnect.
            last_meta, last_data = last_ports(home)
            if opts.meta_port == 0 and last_meta:
                meta_addr, meta_fallback = Address(opts.host, last_meta), meta_addr
            if opts.data_port == 0 and last_data:
                data_addr, data_fallback = Address(opts.host, last_data), data_addr
        else:
            key = opts.cluster.key
            name = opts.name or opts.cluster.local or ""
            if not name:
                raise UsageError(f"no node of {opts.cluster.source} has an address of this machine; pass --name")
            spec = opts.cluster.node(name)
            meta_addr, data_addr = spec.meta, spec.data
        roles = opts.roles or (opts.cluster.node(name).roles if opts.cluster else ROLES["both"])
        set_context(f"node={name}")
        choice = data_transport(opts) if "data" in roles else None
        chunks = ChunkStore(home / "data")
        meta_store = MetaStore(home / "meta")
        log.info("node %s: state in %s, %d chunks (%d bytes), %d dataset versions",
                 name, home, chunks.count, chunks.bytes, len(meta_store.datasets()))
        rdma: RdmaResponder | None = None
        memory = MemoryBudget(f"node {name}", opts.memory)  # one process: one bound for both daemons
        log.info("node %s: requests in flight hold at most %s (%s on one connection)", name,
                 human_bytes(memory.total), human_bytes(memory.per_connection))
        # Before the daemons exist: their caps on half-open connections follow this limit.
        log.info("node %s: up to %d open files", name, raise_open_files_limit())
        lanes: DataService | None = None  # its native range lanes, stopped after the daemons
        try:
            async with open_nursery() as nursery:
                data_bound = data_addr
                services: list[Service] = []
                if choice is not None and choice.port is not None:
                    rdma, choice = _open_responder(choice, chunks)
                    if rdma is not None:
                        nursery.start_soon(rdma.run, name="dlfs-rdma-responder")
                if "data" in roles:
                    data_service = DataService(chunks, key, name, rdma, choice.reason if choice else "", memory)
                    data_service.start_lanes()
                    lanes = data_service
                    services.append(data_service)
                    data_bound = await _listen(nursery, data_service, data_addr, data_fallback)
                if opts.cluster is None:
                    cluster = Cluster([NodeSpec(name, meta_addr, data_bound)], key, 1, "embedded", local=name)
                else:
                    cluster = opts.cluster
                meta_bound = meta_addr
                control, lease = None, None
                if cluster.etcd is not None:
                    # Only a node of a cluster talks to etcd (httpx and the etcd client: 50 ms of imports).
                    from dlfs.control.plane import ControlPlane, Lease

                    control = ControlPlane(cluster.etcd)
                    lease = Lease(control, f"node {name}", partial(_join, control, name, meta_addr, data_bound, roles))
                    nursery.start_soon(_leave_at_exit, control, lease, name="dlfs-etcd-leave")
                if "meta" in roles:
                    ledger = ClusterClient(cluster, nursery)
                    engine: MetaEngine
                    if control is None:
                        engine = EmbeddedEngine(meta_store)
                    else:
                        from dlfs.meta.engine_etcd import EtcdEngine

                        engine = EtcdEngine(meta_store, control, lease, name, cluster.meta_nodes, ledger)
                    meta_service = MetaService(engine, key, name, ledger, memory)
                    services.append(meta_service)
                    meta_bound = await _listen(nursery, meta_service, meta_addr, meta_fallback)
                    nursery.start_soon(meta_service.expire_idle, name="dlfs-ingest-expiry")
                    nursery.start_soon(meta_service.upkeep, name="dlfs-meta-upkeep")
                if lease is not None:
                    # Membership: the node is alive in etcd while this lease is; etcd being down delays
                    # it (logged) but never stops the node serving chunks and indexes.
                    with trio.move_on_after(lease.control.etcd.timeout + 1):
                        await nursery.start(lease.run, name="dlfs-node-lease")
                if opts.metrics is not None:
                    await _serve_metrics(nursery, opts, name, services, cluster, meta_store)
                me = NodeSpec(name, meta_bound, data_bound, roles)
                if opts.cluster is None:
                    write_runtime(home, name, meta_bound, data_bound)
                log.info("node %s (%s): metadata daemon on %s, data daemon on %s", name, "+".join(sorted(roles)),
                         meta_bound if "meta" in roles else "-", data_bound if "data" in roles else "-")
                task_status.started(me)
                notify(f"READY=1\nSTATUS=node {name} serving")  # a Type=notify unit is up only now
                # SIGHUP too (a terminal closed under a foreground node): libfuse's and most daemons' stop signals.
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                    async for sig in signals:
                        log.info("node %s: %s, stopping", name, signal.Signals(sig).name)
                        break
                nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_DEADLINE
                nursery.cancel_scope.cancel()
        finally:
            if lanes is not None:  # after the daemons: nothing hands it a lane any more
                lanes.stop_lanes()
            if rdma is not None:
                rdma.close()
            chunks.close()
            if opts.cluster is None:
                _forget_runtime(runtime_file(home))
            log.info("node %s: stopped", name)
    finally:
        os.close(lock_fd)


async def _join(control: ControlPlane, name: str, meta: Address, data: Address, roles: frozenset[str]) -> int:
    """This node's membership: a lease, and its key bound to it."""
    lease = await control.etcd.grant(control.cfg.lease_ttl)
    doc = {"meta": str(meta), "data": str(data), "roles": sorted(roles), "pid": os.getpid(), "since": time.time()}
    await control.etcd.put(control.node_key(name), json.dumps(doc), lease)
    log.info("node %s: joined the cluster in etcd (lease %x, %d s)", name, lease, control.cfg.lease_ttl)
    return lease


async def _leave_at_exit(control: ControlPlane, lease: Lease) -> None:
    """At shutdown: the node leaves at once (its lease revoked: its open ingests' pins go with it)."""
    try:
        await trio.sleep_forever()
    finally:
        await lease.revoke()
        await control.aclose()


def _forget_runtime(path: Path) -> None:
    """Remove the node's runtime record, unless it is another node's (this home was wiped under us)."""
    try:
        if json.loads(path.read_text()).get("pid") != os.getpid():
            return
    except (OSError, ValueError):
        return
    path.unlink(missing_ok=True)
