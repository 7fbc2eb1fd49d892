"""Where things are: DLFS_HOME, the cluster file, and the defaults for the embedded one-node cluster.

With no cluster file, `dlfs node` runs a one-node cluster on localhost and records the addresses it
bound in $DLFS_HOME/run/node.json; every other command on this machine finds it there. A cluster
file (TOML) names the nodes instead:

    replicas = 2                 # default: min(2, number of nodes)
    key_file = "cluster.key"     # relative to this file
    [[node]]
    name = "n1"
    address = "10.0.0.1"         # meta_port / data_port default to 7420 / 7421

and how chunks travel (`--transport` overrides it per command):

    transport = "auto"           # auto | tcp | rdma
    rdma_device = "mlx5_0"       # optional: the RDMA device (default: the first with an active port)
    rdma_port = 1                # optional: its port

and, for more than one node, the etcd cluster that keeps the control state (dlfs/control/):

    [etcd]
    endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
    prefix = "/dlfs/"            # optional: several dlfs clusters can share one etcd
    ca_file = "etcd-ca.pem"      # optional TLS (https:// endpoints), relative to this file
    cert_file = "etcd-client.pem"
    key_file = "etcd-client-key.pem"
    lease_ttl = 10               # optional: seconds a node's or mount's lease outlives its last keepalive

Every key, its type and its range are in clusterfile.py's schema: a key it does not know, a wrong
type or a value out of range anywhere in the file is one line (exit 2) naming the key, never ignored.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dlfs import clusterfile
from dlfs.clusterfile import DATA_PORT, META_PORT  # noqa: F401 (where a node listens by default)
from dlfs.errors import NoNode, UsageError
from dlfs.private import private_dirs, write_private
from dlfs.procs import running
from dlfs.transport.base import Address
from dlfs.wire.auth import read_key, write_key
from dlfs.wire.messages import DATASET_NAME


def home_dir(explicit: str | None = None) -> Path:
    """The state directory: --home, else $DLFS_HOME, else ~/.dlfs."""
    raw = explicit or os.environ.get("DLFS_HOME") or "~/.dlfs"
    return Path(raw).expanduser().absolute()


def check_dataset_name(name: str) -> str:
    if not re.search(DATASET_NAME, name):  # the rule every request is held to (wire/messages.py)
        raise UsageError(
            f"bad dataset name {name!r}: use letters, digits, '.', '_' and '-' (128 at most), "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class EtcdConfig:
    """Where the cluster's control state lives (the cluster file's [etcd] section)."""

    endpoints: tuple[str, ...]
    prefix: str = "/dlfs/"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    lease_ttl: int = 10


ROLES = {"both": frozenset({"meta", "data"}), "meta": frozenset({"meta"}), "data": frozenset({"data"})}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    meta: Address
    data: Address
    roles: frozenset[str] = ROLES["both"]


@dataclass
class Cluster:
    """The nodes a command talks to, and the key that lets it in."""

    nodes: list[NodeSpec]
    key: bytes
    replicas: int
    source: str  # the cluster file, or the node.json of the embedded node
    local: str | None = None  # the node on this machine, read first
    extra: dict[str, object] = field(default_factory=dict)
    transport: str = "auto"  # auto | tcp | rdma: how chunk reads travel (see dlfs/transport/verbs.py)
    rdma_device: str | None = None  # None: the first device with an active port
    rdma_port: int | None = None
    key_file: str = ""  # where the key came from (dlfs doctor checks its permissions)
    etcd: EtcdConfig | None = None  # None: the embedded catalog (one node, SQLite)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UsageError(f"no node named {name!r} in {self.source}")

    @property
    def data_nodes(self) -> list[NodeSpec]:
        return [n for n in self.nodes if "data" in n.roles]

    @property
    def meta_nodes(self) -> list[NodeSpec]:
        return [n for n in self.nodes if "meta" in n.roles]


def key_path(home: Path) -> Path:
    return home / "cluster.key"


def ensure_home_key(home: Path) -> bytes:
    """The embedded cluster's key, created (0600) on first use."""
    path = key_path(home)
    if not path.exists():
        private_dirs(home)
        try:
            return write_key(path)
        except FileExistsError:
            pass
    return read_key(path)


def runtime_file(home: Path) -> Path:
    return home / "run" / "node.json"


def ports_file(home: Path) -> Path:
    return home / "run" / "ports.json"


def write_runtime(home: Path, name: str, meta: Address, data: Address) -> None:
    """Publish where the running node listens (atomically, for the commands that read it)."""
    path = runtime_file(home)
    private_dirs(path.parent)
    for target, doc in ((ports_file(home), {"meta": meta.port, "data": data.port}),
                        (path, {"name": name, "meta": str(meta), "data": str(data), "pid": os.getpid()})):
        tmp = target.with_suffix(".tmp")
        write_private(tmp, json.dumps(doc))
        os.replace(tmp, target)


def last_ports(home: Path) -> tuple[int, int]:
    """(meta, data) ports of the node's last run under `home`, or (0, 0).

    A restarted node listens where it did before, so mounts made before the restart reconnect.
    """
    try:
        doc = json.loads(ports_file(home).read_text())
        return int(doc["meta"]), int(doc["data"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0


def load_cluster(cluster_file: str | None, home: Path) -> Cluster:
    """The cluster of a command: from --cluster / $DLFS_CLUSTER, else the local embedded node."""
    cluster_file = cluster_file or os.environ.get("DLFS_CLUSTER")
    if cluster_file:
        return parse_cluster_file(Path(cluster_file))
    path = runtime_file(home)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoNode(f"no dlfs node is running under {home}", "start one with `dlfs node`") from None
    except (OSError, ValueError) as exc:
        raise NoNode(f"cannot read {path}: {exc}", "restart the node with `dlfs node`") from None
    if not running(int(info.get("pid", 0))):
        raise NoNode(f"no dlfs node is running under {home}", "start one with `dlfs node`")
    spec = NodeSpec(info["name"], Address.parse(info["meta"]), Address.parse(info["data"]))
    return Cluster([spec], ensure_home_key(home), 1, str(path), local=spec.name, key_file=str(key_path(home)))


def parse_cluster_file(path: Path) -> Cluster:
    """Read and check a cluster file (clusterfile.py's schema); every mistake is one line naming the file."""
    spec, doc = clusterfile.read(path)
    nodes = [NodeSpec(n.name, Address(n.address, n.meta_port or spec.meta_port),
                      Address(n.address, n.data_port or spec.data_port), ROLES[n.role]) for n in spec.node]
    n_data = sum("data" in n.roles for n in nodes)
    key_file = str((path.parent / spec.key_file).resolve())
    key = read_key(Path(key_file))
    etcd = None
    if spec.etcd is not None:
        e = spec.etcd

        def beside(name: str) -> str | None:  # TLS files are relative to the cluster file
            return str((path.parent / name).absolute()) if name else None

        etcd = EtcdConfig(tuple(u.rstrip("/") for u in e.endpoints), e.prefix if e.prefix.endswith("/") else e.prefix + "/",
                          beside(e.ca_file), beside(e.cert_file), beside(e.key_file), e.lease_ttl)
    return Cluster(nodes, key, spec.replicas or min(2, n_data), str(path), local=_local_node(nodes), extra=doc,
                   transport=spec.transport, rdma_device=spec.rdma_device, rdma_port=spec.rdma_port,
                   key_file=key_file, etcd=etcd)


def _local_node(nodes: list[NodeSpec]) -> str | None:
    """The node whose address is one of this machine's, if any."""
    for n in nodes:
        try:
            infos = socket.getaddrinfo(n.meta.host, None)
        except OSError:
            continue
        for info in infos:
            addr = info[4][0]
            try:
                with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                    s.bind((addr, 0))
                return n.name
            except OSError:
                continue
    return None
